"""Simulation studies of proposed MoE-offload optimizations on a routing trace (one JSON report,
one markdown table per study).

  python scripts/negative_results.py --out=/tmp/neg.json            # records a trace first
  python scripts/negative_results.py --trace=/tmp/trace --studies=mass_filter --out=/tmp/neg.json

Without --trace it records ~--tokens positions of the embedded model on its held-out corpus
(scripts/replay.py, with the pilot kept for every expert so the softmax-mass filter sees all E
scores). Studies (each a function of a `Context`, returning a JSON-able dict; register new ones
in STUDIES):

- mass_filter: the softmax-mass confidence filter on the pilot's scores, mass 0.79 … 0.97:
  predicted set size, false positives and recall against the next layer's true top-k, and the
  LRU hit rate at --capacity with its predictions prefetched, against LRU without prefetch.
- pilot_k_sweep: the pilot's top PILOT_K: recall, precision, bytes read per position, hit rate.
- freq_eviction: lfu and lfru (the engine's pin rule) against lru, with pilot prefetch staging:
  hit rate and staged experts wasted, at --capacities.

Decode is modelled with per_token=True: each position is its own step, in trace order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Callable

from absl import app, flags, logging
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON output path.")
flags.DEFINE_string("trace", None, "Trace directory to study; default: record one.")
flags.DEFINE_string("record_to", None, "Where to keep the recorded trace (default: a temporary "
                    "directory, removed at exit).")
flags.DEFINE_integer("tokens", 16384, "Positions to record when no --trace is given.",
                     lower_bound=1)
flags.DEFINE_list("studies", None, "Studies to run (default: every registered one).")
flags.DEFINE_integer("capacity", None, "Slots per MoE layer for the fixed-capacity hit rates "
                     "(default 2 × top_k).", lower_bound=1)
flags.DEFINE_list("capacities", None, "Slots per MoE layer for freq_eviction (default top_k, "
                  "2 × top_k, 4 × top_k, each below E).")
flags.mark_flag_as_required("out")

MASSES = (0.79, 0.85, 0.90, 0.95, 0.97)
PILOT_KS = (2, 4, 6, 8, 12, 16)
PER_TOKEN = True
WHY_PER_TOKEN = (
    "per_token=True: every position is replayed as its own step, in trace order (each row is "
    "a run of consecutive tokens of one sequence). A replay trace's steps are teacher-forced "
    "batches (4 rows × 256 tokens by default) whose unions cover most experts; batch-1 decode "
    "reads one token's top-k per layer per step, which is what these policies face.")


@dataclasses.dataclass
class Context:
  """What a study gets: the trace (recorded on first use), the capacities and replay mode."""
  trace_path: str | None
  record_to: str | None
  tokens: int
  capacity: int | None = None
  capacities: list[int] | None = None
  per_token: bool = PER_TOKEN
  recorded: bool = False
  bytes_note: str | None = None
  _trace: object = None

  @property
  def trace(self):
    """The glmjax.replay.Trace under study (recording it first when none was given)."""
    from glmjax.replay import Trace
    if self._trace is None:
      if self.trace_path is None:
        self.trace_path = record_trace(self.record_to, self.tokens)
        self.recorded = True
      t = Trace.open(self.trace_path)
      if t.pilot is None:
        raise _input_error(f"{self.trace_path}: the trace has no pilot predictions")
      cfg = t.config or {}
      if not t.expert_bytes and {"hidden_size", "moe_intermediate_size"} <= set(cfg):
        # A resident model's replay reads no store; price an expert as scripts/convert.py's
        # default chunk (int4, 64-feature groups) would store it.
        from glmjax.formats.store import ExpertLayout
        nbytes = ExpertLayout.make(cfg["hidden_size"], cfg["moe_intermediate_size"], 4, 64).nbytes
        t = dataclasses.replace(t, expert_bytes=nbytes)
        self.bytes_note = (f"the trace has expert_bytes 0 (a resident model's replay): bytes "
                           f"are priced at {nbytes} per expert, the int4 G=64 store chunk "
                           "scripts/convert.py writes by default")
      self._trace = t
    return self._trace

  def fixed_capacity(self) -> int:
    t = self.trace
    return min(self.capacity or 2 * t.top_k, t.n_experts)

  def sweep_capacities(self) -> list[int]:
    t = self.trace
    caps = self.capacities or [c for c in (t.top_k, 2 * t.top_k, 4 * t.top_k) if c < t.n_experts]
    return sorted({min(int(c), t.n_experts) for c in caps}) or [t.n_experts]


def _input_error(msg: str):
  from glmjax.errors import InputError
  return InputError(msg)


def record_trace(dest: str | None, tokens: int) -> str:
  """Records the embedded model's routing over its held-out corpus with scripts/replay.py,
  keeping the pilot's prediction for every expert. Returns the trace directory."""
  if dest is None:
    tmp = tempfile.mkdtemp(prefix="negative_results.")
    import atexit
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    dest = os.path.join(tmp, "trace")
  # --pilot_p and --top_m are capped at E by the recorder: every expert's score is kept.
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "replay.py"), f"--out={dest}",
         f"--max_tokens={tokens}", "--pilot_p=4096", "--top_m=4096"]
  r = subprocess.run(cmd, capture_output=True, text=True)
  if r.returncode != 0:
    raise _input_error(f"recording the trace failed: {r.stderr.strip()[-2000:]}")
  return dest


