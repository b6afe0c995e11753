"""Expert-cache hit rates of a routing trace under several policies and capacities.

  python scripts/simulate.py --trace=/tmp/trace --out=/tmp/sim
  python scripts/simulate.py --trace=/tmp/trace --policies=lru,belady --capacities=8,16,32 \
      --prefetch=pilot --out=/tmp/sim

Writes OUT/simulate.json (one record per (policy, capacity), capacities in slots per MoE layer)
and OUT/hit_rate.png (hit rate against capacity, one line per policy, the area under Belady
shaded: no demand policy gets above it), and prints a table. Prefetch models apply to the
policies that take them; belady and static always run demand-only.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("trace", None, "Trace directory (written by glmjax.replay.TraceWriter).")
flags.DEFINE_list("policies", ["lru", "lfu", "belady", "static"], "Policies to run: lru, lfu, "
                  "lfru, static, belady, and engine (the engine's host LRU with the bytes of "
                  "that many slots per layer, all layers sharing it; needs a trace of a store).")
flags.DEFINE_list("capacities", [], "Slots per MoE layer; default 1, 2, 4, ... up to E.")
flags.DEFINE_list("prefetch", [], "Prefetch models (pilot, couple, mass, verify: the pilot over "
                  "speculative verify passes) for lru/lfu/...")
flags.DEFINE_integer("pilot_k", 6, "Pilot ids prefetched per position.")
flags.DEFINE_integer("couple_k", 4, "Co-activation prefetches per layer.")
flags.DEFINE_float("mass", None, "Softmax mass of the mass prefetch model (default 0.9).")
flags.DEFINE_enum("land", "evict", ["evict", "free"], "How prefetches enter the cache: evict "
                  "(admitted by the policy, evicting) or free (only into free slots, held for "
                  "the next request otherwise: the engine's rule).")
flags.DEFINE_bool("per_token", False, "Replay each position as its own step.")
flags.DEFINE_string("out", None, "Output directory.")
flags.mark_flag_as_required("trace")
flags.mark_flag_as_required("out")


def default_capacities(n_experts: int) -> list[int]:
  """1, 2, 4, ... below E, then E itself."""
  caps, c = [], 1
  while c < n_experts:
    caps.append(c)
    c *= 2
  return caps + [n_experts]


def plot(records: list[dict], path: str, title: str) -> None:
  """Hit rate against per-layer capacity, one line per run label, Belady's area shaded."""
  import matplotlib
  matplotlib.use("Agg")  # no display on servers
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  fig, ax = plt.subplots(figsize=(7, 4.5))
  lines: dict[str, list[tuple[int, float]]] = {}
  for r in records:
    lines.setdefault(r["label"], []).append((r["capacity"], r["hit_rate"]))
  for label, pts in lines.items():
    pts.sort()
    xs, ys = zip(*pts)
    if label == "belady":
      ax.fill_between(xs, 0, ys, color="0.85", label="under Belady (demand-only bound)")
      ax.plot(xs, ys, "k--", marker=".", label="belady (bound)")
    else:
      ax.plot(xs, ys, marker="o", ms=3, label=label)
  ax.set_xscale("log", base=2)
  ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())  # 16, not 2^4
  ax.set_ylim(0, 1)
  ax.set_xlabel("cache capacity (experts per MoE layer)")
  ax.set_ylabel("hit rate")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def table(records: list[dict]) -> str:
  caps = sorted({r["capacity"] for r in records})
  labels = list(dict.fromkeys(r["label"] for r in records))
  rate = {(r["label"], r["capacity"]): r["hit_rate"] for r in records}
  rows = ["hit rate".ljust(14) + "".join(f"{c:>7}" for c in caps)]
  for label in labels:
    rows.append(label.ljust(14) + "".join(
        f"{rate[(label, c)]:7.3f}" if (label, c) in rate else " " * 7 for c in caps))
  return "\n".join(rows)


def run() -> int:
  from tqdm import tqdm
  from glmjax.replay import POLICIES, Trace, simulate
  from glmjax.errors import GlmjaxError, InputError
  try:
    trace = Trace.open(FLAGS.trace)
    bad = [p for p in FLAGS.policies if p not in POLICIES and p != "engine"]
    if bad:
      raise InputError(f"unknown policy {bad}; known: {', '.join(sorted(POLICIES))}")
    try:
      caps = [int(c) for c in FLAGS.capacities] or default_capacities(trace.n_experts)
    except ValueError:
      raise InputError(f"--capacities must be integers, got {FLAGS.capacities}") from None
    runs = [(p, c) for p in FLAGS.policies for c in caps]
    records = []
    for p, c in tqdm(runs, desc="simulating", unit="run", file=sys.stderr):
      t0 = time.perf_counter()
      if p == "engine":  # the engine's host LRU holding as many bytes as c slots per layer
        pf = ()
        if trace.expert_bytes <= 0:
          raise InputError("policy engine needs a trace with expert_bytes (replay a store)")
        gb = (c * trace.n_layers * trace.expert_bytes + 0.5) / 2**30
        r = simulate(trace, "engine", device_cache_gb=0, host_cache_gb=gb,
                     per_token=FLAGS.per_token)
        r["capacity"] = c
      else:
        pf = tuple(FLAGS.prefetch) if POLICIES[p].prefetch_ok else ()
        r = simulate(trace, p, per_layer=c, prefetch=pf, pilot_k=FLAGS.pilot_k,
                     couple_k=FLAGS.couple_k, mass=FLAGS.mass, land=FLAGS.land,
                     per_token=FLAGS.per_token)
      r["seconds"] = round(time.perf_counter() - t0, 3)
      r["label"] = "+".join([p, *pf, *(["free"] if pf and FLAGS.land == "free" else [])])
      records.append(r)
  except GlmjaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  bound = {r["capacity"]: r["hit_rate"] for r in records if r["label"] == "belady"}
  for r in records:  # each policy as a fraction of the optimum at its capacity
    if bound.get(r["capacity"]):
      r["fraction_of_belady"] = r["hit_rate"] / bound[r["capacity"]]
  os.makedirs(FLAGS.out, exist_ok=True)
  report = {"trace": os.path.abspath(FLAGS.trace), "positions": trace.n_positions,
            "moe_layers": trace.n_layers, "n_experts": trace.n_experts, "top_k": trace.top_k,
            "expert_bytes": trace.expert_bytes, "records": records}
  with open(os.path.join(FLAGS.out, "simulate.json"), "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  plot(records, os.path.join(FLAGS.out, "hit_rate.png"),
       f"{os.path.basename(os.path.abspath(FLAGS.trace))}: {trace.n_positions} positions, "
       f"E={trace.n_experts}, K={trace.top_k}")
  print(table(records))
  print(f"wrote {os.path.join(FLAGS.out, 'simulate.json')} and hit_rate.png")
  return 0


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # keep matplotlib's font-cache notes off the console
  return run()


if __name__ == "__main__":
  app.run(main)
