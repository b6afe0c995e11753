"""Replays a routing trace through a model of the expert cache.

The request stream is the engine's: steps in order; within a step, MoE layers in order; at each
(step, layer) the union of the experts the step's positions chose (a forward of S tokens reads
each expert once). Request q is (step q // L, layer q % L). A resident expert is a hit; a miss is
read once, and after the whole union is served the misses are admitted in union order, never
evicting a member of the union (HostCache's rule). Prefetch models fetch predicted experts of
layer j+1 right after layer j.

The MTP verify-union model ("verify") is the pilot over a speculative run's verify passes: each
position of the pass (its token and every draft) predicts layer j+1, and the union of those
predictions is fetched, so the drafts steer the reads (colibri's per-position pilot over the
draft window). Plain decode steps fetch nothing under it; it needs a live speculative trace.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from glmjax.errors import InputError
from glmjax.replay.policies import POLICIES
from glmjax.replay.trace import Trace

PREFETCH = ("pilot", "couple", "mass", "verify")
DEFAULT_MASS = 0.9


@dataclasses.dataclass(eq=False)
class Stream:
  """A trace as cache requests. Keys are `j * E + expert`; request q = step * L + j owns
  keys[offsets[q]:offsets[q + 1]] (sorted)."""
  keys: list[int]
  offsets: list[int]              # [R + 1]
  n_layers: int
  n_experts: int
  n_steps: int
  key_counts: np.ndarray          # [L * E] requests naming each key over the whole trace
  step_index: np.ndarray          # [N] step of each position
  moe_layers: list[int]           # model layer number of each MoE layer index j
  live: dict                      # the trace's live-run extras (initial pinned sets, heat, ...)
  _rank: list[int] | None = None

  @property
  def n_requests(self) -> int:
    return len(self.offsets) - 1

  @classmethod
  def of(cls, trace: Trace, per_token: bool = False) -> "Stream":
    """The stream of `trace` (cached on it)."""
    cache_key = ("stream", per_token)
    if cache_key not in trace._derived:
      ids, off = trace.union_csr(per_token)
      l, e = trace.n_layers, trace.n_experts
      req_layer = np.repeat(np.arange(len(off) - 1) % l, np.diff(off))  # [T]
      keys = req_layer * e + ids
      step, n_steps = trace.step_index(per_token)
      trace._derived[cache_key] = cls(
          keys=keys.tolist(), offsets=off.tolist(), n_layers=l, n_experts=e, n_steps=n_steps,
          key_counts=np.bincount(keys, minlength=l * e), step_index=step,
          moe_layers=list(trace.moe_layers), live=trace.live)
    return trace._derived[cache_key]

  def future_rank_list(self) -> list[int]:
    """Per flat entry: the rank of the key's future, the sequence of requests naming it after
    this one (then never), in lexicographic order: soonest next use first, ties broken by
    the use after that, and so on. Equal ranks mean identical futures; the largest rank is
    "never used again". Belady evicts by it: with unions, plain MIN's arbitrary tie-break is
    not optimal (two experts first needed by the same union then diverge, and a union's
    resident members cannot be swapped out for its misses)."""
    if self._rank is None:
      keys = np.asarray(self.keys, np.int64)
      off = np.asarray(self.offsets)
      req = np.repeat(np.arange(len(off) - 1), np.diff(off))
      order = np.lexsort((req, keys))  # by key, then time
      same = keys[order[1:]] == keys[order[:-1]]
      nxt = np.full(len(keys), self.n_requests, np.int64)  # next use, n_requests = never
      nxt[order[:-1][same]] = req[order[1:][same]]
      succ = np.full(len(keys), -1, np.int64)  # flat index of the key's next entry
      succ[order[:-1][same]] = order[1:][same]
      self._rank = _sequence_ranks(nxt, succ).tolist()
    return self._rank


def _sequence_ranks(first: np.ndarray, succ: np.ndarray) -> np.ndarray:
  """Dense ranks of the sequences first[i], first[succ[i]], first[succ[succ[i]]], ... (padded
  with first's maximum once succ = -1, which only the last entry of a chain has, holding the
  maximum itself), by prefix doubling: each round orders twice as long prefixes, and a round
  that splits no class means the order is final."""
  def dense(*cols):  # ranks of the rows of cols, lexicographic with cols[0] first
    o = np.lexsort(cols[::-1])
    step = np.zeros(len(o), np.int64)
    for c in cols:
      step[1:] |= c[o][1:] != c[o][:-1]
    r = np.empty(len(o), np.int64)
    r[o] = np.cumsum(step)
    return r

  if len(first) == 0:
    return first.astype(np.int64)
  rank, jump = dense(first), succ.copy()
  classes = rank.max() + 1
  while (jump >= 0).any():
    top = rank.max()
    rank = dense(rank, np.where(jump >= 0, rank[np.maximum(jump, 0)], top))
    jump = np.where(jump >= 0, jump[np.maximum(jump, 0)], -1)
    if rank.max() + 1 == classes:
      break
    classes = rank.max() + 1
  return rank


def _ranked_csr(step: np.ndarray, n_steps: int, ids: np.ndarray, take: np.ndarray,
                n_experts: int) -> tuple[list[int], list[int]]:
  """Per request (step * L + j): the keys of the ids [N, L, P] with `take` set, over the
  step's positions, best (lowest) rank first, ties by id. Ids < 0 are skipped."""
  n, l, p = ids.shape
  rank = np.broadcast_to(np.arange(p), ids.shape)
  req = np.broadcast_to(step[:, None, None] * l + np.arange(l)[None, :, None], ids.shape)
  sel = take & (ids >= 0)
  req, rank, ids = req[sel], rank[sel], ids[sel].astype(np.int64)
  o = np.lexsort((rank, ids, req))  # one entry per (request, id): its best rank
  req, rank, ids = req[o], rank[o], ids[o]
  first = np.ones(len(req), bool)
  first[1:] = (req[1:] != req[:-1]) | (ids[1:] != ids[:-1])
  req, rank, ids = req[first], rank[first], ids[first]
  o = np.lexsort((ids, rank, req))
  req, ids = req[o], ids[o]
  off = np.searchsorted(req, np.arange(n_steps * l + 1))
  return ((req % l) * n_experts + ids).tolist(), off.tolist()


