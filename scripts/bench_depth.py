"""Cold offloaded decode and prefill at several MoE depths against their physical limit.

  python scripts/bench_depth.py --layers=8,24,77 --stores=/tmp/glmjax_depth --json=/tmp/depth.json
  python scripts/bench_depth.py --geometry=tiny --layers=2,4 --experts=8 \\
      --stores=/tmp/depth_tiny --json=/tmp/depth_tiny.json

Stores d{L} (make_synthetic_store.py's) are made unless their manifest exists. Each depth runs
in a fresh process (--one_depth: its own peak RSS), without usage.json or couple.npy: a warm-up
on another prompt compiles, then a cold load runs the prompt with a live trace. The host cache
holds as many experts a MoE layer as --host_cache_gb_per_77_layers × L/77 GiB of GLM-5's.
Phases: time by the generation loop's clocks, counters by a snapshot as the prefill returns, the
trace at its first step. Limit (replay/limit.py): max(compute, Belady bytes / disk) per phase,
decode's Belady the whole trace's minus the prefill's; compute: warm runs at W/2 and W layers;
disk: `reporting.disk_best_gbs` over the deepest store."""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import datetime
import functools
import gc
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile

from absl import app, flags, logging
import numpy as np

import glmjax
from glmjax import cli
from glmjax.formats.synthetic import make_synthetic_store
from glmjax.replay import Trace, simulate
from glmjax.replay.limit import capacity_experts, decode_limit
from glmjax.bench.reporting import disk_best_gbs, store_geometry, write_report
from glmjax.runtime import compile_cache

FLAGS = flags.FLAGS
flags.DEFINE_list("layers", ["8", "24", "77"], "MoE layer counts (depths) to measure.")
flags.DEFINE_enum("geometry", "glm5", ["glm5", "tiny"], "Synthetic store geometry.")
flags.DEFINE_integer("experts", 16, "Routed experts per MoE layer.", lower_bound=1)
flags.DEFINE_integer("vocab_size", 4096, "Vocabulary of the synthetic stores.")
flags.DEFINE_enum("dense_bits", "4", ["0", "4", "8"], "Dense weights of the synthetic stores.")
flags.DEFINE_string("stores", "/tmp/glmjax_depth", "Directory of the stores d{L}, made or reused.")
flags.DEFINE_float("host_cache_gb_per_77_layers", 4.0, "Host cache GiB of 77 GLM-5 MoE layers: "
                   "L/77 of it at depth L, in experts per layer for other geometries.")
flags.DEFINE_integer("prompt_tokens", 4, "Prompt length (ids 5, 6, ...).", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 6, "Tokens generated (decode steps + 1).", lower_bound=2)
flags.DEFINE_integer("warm_layers", 4, "Compute: warm runs at W/2 and W MoE layers.", lower_bound=2)
cli.define_load_flags(only=("device_cache_gb", "io_workers", "prefetch"),
                      defaults={"device_cache_gb": 0.0})
flags.DEFINE_string("json", None, "JSON output path (default: stdout only).")
flags.DEFINE_string("png", None, "PNG of the ratios against depth (default: next to --json).")
flags.DEFINE_integer("one_depth", None, "(internal) measure this depth into --piece.")
flags.DEFINE_list("compute_depths", None, "(internal) warm runs at these depths into --piece.")
flags.DEFINE_string("piece", None, "(internal) a child process's JSON output.")

COUNTERS = ("expert_misses", "expert_host_hits", "expert_pin_hits", "expert_bytes_read",
            "prefetch_issued", "prefetch_useful", "prefetch_late", "prefetch_wasted",
            "prefetch_dropped", "io_service_s", "io_wait_s", "pilot_hits", "pilot_predicted")
GLM5_CHUNK = 20_054_016  # bytes of a GLM-5 expert: ExpertLayout.make(6144, 2048, 4, 64)


def _store(layers: int) -> str:
  return os.path.join(FLAGS.stores, f"d{layers}")


def _forget(path: str) -> None:
  """No learned pins or co-activation carry over from earlier runs."""
  for name in ("usage.json", "couple.npy"):
    if os.path.exists(os.path.join(path, name)):
      os.remove(os.path.join(path, name))


def _watched(model, snap: dict, prefill, *args, **kw):
  """`model`'s prefill, leaving the engine's counters in `snap` as it returns."""
  out = prefill(*args, **kw)
  np.asarray(out[0])  # waits for the logits, as generation does before reading the counters
  snap.update(model.executor.telemetry())
  return out


