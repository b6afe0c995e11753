"""Simulation studies of proposed MoE-offload optimizations on a routing trace: the registry
behind scripts/negative_results.py (one JSON-able dict per study, one markdown table each).

    from glmjax.studies.studies import Context, run_studies
    report = run_studies(Context("/tmp/trace", None, 16384), ["mass_filter"])

Studies (each a function of a `Context`, returning a JSON-able dict with "rows" and "finding";
register new ones in STUDIES):

- mass_filter: the softmax-mass confidence filter on the pilot's scores, mass 0.79 … 0.97:
  predicted set size, false positives and recall against the next layer's true top-k, and the
  LRU hit rate at the fixed capacity with its predictions prefetched, against LRU without
  prefetch.
- pilot_k_sweep: the pilot's top PILOT_K: recall, precision, bytes read per position, hit rate.
- freq_eviction: lfu and lfru (the engine's pin rule) against lru, with pilot prefetch staging:
  hit rate and staged experts wasted, at the sweep capacities.
- verify_cap, stage_breakdown: live runs of the embedded model (glmjax/studies/live_studies.py).

Decode is modelled with per_token=True: each position is its own step, in trace order.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from typing import Callable

import numpy as np

from glmjax.bench.reporting import run_script
from glmjax.errors import InputError
from glmjax.studies.live_studies import stage_breakdown, verify_cap

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
        raise InputError(f"{self.trace_path}: the trace has no pilot predictions")
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


def record_trace(dest: str | None, tokens: int) -> str:
  """Records the embedded model's routing over its held-out corpus with scripts/replay.py,
  keeping the pilot's prediction for every expert. Returns the trace directory."""
  if dest is None:
    tmp = tempfile.mkdtemp(prefix="negative_results.")
    import atexit
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    dest = os.path.join(tmp, "trace")
  # --pilot_p and --top_m are capped at E by the recorder: every expert's score is kept.
  run_script("replay.py", f"--out={dest}", f"--max_tokens={tokens}", "--pilot_p=4096",
             "--top_m=4096", what="recording the trace")
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


def check_study_names(names: list[str]) -> None:
  """Raises InputError naming every entry of `names` that is not in STUDIES."""
  bad = [n for n in names if n not in STUDIES]
  if bad:
    raise InputError(f"--studies: unknown {bad}; known: {', '.join(STUDIES)}")


def run_studies(ctx: Context, names: list[str]) -> dict:
  """Runs the named studies in order, printing each one's table and finding; the report also
  carries `notes`."""
  check_study_names(names)
  report = {}
  for name in names:
    report[name] = STUDIES[name](ctx)
    print(f"\n### {name}\n\n{markdown(report[name]['rows'])}\n\n{report[name]['finding']}")
  report["notes"] = notes(ctx)
  return report