def _mass_take(pilot_scores: np.ndarray, mass: float) -> np.ndarray:
  """[N, L, P] bool: each row's pilot ids in rank order until their softmax (over the P
  recorded scores) reaches cumulative `mass`; the id that crosses it is included."""
  z = pilot_scores - pilot_scores.max(-1, keepdims=True)
  p = np.exp(z)
  cum = np.cumsum(p / p.sum(-1, keepdims=True), -1)
  count = np.minimum((cum < mass - 1e-6).sum(-1) + 1, pilot_scores.shape[-1])  # [N, L]
  return np.arange(pilot_scores.shape[-1]) < count[..., None]


def _verify_rows(trace: Trace) -> np.ndarray:
  """[N] bool: positions of verify passes that carried drafts (from the live notes)."""
  steps = [v["step"] for v in trace.live.get("verify", []) if v.get("drafts", 0) > 0]
  return np.isin(trace.steps, np.asarray(steps, np.int64))


def _check(trace, policy, per_layer, total, prefetch, pilot_k, couple_k, mass, io_per_layer):
  if not isinstance(trace, Trace):
    raise InputError(f"simulate wants a Trace, got {type(trace).__name__}")
  if policy not in POLICIES:
    raise InputError(f"unknown policy {policy!r}; known: {', '.join(sorted(POLICIES))}")
  if (per_layer is None) == (total is None):
    raise InputError("give exactly one of per_layer= (slots per layer) and total= (slots)")
  cap = per_layer if total is None else total
  if int(cap) != cap or cap < 0:
    raise InputError(f"capacity must be a non-negative integer, got {cap!r}")
  bad = [p for p in prefetch if p not in PREFETCH]
  if bad:
    raise InputError(f"unknown prefetch model(s) {bad}; known: {', '.join(PREFETCH)}")
  if prefetch and not POLICIES[policy].prefetch_ok:
    raise InputError(f"policy {policy!r} takes no prefetch (it is a bound or a fixed set)")
  if ({"pilot", "mass", "verify"} & set(prefetch)) and trace.pilot is None:
    raise InputError("pilot/mass/verify prefetch needs a trace recorded with pilot predictions")
  if "verify" in prefetch and not trace.live.get("verify"):
    raise InputError("verify prefetch needs a live speculative trace (generate(draft=k, "
                     "trace=...)): this trace notes no verify pass")
  if pilot_k < 1 or couple_k < 1:
    raise InputError(f"pilot_k and couple_k must be ≥ 1, got {pilot_k}/{couple_k}")
  if mass is not None and not 0 < mass <= 1:
    raise InputError(f"mass must be in (0, 1], got {mass}")
  if io_per_layer is not None and (not prefetch or trace.expert_bytes <= 0 or io_per_layer < 0):
    raise InputError("io_per_layer needs a prefetch model, a trace with expert_bytes > 0 and "
                     "a budget ≥ 0")


