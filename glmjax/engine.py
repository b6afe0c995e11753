"""The offload engine: a host loop over jitted layer steps, resolving routed experts against
three tiers (device pool → host LRU → store on disk) between them.

Per MoE layer and step:
  1. a jitted step runs attention and the router; the host reads the top-k ids `[T, K]`;
  2. the union of distinct experts is resolved: pinned on the device, in the host cache, or a
     miss, and every miss is submitted to the I/O threads at once;
  3. pinned experts are computed first (JAX dispatch is asynchronous, so the device works while
     the host waits), then host-cached ones, then each miss as it arrives;
  4. per-(token, rank) terms from the three groups are merged by selection and combined in
     rank order, so results are bitwise identical whatever tier served an expert.
With every expert resident the same jitted steps run back to back with no host round trip.

Bitwise determinism across budgets holds on the XLA expert path (`expert_terms`, per pair).
`kernel="pallas"` runs the Pallas grouped op in the all-resident fast path only; offloaded
layers always use the per-pair path.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.attention import attention
from glmjax.config import Config
from glmjax.expert_io import COUPLE, DEMAND, PILOT, ExpertReader, drop_page_cache
from glmjax.layers import F32, rms_norm, swiglu
from glmjax.model import KVCache, logits_of
from glmjax.mtp import mtp_input, mtp_output_logits
from glmjax.moe import combine, expert_terms, route, route_cache_aware
from glmjax.quant import ExpertPool
from glmjax.store import ExpertStore
from glmjax.tiers import (DevicePool, Heat, HostCache, as_device_pool, atomic_write, empty_pool,
                          should_repin)
from glmjax.weights import MoE, Weights
from pallas_kernels import grouped_moe

USAGE_FILE = "usage.json"
COUPLE_FILE = "couple.npy"


def _load_couple(path: str, layers: int, experts: int) -> np.ndarray:
  """Co-activation counts expert(L) → expert(L+1), persisted between runs."""
  try:
    table = np.load(path)
    if table.shape == (layers, experts, experts):
      return table
  except (OSError, ValueError):
    pass
  return np.zeros((layers, experts, experts), np.float32)


# --- jitted steps ----------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("cfg", "absorbed", "cache_route"),
                   donate_argnames=("cache",))
def attn_route_step(lw, x, positions, cache, start, selection, cfg: Config, absorbed: bool,
                    resident=None, cache_route=None):
  """Attention (+ residual), then the MLP norm; MoE layers also route. Dense layers finish.

  With `cache_route=(keep, rank)` and a `resident` `[E]` mask, MoE layers route cache-aware
  (lossy) and the last output holds that routing's [swaps, overlap, kl] sums.
  """
  h = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)
  a, cache, selection = attention(lw.attn, h, positions, cfg, cache, start, selection, absorbed)
  x = x + a
  hm = rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps)
  if not isinstance(lw.mlp, MoE):
    return x + swiglu(hm, lw.mlp.gate_up, lw.mlp.down), None, None, None, cache, selection, None
  flat = hm.reshape(-1, hm.shape[-1])  # [T, D]
  if cache_route is not None:
    ids, w, route_stats = route_cache_aware(flat, lw.mlp.router, lw.mlp.bias, cfg, resident,
                                            *cache_route)
    return x, flat, ids, w, cache, selection, route_stats
  ids, w = route(flat, lw.mlp.router, lw.mlp.bias, cfg)
  return x, flat, ids, w, cache, selection, None


@functools.partial(jax.jit, static_argnames=("cfg",))
def moe_finish_step(m: MoE, x, flat, ys, w, cfg: Config):
  """Rank-ordered combine of the expert terms, plus the shared expert, plus the residual."""
  out = combine(ys, w)
  if m.shared is not None:
    out = out + swiglu(flat, m.shared.gate_up, m.shared.down)
  return x + out.reshape(x.shape)


terms_step = jax.jit(expert_terms)


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def pilot_step(next_lw, x, cfg: Config, k: int):
  """Layer L+1's post-attention norm and router applied to layer L's post-attention residual:
  the top `k` experts by biased score per position `[T, k]` (the "pilot" prediction)."""
  h = rms_norm(x, next_lw.mlp_norm, cfg.rms_norm_eps).reshape(-1, x.shape[-1])
  scores = jax.nn.sigmoid(jnp.einsum("td,ed->te", h, next_lw.mlp.router.astype(F32)))
  return jax.lax.top_k(scores + next_lw.mlp.bias.astype(F32), k)[1]


@functools.partial(jax.jit, static_argnames=("cfg",))
def moe_pallas_step(m: MoE, x, flat, pool: ExpertPool, ids, w, cfg: Config):
  """The all-resident MoE through the Pallas grouped op (combine inside the kernel)."""
  out = grouped_moe(flat, pool, ids, w, backend="pallas")
  if m.shared is not None:
    out = out + swiglu(flat, m.shared.gate_up, m.shared.down)
  return x + out.reshape(x.shape)


@jax.jit
def merge_terms(active, a, b):
  return jnp.where(active[..., None], a, b)


@functools.partial(jax.jit, static_argnames=("cfg",))
def logits_step(w: Weights, x, cfg: Config):
  return logits_of(w, x, cfg)


@jax.jit
def embed_step(embed, tokens):
  return embed[tokens].astype(F32)


@functools.partial(jax.jit, static_argnames=("cfg",))
def mtp_in_step(w: Weights, h, next_tokens, cfg: Config):
  return mtp_input(w, w.mtp[0], h, next_tokens, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def mtp_out_step(w: Weights, x, cfg: Config):
  return mtp_output_logits(w, w.mtp[0], x, cfg)


# --- the engine ------------------------------------------------------------------------------

@dataclasses.dataclass
class Budgets:
  device_bytes: int
  host_bytes: int


class OffloadEngine:
  """Runs the model layer by layer over dense weights and a store's routed experts."""

  def __init__(self, cfg: Config, dense: Weights, store: ExpertStore, budgets: Budgets,
               io_workers: int = 4, io_timeout_s: float = 60.0, cold: bool = False,
               progress: bool = True, kernel: str = "xla", prefetch: bool = True,
               pilot_k: int = 6, couple_k: int = 4, cache_route: tuple[int, int] | None = None):
    self.cfg, self.dense, self.store = cfg, dense, store
    self.kernel = kernel
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
    self.stats = collections.Counter()
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
    for layer in self.moe_layers:
      self.device[layer] = DevicePool(layer, self.slots, empty_pool(self.layout, self.slots))
      # Pin the hottest experts of past runs (the persisted usage histogram).
      for e in self.heat.hottest(layer, self.slots, self.cfg.n_routed_experts):
        self.device[layer].install(e, self.store.read(layer, e), self.device[layer].free_slot())

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
      if fut.exception() is not None:
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
      pred = {int(e) for e in np.unique(np.asarray(pilot))}
      self.pilot_pred[next_layer] = pred
      self.hint(next_layer, sorted(pred), PILOT)
    if self.couple_k:
      score = self.couple[layer][union].sum(axis=0)
      top = [int(e) for e in np.argsort(-score, kind="stable")[:self.couple_k] if score[e] > 0]
      self.hint(next_layer, top, COUPLE)

  # -- per-layer expert resolution ----------------------------------------------------------
  def _experts(self, layer: int, flat, ids, next_layer=None, pilot=None):
    """Unweighted expert terms `[T, K, D]` of one MoE layer (and hints for `next_layer`)."""
    dev = self.device.get(layer)
    if self.all_resident:
      return terms_step(flat, dev.pool, ids)
    ids_np = np.asarray(ids)  # [T, K]; the one host round trip per MoE layer
    union = [int(e) for e in np.unique(ids_np)]
    self.heat.use(layer, union)
    self.stats["experts_used"] += len(union)
    keys = {(layer, e) for e in union}
    if self.prefetch:
      self._land(protect=keys)
      pred = self.pilot_pred.pop(layer, None)
      if pred is not None:
        hit = len(pred & set(union))
        self.stats["pilot_hits"] += hit
        self.stats["pilot_predicted"] += len(pred)
        self.stats["pilot_actual"] += len(union)
      for key in keys & self.landed_unused:
        self.landed_unused.discard(key)
        self.stats["prefetch_useful"] += 1
    pinned = [e for e in union if dev is not None and e in dev]
    cached, missing, futures = {}, [], {}
    for e in union:
      if e in pinned:
        continue
      blob = self.host.get((layer, e))
      if blob is not None:
        cached[e] = blob
      elif (layer, e) in self.inflight:  # a prefetch still loading: wait for it, no re-read
        missing.append(e)
        futures[e] = self.inflight.pop((layer, e))[0]
        self.reader.promote(futures[e])  # a hint still queued is now a demand
        self.stats["prefetch_late"] += 1
      else:
        missing.append(e)
        futures[e] = self.reader.submit(layer, e)  # every miss dispatched up front
    if self.prefetch:
      self._predict(layer, union, next_layer, pilot)
      if self._prev_union is not None and self._prev_union[0] < layer:
        self.couple[self._prev_union[0]][np.ix_(self._prev_union[1], union)] += 1.0
      self._prev_union = (layer, union)
    self.stats["expert_pin_hits"] += len(pinned)
    self.stats["expert_host_hits"] += len(cached)
    self.stats["expert_misses"] += len(missing)
    self.stats[f"misses_layer_{layer}"] += len(missing)

    groups = []  # (active [T, K], terms) in the order they are computed
    if pinned:
      slots = _lookup(dev.slot_of, ids_np, self.cfg.n_routed_experts)
      active = np.isin(ids_np, pinned)
      groups.append((active, terms_step(flat, dev.pool, jnp.asarray(slots, jnp.int32),
                                        jnp.asarray(active))))
    if cached:
      groups.append(self._working_terms(layer, flat, ids_np, cached))
    arrived = {}
    for e in missing:  # lazily: each read is awaited only now, after resident work is queued
      blob = self.reader.wait(futures[e], layer, e)
      self.stats["expert_bytes_read"] += blob.nbytes
      self._put_host((layer, e), blob, keys)
      arrived[e] = blob
    if arrived:
      groups.append(self._working_terms(layer, flat, ids_np, arrived))
    self._admit(layer, union, {**cached, **arrived})

    active, ys = groups[-1]
    for act, terms in reversed(groups[:-1]):
      ys = merge_terms(jnp.asarray(act), terms, ys)
    return ys

  def _working_terms(self, layer: int, flat, ids_np, blobs: dict[int, np.ndarray]):
    """Terms of experts held as host bytes, through a transient padded device pool."""
    experts = sorted(blobs)
    width = _bucket(len(experts))
    layout = self.store.layout(layer)
    weights = [layout.unpack(blobs[e]) for e in experts]
    weights += [weights[-1]] * (width - len(experts))
    pool = as_device_pool(weights)
    slots = _lookup({e: s for s, e in enumerate(experts)}, ids_np, self.cfg.n_routed_experts)
    active = np.isin(ids_np, experts)
    return active, terms_step(flat, pool, jnp.asarray(slots, jnp.int32), jnp.asarray(active))

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
      dev.install(e, self.layout.unpack(blobs[e]), slot)

  # -- forward --------------------------------------------------------------------------------
  def forward(self, tokens, cache: KVCache | None = None, absorbed: bool = False):
    """Logits `[B, S, V]`, final hidden `[B, S, D]` and the new cache for `tokens` `[B, S]`."""
    cfg = self.cfg
    tokens = jnp.asarray(tokens, jnp.int32)
    start = jnp.zeros((), jnp.int32) if cache is None else cache.length
    positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    x = embed_step(self.dense.embed, tokens)
    selection, new_layers = None, []
    self._prev_union = None
    layers = self.dense.layers
    for i, lw in enumerate(layers):
      lc = None if cache is None else cache.layers[i]
      resident, aware = None, None
      if self.cache_route and isinstance(lw.mlp, MoE) and not self.all_resident:
        resident = jnp.asarray([self._resident(i, e) for e in range(cfg.n_routed_experts)])
        aware = tuple(self.cache_route)
      x, flat, ids, w, lc, selection, rstats = attn_route_step(
          lw, x, positions, lc, start, selection, cfg=cfg, absorbed=absorbed, resident=resident,
          cache_route=aware)
      if rstats is not None:
        swaps, overlap, kl = (float(v) for v in np.asarray(rstats))
        self.stats["route_swaps"] += swaps
        self.stats["route_overlap_sum"] += overlap
        self.stats["route_kl_sum"] += kl
        self.stats["route_tokens"] += flat.shape[0]
      if ids is not None and self.all_resident and self.kernel == "pallas":
        x = moe_pallas_step(lw.mlp, x, flat, self.device[i].pool, ids, w, cfg=cfg)
      elif ids is not None:
        nxt = i + 1 if i + 1 < len(layers) and isinstance(layers[i + 1].mlp, MoE) else None
        pilot = None
        if self.prefetch and self.pilot_k and nxt is not None:
          pilot = pilot_step(layers[nxt], x, cfg=cfg, k=min(self.pilot_k, cfg.n_routed_experts))
        ys = self._experts(i, flat, ids, nxt, pilot)
        x = moe_finish_step(lw.mlp, x, flat, ys, w, cfg=cfg)
      new_layers.append(lc)
    if not self.all_resident:
      self.heat.decay()
    new_cache = None if cache is None else KVCache(new_layers, cache.length)
    return logits_step(self.dense, x, cfg=cfg), x, new_cache

  def mtp_forward(self, h, next_tokens, cache, start: int):
    """The MTP block at positions start..start+S-1 over (h `[B, S, D]`, next tokens `[B, S]`).

    Returns (logits `[B, S, V]`, block output `[B, S, D]`, the MTP layer cache). Its routed
    experts come through the same tiers as the main layers' (the store's "mtp" group).
    """
    cfg, m = self.cfg, self.dense.mtp[0]
    layer = cfg.num_hidden_layers
    s = h.shape[1]
    start = jnp.asarray(start, jnp.int32)
    positions = start + jnp.arange(s, dtype=jnp.int32)
    u = mtp_in_step(self.dense, h, jnp.asarray(next_tokens, jnp.int32), cfg=cfg)
    x, flat, ids, w, cache, _, _ = attn_route_step(m.layer, u, positions, cache, start, None,
                                                   cfg=cfg, absorbed=s <= 4)
    ys = self._experts(layer, flat, ids)
    x = moe_finish_step(m.layer.mlp, x, flat, ys, w, cfg=cfg)
    return mtp_out_step(self.dense, x, cfg=cfg), x, cache

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


def _lookup(slot_of: dict[int, int], ids, n_experts: int) -> np.ndarray:
  """Slot of each expert id in `ids` (0 for experts not in `slot_of`; those pairs are inactive)."""
  table = np.zeros(n_experts, np.int32)
  table[list(slot_of)] = list(slot_of.values())
  return table[ids]


def _bucket(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())
