"""The offload engine: the one forward pass (glmjax.model.forward.forward) driven step by step, its
routed experts resolved against three tiers (device pool → host LRU → store on disk).

Per MoE layer step (`_tiered`, the engine's expert provider):
  1. the jitted attention + route step gives the top-k ids `[T, K]`; the host reads them (the
     one round trip per MoE layer) and forms the union of experts the real tokens chose
     (padding never routes);
  2. every miss is submitted to the I/O threads at once (a queued prefetch of the same expert
     is promoted to demand priority);
  3. grouped compute: each needed expert is applied once to all the tokens that chose it.
     Pinned experts first, then host-cached ones, then each miss as its read lands, so
     computing one miss overlaps reading the next;
  4. tier bookkeeping (host-cache inserts, admission to the pin pool) runs at the end of the
     step in union order, never in completion order;
  5. the jitted finish step combines the terms in rank order with the shared expert.

Determinism: a (token, rank) term is computed by one kernel whose per-row arithmetic does not
depend on the other rows it runs with (pallas_kernels.cpu; on a CPU-only machine every tier,
resident pools included, uses it), and the combine has a fixed order, so results are bitwise
identical whatever tier served an expert and in whatever order reads complete.

With every expert resident the provider is one jitted kernel call per layer and the steps run
back to back with no host round trip.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.formats.store import ExpertStore
from glmjax.model.config import Config
from glmjax.model.forward import JITTED, KVCache, bucket, forward, mtp_forward, valid_rows
from glmjax.model.layers import F32, rms_norm
from glmjax.model.moe import pool_terms, resolve_kernel
from glmjax.model.quant import ExpertPool, ExpertWeights
from glmjax.model.weights import MoE, Weights
from glmjax.offload.expert_io import COUPLE, DEMAND, PILOT, ExpertReader, drop_page_cache
from glmjax.offload.tiers import (DevicePool, Heat, HostCache, as_device_pool, atomic_write,
                                  empty_pool, should_repin)
from pallas_kernels import cpu

USAGE_FILE = "usage.json"
COUPLE_FILE = "couple.npy"
PLACEMENTS = ("auto", "device", "host")


def _load_couple(path: str, layers: int, experts: int) -> np.ndarray:
  """Co-activation counts expert(L) → expert(L+1), persisted between runs."""
  try:
    table = np.load(path)
    if table.shape == (layers, experts, experts):
      return table
  except (OSError, ValueError):
    pass
  return np.zeros((layers, experts, experts), np.float32)


# --- jitted pieces of the provider ------------------------------------------------------------

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
  return jnp.where(active[..., None], a, b)


# --- the engine ------------------------------------------------------------------------------

@dataclasses.dataclass
class Budgets:
  device_bytes: int
  host_bytes: int


@dataclasses.dataclass
class _Step:
  """One MoE layer step's routing, as the host sees it."""
  layer: int
  x: np.ndarray  # [T, D] float32, the normed hidden states routed
  ids: np.ndarray  # [T, K] expert ids (padding rows included, never used)
  pairs: dict  # expert → (token rows, ranks) of the real tokens that chose it

  @classmethod
  def of(cls, layer, flat, ids, valid) -> "_Step":
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