def _replay(trace, capacity: int) -> dict:
  """Belady, per-layer and global LRU at `capacity` experts, per phase: the prefill step alone,
  and decode = the whole trace - that."""
  k = int(np.sum(trace.steps == trace.steps[0]))  # the prefill: one step
  head = Trace.from_ids(trace.ids[:k], weights=trace.weights[:k], tokens=trace.tokens[:k],
                        steps=trace.steps[:k], n_experts=trace.n_experts, live=trace.live,
                        moe_layers=trace.moe_layers, expert_bytes=trace.expert_bytes)
  layer = ("lru", {"per_layer": capacity // trace.n_layers})  # an LRU per layer, same room
  out = {"prefill_positions": k, "capacity_experts": capacity, "lru_layer": list(layer)}
  for name, (policy, kw) in (("belady", ("belady", {"total": capacity})),  # limit.belady_reads
                             ("lru_layer", layer), ("lru_global", ("lru", {"total": capacity}))):
    pre, whole = simulate(head, policy, **kw), simulate(trace, policy, **kw)
    for phase, q, m in (("prefill", pre["requests"], pre["misses"]),
                        ("decode", whole["requests"] - pre["requests"],
                         whole["misses"] - pre["misses"])):
      out[f"{name}_{phase}"] = {"requests": q, "misses": m, "hit_rate": 1 - m / q if q else 0.0,
                                "bytes": m * trace.expert_bytes}
  return out


def _one_depth(layers: int) -> dict:
  path, work = _store(layers), os.path.splitext(FLAGS.piece)[0]  # traces beside the piece
  geo = store_geometry(path)
  host_gb = FLAGS.host_cache_gb_per_77_layers * layers / 77 * geo["chunk_bytes"] / GLM5_CHUNK
  opts = dict(cli.load_options(), host_cache_gb=host_gb, cold=True, progress=False)
  for name, first in (("warm", 105), ("trace", 5)):  # a warm-up on another prompt compiles
    _forget(path)
    model = glmjax.load(path, **opts)  # cold: the store leaves the page cache
    snap, before = {}, model.executor.telemetry()
    model.executor.prefill = functools.partial(_watched, model, snap, model.executor.prefill)
    prompt = list(range(first, first + FLAGS.prompt_tokens))
    r = model.generate(prompt, FLAGS.max_new_tokens, stop_ids=[], trace=f"{work}.{name}")
    tiers = model.executor.tier_state()
    model.close()
    del model
    gc.collect()
  rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  trace = Trace.open(f"{work}.trace")
  replay = _replay(trace, capacity_experts(tiers, trace.moe_layers))
  s, steps = r.stats, len(r.tokens) - 1
  pre = {k: snap.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
  return {"moe_layers": layers, "store": path, **geo, "host_cache_gb": host_gb,
          "tiers": {k: tiers[k] for k in ("device_bytes", "host_bytes", "slots")},
          "prompt_tokens": int(s["prompt_tokens"]), "new_tokens": len(r.tokens),
          "decode_steps": steps, "prefill_s": s["prefill_s"], "compile_s": s["compile_s"],
          "decode_s_per_token": (s["decode_s"] - s["decode_compile_s"]) / steps,
          "decode_compile_s": s["decode_compile_s"],
          "engine": {"prefill": pre, "decode": {k: s.get(k, 0.0) - pre[k] for k in COUNTERS}},
          "replay": replay, "peak_rss_mb": rss_mb}


def _compute(depths: list[int]) -> dict:
  """Warm runs, every expert in the host cache: the best of two timed runs after a compiling
  one, traced like the measured run (same recording work, no prefix-cache reuse)."""
  out, work = {}, os.path.splitext(FLAGS.piece)[0]
  for w in depths:
    _forget(_store(w))
    gb = store_geometry(_store(w))["expert_bytes_total"] * 1.1 / 2**30
    model = glmjax.load(_store(w), **dict(cli.load_options(), device_cache_gb=0, host_cache_gb=gb,
                                          progress=False))
    model.executor.warm_host()
    runs = [model.generate(list(range(5, 5 + FLAGS.prompt_tokens)), FLAGS.max_new_tokens,
                           stop_ids=[], trace=f"{work}.{w}.{i}").stats for i in range(3)][1:]
    model.close()
    decode = [(s["decode_s"] - s["decode_compile_s"]) / (s["new_tokens"] - 1) for s in runs]
    out[w] = {"prefill_s": min(s["prefill_s"] for s in runs), "decode_s_per_token": min(decode),
              "misses": sum(s.get("expert_misses", 0.0) for s in runs)}
  return out


def _child(work: str, arg: str) -> dict:
  """This script in a fresh process, in one of its internal modes."""
  piece = os.path.join(work, arg.strip("-").replace("=", "_") + ".json")
  subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], arg,
                  f"--piece={piece}"], check=True)
  with open(piece, encoding="utf-8") as f:
    return json.load(f)


