"""Cold offloaded decode against its physical limit, in one run (JSON + a stacked-bar PNG).

  python scripts/make_synthetic_store.py --geometry=glm5 --moe_layers=2 --experts=32 \\
      --vocab_size=4096 --dst=/tmp/glm5
  python scripts/bench_decode.py --model=/tmp/glm5 --cold --max_new_tokens=16 \\
      --device_cache_gb=0 --host_cache_gb=0.4 --json=/tmp/decode.json

The run:
1. measures the disk: the store's expert chunks, dropped from the page cache, read and checked
   as the engine reads them (its chunk size), the best rate of 1, 2, 4 and 8 threads
   (`disk_best_gbs`: a limit at the engine's own thread count would be that setting's);
2. measures compute: the same request with every expert resident (warm, compiled);
3. compiles the offloaded steps once (a warm-up request, traced too), then drops the store from the page
   cache (--cold) and runs the request at the given budgets with a live routing trace;
4. replays that trace under Belady at the tiers' capacity: the fewest bytes any policy reads;
5. runs the request once more, cold again, with every stage timed (timing waits on each
   jitted step, so it is kept out of the measured run).

Reports limit_s_per_token = max(compute, Belady bytes / disk bandwidth) per generated token,
measured_s_per_token, ratio (measured / limit), disk_gbs and `stages` (ms per token).
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import gc
import os
import shutil
import tempfile
import time

from absl import app, flags, logging
import numpy as np

from glmjax import cli

FLAGS = flags.FLAGS
cli.define_model_flag(cli.STORE_KINDS)
flags.DEFINE_string("prompt", "def fibonacci(n):", "Prompt text (ids 5..12 without a tokenizer).")
flags.DEFINE_integer("max_new_tokens", 16, "Tokens generated per request.", lower_bound=1)
cli.define_load_flags(
    only=("prefill_chunk", "cold", "device_cache_gb", "host_cache_gb", "io_workers", "prefetch"),
    defaults={"cold": True, "device_cache_gb": 0.0, "host_cache_gb": 0.4},
    notes={"cold": "Here: before each measured run.",
           "device_cache_gb": "Of the measured run.", "host_cache_gb": "Of the measured run."})
flags.DEFINE_string("json", None, "JSON output path (default: stdout only).")
flags.DEFINE_string("png", None, "Stacked-bar PNG of the stages (default: next to --json).")

# The stages of a token, in the order the bar stacks them.
STAGES = ("attention", "route", "bookkeeping", "io_wait", "expert_compute", "combine",
          "lm_head", "embed", "sampling", "other")


def _request(model, prompt):
  """One greedy request; returns (GenerationResult, wall seconds without compilation)."""
  t0 = time.perf_counter()
  r = model.generate(prompt, FLAGS.max_new_tokens, stop_ids=[])
  wall = time.perf_counter() - t0
  return r, wall - r.stats.get("fused_compile_s", 0.0)


def _split_route(model, stages: dict, n_steps: int) -> None:
  """Splits `attention_route` into attention and route: the router alone, timed per call."""
  import jax
  import jax.numpy as jnp
  from glmjax.model.moe import route
  cfg = model.config
  both = stages.pop("attention_route", 0.0)
  per_call = 0.0
  for i in model.moe_layers:
    lw = model.weights.layers[i]
    fn = jax.jit(lambda x, lw=lw: route(x, lw.mlp.router, lw.mlp.bias, cfg))
    x = jnp.ones((1, cfg.hidden_size), jnp.float32)
    jax.block_until_ready(fn(x))
    t0 = time.perf_counter()
    for _ in range(50):
      jax.block_until_ready(fn(x))
    per_call += (time.perf_counter() - t0) / 50
  stages["route"] = min(per_call * n_steps, both)
  stages["attention"] = both - stages["route"]


def _sampling_s(model, n: int) -> float:
  """The greedy sampler's time for `n` tokens, timed on its own."""
  import jax.numpy as jnp
  from glmjax.decoding import sampling
  picker = sampling.TokenPicker(sampling.SamplingParams(), model.config.vocab_size, [], 0)
  logits = jnp.zeros((model.config.vocab_size,), jnp.float32)
  picker.pick(logits)
  t0 = time.perf_counter()
  for _ in range(n):
    picker.pick(logits)
  return time.perf_counter() - t0