# --- shared measures ---------------------------------------------------------------------------

def set_quality(trace, take: np.ndarray) -> dict:
  """Per (position, predicted layer): size of the predicted set `take` `[N, L, P]`, false
  positives and recall against the true top-k ids, precision. Means over layers 1..L-1 (the
  pilot predicts each layer from the one before; layer 0 has no prediction)."""
  pilot, ids = trace.pilot[:, 1:], trace.ids[:, 1:]  # [N, L-1, P], [N, L-1, K]
  take = take[:, 1:]
  in_true = (pilot[..., :, None] == ids[..., None, :]).any(-1)  # [N, L-1, P]
  size = take.sum(-1)  # [N, L-1]
  tp = (take & in_true).sum(-1)
  return {"set_size": float(size.mean()), "set_size_p90": float(np.percentile(size, 90)),
          "false_positives": float((size - tp).mean()),
          "recall": float(tp.mean() / trace.top_k),
          "precision": float(tp.sum() / max(size.sum(), 1))}


def replay(trace, policy: str, capacity: int, per_token: bool, **prefetch) -> dict:
  """simulate() at `capacity` slots per layer; the counters the studies report."""
  from glmjax.replay import simulate
  r = simulate(trace, policy, per_layer=capacity, per_token=per_token, **prefetch)
  n = trace.n_positions
  issued = r["prefetch_issued"]
  return {"hit_rate": r["hit_rate"], "bytes_read_per_position": r["bytes_read"] / n,
          "reads_per_position": r["reads"] / n, "prefetch_issued": issued,
          "prefetch_useful": r["prefetch_useful"], "prefetch_wasted": r["prefetch_wasted"],
          "wasted_fraction": r["prefetch_wasted"] / issued if issued else 0.0}


def _logit_trace(trace):
  """The trace with each pilot score s replaced by its router logit log(s / (1 - s)), so the
  mass filter's softmax is over logits, as on a softmax router."""
  s = np.clip(trace.pilot_scores, 1e-6, 1 - 1e-6)
  return dataclasses.replace(trace, pilot_scores=np.log(s / (1 - s)).astype(np.float32))


# --- the studies ---------------------------------------------------------------------------------