def _plot(report: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax, ds = *plt.subplots(figsize=(6, 4)), report["depths"]
  for phase in ("decode", "prefill"):
    ax.plot([d["moe_layers"] for d in ds], [d[f"{phase}_ratio"] for d in ds], "o-", label=phase)
  ax.axhline(1.3, color="0.5", ls="--", label="1.3")
  ax.set(xlabel="MoE layers", ylabel="measured / physical limit", ylim=(0, None),
         xticks=[d["moe_layers"] for d in ds], title=f"cold offloaded, {report['geometry']} stores")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if FLAGS.piece:  # a child: one depth, or the warm runs
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # else the one set up there
      compile_cache.enable()  # the children reuse each other's compiled steps
    out = (_one_depth(FLAGS.one_depth) if FLAGS.one_depth is not None
           else _compute([int(w) for w in FLAGS.compute_depths]))
    with open(FLAGS.piece, "w", encoding="utf-8") as f:
      json.dump(out, f)
    return
  layers = sorted({int(l) for l in FLAGS.layers})
  warm = sorted({FLAGS.warm_layers // 2, FLAGS.warm_layers})
  for l in sorted(set(layers) | set(warm)):
    if not os.path.exists(os.path.join(_store(l), "manifest.json")):
      make_synthetic_store(_store(l), geometry=FLAGS.geometry, moe_layers=l, progress=False,
                           experts=FLAGS.experts, vocab_size=FLAGS.vocab_size,
                           dense_bits=int(FLAGS.dense_bits))
    geo = store_geometry(_store(l))
    if (geo["moe_layers"], geo["experts"]) != (l, FLAGS.experts):
      raise app.UsageError(f"{_store(l)}: not a store of {l} MoE layers × {FLAGS.experts}")
  disk = disk_best_gbs(_store(layers[-1]))
  with tempfile.TemporaryDirectory(prefix="bench_depth.") as work:
    warm_runs = _child(work, f"--compute_depths={','.join(map(str, warm))}")
    depths = [_child(work, f"--one_depth={l}") for l in layers]
  fit, (w0, w1) = {}, sorted(int(w) for w in warm_runs)
  for phase, key in (("prefill", "prefill_s"), ("decode", "decode_s_per_token")):
    t0, t1 = warm_runs[str(w0)][key], warm_runs[str(w1)][key]
    b = max(0.0, (t1 - t0) / (w1 - w0))  # the line through the two warm runs, both terms ≥ 0
    a = max(0.0, t1 - b * w1)
    fit[phase] = {"intercept_s": a, "slope_s_per_layer": b}
  for d in depths:  # each phase's limit, ratio, bound and hit rates (engine and replays)
    l, rp, steps = d["moe_layers"], d["replay"], d["decode_steps"]
    for phase, n in (("prefill", 1), ("decode", steps)):
      measured = d["prefill_s"] if phase == "prefill" else d["decode_s_per_token"] * steps
      compute = n * (fit[phase]["intercept_s"] + fit[phase]["slope_s_per_layer"] * l)
      lim = decode_limit(compute_s=compute, io_bytes=rp[f"belady_{phase}"]["bytes"],
                         disk_gbs=disk["disk_gbs"], measured_s=measured, tokens=n)
      d.update({f"{phase}_limit": lim, f"{phase}_ratio": lim["ratio"],
                f"{phase}_bound": lim["bound"]})
      e = d["engine"][phase]
      served = e["expert_host_hits"] + e["expert_pin_hits"] + e["expert_misses"]
      d[f"{phase}_hit_rate"] = 1 - e["expert_misses"] / served if served else 0.0
      d[f"{phase}_host_hit_rate"] = e["expert_host_hits"] / served if served else 0.0
      for sim in ("belady", "lru_layer", "lru_global"):
        d[f"{phase}_{sim}_hit_rate"] = rp[f"{sim}_{phase}"]["hit_rate"]
    d["ms_per_layer_token"] = 1e3 * d["decode_s_per_token"] / l
    d["bytes_read_per_token"] = d["engine"]["decode"]["expert_bytes_read"] / steps
    d["belady_bytes_per_token"] = rp["belady_decode"]["bytes"] / steps
  report = {
      "command": shlex.join([sys.executable, *sys.argv]),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      **{k: getattr(FLAGS, k) for k in (
          "geometry", "experts", "vocab_size", "prompt_tokens", "max_new_tokens",
          "device_cache_gb", "host_cache_gb_per_77_layers", "io_workers", "prefetch")},
      "dense_bits": int(FLAGS.dense_bits), "compute": {"warm_runs": warm_runs, "fit": fit},
      "disk": {**disk, "store": _store(layers[-1]), "scope": "every chunk of the deepest store"},
      "depths": depths}
  png = FLAGS.png or (os.path.splitext(FLAGS.json)[0] + ".png" if FLAGS.json else None)
  if png:
    _plot(report, png)
    report["png"] = png
  write_report(report, FLAGS.json)


if __name__ == "__main__":
  app.run(main)
