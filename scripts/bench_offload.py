"""Offloaded decoding at several cache budgets, side by side in one run (JSON output).

  python scripts/bench_offload.py --model=/nvme/glm5-int4 --tokens=64
  python scripts/bench_offload.py            # converts the embedded model to a temp store

For each (device, host) budget, given as fractions of the store's expert bytes, a fresh engine
generates --tokens greedy tokens from the same prompt, with the store dropped from the page cache
first (--cold), then generates them again warm. Reports the hit split (pin / host), misses, bytes
read per token, io_service_s (time reads took) against io_wait_s (time compute waited), cold and
warm decode tok/s, and the warm time to score --score_tokens tokens; medians over --repeats
fresh runs.
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import os
import statistics
import time

from absl import app, flags, logging
import numpy as np

from glmjax import cli
from glmjax.bench.reporting import bench_store, store_geometry, write_report

FLAGS = flags.FLAGS
cli.define_model_flag(cli.STORE_KINDS, store_alias=True)
flags.DEFINE_string("prompt", "import os\nimport sys\n\ndef main(", "Prompt text.")
flags.DEFINE_integer("tokens", 48, "Tokens generated per run.")
flags.DEFINE_integer("repeats", 3, "Fresh runs per budget (median reported).")
flags.DEFINE_list("budgets", ["0:0", "0:0.25", "0:0.5", "0.25:0", "0.25:0.5", "0:1", "1:0"],
                  "device:host fractions of the total expert bytes.")
cli.define_load_flags(only=("prefill_chunk", "cold", "io_workers"), defaults={"cold": True},
                      notes={"cold": "Here: before each run."})
flags.DEFINE_integer("score_tokens", 1024, "Tokens scored (teacher-forced) per budget; 0 = skip.")
flags.DEFINE_string("out", None, "JSON output path (default: stdout).")

KEYS = ("expert_pin_hits", "expert_host_hits", "expert_misses", "experts_used",
        "expert_bytes_read", "io_service_s", "io_wait_s", "decode_tok_s", "warm_decode_tok_s",
        "score_s")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import glmjax
  path = bench_store(FLAGS.model, "bench_offload.")
  geo = store_geometry(path)
  total = geo["expert_bytes_total"]
  usage = os.path.join(path, "usage.json")

  def run(dev_frac, host_frac):
    if os.path.exists(usage):
      os.remove(usage)  # no pins learned from earlier runs: each budget starts alike
    model = glmjax.load(path, **cli.load_options(), progress=False,
                        device_cache_gb=dev_frac * total / 2**30,
                        host_cache_gb=host_frac * total / 2**30)
    prompt = FLAGS.prompt if model.tokenizer is not None else [5, 6, 7, 8, 9, 10, 11, 12]
    r = model.generate(prompt, FLAGS.tokens, stop_ids=[])
    # Warm: the same request again, the tiers holding what the cold run left in them (with a
    # host budget of 1, every expert the request uses).
    warm = model.generate(prompt, FLAGS.tokens, stop_ids=[]).stats
    r.stats["warm_decode_tok_s"] = warm["decode_tok_s"]
    r.stats["warm_fused_steps"] = warm.get("fused_steps", 0.0)  # one-jit steps (CPU tiers)
    if FLAGS.score_tokens:  # warm (compiled, cache filled) scoring time of one long sequence
      toks = np.random.default_rng(0).integers(3, model.config.vocab_size, (1, FLAGS.score_tokens))
      model.score(toks)
      t0 = time.perf_counter()
      model.score(toks)
      r.stats["score_s"] = time.perf_counter() - t0
    model.close()
    return r

  run(0, 0)  # compile every step shape once, outside the measurements
  rows = []
  for spec in FLAGS.budgets:
    dev, host = (float(x) for x in spec.split(":"))
    runs = [run(dev, host) for _ in range(FLAGS.repeats)]
    med = {k: statistics.median(r.stats.get(k, 0.0) for r in runs) for k in KEYS}
    used = med["experts_used"] or 1.0
    if runs[0].stats.get("all_resident"):  # every use is a pinned hit; nothing is counted
      med["expert_pin_hits"] = used = 1.0
    rows.append({
        "device_frac": dev, "host_frac": host, **med,
        "hit_pct": 100 * (med["expert_pin_hits"] + med["expert_host_hits"]) / used,
        "pin_pct": 100 * med["expert_pin_hits"] / used,
        "host_pct": 100 * med["expert_host_hits"] / used,
        "bytes_per_token": med["expert_bytes_read"] / FLAGS.tokens,
        "warm_fused_steps": statistics.median(r.stats.get("warm_fused_steps", 0.0) for r in runs),
        "same_tokens": all(r.tokens == runs[0].tokens for r in runs)})
  result = {"store": path, **geo, "tokens": FLAGS.tokens,
            "repeats": FLAGS.repeats, "cold": FLAGS.cold, "rows": rows}
  write_report(result, FLAGS.out)


if __name__ == "__main__":
  app.run(main)
