"""Decode tok/s of the embedded model against the number of (fake CPU) devices (JSON output).

  python scripts/bench_mesh.py --devices=1,2,4 --tokens=32 --runs=3 --out=mesh.json

For each count n, a fresh process with n CPU devices (the count is fixed before JAX starts)
loads the model on one device (n = 1) or on the mesh expert:n, generates --tokens greedy tokens
once to compile, then --runs more times; the report holds each run's decode tok/s (compilation
left out, glmjax's own figure), their median, and whether its tokens equal the first count's.
Fake CPU devices share the machine's cores: this measures the collective pattern's overhead,
not a speed-up.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_list("devices", ["1", "2", "4"], "Device counts to measure.")
flags.DEFINE_integer("tokens", 32, "Tokens generated per run.", lower_bound=2)
flags.DEFINE_integer("runs", 3, "Measured runs per device count.", lower_bound=1)
flags.DEFINE_string("out", None, "JSON output path (default: stdout only).")
flags.DEFINE_integer("child", 0, "Internal: measure in this process with this many devices.")

PROMPT = [5, 6, 7, 8, 9]


def child(n: int) -> dict:
  import glmjax
  from glmjax import sharding
  mesh = None if n == 1 else sharding.make_mesh({"expert": n})
  model = glmjax.load(mesh=mesh, progress=False)
  model.generate(PROMPT, FLAGS.tokens, stop_ids=[])  # compiles every step shape
  runs = [model.generate(PROMPT, FLAGS.tokens, stop_ids=[]) for _ in range(FLAGS.runs)]
  return {"devices": n, "tok_s": [r.stats["decode_tok_s"] for r in runs],
          "tokens": runs[0].tokens, "same_every_run": all(r.tokens == runs[0].tokens
                                                           for r in runs)}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if FLAGS.child:
    print("RESULT " + json.dumps(child(FLAGS.child)), flush=True)
    return 0
  from glmjax.reporting import write_report
  rows = []
  for n in (int(d) for d in FLAGS.devices):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
    r = subprocess.run([sys.executable, __file__, f"--child={n}", f"--tokens={FLAGS.tokens}",
                        f"--runs={FLAGS.runs}"], capture_output=True, text=True, env=env)
    if r.returncode:
      print(r.stderr[-3000:], file=sys.stderr)
      return 1
    row = json.loads([l for l in r.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
    row["median_tok_s"] = statistics.median(row["tok_s"])
    rows.append(row)
  first = rows[0]["tokens"]
  for row in rows:
    row["tokens_equal_first"] = row.pop("tokens") == first
  write_report({"model": "embedded", "prompt": PROMPT, "new_tokens": FLAGS.tokens,
                "runs": FLAGS.runs, "rows": rows}, FLAGS.out)
  return 0


if __name__ == "__main__":
  app.run(main)