def simulate(trace: Trace, policy: str, *, per_layer: int | None = None,
             total: int | None = None, prefetch=(), pilot_k: int = 6, couple_k: int = 4,
             mass: float | None = None, per_token: bool = False,
             io_per_layer: int | None = None, land: str = "evict",
             device_cache_gb: float | None = None, host_cache_gb: float | None = None) -> dict:
  """Replays `trace` through a cache run by `policy` (a key of `POLICIES`).

  per_layer=c: each MoE layer has its own cache of c experts; total=n: one cache of n experts
  shared by all layers. prefetch: names from PREFETCH ("pilot": the top `pilot_k` pilot ids of
  layer j+1; "couple": the `couple_k` layer-(j+1) experts most co-activated with layer j's
  union, learned online; "mass": pilot ids up to softmax mass `mass`, default 0.9; "verify": the
  top `pilot_k` pilot ids of every position of a speculative verify pass, drafts included), fetched
  after layer j is served. io_per_layer: bytes a layer's compute hides; prefetches beyond it
  arrive late (their demand counts as a miss, without a second read). land: how a prefetch
  enters layer j+1's cache; "evict" admits it by the policy's rule, evicting as a miss would;
  "free" only into free slots, never evicting (the engine's rule). A prefetch that does not
  land (no free slot under "free"; capacity 0, or every resident protected) is held for layer
  j+1's request, whose miss takes it without a second read, as the engine does, and is wasted
  if that request does not use it.
  Returns the counters: hits, misses, requests, hit_rate, reads, bytes_read, prefetch_*.

  policy="engine" replays the engine's two tiers under byte budgets instead
  (`device_cache_gb`, `host_cache_gb`; see `glmjax.replay.engine_model.simulate_engine`) and
  adds pin_hits and host_hits.
  """
  if policy == "engine":
    if per_layer is not None or total is not None or prefetch:
      raise InputError("policy 'engine' takes device_cache_gb= and host_cache_gb= budgets, "
                       "not per_layer/total, and no prefetch model")
    from glmjax.replay.engine_model import simulate_engine
    return simulate_engine(trace, device_cache_gb=device_cache_gb, host_cache_gb=host_cache_gb,
                           per_token=per_token)
  prefetch = tuple(prefetch)
  _check(trace, policy, per_layer, total, prefetch, pilot_k, couple_k, mass, io_per_layer)
  if land not in ("evict", "free"):
    raise InputError(f"land must be 'evict' or 'free', got {land!r}")
  st = Stream.of(trace, per_token)
  l, e = st.n_layers, st.n_experts
  cls = POLICIES[policy]
  if total is None:
    caches = [cls(int(per_layer), st, [j]) for j in range(l)]
  else:
    caches = [cls(int(total), st, list(range(l)))] * l  # one cache, reached from every layer
  keys, off = st.keys, st.offsets
  hits = misses = reads = 0
  layer_misses = [0] * l

  cand: list[tuple[list[int], list[int]]] = []  # per pilot-like model: ranked key CSR
  if "pilot" in prefetch:
    take = np.broadcast_to(np.arange(trace.pilot.shape[2]) < pilot_k, trace.pilot.shape)
    cand.append(_ranked_csr(st.step_index, st.n_steps, trace.pilot, take, e))
  if "mass" in prefetch:
    take = _mass_take(trace.pilot_scores, DEFAULT_MASS if mass is None else mass)
    cand.append(_ranked_csr(st.step_index, st.n_steps, trace.pilot, take, e))
  if "verify" in prefetch:
    take = np.broadcast_to(np.arange(trace.pilot.shape[2]) < pilot_k, trace.pilot.shape)
    take = take & _verify_rows(trace)[:, None, None]
    cand.append(_ranked_csr(st.step_index, st.n_steps, trace.pilot, take, e))
  couple = np.zeros((max(l - 1, 0), e, e), np.int64) if "couple" in prefetch else None
  in_time = None if io_per_layer is None else int(io_per_layer) // trace.expert_bytes
  issued = useful = wasted = late_n = 0
  pending: set[int] = set()  # prefetched, resident, not yet requested
  late: set[int] = set()     # prefetched for the next request beyond the I/O budget
  staged: set[int] = set()   # prefetched, no room to land: the next request's miss takes it

  for q in range(st.n_requests):
    j = q % l
    cache = caches[j]
    ks = keys[off[q]:off[q + 1]]
    hit = cache.access(ks, q)
    missed = [k for k, h in zip(ks, hit) if not h]
    n_miss = len(missed)
    reads += n_miss
    if pending:
      for k, h in zip(ks, hit):
        if h and k in pending:
          pending.discard(k)
          if k in late:
            n_miss += 1  # it was read, but arrives after the layer needed it
            late_n += 1
          else:
            useful += 1
    if staged:  # as the engine does: a read with no tier to go to serves the step's miss
      for k in staged.intersection(missed):
        reads -= 1  # counted when issued
        if k in late:
          late_n += 1
        else:
          useful += 1
      wasted += len(staged.difference(missed))
      staged.clear()
    late.clear()
    misses += n_miss
    hits += len(ks) - n_miss
    layer_misses[j] += n_miss
    protect = set(ks) if missed or prefetch else ()
    if missed:
      for v in cache.admit(missed, q, protect):
        if v in pending:
          pending.discard(v)
          wasted += 1

    if couple is not None:
      cur = np.asarray(ks) - j * e  # this union's expert ids
      if j >= 1:  # learn layer j-1 → j from this step, before predicting j+1
        prev = np.asarray(keys[off[q - 1]:off[q]]) - (j - 1) * e
        couple[j - 1][np.ix_(prev, cur)] += 1
    if prefetch and j + 1 < l:
      want: list[int] = []
      for ck, co in cand:
        want += ck[co[q + 1]:co[q + 2]]
      if couple is not None:
        score = couple[j][cur].sum(0)
        top = np.argsort(-score, kind="stable")[:couple_k]
        want += (top[score[top] > 0] + (j + 1) * e).tolist()
      # Prefetches go to layer j+1's cache; `protect` (layer j's union) only matters when
      # the cache is shared (total=).
      nxt = caches[j + 1]
      todo = [k for k in dict.fromkeys(want) if k not in nxt]  # ranked, deduplicated
      if todo:
        issued += len(todo)
        reads += len(todo)
        room = todo if land == "evict" else todo[:max(nxt.capacity - len(nxt), 0)]
        for v in nxt.admit(room, q, protect, prefetch=True):
          if v in pending:
            pending.discard(v)
            wasted += 1
        for i, k in enumerate(todo):
          if k in nxt:
            pending.add(k)
            if in_time is not None and i >= in_time:
              late.add(k)
          else:  # no room: held for layer j+1's request, the next one
            staged.add(k)
            if in_time is not None and i >= in_time:
              late.add(k)
    if j == l - 1:
      for c in (caches if total is None else caches[:1]):
        c.end_step(q // l)

  wasted += len(pending) + len(staged)  # never requested by the end
  requests = hits + misses
  extra: dict = {}  # a policy's own counters, summed over its caches
  for c in (caches if total is None else caches[:1]):
    for k, v in c.stats().items():
      extra[k] = extra.get(k, 0) + v
  return {**extra, "policy": policy, "capacity": int(per_layer if total is None else total),
          "mode": "per_layer" if total is None else "total", "prefetch": list(prefetch),
          "land": land, "per_token": bool(per_token), "steps": st.n_steps, "requests": requests,
          "hits": hits, "misses": misses, "hit_rate": hits / requests if requests else 0.0,
          "reads": reads, "bytes_read": reads * trace.expert_bytes,
          "expert_bytes": trace.expert_bytes, "prefetch_issued": issued,
          "prefetch_useful": useful, "prefetch_late": late_n, "prefetch_wasted": wasted,
          "layer_misses": layer_misses}


def prediction_mask(trace: Trace, pilot_k: int | None = None,
                    mass: float | None = None) -> np.ndarray:
  """[N, L, P] bool: which of `trace.pilot`'s ids a prefetch model fetches, exactly as
  `simulate` selects them: the top `pilot_k` (prefetch="pilot") or, with `mass`, the ids up to
  that softmax mass of the recorded pilot scores (prefetch="mass"). Rows with no prediction
  (layer 0, ids -1) are all False. Give exactly one of the two."""
  if trace.pilot is None:
    raise InputError("prediction_mask needs a trace recorded with pilot predictions")
  if (pilot_k is None) == (mass is None):
    raise InputError("give exactly one of pilot_k= and mass=")
  if pilot_k is not None:
    if int(pilot_k) != pilot_k or pilot_k < 1:
      raise InputError(f"pilot_k must be an integer ≥ 1, got {pilot_k!r}")
    take = np.broadcast_to(np.arange(trace.pilot.shape[2]) < pilot_k, trace.pilot.shape)
  else:
    if not 0 < mass <= 1:
      raise InputError(f"mass must be in (0, 1], got {mass}")
    take = _mass_take(trace.pilot_scores, mass)
  return take & (trace.pilot >= 0)