def _plot(report: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  bottom = 0.0
  for name in STAGES:
    ms = report["stages"].get(name, 0.0)
    ax.bar(["measured"], [ms], bottom=bottom, label=name)
    bottom += ms
  lim = report["limit"]
  ax.bar(["limit"], [1e3 * lim["compute_s_per_token"]], label="compute (resident)", color="0.6")
  ax.bar(["limit"], [1e3 * max(0.0, lim["io_s_per_token"] - lim["compute_s_per_token"])],
         bottom=1e3 * lim["compute_s_per_token"], label="Belady reads beyond compute",
         color="0.85")
  ax.set_ylabel("ms per generated token")
  ax.set_title(f"cold decode: ratio {lim['ratio']:.2f} to the limit ({lim['bound']}-bound)")
  ax.legend(fontsize=7, loc="upper right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import glmjax
  from glmjax.offload.expert_io import drop_page_cache
  from glmjax.replay import Trace
  from glmjax.replay.limit import belady_reads, capacity_experts, decode_limit
  from glmjax.bench.reporting import bench_store, disk_best_gbs, store_geometry, write_report
  path = bench_store(FLAGS.model, "bench_decode.")
  if not os.path.exists(os.path.join(path, "manifest.json")):
    raise app.UsageError(f"--model {path}: not an expert store (no manifest.json)")
  geo = store_geometry(path)
  budgets = dict(device_cache_gb=FLAGS.device_cache_gb, host_cache_gb=FLAGS.host_cache_gb,
                 io_workers=FLAGS.io_workers, prefetch=FLAGS.prefetch)
  work = tempfile.mkdtemp(prefix="bench_decode.")
  try:
    # 1. the disk, at the engine's chunk size, at its best thread count
    disk = disk_best_gbs(path)

    # 2. compute: every expert resident, warm
    resident = glmjax.load(path, progress=False, prefill_chunk=FLAGS.prefill_chunk,
                           device_cache_gb=geo["expert_bytes_total"] * 2 / 2**30,
                           host_cache_gb=0)
    prompt = FLAGS.prompt if resident.tokenizer is not None else [5, 6, 7, 8, 9, 10, 11, 12]
    _request(resident, prompt)
    ref, compute_s = _request(resident, prompt)
    resident.close()
    del resident  # its weights go before the offloaded model's budgets are sized
    gc.collect()

    # 3. the offloaded request: compiled by a warm-up, then measured cold with a live trace
    warm = glmjax.load(path, progress=False, prefill_chunk=FLAGS.prefill_chunk, **budgets)
    warm.generate(prompt, FLAGS.max_new_tokens, stop_ids=[], trace=os.path.join(work, "warm"))
    warm.close()
    del warm
    gc.collect()
    usage = os.path.join(path, "usage.json")  # no pins learned from the runs before

    def fresh():
      if os.path.exists(usage):
        os.remove(usage)
      if FLAGS.cold:
        drop_page_cache(path)
      return glmjax.load(path, progress=False, prefill_chunk=FLAGS.prefill_chunk, **budgets)

    model = fresh()
    trace_dir = os.path.join(work, "trace")
    t0 = time.perf_counter()
    r = model.generate(prompt, FLAGS.max_new_tokens, stop_ids=[], trace=trace_dir)
    measured_s = time.perf_counter() - t0 - r.stats.get("fused_compile_s", 0.0)
    tiers = model.executor.tier_state()
    model.close()
    del model
    gc.collect()
    tokens = len(r.tokens)

    # 4. the fewest bytes any policy of that capacity reads
    trace = Trace.open(trace_dir)
    belady = belady_reads(trace, capacity_experts(tiers, trace.moe_layers))
    limit = decode_limit(compute_s=compute_s, io_bytes=belady["belady_bytes"],
                         disk_gbs=disk["disk_gbs"], measured_s=measured_s, tokens=tokens)

    # 5. where the time goes: the same request, cold, every stage timed
    model = fresh()
    timed_stages = model.executor.stage_timing()
    t0 = time.perf_counter()
    timed = model.generate(prompt, FLAGS.max_new_tokens, stop_ids=[])
    staged_wall = time.perf_counter() - t0
    stages = dict(timed_stages)
    _split_route(model, stages, n_steps=len(timed.tokens))
    stages["sampling"] = _sampling_s(model, len(timed.tokens))
    model.close()
    stages["other"] = max(0.0, staged_wall - sum(stages.values()))
    n = max(len(timed.tokens), 1)
    report = {
        "store": path, **geo, "prompt_tokens": int(r.stats["prompt_tokens"]),
        "new_tokens": tokens, "cold": FLAGS.cold, "budgets": budgets,
        "disk": disk, "compute_s": compute_s, "measured_s": measured_s,
        **{k: limit[k] for k in ("limit_s_per_token", "measured_s_per_token", "ratio",
                                 "disk_gbs")},
        "limit": limit, "belady": belady,
        "engine": {k: r.stats.get(k, 0.0) for k in (
            "expert_misses", "expert_host_hits", "expert_pin_hits", "expert_bytes_read",
            "prefetch_issued", "prefetch_useful", "io_service_s", "io_wait_s")},
        "same_tokens_as_resident": r.tokens == ref.tokens,
        "stages": {k: 1e3 * stages.get(k, 0.0) / n for k in STAGES},
        "stages_unit": "ms per generated token, from a second cold run with every stage timed "
                       f"({1e3 * staged_wall / n:.1f} ms per token wall)",
    }
    out = FLAGS.json
    png = FLAGS.png or (os.path.splitext(out)[0] + ".png" if out else None)
    if png:
      _plot(report, png)
      report["png"] = png
    write_report(report, out)
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
