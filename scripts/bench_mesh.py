"""Decode tok/s of the embedded model against the number of (fake CPU) devices (JSON output),
or, with --offload, of an expert store needing offload on 2 processes against 1.

  python scripts/bench_mesh.py --devices=1,2,4 --tokens=32 --runs=3 --out=mesh.json
  python scripts/make_synthetic_store.py --geometry=glm5 --moe_layers=1 --vocab_size=4096 \\
      --dense_bits=8 --nomtp --zipf=1 --dst=/tmp/glm5_1l
  python scripts/bench_mesh.py --offload=/tmp/glm5_1l --host_cache_gb=1 --json=offload.json

Device counts: for each count n, a fresh process with n CPU devices (the count is fixed before
JAX starts) loads the model on one device (n = 1) or on the mesh expert:n, generates --tokens
greedy tokens once to compile, then --runs more times; the report holds each run's decode tok/s
(compilation left out, glmjax's own figure), their median, and whether its tokens equal the
first count's. Fake CPU devices share the machine's cores: this measures the collective
pattern's overhead, not a speed-up.

--offload=STORE: the same runs on STORE, first in one process (no mesh), then in 2 processes ×
1 device joined over loopback by scripts/launch_local.py on the mesh expert:2, where each
process owns, caches and reads half of the experts (glmjax.offload.owners). --host_cache_gb and
--device_cache_gb are per process, so two processes hold twice as many experts. Each side
starts from the same state: the store's learned usage and co-activation files are removed
before it (the runs write them back). Per process the report gives the decode tok/s of each run
and their median, the expert bytes read per decode token and the hit rates of the experts it
owns (medians over runs); and whether the 2-process greedy tokens equal the one-process ones.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags, logging

from glmjax import cli, distributed

FLAGS = flags.FLAGS
flags.DEFINE_list("devices", ["1", "2", "4"], "Device counts to measure.")
flags.DEFINE_integer("tokens", 32, "Tokens generated per run.", lower_bound=2)
flags.DEFINE_integer("runs", 3, "Measured runs per device count.", lower_bound=1)
flags.DEFINE_string("out", None, "JSON output path (default: stdout only).")
flags.DEFINE_alias("json", "out")
flags.DEFINE_integer("child", 0, "Internal: measure in this process with this many devices.")
flags.DEFINE_string("offload", None, "Expert store: compare 2 processes × 1 device with 1 process "
                    "on it instead of device counts (see the module docstring).")
cli.define_load_flags(only=("host_cache_gb", "device_cache_gb"),
                      defaults={"host_cache_gb": 1.0, "device_cache_gb": 0.0},
                      notes={"host_cache_gb": "--offload: per process.",
                             "device_cache_gb": "--offload: per process."})
flags.DEFINE_bool("offload_child_run", False, "Internal: one process of an --offload side.")
flags.DEFINE_string("child_out", None, "Internal: this --offload process's JSON record "
                    "(`{process}`: its index).")
distributed.define_flags()  # --coordinator etc. and --mesh, which launch_local.py passes

PROMPT = [5, 6, 7, 8, 9]
# Per-run counters kept from each process's own (not summed) generation stats.
COUNTERS = ("experts_used", "expert_pin_hits", "expert_host_hits", "expert_misses",
            "expert_bytes_read", "prefill_expert_bytes", "new_tokens", "decode_tok_s")


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


def offload_child() -> int:
  """One process of an --offload side: loads the store, generates once to compile and warm its
  caches, then --runs times, and writes its own counters to --child_out."""
  import jax
  import glmjax
  try:
    distributed.initialize()
    with glmjax.load(FLAGS.offload, mesh=distributed.mesh_from_flags(), progress=False,
                     **cli.load_options()) as model:
      gen = lambda: model.generate(PROMPT, FLAGS.tokens, temperature=0.0, stop_ids=[])
      gen()
      runs = [gen() for _ in range(FLAGS.runs)]
      tiers = model.executor.tier_state()
      rec = {"process": jax.process_index(), "owned_experts": tiers["owned_experts"],
             "host_budget_bytes": tiers["host_bytes"], "host_used_bytes": tiers["host_used_bytes"],
             "chunk_bytes": tiers["chunk_bytes"], "tokens": [int(t) for t in runs[0].tokens],
             "same_every_run": all(r.tokens == runs[0].tokens for r in runs),
             "runs": [{k: float(r.stats.get(k, 0.0)) for k in COUNTERS} for r in runs]}
  except glmjax.GlmjaxError as e:
    print(f"error: {e}", file=sys.stderr)
    distributed.exit_now(1)  # the other process fails at its next collective, not waits
    return 1
  with open(distributed.per_process(FLAGS.child_out), "w", encoding="utf-8") as f:
    json.dump(rec, f)
  return 0


def process_row(rec: dict) -> dict:
  """One process's figures: medians over runs of its decode rate, bytes per decode token and
  hit rates over the experts it owns."""
  def med(f):
    return statistics.median(f(r) for r in rec["runs"])
  used = lambda r: max(r["experts_used"], 1.0)
  steps = lambda r: max(r["new_tokens"] - 1, 1.0)  # decode steps after the prefill's token
  return {
      "process": rec["process"], "owned_experts": rec["owned_experts"],
      "host_budget_bytes": rec["host_budget_bytes"], "host_used_bytes": rec["host_used_bytes"],
      "tok_s": [r["decode_tok_s"] for r in rec["runs"]],
      "median_tok_s": med(lambda r: r["decode_tok_s"]),
      "decode_bytes_read_per_token": med(
          lambda r: (r["expert_bytes_read"] - r["prefill_expert_bytes"]) / steps(r)),
      "prefill_bytes_read": med(lambda r: r["prefill_expert_bytes"]),
      "experts_used_per_run": med(lambda r: r["experts_used"]),
      "pin_hit_rate": med(lambda r: r["expert_pin_hits"] / used(r)),
      "host_hit_rate": med(lambda r: r["expert_host_hits"] / used(r)),
      "hit_rate": med(lambda r: (r["expert_pin_hits"] + r["expert_host_hits"]) / used(r)),
      "same_every_run": rec["same_every_run"]}


def side_hit_rate(recs: list[dict]) -> float:
  """Median over runs of the hits of every process over the experts used by every process
  (each process counts only its own, so the sums are one process's kind of figure)."""
  def rate(i):
    rs = [rec["runs"][i] for rec in recs]
    hits = sum(r["expert_pin_hits"] + r["expert_host_hits"] for r in rs)
    return hits / max(sum(r["experts_used"] for r in rs), 1.0)
  return statistics.median(rate(i) for i in range(len(recs[0]["runs"])))


def offload_side(processes: int, tmp: str) -> list[dict]:
  """Runs one side (1 process, or 2 through launch_local) and returns each process's record."""
  from glmjax.offload.engine import USAGE_FILE
  from glmjax.offload.prefetch import COUPLE_FILE
  for name in (USAGE_FILE, COUPLE_FILE):  # both sides start unlearned
    if os.path.exists(os.path.join(FLAGS.offload, name)):
      os.remove(os.path.join(FLAGS.offload, name))
  out = os.path.join(tmp, f"n{processes}_p{{process}}.json")
  args = [__file__, "--offload_child_run", f"--offload={FLAGS.offload}",
          f"--tokens={FLAGS.tokens}", f"--runs={FLAGS.runs}", f"--child_out={out}",
          f"--host_cache_gb={FLAGS.host_cache_gb}", f"--device_cache_gb={FLAGS.device_cache_gb}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if processes == 1:
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    cmd = [sys.executable, *args]
  else:
    launch = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_local.py")
    cmd = [sys.executable, launch, f"--processes={processes}", "--devices_per_process=1",
           "--", *args, f"--mesh=expert:{processes}"]
  r = subprocess.run(cmd, env=env)
  if r.returncode:
    raise SystemExit(f"bench_mesh: the {processes}-process side exited {r.returncode}")
  recs = []
  for path in sorted(glob.glob(os.path.join(tmp, f"n{processes}_p*.json"))):
    with open(path, encoding="utf-8") as f:
      recs.append(json.load(f))
  return recs


def offload_main() -> dict:
  """The --offload report: both sides, per process, and whether their tokens agree."""
  with open(os.path.join(FLAGS.offload, "manifest.json"), encoding="utf-8") as f:
    cfg = json.load(f)["source_config"]
  sides, tokens = [], {}
  with tempfile.TemporaryDirectory() as tmp:
    for n in (1, 2):
      recs = offload_side(n, tmp)
      tokens[n] = recs[0]["tokens"]
      sides.append({"processes": n, "devices_per_process": 1,
                    "mesh": None if n == 1 else f"expert:{n}",
                    # the processes step in lockstep: process 0's rate is the side's
                    "median_tok_s": process_row(recs[0])["median_tok_s"],
                    "decode_bytes_read_per_token_all": sum(
                        process_row(r)["decode_bytes_read_per_token"] for r in recs),
                    "hit_rate_all": side_hit_rate(recs),
                    "per_process": [process_row(r) for r in recs]})
  return {"store": FLAGS.offload, "hidden_size": cfg["hidden_size"],
          "moe_intermediate_size": cfg["moe_intermediate_size"],
          "experts": cfg["n_routed_experts"], "top_k": cfg["num_experts_per_tok"],
          "vocab_size": cfg["vocab_size"], "host_cache_gb_per_process": FLAGS.host_cache_gb,
          "device_cache_gb_per_process": FLAGS.device_cache_gb, "prompt": PROMPT,
          "new_tokens": FLAGS.tokens, "runs": FLAGS.runs, "sides": sides,
          "tokens_equal_one_process": all(t == tokens[1] for t in tokens.values())}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if FLAGS.offload_child_run:
    return offload_child()
  if FLAGS.child:
    print("RESULT " + json.dumps(child(FLAGS.child)), flush=True)
    return 0
  from glmjax.bench.reporting import write_report
  if FLAGS.offload:
    write_report(offload_main(), FLAGS.out)
    return 0
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
