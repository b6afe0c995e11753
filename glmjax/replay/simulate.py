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

import collections
import dataclasses

import numpy as np

from glmjax.errors import InputError
from glmjax.offload.rules import PrefetchLedger, couple_top, land_free, learn_couple, pilot_union
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
  step's positions (the pilot's union, `pilot_union`), best (lowest) rank first, ties by id.
  Ids < 0 are skipped."""
  n, l, p = ids.shape
  req = (step[:, None] * l + np.arange(l)[None, :]).reshape(-1)  # [N * L] request of each row
  req, ids, rank = pilot_union(ids.reshape(n * l, p), np.reshape(take, (n * l, p)), group=req)
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
  l = st.n_layers
  cls = POLICIES[policy]
  if total is None:
    caches = [cls(int(per_layer), st, [j]) for j in range(l)]
  else:
    caches = [cls(int(total), st, list(range(l)))] * l  # one cache, reached from every layer
  stats = collections.Counter()  # hits, misses, reads and the prefetch_* counters
  pf = None
  if prefetch:
    in_time = None if io_per_layer is None else int(io_per_layer) // trace.expert_bytes
    pf = _Prefetcher(st, caches, _candidates(trace, st, prefetch, pilot_k, mass),
                     couple_k if "couple" in prefetch else 0, land, in_time, stats)
  owners = caches if total is None else caches[:1]  # each cache once
  layer_misses = _replay(st, caches, owners, pf, stats)
  stats["prefetch_wasted"] += 0 if pf is None else pf.ledger.unused()  # never requested
  requests = stats["hits"] + stats["misses"]
  extra: dict = {}  # a policy's own counters, summed over its caches
  for c in owners:
    for k, v in c.stats().items():
      extra[k] = extra.get(k, 0) + v
  return {**extra, "policy": policy, "capacity": int(per_layer if total is None else total),
          "mode": "per_layer" if total is None else "total", "prefetch": list(prefetch),
          "land": land, "per_token": bool(per_token), "steps": st.n_steps, "requests": requests,
          "hits": stats["hits"], "misses": stats["misses"],
          "hit_rate": stats["hits"] / requests if requests else 0.0,
          "reads": stats["reads"], "bytes_read": stats["reads"] * trace.expert_bytes,
          "expert_bytes": trace.expert_bytes, "prefetch_issued": stats["prefetch_issued"],
          "prefetch_useful": stats["prefetch_useful"], "prefetch_late": stats["prefetch_late"],
          "prefetch_wasted": stats["prefetch_wasted"], "layer_misses": layer_misses}


def _candidates(trace: Trace, st: Stream, prefetch, pilot_k: int, mass) -> list:
  """Candidate generation: per pilot-like prefetch model, the ranked key CSR of what it
  fetches for each request."""
  cand: list[tuple[list[int], list[int]]] = []
  e = st.n_experts
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
  return cand


def _replay(st: Stream, caches: list, owners: list, pf: "_Prefetcher | None",
            stats) -> list[int]:
  """Accounting: every request through its layer's cache (`caches[j]`; `owners`: each cache
  once), in order, counting hits, misses and reads into `stats`, the prefetcher (if any)
  served first and issuing after. Returns the misses per MoE layer."""
  l, keys, off = st.n_layers, st.keys, st.offsets
  layer_misses = [0] * l
  for q in range(st.n_requests):
    j = q % l
    cache = caches[j]
    ks = keys[off[q]:off[q + 1]]
    hit = cache.access(ks, q)
    missed = [k for k, h in zip(ks, hit) if not h]
    n_miss = len(missed)
    stats["reads"] += n_miss
    if pf is not None:
      n_miss += pf.served(j, ks, hit, missed)
    stats["misses"] += n_miss
    stats["hits"] += len(ks) - n_miss
    layer_misses[j] += n_miss
    protect = set(ks) if missed or pf is not None else ()
    if missed:
      evicted = cache.admit(missed, q, protect)
      if pf is not None:
        pf.ledger.evicted(evicted)
    if pf is not None:
      pf.issue(q, j, ks, protect)
    if j == l - 1:
      for c in owners:
        c.end_step(q // l)
  return layer_misses


class _Prefetcher:
  """The engine's prefetch rules (glmjax.offload.rules) over a stream: after layer j is
  served, the candidates for layer j+1 (`cand`, ranked key CSRs, then co-activation's top
  `couple_k`, learned online) are fetched into layer j+1's cache, by the policy's own rule
  (land="evict") or into free room only (land="free", `land_free`); one with no room is held
  for layer j+1's request (`PrefetchLedger`), whose miss takes it and which drops the rest.
  Fetches beyond `in_time` per layer arrive late."""

  def __init__(self, st: Stream, caches: list, cand: list, couple_k: int, land: str, in_time,
               stats):
    self.st, self.caches, self.cand, self.couple_k = st, caches, cand, couple_k
    self.land, self.in_time, self.stats = land, in_time, stats
    l, e = st.n_layers, st.n_experts
    self.couple = np.zeros((max(l - 1, 0), e, e), np.int64) if couple_k else None
    self.ledger = PrefetchLedger(stats, layer_of=lambda key: key // e)
    self.late: set[int] = set()  # fetched for the next request beyond the I/O budget

  def served(self, j: int, ks, hit, missed) -> int:
    """Request (layer j, keys `ks`) was served: landed fetches it hit are useful (late ones
    still missed), held ones its misses take instead of reading again, and the rest of the
    held ones expire. Returns the extra misses (late arrivals)."""
    n_late = self.ledger.used([k for k, h in zip(ks, hit) if h], self.late)
    for k in missed:
      if k in self.ledger.pending:  # as the engine does: a held read serves the step's miss
        self.stats["reads"] -= 1  # counted when issued
        self.ledger.take(k, "late" if k in self.late else "useful")
    self.ledger.expire(j)
    self.late.clear()
    return n_late

  def issue(self, q: int, j: int, ks, protect) -> None:
    """Fetches layer j+1's candidates after request q (layer j, keys `ks`)."""
    e, l = self.st.n_experts, self.st.n_layers
    if self.couple is not None:
      cur = np.asarray(ks) - j * e  # this union's expert ids
      if j >= 1:  # learn layer j-1 → j from this step, before predicting j+1
        prev = np.asarray(self.st.keys[self.st.offsets[q - 1]:self.st.offsets[q]]) - (j - 1) * e
        learn_couple(self.couple[j - 1], prev, cur)
    if j + 1 >= l:
      return
    want: list[int] = []
    for ck, co in self.cand:
      want += ck[co[q + 1]:co[q + 2]]
    if self.couple is not None:
      want += [x + (j + 1) * e for x in couple_top(self.couple[j], cur, self.couple_k)]
    # Prefetches go to layer j+1's cache; `protect` (layer j's union) only matters when the
    # cache is shared (total=).
    nxt = self.caches[j + 1]
    todo = [k for k in dict.fromkeys(want) if k not in nxt]  # ranked, deduplicated
    if not todo:
      return
    self.stats["reads"] += len(todo)
    for k in todo:
      self.ledger.issue(k)
    landing = todo  # "evict": admitted by the policy's rule, as a miss would be
    if self.land == "free":
      free, landing = max(nxt.capacity - len(nxt), 0), []
      land_free(todo, lambda k: len(landing) < free, landing.append)
    self.ledger.evicted(nxt.admit(landing, q, protect, prefetch=True))
    self.ledger.hold([k for k in todo if k not in nxt])  # no room: held, as land_free's
    for i, k in enumerate(todo):
      if k in nxt:
        self.ledger.resolve(k, "landed")
      # else no room: held for layer j+1's request, the next one
      if self.in_time is not None and i >= self.in_time:
        self.late.add(k)


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