def mass_filter(ctx: Context) -> dict:
  """The softmax-mass confidence filter applied to the pilot's scores."""
  from glmjax.replay.simulate import prediction_mask
  t, cap = ctx.trace, ctx.fixed_capacity()
  base = replay(t, "lru", cap, ctx.per_token)
  rows = []
  for scores, tr in (("sigmoid", t), ("logit", _logit_trace(t))):
    for m in MASSES:
      q = set_quality(tr, prediction_mask(tr, mass=m))
      sim = replay(tr, "lru", cap, ctx.per_token, prefetch=("mass",), mass=m)
      rows.append({"scores": scores, "mass": m, **q, "hit_rate": sim["hit_rate"],
                   "hit_rate_no_prefetch": base["hit_rate"],
                   "bytes_read_per_position": sim["bytes_read_per_position"],
                   "wasted_fraction": sim["wasted_fraction"]})
  sig = [r for r in rows if r["scores"] == "sigmoid"]
  lo, hi = sig[0], sig[-1]
  finding = (
      f"Softmax over the {t.pilot.shape[2]} recorded sigmoid scores is nearly flat (they lie in "
      f"(0, 1)): mass {lo['mass']} already selects {lo['set_size']:.1f} of {t.n_experts} experts "
      f"per position ({lo['false_positives']:.1f} false positives, recall {lo['recall']:.3f}), "
      f"mass {hi['mass']} selects {hi['set_size']:.1f}. Prefetching them into {cap} slots per "
      f"layer gives an LRU hit rate of {lo['hit_rate']:.3f}–{hi['hit_rate']:.3f} against "
      f"{base['hit_rate']:.3f} without prefetch, reading "
      f"{lo['bytes_read_per_position'] / max(base['bytes_read_per_position'], 1e-9):.1f}–"
      f"{hi['bytes_read_per_position'] / max(base['bytes_read_per_position'], 1e-9):.1f}× the "
      "bytes.")
  return {"capacity": cap, "lru_no_prefetch": base, "rows": rows, "finding": finding,
          "method": "mass: pilot ids in rank order until the softmax of the recorded pilot "
                    "scores reaches the mass (the id crossing it included), as simulate's "
                    "prefetch='mass'. 'sigmoid' rows: softmax over the sigmoid scores "
                    "(the filter applied as is); 'logit' rows: over the router logits "
                    "log(s/(1-s)), the most favourable transfer to a softmax-style gate. "
                    "False positives and recall against the true top-k of the predicted layer."}


def pilot_k_sweep(ctx: Context) -> dict:
  """The pilot's top PILOT_K ids prefetched: accuracy against cost."""
  from glmjax.replay.simulate import prediction_mask
  t, cap = ctx.trace, ctx.fixed_capacity()
  base = replay(t, "lru", cap, ctx.per_token)
  rows = [{"pilot_k": 0, "recall": 0.0, "precision": 0.0, **_pick(base)}]
  for k in PILOT_KS:
    if k > t.pilot.shape[2]:
      continue
    q = set_quality(t, prediction_mask(t, pilot_k=k))
    sim = replay(t, "lru", cap, ctx.per_token, prefetch=("pilot",), pilot_k=k)
    rows.append({"pilot_k": k, "recall": q["recall"], "precision": q["precision"], **_pick(sim)})
  best = max(rows, key=lambda r: r["hit_rate"])
  at_k = {r["pilot_k"]: r for r in rows}
  finding = (
      f"Recall rises with PILOT_K while precision falls; at {cap} slots per layer the best "
      f"hit rate is {best['hit_rate']:.3f} at PILOT_K={best['pilot_k']} (no prefetch: "
      f"{base['hit_rate']:.3f}), reading {best['bytes_read_per_position']:.0f} bytes per "
      f"position against {base['bytes_read_per_position']:.0f}.")
  if 6 in at_k and 8 in at_k:
    finding += (f" PILOT_K 6 → 8: recall {at_k[6]['recall']:.3f} → {at_k[8]['recall']:.3f}, "
                f"hit rate {at_k[6]['hit_rate']:.3f} → {at_k[8]['hit_rate']:.3f}, bytes "
                f"{at_k[6]['bytes_read_per_position']:.0f} → "
                f"{at_k[8]['bytes_read_per_position']:.0f}.")
  return {"capacity": cap, "rows": rows, "finding": finding,
          "method": "LRU per layer at the fixed capacity, prefetch='pilot' (pilot_k 0 = no "
                    "prefetch). Recall = |top-PILOT_K ∩ true top-k| / k, precision = the same "
                    "over PILOT_K, both over layers 1..L-1; bytes read per position = demand "
                    "misses + prefetches, × expert bytes."}