class OffloadEngine:
  """Runs the model layer by layer over dense weights and a store's routed experts."""

  def __init__(self, cfg: Config, dense: Weights, store: ExpertStore, budgets: Budgets,
               io_workers: int = 4, io_timeout_s: float = 60.0, cold: bool = False,
               progress: bool = True, kernel: str = "auto", prefetch: bool = True,
               pilot_k: int = 6, couple_k: int = 4, cache_route: tuple[int, int] | None = None,
               expert_compute: str = "device"):
    if expert_compute not in PLACEMENTS:
      raise ValueError(f"expert_compute must be one of {PLACEMENTS}, got {expert_compute!r}")
    self.cfg, self.dense, self.store = cfg, dense, store
    self.kernel = resolve_kernel(kernel)  # the device kernel (pinned and uploaded experts)
    self.on_cpu = jax.default_backend() == "cpu"
    self.expert_compute = expert_compute
    self.cache_route = cache_route
    self.pilot_k, self.couple_k = pilot_k, couple_k
    self.moe_layers = [i for i, l in enumerate(dense.layers) if isinstance(l.mlp, MoE)]
    self.layout = store.layout(self.moe_layers[0])
    self.chunk_bytes = self.layout.nbytes
    e = cfg.n_routed_experts
    slots = min(e, budgets.device_bytes // max(1, self.chunk_bytes * len(self.moe_layers)))
    self.slots = int(slots)
    self.all_resident = self.slots == e
    self.host = HostCache(0 if self.all_resident else budgets.host_bytes)
    # The read function closes over the store only, never the engine (see ExpertReader).
    read = lambda layer, expert, store=store: store.read_async(layer, expert).result()
    self.reader = ExpertReader(read, io_workers, io_timeout_s)
    # A model dropped without close() still stops its I/O threads when collected.
    self._finalizer = weakref.finalize(self, self.reader.close)
    self.usage_path = os.path.join(store.path, USAGE_FILE)
    self.heat = Heat.load(self.usage_path)
    if cold:
      drop_page_cache(os.path.join(store.path, "experts"))
    self.stats = collections.Counter({"experts_on_device": 0, "experts_on_host": 0,
                                      "h2d_bytes": 0})
    self.rates = {"host": 0.0, "h2d": 0.0}  # measured bytes/s (auto placement), EMA
    self.device: dict[int, DevicePool] = {}
    self._fill_device_tier(progress)
    # Prefetch: only worth it when a landed expert has somewhere to stay.
    self.prefetch = prefetch and not self.all_resident and (self.host.budget > 0 or self.slots > 0)
    self.inflight: dict[tuple[int, int], tuple] = {}  # key → (future, kind)
    self.landed_unused: set = set()  # prefetched, landed, not yet used
    self.pilot_pred: dict[int, set] = {}  # layer → experts the pilot predicted this step
    self.couple_path = os.path.join(store.path, COUPLE_FILE)
    self.couple = _load_couple(self.couple_path, cfg.num_hidden_layers + len(dense.mtp),
                               cfg.n_routed_experts)
    self._prev_union: tuple[int, list] | None = None

  # -- setup --------------------------------------------------------------------------------
  def _fill_device_tier(self, progress: bool):
    from tqdm import tqdm
    if self.slots == 0:
      return
    if self.all_resident:
      mtp = [self.cfg.num_hidden_layers] if self.dense.mtp else []
      for layer in tqdm(self.moe_layers + mtp, desc="loading experts", disable=not progress,
                        leave=False):
        pool = DevicePool(layer, self.slots, jax.tree_util.tree_map(
            jnp.asarray, self.store.read_layer(layer)))
        pool.slot_of = {x: x for x in range(self.slots)}
        pool.expert_in = list(range(self.slots))
        self.device[layer] = pool
      return
    # Pin the hottest experts of past runs (the persisted usage histogram), read in parallel
    # through the I/O threads and installed as they land.
    futures = {}
    for layer in self.moe_layers:
      self.device[layer] = DevicePool(layer, self.slots, empty_pool(self.layout, self.slots))
      for e in self.heat.hottest(layer, self.slots, self.cfg.n_routed_experts):
        futures[self.reader.submit(layer, e)] = (layer, e)
    with tqdm(total=len(futures), desc="pinning experts", disable=not progress or not futures,
              leave=False) as bar:
      for (layer, e), blob in self.reader.as_completed(futures):
        dev = self.device[layer]
        dev.install(e, self.layout.unpack(blob), dev.free_slot())
        bar.update()

  def resident_weights(self) -> Weights:
    """With every expert resident: the dense weights with each MoE layer's pool as its experts,
    for the one-jit resident path (glmjax.model.forward's entry points)."""
    def fill(i, lw):
      if not isinstance(lw.mlp, MoE):
        return lw
      return dataclasses.replace(lw, mlp=dataclasses.replace(lw.mlp, experts=self.device[i].pool))
    layers = [fill(i, lw) for i, lw in enumerate(self.dense.layers)]
    mtp = [dataclasses.replace(m, layer=fill(self.cfg.num_hidden_layers + j, m.layer))
           for j, m in enumerate(self.dense.mtp)]
    return dataclasses.replace(self.dense, layers=layers, mtp=mtp)

  def save(self) -> None:
    """Persists the usage histogram (next run's pinned set) and the co-activation table."""
    self.heat.save(self.usage_path)
    if self.prefetch:
      atomic_write(self.couple_path, lambda f: np.save(f, self.couple))

  def close(self) -> None:
    """Saves, then stops and joins the I/O threads. Idempotent; the engine is unusable after."""
    if self.closed:
      return
    self.save()
    self._finalizer()  # runs reader.close() once
    self.device.clear()
    self.host = HostCache(0)
    self.inflight.clear()

  @property
  def closed(self) -> bool:
    return not self._finalizer.alive

  # -- prefetch ------------------------------------------------------------------------------
  def _resident(self, layer: int, e: int) -> bool:
    dev = self.device.get(layer)
    return (dev is not None and e in dev) or (layer, e) in self.host or (layer, e) in self.inflight

  def hint(self, layer: int, experts, kind: int) -> None:
    """Queues non-resident `experts` of `layer` for reading at priority `kind`."""
    for e in experts:
      e = int(e)
      if self._resident(layer, e):
        continue
      fut = self.reader.submit(layer, e, kind)
      if fut is None:
        self.stats["prefetch_dropped"] += 1
        continue
      self.inflight[(layer, e)] = (fut, kind)
      self.stats["prefetch_issued"] += 1

  def _land(self, protect) -> None:
    """Moves finished prefetches into the host cache (and free device slots)."""
    for key, (fut, kind) in list(self.inflight.items()):
      if kind == DEMAND or not fut.done():
        continue
      del self.inflight[key]
      if fut.cancelled() or fut.exception() is not None:
        self.stats["prefetch_failed"] += 1  # a hint failing is not an error; demand retries
        continue
      blob = fut.result()
      self.stats["expert_bytes_read"] += blob.nbytes
      self._put_host(key, blob, protect)
      dev = self.device.get(key[0])
      slot = dev.free_slot() if dev is not None else None
      if slot is not None:
        dev.install(key[1], self.store.layout(key[0]).unpack(blob), slot)
      if key in self.host or (dev is not None and key[1] in dev):
        self.landed_unused.add(key)
      else:
        self.stats["prefetch_wasted"] += 1

  def _put_host(self, key, blob, protect=()) -> None:
    for victim in self.host.put(key, blob, protect):
      if victim in self.landed_unused:
        self.landed_unused.discard(victim)
        self.stats["prefetch_wasted"] += 1

  def _predict(self, layer: int, union: list, next_layer: int | None, pilot) -> None:
    """Pilot and co-activation hints for `next_layer`, after `layer`'s union is known."""
    if next_layer is None:
      return
    if pilot is not None:
      pred = {int(e) for e in np.unique(pilot)}
      self.pilot_pred[next_layer] = pred
      self.hint(next_layer, sorted(pred), PILOT)
    if self.couple_k:
      score = self.couple[layer][union].sum(axis=0)
      top = [int(e) for e in np.argsort(-score, kind="stable")[:self.couple_k] if score[e] > 0]
      self.hint(next_layer, top, COUPLE)

  def _next_moe(self, layer: int) -> int | None:
    nxt = layer + 1
    layers = self.dense.layers
    return nxt if nxt < len(layers) and isinstance(layers[nxt].mlp, MoE) else None

  # -- the expert providers -----------------------------------------------------------------
  def _resident_terms(self, layer, m, x, flat, ids, n_valid, route_stats=None):
    """All experts pinned: one jitted kernel call, no host round trip."""
    valid = valid_rows(x.shape, n_valid)
    return pool_terms_step(flat, self.device[layer].pool, ids, valid[:, None], kernel=self.kernel)

  def _tiered(self, layer, m, x, flat, ids, n_valid, route_stats=None):
    """Unweighted expert terms `[T, K, D]` of one MoE layer through the tiers."""
    valid = valid_rows(x.shape, n_valid)  # [T] bool: real tokens
    if route_stats is not None:  # [T, 3] per token; padding rows do not count
      swaps, overlap, kl = (float(v) for v in np.asarray(route_stats)[valid].sum(axis=0))
      self.stats["route_swaps"] += swaps
      self.stats["route_overlap_sum"] += overlap
      self.stats["route_kl_sum"] += kl
      self.stats["route_tokens"] += int(valid.sum())
    nxt = self._next_moe(layer) if layer < self.cfg.num_hidden_layers else None
    pilot = None
    if self.prefetch and self.pilot_k and nxt is not None:
      k = min(self.pilot_k, self.cfg.n_routed_experts)
      pilot = pilot_step(self.dense.layers[nxt], x, cfg=self.cfg, k=k)
    step = _Step.of(layer, flat, ids, valid)  # the host round trip
    if pilot is not None:
      pilot = np.asarray(pilot)[valid]
    union = step.union
    self.heat.use(layer, union)
    self.stats["experts_used"] += len(union)
    keys = {(layer, e) for e in union}
    if self.prefetch:
      self._land(protect=keys)
      pred = self.pilot_pred.pop(layer, None)
      if pred is not None:
        self.stats["pilot_hits"] += len(pred & set(union))
        self.stats["pilot_predicted"] += len(pred)
        self.stats["pilot_actual"] += len(union)
      for key in keys & self.landed_unused:
        self.landed_unused.discard(key)
        self.stats["prefetch_useful"] += 1
    dev = self.device.get(layer)
    pinned = [e for e in union if dev is not None and e in dev]
    cached, futures = {}, {}
    for e in union:
      if e in pinned:
        continue
      blob = self.host.get((layer, e))
      if blob is not None:
        cached[e] = blob
      elif (layer, e) in self.inflight:  # a prefetch still loading: wait for it, no re-read
        fut = self.inflight.pop((layer, e))[0]
        self.reader.promote(fut)  # a hint still queued is now a demand
        futures[fut] = (layer, e)
        self.stats["prefetch_late"] += 1
      else:
        futures[self.reader.submit(layer, e)] = (layer, e)  # every miss dispatched up front
    if self.prefetch:
      self._predict(layer, union, nxt, pilot)
      if self._prev_union is not None and self._prev_union[0] < layer:
        self.couple[self._prev_union[0]][np.ix_(self._prev_union[1], union)] += 1.0
      self._prev_union = (layer, union)
    self.stats["expert_pin_hits"] += len(pinned)
    self.stats["expert_host_hits"] += len(cached)
    self.stats["expert_misses"] += len(futures)
    self.stats[f"misses_layer_{layer}"] += len(futures)
    terms = self._compute(step, dev, pinned, cached, futures)
    return terms

  def _compute(self, step: _Step, dev, pinned, cached, futures):
    """Grouped compute of one layer step; the tiers are updated after, in union order."""
    layout = self.store.layout(step.layer)
    host_terms = np.zeros((*step.ids.shape, step.x.shape[1]), np.float32)  # [T, K, D]
    on_device = self._place(len(cached) + len(futures))
    # A CPU-only machine has no bus to cross: "device" placement computes where the bytes are,
    # with the same kernel (it is still counted as device placement).
    upload = on_device and not self.on_cpu
    uploads: dict[int, np.ndarray] = {}
    device_terms = None
    if pinned and not self.on_cpu:  # the device kernel over the pin pool, queued first
      device_terms = self._device_terms(step, dev.pool, dev.slot_of, pinned)
    elif pinned:  # CPU-only: the device pool is host memory; the same CPU kernel reads it
      pool = jax.tree_util.tree_map(np.asarray, dev.pool)
      for e in pinned:
        s = dev.slot_of[e]
        self._host_expert(step, e, ExpertWeights(
            dataclasses.replace(pool.gate_up, packed=pool.gate_up.packed[s],
                                scales=pool.gate_up.scales[s]),
            dataclasses.replace(pool.down, packed=pool.down.packed[s],
                                scales=pool.down.scales[s])), host_terms)
    self.stats["experts_on_device"] += len(pinned)
    arrived = {}
    landed = ((key[1], blob) for key, blob in self.reader.as_completed(futures))
    for e, blob in itertools.chain(cached.items(), landed):  # misses in completion order
      if e not in cached:
        arrived[e] = blob
        self.stats["expert_bytes_read"] += blob.nbytes
      if upload:
        uploads[e] = blob
      else:
        t0 = time.perf_counter()
        self._host_expert(step, e, layout.unpack(blob), host_terms)
        self._rate("host", blob.nbytes, time.perf_counter() - t0)
    if uploads:
      device_terms = self._upload_terms(step, layout, uploads, device_terms)
    self.stats["experts_on_device" if on_device else "experts_on_host"] += len(cached) + len(
        arrived)
    # Tier bookkeeping in union order, whatever order the reads completed in.
    protect = {(step.layer, e) for e in step.union}
    for e in step.union:
      if e in arrived:
        self._put_host((step.layer, e), arrived[e], protect)
    held = {**cached, **arrived}
    self._admit(step.layer, step.union, {e: held[e] for e in step.union if e in held})
    out = jnp.asarray(host_terms)
    if device_terms is not None:
      active, terms = device_terms
      out = merge_terms(jnp.asarray(active), terms, out)
    return out

  def _host_expert(self, step: _Step, e: int, w: ExpertWeights, out: np.ndarray) -> None:
    """Expert `e` applied by the CPU kernel to every real token that chose it."""
    t, k = step.pairs[e]
    gu, dn = w.gate_up, w.down
    out[t, k] = cpu.expert_ffn(step.x[t], gu.packed, gu.scales, dn.packed, dn.scales, gu.bits,
                               gu.group_size, dn.out_features, dn.in_features)

  def _device_terms(self, step: _Step, pool: ExpertPool, slot_of: dict, experts):
    """(active `[T, K]`, device terms) of `experts` held in a device `pool`."""
    active = np.zeros(step.ids.shape, bool)
    slots = np.zeros(step.ids.shape, np.int32)
    for e in experts:
      t, k = step.pairs[e]
      active[t, k] = True
      slots[t, k] = slot_of[e]
    terms = pool_terms_step(jnp.asarray(step.x), pool, jnp.asarray(slots), jnp.asarray(active),
                            kernel=self.kernel)
    return active, terms

  def _upload_terms(self, step: _Step, layout, blobs: dict, prior):
    """Host-held experts uploaded into a transient device pool and run by the device kernel
    (expert_compute="device" on an accelerator), merged over `prior` device terms."""
    experts = sorted(blobs)
    weights = [layout.unpack(blobs[e]) for e in experts]
    weights += [weights[-1]] * (bucket(len(experts)) - len(experts))  # few compiled shapes
    t0 = time.perf_counter()
    pool = as_device_pool(weights)
    nbytes = sum(blobs[e].nbytes for e in experts)
    self.stats["h2d_bytes"] += nbytes
    self._rate("h2d", nbytes, time.perf_counter() - t0)
    active, terms = self._device_terms(step, pool, {e: s for s, e in enumerate(experts)}, experts)
    if prior is not None:
      terms = merge_terms(jnp.asarray(prior[0]), prior[1], terms)
      active = active | prior[0]
    return active, terms

  def _rate(self, name: str, nbytes: int, seconds: float) -> None:
    if seconds > 0:
      r = nbytes / seconds
      self.rates[name] = r if not self.rates[name] else 0.8 * self.rates[name] + 0.2 * r

  def _place(self, n: int) -> bool:
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

  def _admit(self, layer: int, union, blobs: dict[int, np.ndarray]):
    """Moves just-used experts into the device tier: free slots first, then LFRU swaps."""
    dev = self.device.get(layer)
    if dev is None:
      return
    for e in sorted(blobs, key=lambda e: -self.heat[(layer, e)]):
      slot = dev.free_slot()
      if slot is None:
        cold = dev.coldest(self.heat)
        if cold is None or cold[1] in union or not should_repin(self.heat[(layer, e)],
                                                               self.heat[(layer, cold[1])]):
          continue
        slot = cold[0]
        self.stats["repins"] += 1
      dev.install(e, self.store.layout(layer).unpack(blobs[e]), slot)

  # -- forward --------------------------------------------------------------------------------
  def _provider(self):
    return self._resident_terms if self.all_resident else self._tiered

  def _route_args(self, layer: int):
    """Cache-aware routing's inputs for `layer`: (resident `[E]` mask, (keep, rank))."""
    if layer not in self.device and layer not in self.moe_layers:
      return None, None
    mask = [self._resident(layer, e) for e in range(self.cfg.n_routed_experts)]
    return jnp.asarray(mask), tuple(self.cache_route)

  def forward(self, tokens, cache: KVCache | None = None, absorbed: bool = False,
              n_valid: int | None = None):
    """Logits `[B, S, V]`, final hidden `[B, S, D]` and the new cache for `tokens` `[B, S]`
    (the first `n_valid` positions real, the rest padding that never routes)."""
    self._prev_union = None
    aware = self.cache_route is not None and not self.all_resident
    out = forward(self.dense, jnp.asarray(tokens, jnp.int32), self.cfg, cache, absorbed,
                  experts=self._provider(), steps=JITTED, n_valid=n_valid,
                  route_args=self._route_args if aware else None)
    if not self.all_resident:
      self.heat.decay()
    return out

  def mtp_forward(self, h, next_tokens, cache, start: int):
    """The MTP block at positions start..start+S-1 over (h `[B, S, D]`, next tokens `[B, S]`).

    Returns (logits `[B, S, V]`, block output `[B, S, D]`, the MTP layer cache). Its routed
    experts come through the same tiers as the main layers' (the store's "mtp" group).
    """
    return mtp_forward(self.dense, h, jnp.asarray(next_tokens, jnp.int32), self.cfg, cache,
                       jnp.asarray(start, jnp.int32), absorbed=h.shape[1] <= 4,
                       experts=self._provider(), steps=JITTED)

  def telemetry(self) -> dict[str, float]:
    """Flat numeric counters since construction (callers take differences)."""
    out = {k: float(v) for k, v in self.stats.items()}
    out["all_resident"] = float(self.all_resident)  # fast path: no per-expert accounting
    if self.prefetch:
      out["prefetch_unused"] = float(len(self.landed_unused))
      out["prefetch_inflight"] = float(sum(1 for f, k in self.inflight.values() if k != DEMAND))
    out["io_service_s"] = self.reader.service_s
    out["io_wait_s"] = self.reader.wait_s
    return out
