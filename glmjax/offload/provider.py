"""The offload engine's expert provider for the layer-by-layer path: per MoE layer step, the
experts of the union resolved against the tiers (device pool → host LRU → store on disk).

Per MoE layer step (`TieredProvider.tiered`):
  1. the jitted attention + route step gives the top-k ids `[T, K]`; the host reads them (the
     one round trip per MoE layer) and forms the union of experts the real tokens chose
     (padding never routes);
  2. `account`: the tiers' lookups (`TierRules.lookup`) and the prefetcher's turn;
     every miss is submitted to the I/O threads at once (a queued prefetch of the same expert
     is promoted to demand priority);
  3. `compute`, grouped: each needed expert is applied once to all the tokens that chose it.
     Pinned experts first, then host-cached ones, then each miss as its read lands, so
     computing one miss overlaps reading the next;
  4. the step's record (`LayerUse`) is folded into the tiers and counters (`TierRules.fold`:
     heat, counters, host-cache inserts, admission to the pin pool) at the end of the step in
     union order, never in completion order;
  5. the jitted finish step combines the terms in rank order with the shared expert.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.errors import ExpertIOError
from glmjax.model.config import Config
from glmjax.model.forward import JITTED, bucket, valid_rows
from glmjax.model.kernels import expert_ffn, pool_terms
from glmjax.model.layers import F32, rms_norm
from glmjax.model.quant import ExpertPool, ExpertWeights
from glmjax.model.weights import MoE
from glmjax.offload.prefetch import Prefetcher
from glmjax.offload.rules import LayerUse
from glmjax.offload.shared import EngineShared
from glmjax.offload.tiers import MeshPins, as_device_pool, cpu_device


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def pilot_step(next_lw, x, cfg: Config, k: int):
  """Layer L+1's post-attention norm and router applied to layer L's post-attention residual:
  the top `k` experts by biased score per position `[T, k]` (the "pilot" prediction)."""
  h = rms_norm(x, next_lw.mlp_norm, cfg.rms_norm_eps).reshape(-1, x.shape[-1])
  scores = jax.nn.sigmoid(jnp.einsum("td,ed->te", h, next_lw.mlp.router.astype(F32)))
  return jax.lax.top_k(scores + next_lw.mlp.bias.astype(F32), k)[1]


pool_terms_step = jax.jit(pool_terms, static_argnames=("kernel",))


@jax.jit
def merge_terms(active, a, b):
  """`a`'s terms `[T, K, D]` where `active` `[T, K]` is set, `b`'s elsewhere."""
  return jnp.where(active[..., None], a, b)


@dataclasses.dataclass
class LayerStep:
  """One MoE layer step's routing, as the host sees it."""
  layer: int
  x: np.ndarray  # [T, D] float32, the normed hidden states routed
  ids: np.ndarray  # [T, K] expert ids (padding rows included, never used)
  pairs: dict  # expert → (token rows, ranks) of the real tokens that chose it

  @classmethod
  def of(cls, layer, flat, ids, valid) -> "LayerStep":
    ids_np = np.asarray(ids)
    rows = np.flatnonzero(valid)
    t, k = np.divmod(np.arange(rows.size * ids_np.shape[1]), ids_np.shape[1])
    t = rows[t]
    chosen = ids_np[t, k]
    order = np.argsort(chosen, kind="stable")
    t, k, chosen = t[order], k[order], chosen[order]
    cuts = np.flatnonzero(np.diff(chosen)) + 1
    pairs = {int(c[0]): (tt, kk) for c, tt, kk in zip(np.split(chosen, cuts), np.split(t, cuts),
                                                      np.split(k, cuts)) if c.size}
    return cls(layer, np.asarray(flat, np.float32), ids_np, pairs)

  @property
  def union(self) -> list[int]:
    return sorted(self.pairs)

  def slot_grid(self, experts, slot_of) -> tuple[np.ndarray, np.ndarray]:
    """(active `[T, K]`, slots `[T, K]`): the pairs of `experts`, each at `slot_of(e)`."""
    active = np.zeros(self.ids.shape, bool)
    slots = np.zeros(self.ids.shape, np.int32)
    for e in experts:
      t, k = self.pairs[e]
      active[t, k] = True
      slots[t, k] = slot_of(e)
    return active, slots