def _pick(sim: dict) -> dict:
  return {k: sim[k] for k in ("hit_rate", "bytes_read_per_position", "reads_per_position",
                              "wasted_fraction")}


def freq_eviction(ctx: Context) -> dict:
  """Frequency-weighted eviction (lfu, lfru) against lru with pilot prefetch staging."""
  t = ctx.trace
  rows = []
  for cap in ctx.sweep_capacities():
    bound = replay(t, "belady", cap, ctx.per_token)["hit_rate"]
    for policy in ("lru", "lfu", "lfru"):
      demand = replay(t, policy, cap, ctx.per_token)
      staged = replay(t, policy, cap, ctx.per_token, prefetch=("pilot",))
      rows.append({"capacity": cap, "policy": policy, "hit_rate_no_prefetch": demand["hit_rate"],
                   "hit_rate_pilot": staged["hit_rate"],
                   "prefetch_issued": staged["prefetch_issued"],
                   "prefetch_useful": staged["prefetch_useful"],
                   "prefetch_wasted": staged["prefetch_wasted"],
                   "wasted_fraction": staged["wasted_fraction"], "belady_demand_bound": bound})
  parts = []
  for cap in ctx.sweep_capacities():
    by = {r["policy"]: r for r in rows if r["capacity"] == cap}
    lru = by["lru"]
    parts.append(
        f"at {cap} slots lru {lru['hit_rate_pilot']:.3f} ({lru['wasted_fraction']:.0%} of "
        "staged wasted), " + ", ".join(
            f"{p} {by[p]['hit_rate_pilot']:.3f} ({by[p]['wasted_fraction']:.0%}; "
            f"{100 * (by[p]['hit_rate_pilot'] - lru['hit_rate_pilot']):+.1f} pp vs lru)"
            for p in ("lfu", "lfru")))
  finding = ("With pilot staging, hit rate (share of staged experts wasted): " + "; ".join(parts)
             + ".")
  return {"capacities": ctx.sweep_capacities(), "pilot_k": 6, "rows": rows, "finding": finding,
          "method": "per-layer caches, prefetch='pilot' at simulate's default pilot_k 6. "
                    "prefetch_wasted counts staged experts evicted before use, read and "
                    "dropped for want of room (lfru admits only past its hysteresis), or never "
                    "requested. lfu: use counts since the start, a prefetch enters with its "
                    "count (0 if never used); lfru: the engine's pin rule (decayed heat, "
                    "hysteresis). belady: the demand-only optimum, for scale."}


# --- live studies: these run the embedded model's store through the engine -----------------------

PROMPT = "import os\nimport sys\n\ndef main("


def _store() -> tuple[str, int]:
  from glmjax.reporting import bench_store, store_geometry
  path = bench_store(None, "negative_results.")
  return path, store_geometry(path)["expert_bytes_total"]


def verify_cap(ctx: Context) -> dict:
  """The opt-in, lossy `expert_budget`: a speculative verify pass routed within its N most
  chosen experts per MoE layer, against uncapped verification."""
  import glmjax
  path, total = _store()
  rows, base = [], None
  for cap in (None, 12, 10, 8, 6):
    m = glmjax.load(path, progress=False, device_cache_gb=0, host_cache_gb=0.25 * total / 2**30,
                    prefetch=False, expert_budget=cap)
    eng, verify = m.engine, []
    forward = eng.forward

    def counted(tokens, cache=None, absorbed=False, **kw):  # experts used by verify passes
      before = eng.stats["experts_used"]
      out = forward(tokens, cache, absorbed=absorbed, **kw)
      if absorbed and np.shape(tokens)[1] > 1:
        verify.append(eng.stats["experts_used"] - before)
      return out
    eng.forward = counted
    m.generate(PROMPT, 16, stop_ids=[], draft=3)  # warm-up: compiles, fills the cache
    verify.clear()
    r = m.generate(PROMPT, 64, stop_ids=[], draft=3)
    m.close()
    s = r.stats
    base = base or r.tokens
    rows.append({"expert_budget": cap or "off",
                 "acceptance": s["draft_accepted"] / max(s["draft_proposed"], 1),
                 "tokens_per_verify": s["tokens_per_forward"],
                 "experts_per_layer_per_verify": float(np.mean(verify)) / len(m.moe_layers),
                 "misses_per_token": s["expert_misses"] / max(s["new_tokens"], 1),
                 "decode_tok_s": s["decode_tok_s"], "same_tokens": r.tokens == base})
  off, lowest = rows[0], rows[-1]
  return {"rows": rows, "finding":
          f"Drafts 3, host cache 25% of the expert bytes, prefetch off, 64 greedy tokens. "
          f"Uncapped, a verify pass loads {off['experts_per_layer_per_verify']:.1f} experts per "
          f"layer at acceptance {off['acceptance']:.2f}; capped at "
          f"{lowest['expert_budget']} it loads {lowest['experts_per_layer_per_verify']:.1f} at "
          f"acceptance {lowest['acceptance']:.2f}. Any cap below the union changes the greedy "
          "output (the cap is lossy by design). Tok/s on this shared 2-core machine is noise-"
          "level at 20 KB experts; the bytes saved per verify are the figure that transfers."}


def stage_breakdown(ctx: Context) -> dict:
  """Amdahl: where a decoded token's time goes, stage by stage (each stage waits for its
  results while timed, so the overlap the engine normally gets is removed)."""
  import time
  import jax
  import jax.numpy as jnp
  import glmjax
  from glmjax.decoding import sampling
  from glmjax.model.moe import route
  path, total = _store()
  rows = []
  for host in (0.25, 1.0):
    m = glmjax.load(path, progress=False, device_cache_gb=0, host_cache_gb=host * total / 2**30,
                    prefetch=False)
    m.generate(PROMPT, 48, stop_ids=[])  # warm: compiled, cache filled
    m.engine.stage_s = {}
    n = 48
    t0 = time.perf_counter()
    m.generate(PROMPT, n, stop_ids=[])
    wall = time.perf_counter() - t0
    stages = {k: v / n for k, v in m.engine.stage_s.items()}
    # Router top-k and sampling, timed on their own (inside the steps they are fused away).
    cfg, lw = m.config, m.weights.layers[m.moe_layers[0]]
    x = jnp.ones((1, cfg.hidden_size), jnp.float32)
    router = jax.jit(lambda x: route(x, lw.mlp.router, lw.mlp.bias, cfg))
    logits = jnp.zeros((cfg.vocab_size,), jnp.float32)
    picker = sampling.TokenPicker(sampling.SamplingParams(), cfg.vocab_size, [1], 0)

    def per_call(fn, reps=200):
      fn()
      t = time.perf_counter()
      for _ in range(reps):
        jax.block_until_ready(fn())
      return (time.perf_counter() - t) / reps
    stages["router_top_k (within attention_route)"] = per_call(lambda: router(x)) * len(
        m.moe_layers)
    stages["sampling"] = per_call(lambda: picker.pick(logits))
    m.close()
    timed = sum(v for k, v in stages.items() if "within" not in k)
    for k, v in sorted(stages.items(), key=lambda kv: -kv[1]):
      rows.append({"host_cache": host, "stage": k, "ms_per_token": 1e3 * v,
                   "share_pct": 100 * v / timed})
    rows.append({"host_cache": host, "stage": "(wall, per token)", "ms_per_token": 1e3 * wall / n,
                 "share_pct": None})
  def share(host, stage):
    return next(r["share_pct"] for r in rows if r["host_cache"] == host and r["stage"] == stage)
  router = "router_top_k (within attention_route)"
  return {"rows": rows, "finding":
          "Layer-by-layer steps with every stage timed to completion (stage timing turns the "
          f"fused step off). Router top-k: {share(0.25, router):.1f}% / {share(1.0, router):.1f}% "
          f"of a token (host cache 25% / 100%), sub-noise; sampling: "
          f"{share(0.25, 'sampling'):.1f}% / {share(1.0, 'sampling'):.1f}%, not sub-noise at this "
          f"model size (a 4096-way vocabulary against a 9M-parameter body); tier bookkeeping: "
          f"{share(0.25, 'bookkeeping'):.1f}% with a thrashing 25% cache (inserts and "
          f"evictions) against {share(1.0, 'bookkeeping'):.1f}% with everything cached. Expert "
          "compute and attention dominate either way."}