def attributed(e: ExpertIOError, steps: list[LayerStep], seq_lens: list[int]) -> ExpertIOError:
  """`e` (a read of `e.expert` of the steps' layer failed) as a new error whose `rows` are the
  batch rows whose tokens chose that expert in `steps` (chunk j's token t is row t // S_j): a
  server fails those requests and re-runs the others. A fresh error, since `e` may be the
  one a shared read future holds."""
  out = ExpertIOError(str(e), e.layer, e.expert)
  rows = set()
  for step, s in zip(steps, seq_lens):
    if e.layer == step.layer and e.expert in step.pairs:
      rows.update(int(t) // s for t in step.pairs[e.expert][0])
  out.rows = tuple(sorted(rows)) or None  # None: no row to blame (not this layer's expert)
  return out


class Placement:
  """Where host-held experts are computed: `expert_compute` "device" (uploaded, on an
  accelerator), "host" (the CPU kernel) or "auto" (by the measured `rates`, bytes/s EMA)."""

  def __init__(self, expert_compute: str, on_cpu: bool, store, stats):
    self.expert_compute, self.on_cpu, self.store, self.stats = expert_compute, on_cpu, store, stats
    self.rates = {"host": 0.0, "h2d": 0.0}

  def place(self, n: int) -> bool:
    """Whether this step's host-held experts run on the device (True) or the CPU kernel."""
    if self.expert_compute == "device":
      return True
    if self.expert_compute == "host" or self.on_cpu or n == 0:
      return False
    # auto: upload when the bus moves bytes faster than the CPU kernel streams them (the device
    # kernel itself is far faster than either). Unmeasured rates start by trying each.
    if not self.rates["h2d"]:
      return True
    if not self.rates["host"]:
      return False
    return self.rates["h2d"] > self.rates["host"]

  def rate(self, name: str, nbytes: int, seconds: float) -> None:
    """Folds a measured transfer (`nbytes` in `seconds`) into rate `name` (EMA)."""
    if seconds > 0:
      r = nbytes / seconds
      self.rates[name] = r if not self.rates[name] else 0.8 * self.rates[name] + 0.2 * r

  def upload(self, layer: int, weights: dict[int, ExpertWeights]):
    """Host-held experts uploaded into a transient device pool for the device kernel
    (expert_compute="device" on an accelerator): (pool, slot_of), or None when there are none."""
    if not weights:
      return None
    experts = sorted(weights)
    stacked = [weights[e] for e in experts]
    stacked += [stacked[-1]] * (bucket(len(experts)) - len(experts))  # few compiled shapes
    t0 = time.perf_counter()
    pool = as_device_pool(stacked)
    nbytes = len(experts) * self.store.layout(layer).nbytes
    self.stats["h2d_bytes"] += nbytes
    self.rate("h2d", nbytes, time.perf_counter() - t0)
    return pool, {e: s for s, e in enumerate(experts)}


class TieredProvider:
  """The expert provider of the layer steps (`tiered`; `resident_terms` when every expert is
  pinned) over `tiers`, reading misses through `reader` and giving `prefetcher` its turn after
  each lookup. `stage_s` (a dict of seconds by stage, or None) turns on stage timing: every
  step then waits for its results, so it measures where time goes at the cost of the overlap
  it removes."""

  def __init__(self, shared: EngineShared, prefetcher: Prefetcher, placement: Placement,
               kernel: str, owners=None):
    self.cfg, self.dense, self.store, self.tiers = (shared.cfg, shared.dense, shared.store,
                                                    shared.tiers)
    self.reader, self.stats, self.mesh = shared.reader, shared.stats, shared.mesh
    self.prefetcher, self.placement, self.kernel = prefetcher, placement, kernel
    self.owners = owners  # `owners.Ownership` on a mesh: which experts are this process's
    self.stage_s: dict | None = None
    self._layer_index = {id(l): i for i, l in enumerate(self.dense.layers)}  # `dense_pilot`

  def resident_terms(self, layer, m, chunks):
    """All experts pinned: one jitted kernel call per chunk, no host round trip."""
    for r in chunks:
      valid = valid_rows(r.x.shape, r.n_valid)
      yield pool_terms_step(r.flat, self.tiers.device[layer].pool, r.ids, valid[:, None],
                            kernel=self.kernel)

  def tiered(self, layer, m, chunks):
    """Unweighted expert terms `[T, K, D]` of one MoE layer through the tiers, chunk by chunk:
    one union over every chunk (a layer-major prefill reads each expert once per layer), one
    lookup and one bookkeeping pass per layer."""
    nxt = self.next_moe(layer)
    steps, valids, pilots, stats = [], [], [], []
    for r in chunks:
      valid = valid_rows(r.x.shape, r.n_valid)  # [T] bool: real tokens
      pilot = None
      if self.prefetcher.predicting and self.prefetcher.pilot_k and nxt is not None:
        k = min(self.prefetcher.pilot_k, self.cfg.n_routed_experts)
        pilot = pilot_step(self.dense.layers[nxt], r.x, cfg=self.cfg, k=k)
      steps.append(LayerStep.of(layer, r.flat, r.ids, valid))  # the host round trip
      valids.append(valid)
      pilots.append(None if pilot is None else np.asarray(pilot)[valid])
      stats.append(None if r.route_stats is None else np.asarray(r.route_stats))
    union = sorted(set().union(*(s.pairs for s in steps)))
    owned = union if self.owners is None else self.owners.mine(union)  # this process's share
    t0 = time.perf_counter()
    use, futures = self.account(
        layer, union, owned, np.concatenate(valids),
        None if stats[0] is None else np.concatenate(stats),
        None if pilots[0] is None else np.concatenate(pilots))
    self.stage("bookkeeping", t0)
    try:
      yield from self.compute(use, steps, futures)
    except ExpertIOError as e:  # named, and blamed on the rows that routed to the expert
      raise attributed(e, steps, [r.x.shape[1] for r in chunks]) from e

  def stage(self, name: str, t0: float, wait=None) -> float:
    """With stage timing on (`stage_s` a dict), adds the time since `t0` to stage `name`
    (after waiting for `wait`'s results). Returns now."""
    if self.stage_s is None:
      return t0
    if wait is not None:
      jax.block_until_ready(wait)
    now = time.perf_counter()
    self.stage_s[name] = self.stage_s.get(name, 0.0) + now - t0
    return now

  def account(self, layer: int, union: list[int], owned: list[int], valid, route_stats, pilot):
    """A layer step's tier lookups over `owned` (the experts of `union` this process owns; all
    of them in one process), in union order: (its `LayerUse`, the misses' futures). Every miss
    is submitted to the I/O threads here, at once, unless a prefetch of it is under way
    (`Prefetcher.take`). Co-activation (and heat, in the fold) learn from the whole `union`,
    which every process sees, so they are the same in every process."""
    if route_stats is not None:  # [T, 3] per token; padding rows do not count
      swaps, overlap, kl = (float(v) for v in np.asarray(route_stats)[valid].sum(axis=0))
      self.stats["route_swaps"] += swaps
      self.stats["route_overlap_sum"] += overlap
      self.stats["route_kl_sum"] += kl
      self.stats["route_tokens"] += int(valid.sum())
    pf = self.prefetcher
    if pf.enabled and not pf.paused:  # a precompile step leaves the tiers alone
      pf.land()
      pf.ledger.used([(layer, e) for e in owned])
    pf.count_pilot(layer, union)
    pinned, cached, missing = self.tiers.lookup(layer, owned)
    futures = {}
    for e in missing:  # every miss dispatched up front
      fut = pf.take(layer, e)
      futures[self.reader.submit(layer, e) if fut is None else fut] = (layer, e)
    if pf.inflight and not pf.paused:  # a precompile step drops no held prefetch
      pf.expire(layer)
    if pf.predicting:
      pf.predict(layer, union, self.next_moe(layer), pilot)
    return LayerUse(layer, union, owned, pinned, cached, missing), futures

  def compute(self, use: LayerUse, steps: list[LayerStep], futures):
    """Grouped compute of one layer's chunks (`steps`) as `use` (its lookups) says, yielding
    each chunk's terms; the step is folded into the tiers after the last (`TierRules.fold`).

    Pinned experts run as one kernel call per chunk over the pin pool, host-cached ones as one
    call over the host slab (or uploaded, under device placement on an accelerator), and each
    miss on its own: in the first chunk as its read lands, so computing one miss overlaps
    reading the next; later chunks find every read landed."""
    t_compute, wait0 = time.perf_counter(), self.reader.wait_s
    layer, pinned, cached, place = use.layer, use.pinned, use.cached, self.placement
    dev = self.tiers.device.get(layer)
    layout = self.store.layout(layer)
    # On a mesh whatever is not pinned runs on the host (the CPU kernel), never uploaded.
    use.on_device = self.mesh is None and place.place(len(cached) + len(futures))
    # A CPU-only machine has no bus to cross: "device" placement computes where the bytes are,
    # with the same kernel (it is still counted as device placement).
    upload = use.on_device and not place.on_cpu
    slab = self.tiers.slabs.slab(layer) if cached else None
    slots = {e: self.tiers.slabs.where[(layer, e)][1] for e in cached}
    arrived, weights = {}, {}  # the misses' bytes and unpacked views, until bookkeeping
    uploaded = None  # (pool, slot_of) of the uploaded experts, built once for every chunk
    for j, step in enumerate(steps):
      mine = lambda experts: [e for e in experts if e in step.pairs]
      parts = []  # (active [T, K], terms), merged over the misses' terms
      miss_terms = np.zeros((*step.ids.shape, step.x.shape[1]), np.float32)  # [T, K, D]
      if mine(pinned) and self.mesh is None:  # on a mesh: by their owners, in `mesh_terms`
        # the device kernel over the pin pool (CPU-only: the CPU kernel)
        parts.append(self.pool_terms(step, dev.pool, dev.slot_of, mine(pinned),
                                      "cpu" if place.on_cpu else self.kernel))
      if mine(cached) and not upload:  # the CPU kernel over the host slab, one call
        t0 = time.perf_counter()
        parts.append(self.pool_terms(step, slab.pool, slots, mine(cached), "cpu"))
        if place.expert_compute == "auto" and not place.on_cpu:  # rates only matter for auto
          parts[-1][1].block_until_ready()
          place.rate("host", len(mine(cached)) * layout.nbytes, time.perf_counter() - t0)
      if j == 0:  # the reads land while the first chunk computes
        for (_, e), blob in self.reader.as_completed(futures):  # in completion order
          arrived[e], weights[e] = blob, layout.unpack(blob)
          self.stats["expert_bytes_read"] += blob.nbytes
          if not upload and e in step.pairs:
            t0 = time.perf_counter()
            self.host_expert(step, e, weights[e], miss_terms)
            place.rate("host", blob.nbytes, time.perf_counter() - t0)
        if upload:
          uploaded = place.upload(layer, {**{e: slab.weights(slots[e])
                                             for e in cached}, **weights})
      elif not upload:
        for e in mine(weights):
          self.host_expert(step, e, weights[e], miss_terms)
      if uploaded is not None and mine(uploaded[1]):
        parts.append(self.pool_terms(step, *uploaded, mine(uploaded[1]), self.kernel))
      out = miss_terms  # host arrays go to the jit as they are (`jnp.asarray` compiles per shape)
      for active, terms in parts:
        out = merge_terms(active, terms, out)
      if self.mesh is not None:  # every owner's terms: pinned on its devices, host-held here
        out = self.mesh_terms(step, dev, mine(pinned), np.asarray(out))
      elif not parts:  # committed, as merge_terms' output is: the combine compiles once
        out = jax.device_put(out, jax.local_devices()[0])
      if self.stage_s is not None and j == len(steps) - 1:  # less what it waited for reads
        self.stage("expert_compute", t_compute + (self.reader.wait_s - wait0), out)
        self.stage_s["io_wait"] = self.stage_s.get("io_wait", 0.0) + self.reader.wait_s - wait0
      yield out
    t0 = time.perf_counter()
    # Tier bookkeeping in union order, whatever order the reads completed in (the rule is
    # TierRules.fold, shared with the fused step and the simulator).
    self.tiers.fold(use, (arrived, weights))
    self.stage("bookkeeping", t0)

  def host_expert(self, step: LayerStep, e: int, w: ExpertWeights, out: np.ndarray) -> None:
    """Expert `e` applied by the CPU kernel to every real token that chose it."""
    t, k = step.pairs[e]
    out[t, k] = expert_ffn(step.x[t], w)

  def pool_terms(self, step: LayerStep, pool: ExpertPool, slot_of: dict, experts, kernel: str):
    """(active `[T, K]`, terms) of `experts`, held in `pool` at `slot_of`, run by `kernel`."""
    active, slots = step.slot_grid(experts, slot_of.__getitem__)
    x = step.x
    if kernel == "cpu" and not self.placement.on_cpu:
      x = jax.device_put(x, cpu_device())
    terms = pool_terms_step(x, pool, slots, active, kernel=kernel)
    return active, terms

  def mesh_terms(self, step: LayerStep, pins: MeshPins | None, experts, host_terms):
    """The terms `[T, K, D]` on a mesh, replicated: the pinned `experts` computed by their
    owners' devices, `host_terms` (this process's host-held pairs, zero elsewhere) added in by
    the one psum over `expert` (`Ownership.combine`). Every process calls it once per chunk."""
    kernel = "cpu" if self.placement.on_cpu else self.kernel
    pinned = None if pins is None else (pins.pool(),
                                        lambda d: pins.slot_grid(d, step, experts))
    return self.owners.combine(step.x, host_terms, pinned, kernel)


  def layer_of(self, lw) -> int | None:
    """The index of decoder layer weights `lw` (None: not a main layer, e.g. the MTP block's)."""
    return self._layer_index.get(id(lw))

  def next_moe(self, layer: int) -> int | None:
    """The layer after `layer` if it is a MoE layer, else None."""
    nxt = layer + 1
    layers = self.dense.layers
    return nxt if nxt < len(layers) and isinstance(layers[nxt].mlp, MoE) else None


  def steps(self, n_valid=None, end: int | None = None):
    """The jitted pieces, each timed into `stage_s` (waiting for its results) when on; while
    predicting, a dense layer followed by a MoE layer also hints the pilot's prediction of that
    layer's experts (`dense_pilot`; its real rows: `n_valid`, or with `end` those before
    position `end`, for the chunks of a prefill)."""
    steps = JITTED
    if self.stage_s is not None:
      def timed(name, fn):
        def call(*args, **kw):
          t0 = time.perf_counter()
          out = jax.block_until_ready(fn(*args, **kw))
          self.stage(name, t0)
          return out
        return call
      steps = dataclasses.replace(
          JITTED, embed=timed("embed", JITTED.embed),
          attn_route=timed("attention_route", JITTED.attn_route),
          finish=timed("combine", JITTED.finish), logits=timed("lm_head", JITTED.logits))
    if self.prefetcher.predicting and self.prefetcher.pilot_k:
      steps = dataclasses.replace(steps, attn_route=self.dense_pilot(steps.attn_route, n_valid,
                                                                      end))
    return steps

  def dense_pilot(self, attn_route, n_valid, end=None):
    """`attn_route`, which after a dense layer whose successor is a MoE layer hints the pilot's
    prediction of that layer's experts from the dense layer's output, so their reads overlap
    the MoE layer's attention instead of waiting for its routing (the MoE → MoE pilot runs in
    `tiered`). Padding rows predict nothing."""
    def call(lw, x, start, **kw):
      out = attn_route(lw, x, start, **kw)
      i = self._layer_index.get(id(lw))
      nxt = None if out.ids is not None or i is None else self.next_moe(i)
      if nxt is not None:
        k = min(self.prefetcher.pilot_k, self.cfg.n_routed_experts)
        pilot = np.asarray(pilot_step(self.dense.layers[nxt], out.x, cfg=self.cfg, k=k))
        nv = n_valid if end is None else min(max(end - int(start), 0), out.x.shape[1])
        self.prefetcher.hint_pilot(nxt, pilot[valid_rows(out.x.shape, nv)])
      return out
    return call