STUDIES: dict[str, Callable[[Context], dict]] = {
    "mass_filter": mass_filter,
    "pilot_k_sweep": pilot_k_sweep,
    "freq_eviction": freq_eviction,
    "verify_cap": verify_cap,
    "stage_breakdown": stage_breakdown,
}


# --- output --------------------------------------------------------------------------------------

def markdown(rows: list[dict]) -> str:
  """A markdown table of `rows` (columns: the first row's keys)."""
  if not rows:
    return "(no rows)"
  cols = list(rows[0])

  def cell(v):
    if isinstance(v, float):
      return f"{v:.4g}"
    return "" if v is None else str(v)

  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
  return "\n".join(lines)


def notes(ctx: Context) -> dict:
  """What the numbers are about: the model, the replay mode, the sources of the thresholds."""
  t = ctx._trace
  out = {"replay": WHY_PER_TOKEN,
         "mass_thresholds": "0.79 … 0.97 are the thresholds the seed review attributes to "
                            "arXiv 2502.12224 ('79%→97%'); peers.md found no softmax-mass "
                            "filter or 79% figure in that paper (Fate), so they are taken as "
                            "given, not as the paper's method.",
         "pilot": "pilot row j is layer j's experts predicted one MoE layer early (layer j-1's "
                  "post-attention residual through layer j's norm and router); layer 0 has none."}
  if t is not None:
    hidden = (t.config or {}).get("hidden_size")
    what = (f"the embedded 9M-parameter model (E={t.n_experts} routed experts, top-{t.top_k}, "
            f"{t.n_layers} MoE layers), recorded here on its held-out corpus — not GLM-5.2 "
            "(E=256, top-8, 75 MoE layers); absolute rates do not transfer, directions may"
            if ctx.recorded else
            f"the trace at {ctx.trace_path}: E={t.n_experts}, top-{t.top_k}, {t.n_layers} MoE "
            f"layers (hidden {hidden}), from {t.options.get('source', 'unknown')}")
    where = ("recorded to a temporary directory, removed at exit (--record_to keeps it)"
             if ctx.recorded and ctx.record_to is None else ctx.trace_path)
    out.update({"model": what, "trace": where, "positions": t.n_positions,
                "n_experts": t.n_experts, "top_k": t.top_k, "moe_layers": t.n_layers,
                "pilot_width": int(t.pilot.shape[2]), "expert_bytes": t.expert_bytes})
    if ctx.bytes_note:
      out["bytes"] = ctx.bytes_note
    elif not t.expert_bytes:
      out["bytes"] = "the trace has expert_bytes 0 and no layout to price one: byte columns " \
                     "are 0; use reads_per_position"
  return out


def run(ctx: Context, names: list[str]) -> dict:
  report = {}
  for name in names:
    report[name] = STUDIES[name](ctx)
    print(f"\n### {name}\n\n{markdown(report[name]['rows'])}\n\n{report[name]['finding']}")
  report["notes"] = notes(ctx)
  return report


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from glmjax.errors import GlmjaxError
  names = FLAGS.studies or list(STUDIES)
  try:
    bad = [n for n in names if n not in STUDIES]
    if bad:
      raise _input_error(f"--studies: unknown {bad}; known: {', '.join(STUDIES)}")
    try:
      caps = [int(c) for c in FLAGS.capacities] if FLAGS.capacities else None
    except ValueError:
      raise _input_error(f"--capacities must be integers, got {FLAGS.capacities}") from None
    if caps is not None and min(caps) < 1:
      raise _input_error(f"--capacities must be ≥ 1, got {caps}")
    ctx = Context(FLAGS.trace, FLAGS.record_to, FLAGS.tokens, FLAGS.capacity, caps)
    report = run(ctx, names)
  except GlmjaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  with open(FLAGS.out, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  print(f"\nwrote {FLAGS.out}")
  return 0


if __name__ == "__main__":
  app.run(main)
