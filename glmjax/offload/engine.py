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

On a mesh (one process) each device of the `expert` axis pins only experts it owns (`MeshPins`)
and computes them under shard_map; everything else runs on the host as above, its terms then
replicated onto the mesh. Host cache, I/O threads and bookkeeping are the process's.
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm import tqdm

from glmjax.errors import InputError

from glmjax.formats.store import ExpertStore
from glmjax.model.config import Config
from glmjax.model.forward import (JITTED, Chunk, KVCache, RecordOptions, bucket, forward,
                                  fresh_start, layers, mtp_forward, recording, sharded_terms,
                                  valid_rows)
from glmjax.model.layers import F32, rms_norm
from glmjax.model.moe import pool_terms, resolve_kernel
from glmjax.model.quant import ExpertPool, ExpertWeights
from glmjax.model.weights import MoE, Weights
from glmjax.offload.expert_io import COUPLE, DEMAND, FILL, PILOT, ExpertReader, drop_page_cache
from glmjax.offload.tiers import (DevicePool, Heat, HostCache, HostSlabs, as_device_pool,
                                  atomic_write, cpu_device, empty_pool, gather_slot,
                                  lfru_admissions)
from glmjax.sharding import axis_size, put, replicated
from pallas_kernels import cpu

USAGE_FILE = "usage.json"
COUPLE_FILE = "couple.npy"
PLACEMENTS = ("auto", "device", "host")
# A step of more tokens than this runs fused only when the tiers hold every expert.
FUSED_GUESS_TOKENS = 16


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


# Pinned experts on a mesh: each device computes the pairs whose slot lies in its own block of
# the assembled pool, one psum over `expert` (a term plus exact zeros: unchanged).
sharded_pool_terms = jax.jit(sharded_terms, static_argnames=("mesh", "kernel"))


def _tier_terms(flat, valid, ids, pool, table):
  """Terms of the experts `table` `[E]` (slot, or -1) places in `pool`: (terms, found `[T, K]`)."""
  slots = table[ids]  # [T, K]
  found = slots >= 0
  return pool_terms(flat, pool, jnp.maximum(slots, 0), valid & found, "cpu"), found


@functools.partial(jax.jit, static_argnames=("cfg", "absorbed", "impl"),
                   donate_argnames=("cache",))
def fused_forward(dense: Weights, tokens, cache, n_valid, tiers: dict, start, cfg: Config,
                  absorbed: bool, impl: str = "sparse"):
  """The one forward pass in one jit over the CPU-resident tiers, for a step whose experts are
  (probably) all cached: each MoE layer gathers its experts from the pin pool and the host slab
  through slot tables (`tiers`: "pins" {layer: pool}, "pin" `[L, E]`, "slab" pool or None,
  "host" `[L, E]`), with no host round trip.

  Returns (logits, hidden, cache, record): `record` is one int32 vector, the concatenation of
  missing `[M]` (per MoE layer, the real (token, rank) pairs whose expert no tier held) and
  ids `[M, T, K]`.
  A step with anything missing is void; the caller re-runs it through the tiers (the cache
  writes of this step sit past `length` and are rewritten).
  """
  ids_seen, missing = [], []

  def provide(layer, m, chunks):
    (r,) = chunks
    flat, ids = r.flat, r.ids
    valid = valid_rows(r.x.shape, r.n_valid, jnp)[:, None]  # [T, 1]
    terms, found = jnp.zeros((*ids.shape, flat.shape[-1]), F32), jnp.zeros(ids.shape, bool)
    if tiers["slab"] is not None:
      terms, found = _tier_terms(flat, valid, ids, tiers["slab"], tiers["host"][layer])
    if layer in tiers["pins"]:
      pinned, on_pin = _tier_terms(flat, valid, ids, tiers["pins"][layer], tiers["pin"][layer])
      terms, found = jnp.where(on_pin[..., None], pinned, terms), found | on_pin
    ids_seen.append(ids)
    missing.append(jnp.sum(valid & ~found))
    yield terms

  logits, x, cache = forward(dense, tokens, cfg, cache, absorbed, experts=provide,
                             n_valid=n_valid, start=start, impl=impl)  # start: run-time, as the layer steps'
  # One int32 vector, so the host fetches the whole record in one transfer.
  record = jnp.concatenate([jnp.stack(missing).astype(jnp.int32),
                            jnp.stack(ids_seen).astype(jnp.int32).reshape(-1)])
  return logits, x, cache, record


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

  def slot_grid(self, experts, slot_of) -> tuple[np.ndarray, np.ndarray]:
    """(active `[T, K]`, slots `[T, K]`): the pairs of `experts`, each at `slot_of(e)`."""
    active = np.zeros(self.ids.shape, bool)
    slots = np.zeros(self.ids.shape, np.int32)
    for e in experts:
      t, k = self.pairs[e]
      active[t, k] = True
      slots[t, k] = slot_of(e)
    return active, slots


class MeshPins:
  """One MoE layer's pin tier on a mesh: a DevicePool per device of the `expert` axis, each
  holding only experts that device owns (expert e belongs to block e // (E/n), the plan's
  contiguous split). The pools share one `[E]` table row (an expert's slot in its owner's pool).
  The pinned terms run on the mesh over the pools assembled, without a copy, into one pool
  `[n·S, ...]` split along `expert` (device d holds global slots d·S .. d·S+S-1)."""

  def __init__(self, layer: int, slots: int, layout, mesh, n_experts: int, table: np.ndarray):
    self.layer, self.slots, self.mesh = layer, slots, mesh
    n = axis_size(mesh, "expert")
    self.block = n_experts // n
    ax = mesh.axis_names.index("expert")
    self.shards = []
    for d in range(n):  # the devices at expert index d hold pool d (replicated over other axes)
      sub = Mesh(np.take(mesh.devices, [d], axis=ax), mesh.axis_names)
      pool = jax.device_put(empty_pool(layout, slots), NamedSharding(sub, P()))
      self.shards.append(DevicePool(layer, slots, pool, table))

  def owner(self, e: int) -> int:
    return e // self.block

  def shard(self, e: int) -> DevicePool:
    return self.shards[self.owner(e)]

  def __contains__(self, e: int) -> bool:
    return e in self.shard(e)

  def global_slot(self, e: int) -> int:
    return self.owner(e) * self.slots + self.shard(e).slot_of[e]

  @property
  def expert_in(self) -> list:
    return [e for d in self.shards for e in d.expert_in]

  def pool(self) -> ExpertPool:
    """The shards' pools as one pool `[n·S, ...]` split along `expert` (no copy; rebuilt per
    step, since an install donates a shard's buffers)."""
    sharding = NamedSharding(self.mesh, P("expert"))

    def whole(*leaves):
      arrays = [s.data for leaf in leaves for s in leaf.addressable_shards]
      return jax.make_array_from_single_device_arrays(
          (len(leaves) * leaves[0].shape[0], *leaves[0].shape[1:]), sharding, arrays)
    return jax.tree_util.tree_map(whole, *[d.pool for d in self.shards])


class OffloadEngine:
  """Runs the model layer by layer over dense weights and a store's routed experts."""

  def __init__(self, cfg: Config, dense: Weights, store: ExpertStore, budgets: Budgets,
               io_workers: int = 4, io_timeout_s: float = 60.0, cold: bool = False,
               progress: bool = True, kernel: str = "auto", prefetch: bool = True,
               pilot_k: int = 6, couple_k: int = 4, cache_route: tuple[int, int] | None = None,
               expert_compute: str = "device", expert_budget: int | None = None, mesh=None,
               attention: str = "sparse"):
    if expert_compute not in PLACEMENTS:
      raise ValueError(f"expert_compute must be one of {PLACEMENTS}, got {expert_compute!r}")
    self.cfg, self.dense, self.store = cfg, dense, store
    self.progress = progress  # bars while loading, and over a layer-major prefill
    self.impl = attention  # the attention's: "sparse" (DSA) or the "dense" reference
    self.budgets = budgets
    self.expert_budget = expert_budget  # verify passes' expert cap (opt-in, lossy) or None
    self.kernel = resolve_kernel(kernel)  # the device kernel (pinned and uploaded experts)
    self.on_cpu = jax.default_backend() == "cpu"
    self.expert_compute = expert_compute
    self.cache_route = cache_route
    self.pilot_k, self.couple_k = pilot_k, couple_k
    self.moe_layers = [i for i, l in enumerate(dense.layers) if isinstance(l.mlp, MoE)]
    self.layout = store.layout(self.moe_layers[0])
    self.chunk_bytes = self.layout.nbytes
    e = cfg.n_routed_experts
    # On a mesh each device of the expert axis has the budget, for its own experts only: with
    # every expert fitting they are all resident (`_sharded_layer`), otherwise each device pins
    # up to `dev_slots` of the E/n experts it owns (`MeshPins`) and the rest run on the host.
    self.mesh, n_dev = mesh, axis_size(mesh, "expert")
    per_dev = budgets.device_bytes // max(1, self.chunk_bytes * len(self.moe_layers))
    self.dev_slots = int(min(e // n_dev, per_dev))
    self.slots = int(min(e, n_dev * per_dev))
    self.all_resident = self.slots == e
    if mesh is not None and not self.all_resident and jax.process_count() > 1:
      raise InputError(
          f"{store.path}: the tiered (partly resident) engine on a mesh runs in one process for "
          f"now; the device budget allows {self.slots} of {e} experts per layer. Raise "
          "device_cache_gb so that every expert is resident, or run in one process")
    self.host = HostCache(0 if self.all_resident else budgets.host_bytes)  # the LRU rule
    n_layers = cfg.num_hidden_layers + len(dense.mtp)
    self.slabs = HostSlabs(store.layout, self._max_host_slots, n_layers, e)  # slot-addressed
    self.pin_tables = np.full((n_layers, e), -1, np.int32)  # rows: each DevicePool's table
    # The read function closes over the store only, never the engine (see ExpertReader).
    read = lambda layer, expert, store=store: store.read_chunk(layer, expert)
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
    self._layer_index = {id(l): i for i, l in enumerate(dense.layers)}  # for `_dense_pilot`
    self.couple_path = os.path.join(store.path, COUPLE_FILE)
    self.couple = _load_couple(self.couple_path, cfg.num_hidden_layers + len(dense.mtp),
                               cfg.n_routed_experts)
    self._prev_union: tuple[int, list] | None = None
    self._predicting = self.prefetch  # this forward predicts next-layer experts
    # Stage timing (a dict of seconds by stage, or None): every step then waits for its
    # results, so it measures where time goes at the cost of the overlap it removes.
    self.stage_s: dict | None = None
    # The fused step (one jit per forward over the CPU-resident tiers) needs every expert in
    # CPU memory addressable by slot, and exact routing. It is tried when the tiers hold every
    # expert, or, for a step of at most FUSED_GUESS_TOKENS tokens, after a step that missed
    # nothing: a cold cache does not pay for void attempts, and neither does a long prefill,
    # whose union is most of a layer's experts (a void 1024-token attempt cost 0.3 s).
    # On a mesh the fused step is off (its pin pools are one-device): steps run layer by layer.
    self.fused = (self.on_cpu and cache_route is None and not self.all_resident and mesh is None
                  and len({store.layout(l) for l in self.moe_layers}) == 1)
    self._fused_ready = False
    self._dry = False  # a precompile step: no fill, no fused attempt, no heat decay
    self._fused_compiled: dict = {}
    self._zero = fresh_start()  # a cache-less fused step's start (see forward)
    # A fused step run while every expert is held cannot miss: it returns without waiting for
    # its record, which is settled (its bookkeeping applied) at the engine's next call.
    self._unsettled = None  # (record, tokens, valid) of such a step
    # A host cache that can hold every routed expert of the main layers is filled in the
    # background (FILL priority, hottest first), so that steps end up fused and never miss.
    unpinned = len(self.moe_layers) * (e - self.slots)
    self._fill = (self.prefetch and self.fused and unpinned > 0
                  and self.host.budget >= unpinned * self.chunk_bytes)
    self._fill_order, self._fill_next = None, 0
    self._tables = None  # (host copy, device copy) of the pin and host slot tables

  def _max_host_slots(self, layout) -> int:
    """Slots a host slab of `layout` may grow to: the budget's worth, or every such expert."""
    experts = sum(1 for l in self.store.where if self.store.layout(l) == layout)
    return min(experts * self.cfg.n_routed_experts, self.host.budget // layout.nbytes)

  # -- setup --------------------------------------------------------------------------------
  def _fill_device_tier(self, progress: bool):
    if self.slots == 0:
      return
    if self.all_resident:
      mtp = [self.cfg.num_hidden_layers] if self.dense.mtp else []
      for layer in tqdm(self.moe_layers + mtp, desc="loading experts", disable=not progress,
                        leave=False):
        pool = DevicePool(layer, self.slots, self._sharded_layer(layer) if self.mesh else
                          jax.tree_util.tree_map(jnp.asarray, self.store.read_layer(layer)))
        pool.slot_of = {x: x for x in range(self.slots)}
        pool.expert_in = list(range(self.slots))
        self.device[layer] = pool
      return
    # Pin the hottest experts of past runs (the persisted usage histogram), read in parallel
    # through the I/O threads and installed as they land.
    futures = {}
    if self.mesh is not None:
      self._fill_mesh_pins(futures)
    for layer in self.moe_layers if self.mesh is None else ():
      # The table is a row view of pin_tables: installs keep the fused step's table current.
      self.device[layer] = DevicePool(layer, self.slots, empty_pool(self.layout, self.slots),
                                      self.pin_tables[layer])
      # Slots by heat rank, not by read completion: where an expert sits decides LFRU ties.
      for slot, e in enumerate(self.heat.hottest(layer, self.slots, self.cfg.n_routed_experts)):
        futures[self.reader.submit(layer, e)] = (layer, e, slot)
    with tqdm(total=len(futures), desc="pinning experts", disable=not progress or not futures,
              leave=False) as bar:
      for (layer, e, slot), blob in self.reader.as_completed(futures):
        pins = self.device[layer]
        (pins.shard(e) if self.mesh is not None else pins).install(e, self.layout.unpack(blob),
                                                                   slot)
        bar.update()

  def _fill_mesh_pins(self, futures: dict) -> None:
    """On a mesh: each device's pool gets the hottest experts it owns, slots by heat rank."""
    e, n = self.cfg.n_routed_experts, axis_size(self.mesh, "expert")
    for layer in self.moe_layers:
      pins = MeshPins(layer, self.dev_slots, self.layout, self.mesh, e, self.pin_tables[layer])
      self.device[layer] = pins
      ranked = self.heat.hottest(layer, e, e)
      for d in range(n):
        own = [x for x in ranked if pins.owner(x) == d][:self.dev_slots]
        for slot, x in enumerate(own):
          futures[self.reader.submit(layer, x)] = (layer, x, slot)

  def _sharded_layer(self, layer: int) -> ExpertPool:
    """Every expert of `layer` as a pool in slot = expert id order, split along the mesh's
    `expert` axis: each process reads only the chunks of its own devices' experts."""
    layout, store = self.store.layout(layer), self.store
    proto = layout.unpack(np.zeros((1, layout.nbytes), np.uint8))
    proto_leaves, treedef = jax.tree_util.tree_flatten(ExpertPool(proto.gate_up, proto.down))
    read: dict = {}  # (first, end) expert → the unpacked leaves of those experts

    def leaves(lo, hi):
      if (lo, hi) not in read:
        blobs = np.stack([store.read_chunk(layer, e) for e in range(lo, hi)])
        w = layout.unpack(blobs)
        read[(lo, hi)] = jax.tree_util.tree_leaves(ExpertPool(w.gate_up, w.down))
      return read[(lo, hi)]

    def make(i, leaf):
      spec = P("expert", *[None] * (leaf.ndim - 1))
      rows = range(self.cfg.n_routed_experts)

      def shard(index):
        r = rows[index[0]]
        return leaves(r.start, r.stop)[i][(slice(None), *index[1:])]
      return jax.make_array_from_callback((len(rows), *leaf.shape[1:]),
                                          NamedSharding(self.mesh, spec), shard)

    return jax.tree_util.tree_unflatten(treedef, [make(i, l) for i, l in enumerate(proto_leaves)])

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
    self.settle()
    self.heat.save(self.usage_path)
    if self.prefetch:
      atomic_write(self.couple_path, lambda f: np.save(f, self.couple))

  def close(self) -> None:
    """Saves, then stops and joins the I/O threads. Idempotent; the engine is unusable after."""
    if self.closed:
      return
    self.save()  # settles first
    self._finalizer()  # runs reader.close() once
    self.device.clear()
    self.host = HostCache(0)
    self.slabs = HostSlabs(self.store.layout, lambda layout: 0, 0, 0)
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
    self.settle()
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

  def _land(self) -> None:
    """Moves finished prefetches into free room: the host cache's unused bytes, or a free
    slot of their layer's pin pool. A prefetch never evicts a cached expert: one that finds
    no room is held (in `inflight`) for its layer's next step, whose miss takes the read, and
    is dropped if that step does not use it (`_expire`). Landing by eviction let wrong guesses
    push out what the next tokens needed (at a 12.5% host cache: 900 against 713 kB read per
    token, BUILD_NOTES §12)."""
    for key, (fut, kind) in list(self.inflight.items()):
      if kind == DEMAND or not fut.done() or not self._room_for(key):
        continue
      del self.inflight[key]
      if fut.cancelled() or fut.exception() is not None:
        self.stats["prefetch_failed"] += 1  # a hint failing is not an error; demand retries
        continue
      blob = fut.result()
      self.stats["expert_bytes_read"] += blob.nbytes
      self._put_host(key, blob)  # into free room: evicts nothing
      dev = self.device.get(key[0])
      if isinstance(dev, MeshPins):
        dev = dev.shard(key[1])  # only its owner's pool may take it
      slot = dev.free_slot() if dev is not None else None
      if slot is not None:
        dev.install(key[1], self.store.layout(key[0]).unpack(blob), slot)
      if key in self.host or (dev is not None and key[1] in dev):
        self.landed_unused.add(key)
      else:
        self.stats["prefetch_wasted"] += 1
    self.slabs.flush()

  def _room_for(self, key) -> bool:
    """Whether `key` can land without evicting anything: free host-cache bytes for it, or a
    free slot in its layer's pin pool."""
    if self.host.used + self.store.layout(key[0]).nbytes <= self.host.budget:
      return True
    dev = self.device.get(key[0])
    if isinstance(dev, MeshPins):
      dev = dev.shard(key[1])
    return dev is not None and dev.free_slot() is not None

  def _expire(self, layer: int) -> None:
    """Drops the finished prefetches of `layer` still held for want of room: its step has
    come and did not use them."""
    for key, (fut, kind) in list(self.inflight.items()):
      if key[0] == layer and kind != DEMAND and fut.done():
        del self.inflight[key]
        if fut.cancelled() or fut.exception() is not None:
          self.stats["prefetch_failed"] += 1
        else:
          self.stats["prefetch_wasted"] += 1
          self.stats["expert_bytes_read"] += fut.result().nbytes  # read, and for nothing

  def _put_host(self, key, blob, protect=()) -> None:
    for victim in self.host.put(key, blob.nbytes, protect):
      self.slabs.release(victim)
      if victim in self.landed_unused:
        self.landed_unused.discard(victim)
        self.stats["prefetch_wasted"] += 1
    if key in self.host and key not in self.slabs.where:
      self.slabs.store(key, blob)  # written by the next flush, before the slab is read

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
  def _resident_terms(self, layer, m, chunks):
    """All experts pinned: one jitted kernel call per chunk, no host round trip."""
    for r in chunks:
      valid = valid_rows(r.x.shape, r.n_valid)
      yield pool_terms_step(r.flat, self.device[layer].pool, r.ids, valid[:, None],
                            kernel=self.kernel)

  def _tiered(self, layer, m, chunks):
    """Unweighted expert terms `[T, K, D]` of one MoE layer through the tiers, chunk by chunk:
    one union over every chunk (a layer-major prefill reads each expert once per layer), one
    lookup and one bookkeeping pass per layer."""
    nxt = self._next_moe(layer)
    steps, valids, pilots, stats = [], [], [], []
    for r in chunks:
      valid = valid_rows(r.x.shape, r.n_valid)  # [T] bool: real tokens
      pilot = None
      if self._predicting and self.pilot_k and nxt is not None:
        k = min(self.pilot_k, self.cfg.n_routed_experts)
        pilot = pilot_step(self.dense.layers[nxt], r.x, cfg=self.cfg, k=k)
      steps.append(_Step.of(layer, r.flat, r.ids, valid))  # the host round trip
      valids.append(valid)
      pilots.append(None if pilot is None else np.asarray(pilot)[valid])
      stats.append(None if r.route_stats is None else np.asarray(r.route_stats))
    union = sorted(set().union(*(s.pairs for s in steps)))
    t0 = time.perf_counter()
    pinned, cached, futures = self._account(
        layer, union, np.concatenate(valids),
        None if stats[0] is None else np.concatenate(stats),
        None if pilots[0] is None else np.concatenate(pilots))
    self._stage("bookkeeping", t0)
    yield from self._compute(layer, steps, union, pinned, cached, futures)

  def _stage(self, name: str, t0: float, wait=None) -> float:
    """With stage timing on (`stage_s` a dict), adds the time since `t0` to stage `name`
    (after waiting for `wait`'s results). Returns now."""
    if self.stage_s is None:
      return t0
    if wait is not None:
      jax.block_until_ready(wait)
    now = time.perf_counter()
    self.stage_s[name] = self.stage_s.get(name, 0.0) + now - t0
    return now

  def _account(self, layer: int, union: list[int], valid, route_stats, pilot):
    """A layer step's tier lookups and counters, in union order: (pinned, host-cached, miss
    futures). Every miss is submitted to the I/O threads here, at once."""
    if route_stats is not None:  # [T, 3] per token; padding rows do not count
      swaps, overlap, kl = (float(v) for v in np.asarray(route_stats)[valid].sum(axis=0))
      self.stats["route_swaps"] += swaps
      self.stats["route_overlap_sum"] += overlap
      self.stats["route_kl_sum"] += kl
      self.stats["route_tokens"] += int(valid.sum())
    self.heat.use(layer, union)
    self.stats["experts_used"] += len(union)
    keys = {(layer, e) for e in union}
    if self.prefetch and not self._dry:  # a precompile step leaves the tiers alone
      self._land()
      for key in keys & self.landed_unused:
        self.landed_unused.discard(key)
        self.stats["prefetch_useful"] += 1
    pred = self.pilot_pred.pop(layer, None)
    if pred is not None:
      self.stats["pilot_hits"] += len(pred & set(union))
      self.stats["pilot_predicted"] += len(pred)
      self.stats["pilot_actual"] += len(union)
    dev = self.device.get(layer)
    pinned, cached, futures = [], [], {}
    for e in union:
      if dev is not None and e in dev:
        pinned.append(e)
      elif self.host.touch((layer, e)):
        cached.append(e)
      elif (layer, e) in self.inflight:  # a prefetch not landed: take its read, no re-read
        fut = self.inflight.pop((layer, e))[0]
        if not fut.done():  # still loading: wait for it
          self.reader.promote(fut)  # a hint still queued is now a demand
          self.stats["prefetch_late"] += 1
        elif fut.cancelled() or fut.exception() is not None:
          self.stats["prefetch_failed"] += 1  # a hint failing is not an error: read it again
          fut = self.reader.submit(layer, e)
        else:  # read in time, held for this step because it found no room (_land)
          self.stats["prefetch_useful"] += 1
        futures[fut] = (layer, e)
      else:
        futures[self.reader.submit(layer, e)] = (layer, e)  # every miss dispatched up front
    if self.inflight and not self._dry:  # a precompile step drops no held prefetch
      self._expire(layer)
    if self._predicting:
      self._predict(layer, union, self._next_moe(layer), pilot)
      if self._prev_union is not None and self._prev_union[0] < layer:
        self.couple[self._prev_union[0]][np.ix_(self._prev_union[1], union)] += 1.0
      self._prev_union = (layer, union)
    self.stats["expert_pin_hits"] += len(pinned)
    self.stats["expert_host_hits"] += len(cached)
    self.stats["expert_misses"] += len(futures)
    self.stats[f"misses_layer_{layer}"] += len(futures)
    return pinned, cached, futures

  def _compute(self, layer: int, steps: list[_Step], union, pinned, cached, futures):
    """Grouped compute of one layer's chunks (`steps`), yielding each chunk's terms; the tiers
    are updated after the last, in union order.

    Pinned experts run as one kernel call per chunk over the pin pool, host-cached ones as one
    call over the host slab (or uploaded, under device placement on an accelerator), and each
    miss on its own: in the first chunk as its read lands, so computing one miss overlaps
    reading the next; later chunks find every read landed."""
    t_compute, wait0 = time.perf_counter(), self.reader.wait_s
    dev = self.device.get(layer)
    layout = self.store.layout(layer)
    # On a mesh whatever is not pinned runs on the host (the CPU kernel), never uploaded.
    on_device = self.mesh is None and self._place(len(cached) + len(futures))
    # A CPU-only machine has no bus to cross: "device" placement computes where the bytes are,
    # with the same kernel (it is still counted as device placement).
    upload = on_device and not self.on_cpu
    self.stats["experts_on_device"] += len(pinned)
    slab = self.slabs.slab(layer) if cached else None
    slots = {e: self.slabs.where[(layer, e)][1] for e in cached}
    arrived, weights = {}, {}  # the misses' bytes and unpacked views, until bookkeeping
    uploaded = None  # (pool, slot_of) of the uploaded experts, built once for every chunk
    for j, step in enumerate(steps):
      mine = lambda experts: [e for e in experts if e in step.pairs]
      parts = []  # (active [T, K], terms), merged over the misses' terms
      on_mesh = None  # the pinned (active, terms) on a mesh, merged last
      miss_terms = np.zeros((*step.ids.shape, step.x.shape[1]), np.float32)  # [T, K, D]
      if mine(pinned) and self.mesh is not None:  # each owner over its own pool (shard_map)
        on_mesh = self._mesh_terms(step, dev, mine(pinned))
      elif mine(pinned):  # the device kernel over the pin pool (CPU-only: the CPU kernel)
        parts.append(self._pool_terms(step, dev.pool, dev.slot_of, mine(pinned),
                                      "cpu" if self.on_cpu else self.kernel))
      if mine(cached) and not upload:  # the CPU kernel over the host slab, one call
        t0 = time.perf_counter()
        parts.append(self._pool_terms(step, slab.pool, slots, mine(cached), "cpu"))
        if self.expert_compute == "auto" and not self.on_cpu:  # rates only matter for auto
          parts[-1][1].block_until_ready()
          self._rate("host", len(mine(cached)) * layout.nbytes, time.perf_counter() - t0)
      if j == 0:  # the reads land while the first chunk computes
        for (_, e), blob in self.reader.as_completed(futures):  # in completion order
          arrived[e], weights[e] = blob, layout.unpack(blob)
          self.stats["expert_bytes_read"] += blob.nbytes
          if not upload and e in step.pairs:
            t0 = time.perf_counter()
            self._host_expert(step, e, weights[e], miss_terms)
            self._rate("host", blob.nbytes, time.perf_counter() - t0)
        if upload:
          uploaded = self._upload(layer, {**{e: gather_slot(slab.pool, slots[e])
                                             for e in cached}, **weights})
        self.stats["experts_on_device" if on_device else "experts_on_host"] += (
            len(cached) + len(arrived))
      elif not upload:
        for e in mine(weights):
          self._host_expert(step, e, weights[e], miss_terms)
      if uploaded is not None and mine(uploaded[1]):
        parts.append(self._pool_terms(step, *uploaded, mine(uploaded[1]), self.kernel))
      out = jnp.asarray(miss_terms)
      for active, terms in parts:
        out = merge_terms(jnp.asarray(active), terms, out)
      if self.mesh is not None:  # the host's terms replicated onto the mesh, then the pinned
        out = jax.device_put(out, replicated(self.mesh))
        if on_mesh is not None:
          out = merge_terms(put(on_mesh[0], replicated(self.mesh)), on_mesh[1], out)
      if self.stage_s is not None and j == len(steps) - 1:  # less what it waited for reads
        self._stage("expert_compute", t_compute + (self.reader.wait_s - wait0), out)
        self.stage_s["io_wait"] = self.stage_s.get("io_wait", 0.0) + self.reader.wait_s - wait0
      yield out
    t0 = time.perf_counter()
    # Tier bookkeeping in union order, whatever order the reads completed in.
    protect = {(layer, e) for e in union}
    for e in union:
      if e in arrived:
        self._put_host((layer, e), arrived[e], protect)
    self.slabs.flush()
    sources = {}  # in union order: admission must not follow read completion order
    for e in union:
      if e in arrived:
        sources[e] = weights[e]
      elif e in slots:
        sources[e] = (slab.pool, slots[e])
    self._admit(layer, union, sources)
    self._stage("bookkeeping", t0)

  def _host_expert(self, step: _Step, e: int, w: ExpertWeights, out: np.ndarray) -> None:
    """Expert `e` applied by the CPU kernel to every real token that chose it."""
    t, k = step.pairs[e]
    gu, dn = w.gate_up, w.down
    out[t, k] = cpu.expert_ffn(step.x[t], gu.packed, gu.scales, dn.packed, dn.scales, gu.bits,
                               gu.group_size, dn.out_features, dn.in_features)

  def _pool_terms(self, step: _Step, pool: ExpertPool, slot_of: dict, experts, kernel: str):
    """(active `[T, K]`, terms) of `experts`, held in `pool` at `slot_of`, run by `kernel`."""
    active, slots = step.slot_grid(experts, slot_of.__getitem__)
    x = step.x
    if kernel == "cpu" and not self.on_cpu:
      x = jax.device_put(x, cpu_device())
    terms = pool_terms_step(x, pool, slots, active, kernel=kernel)
    return active, terms

  def _mesh_terms(self, step: _Step, pins: MeshPins, experts):
    """(active `[T, K]`, terms) of pinned `experts` on a mesh: each computed by its owner."""
    active, slots = step.slot_grid(experts, pins.global_slot)
    rep = replicated(self.mesh)
    terms = sharded_pool_terms(put(step.x, rep), put(slots, rep), put(active, rep), pins.pool(),
                               mesh=self.mesh, kernel="cpu" if self.on_cpu else self.kernel)
    return active, terms

  def _upload(self, layer: int, weights: dict[int, ExpertWeights]):
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
    self._rate("h2d", nbytes, time.perf_counter() - t0)
    return pool, {e: s for s, e in enumerate(experts)}

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

  def _admit(self, layer: int, union, sources: dict):
    """Moves just-used experts into the device tier: free slots first, then LFRU swaps.
    `sources[e]` is the expert's weights, or (host slab pool, slot)."""
    dev = self.device.get(layer)
    if dev is None:
      return
    if isinstance(dev, MeshPins):  # each device's pool admits only experts it owns
      for d, shard in enumerate(dev.shards):
        self._admit_into(shard, union, {e: s for e, s in sources.items() if dev.owner(e) == d})
      return
    self._admit_into(dev, union, sources)

  def _admit_into(self, dev: DevicePool, union, sources: dict):
    for e, slot, repinned in lfru_admissions(dev, self.heat, union, sources):
      self.stats["repins"] += repinned
      if isinstance(sources[e], ExpertWeights):
        dev.install(e, sources[e], slot)
      else:
        dev.install_from(e, *sources[e], slot)

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
              n_valid: int | None = None, record: list | None = None,
              record_opts: RecordOptions = RecordOptions(), expert_cap: int | None = None):
    """Logits `[B, S, V]`, final hidden `[B, S, D]` and the new cache for `tokens` `[B, S]`
    (the first `n_valid` positions real, the rest padding that never routes). With `record`
    (a list), each MoE layer's routing record (`route_record`) is appended to it. With
    `expert_cap`, each MoE layer routes the step within that many experts (lossy, opt-in)."""
    self.settle()
    self._prev_union = None
    if not (isinstance(tokens, jax.Array) and tokens.dtype == jnp.int32):
      tokens = jnp.asarray(tokens, jnp.int32)
    out = None
    all_cached = self._all_cached()
    # With every expert held there is nothing to fetch: prediction (pilot, co-activation
    # learning and their statistics) pauses rather than cost time per layer.
    self._predicting = self.prefetch and not all_cached
    if self._fill and not all_cached and not self._dry:
      self._fill_host()
    guess = self._fused_ready and tokens.size <= FUSED_GUESS_TOKENS
    if self.fused and record is None and self.stage_s is None and expert_cap is None and (
        guess or all_cached) and not self._dry:
      out, cache = self._fused(tokens, cache, absorbed, n_valid, sure=all_cached)
    if out is None:
      misses = self.stats["expert_misses"]
      aware = self.cache_route is not None and not self.all_resident
      experts = self._provider()
      if record is not None:
        experts = recording(experts, self.dense, self.cfg, record, record_opts, jitted=True)
      out = forward(self.dense, tokens, self.cfg, cache, absorbed, experts=experts,
                    steps=self._steps(n_valid), n_valid=n_valid,
                    route_args=self._route_args if aware else None, expert_cap=expert_cap,
                    impl=self.impl)
      if not self._dry:
        self._fused_ready = self.stats["expert_misses"] == misses
    if not self.all_resident and self._unsettled is None and not self._dry:
      self.heat.decay()  # else settle() decays, after the uses
    return out

  def prefill(self, chunks: list, cache: KVCache, n_valid: int, record: list | None = None,
              record_opts: RecordOptions = RecordOptions()):
    """A prompt's chunks (token arrays `[B, S_j]`, only the last padded: its first `n_valid`
    positions real) written at the cache's length, layer-major: every chunk through layer L,
    then layer L + 1, the hidden states `[S, D]` held between layers. Each MoE layer's experts
    are looked up, read and settled once for the whole prompt, and each chunk's terms are
    combined before the next chunk's are computed. Returns (final hidden states per chunk
    `[B, S_j, D]`, the cache with the prompt written; its length is the caller's)."""
    if len(chunks) == 1:
      _, x, cache = self.forward(chunks[0], cache, n_valid=n_valid, record=record,
                                 record_opts=record_opts)
      return [x], cache
    self.settle()
    self._prev_union = None
    all_cached = self._all_cached()
    self._predicting = self.prefetch and not all_cached
    if self._fill and not all_cached:
      self._fill_host()
    misses = self.stats["expert_misses"]
    experts = self._provider()
    if record is not None:
      experts = recording(experts, self.dense, self.cfg, record, record_opts, jitted=True)
    start, offsets = int(cache.length), np.cumsum([0] + [c.shape[1] for c in chunks[:-1]])
    end = start + int(offsets[-1]) + n_valid  # past the last real position
    pieces = [Chunk(JITTED.embed(self.dense, t), start + int(o),
                    n_valid if j == len(chunks) - 1 else None)
              for j, (t, o) in enumerate(zip(chunks, offsets))]
    aware = self.cache_route is not None and not self.all_resident
    steps = self._steps(end=end)
    with tqdm(total=len(self.dense.layers) * len(pieces), desc="prefill", unit="chunk",
              leave=False, disable=not self.progress) as bar:
      def counted(*args, **kw):  # the bar moves by (layer, chunk)
        bar.update()
        return step(*args, **kw)
      step = steps.attn_route
      new = layers(self.dense, pieces, self.cfg, cache, False, experts,
                   dataclasses.replace(steps, attn_route=counted),
                   self._route_args if aware else None, None, self.impl)
    self._fused_ready = self.stats["expert_misses"] == misses
    if not self.all_resident:
      self.heat.decay()
    return [p.x for p in pieces], KVCache(new, cache.pages, cache.length)

  def precompile(self, tokens, cache: KVCache, absorbed: bool = True) -> KVCache:
    """Compiles the steps of a `tokens` `[B, S]` shape ahead of its first real step (a
    server's batch would otherwise stall on them): runs one step whose rows are all padding
    through the layer steps (padding routes nothing, so nothing is read), and compiles the
    fused step for it without running it. Counters, heat and the fused-step state are left
    as they were. Returns the new cache (`cache` is donated); its rows hold nothing valid."""
    self.settle()
    saved = (collections.Counter(self.stats), self._fused_ready, self._prev_union)
    n_valid = np.zeros(tokens.shape[0], np.int32)
    self._dry = True
    try:
      _, _, cache = self.forward(tokens, cache, absorbed, n_valid=n_valid)
      if self.fused:
        compiled, args = self._fused_executable(jnp.asarray(tokens, jnp.int32), cache, absorbed,
                                                n_valid)
        cache = compiled(*args)[2]
        # after a void fused attempt the layer steps take the fused step's cache
        _, _, cache = self.forward(tokens, cache, absorbed, n_valid=n_valid)
    finally:
      self._dry = False
      self.stats, self._fused_ready, self._prev_union = saved
    return cache

  def _steps(self, n_valid=None, end: int | None = None):
    """The jitted pieces, each timed into `stage_s` (waiting for its results) when on; while
    predicting, a dense layer followed by a MoE layer also hints the pilot's prediction of that
    layer's experts (`_dense_pilot`; its real rows: `n_valid`, or with `end` those before
    position `end`, for the chunks of a prefill)."""
    steps = JITTED
    if self.stage_s is not None:
      def timed(name, fn):
        def call(*args, **kw):
          t0 = time.perf_counter()
          out = jax.block_until_ready(fn(*args, **kw))
          self._stage(name, t0)
          return out
        return call
      steps = dataclasses.replace(
          JITTED, embed=timed("embed", JITTED.embed),
          attn_route=timed("attention_route", JITTED.attn_route),
          finish=timed("combine", JITTED.finish), logits=timed("lm_head", JITTED.logits))
    if self._predicting and self.pilot_k:
      steps = dataclasses.replace(steps, attn_route=self._dense_pilot(steps.attn_route, n_valid,
                                                                      end))
    return steps

  def _dense_pilot(self, attn_route, n_valid, end=None):
    """`attn_route`, which after a dense layer whose successor is a MoE layer hints the pilot's
    prediction of that layer's experts from the dense layer's output, so their reads overlap
    the MoE layer's attention instead of waiting for its routing (the MoE → MoE pilot runs in
    `_tiered`). Padding rows predict nothing."""
    def call(lw, x, start, **kw):
      out = attn_route(lw, x, start, **kw)
      i = self._layer_index.get(id(lw))
      nxt = None if out[2] is not None or i is None else self._next_moe(i)
      if nxt is not None:
        k = min(self.pilot_k, self.cfg.n_routed_experts)
        pilot = np.asarray(pilot_step(self.dense.layers[nxt], out[0], cfg=self.cfg, k=k))
        nv = n_valid if end is None else min(max(end - int(start), 0), out[0].shape[1])
        pred = {int(e) for e in np.unique(pilot[valid_rows(out[0].shape, nv)])}
        self.pilot_pred[nxt] = pred
        self.hint(nxt, sorted(pred), PILOT)
      return out
    return call

  def _fill_keys(self) -> list:
    """Main-layer (layer, expert) keys in fill order: each layer's experts hottest first by
    the usage history, layers interleaved (a fixed order, whatever the reads' timing)."""
    e = self.cfg.n_routed_experts
    ranked = [list(dict.fromkeys(self.heat.hottest(l, e, e) + list(range(e))))
              for l in self.moe_layers]
    return [(l, r[i]) for i in range(e) for l, r in zip(self.moe_layers, ranked)]

  def _fill_host(self) -> None:
    """Queues FILL reads of main-layer experts no tier holds, as far as the reader has room
    for hints; they land like any prefetch. One pass over `_fill_keys` (fixed at the first
    call): an expert evicted later is not read again."""
    if self._fill_order is None:
      self._fill_order = self._fill_keys()
    room = self.reader.hint_room
    while room and self._fill_next < len(self._fill_order):
      key = self._fill_order[self._fill_next]
      self._fill_next += 1
      if not self._resident(*key):
        self.hint(key[0], [key[1]], FILL)
        room -= 1
    if self._fill_next == len(self._fill_order):
      self._fill = False

  def warm_host(self) -> None:
    """Reads, now, every main-layer expert that no tier holds into the host cache, as far as
    its budget allows, in `_fill_keys` order (the reads run in parallel on the I/O threads;
    inserts follow the fixed order, so the cache's contents do not depend on their timing)."""
    self.settle()
    room = (self.host.budget - self.host.used) // self.chunk_bytes
    keys = [k for k in self._fill_keys() if not self._resident(*k)][:max(0, room)]
    for i in range(0, len(keys), 64):  # a bounded transient: 64 chunks in flight at most
      part = keys[i:i + 64]
      futures = {self.reader.submit(*k): k for k in part}
      blobs = dict(self.reader.as_completed(futures))
      for k in part:
        self.stats["expert_bytes_read"] += blobs[k].nbytes
        self._put_host(k, blobs[k])
      self.slabs.flush()

  def _all_cached(self) -> bool:
    """Every routed expert of the main layers is held by a tier: no step can miss."""
    rows = self.moe_layers
    return bool(((self.pin_tables[rows] >= 0) | (self.slabs.tables[rows] >= 0)).all())

  def _fused(self, tokens, cache, absorbed, n_valid, sure: bool = False):
    """Tries the step as one jit over the tiers (`fused_forward`). On success applies the same
    tier bookkeeping as the layer-by-layer path, layer by layer in union order, and returns
    (output, None); when a routed expert was not cached returns (None, cache) to re-run."""
    compiled, args = self._fused_executable(tokens, cache, absorbed, n_valid)
    logits, x, new_cache, record = compiled(*args)
    valid = valid_rows(tokens.shape, n_valid)
    if sure:  # nothing can be missing: settled later, so this call does not wait for the step
      self.stats["fused_steps"] += 1
      self._unsettled = (record, tokens.size, valid)
      return (logits, x, new_cache), None
    missed, ids = self._split_record(record, tokens.size)
    if missed:
      self._fused_ready = False
      self.stats["fused_void"] += 1
      return None, new_cache
    self.stats["fused_steps"] += 1
    self._settle_fused(ids, valid)
    return (logits, x, new_cache), None

  def _fused_executable(self, tokens, cache, absorbed, n_valid):
    """(`fused_forward` compiled for this step's shapes, its arguments), compiled once per
    shape ahead of the call, so its time is accounted apart (`fused_compile_s`)."""
    n_layers = self.cfg.num_hidden_layers
    slab = self.slabs.slabs.get(self.layout)
    dev = jax.devices()[0]
    tables = np.stack([self.pin_tables[:n_layers], self.slabs.tables[:n_layers]])
    if self._tables is None or not np.array_equal(self._tables[0], tables):
      # uploaded when the tiers changed (two arrays: indexing a device array is a dispatch)
      self._tables = (tables, *jax.device_put((tables[0], tables[1]), dev))
    tiers = {
        "pins": {l: d.pool for l, d in self.device.items() if l < n_layers},
        "pin": self._tables[1],
        "slab": None if slab is None else slab.pool,
        "host": self._tables[2],
    }
    nv = None if n_valid is None else np.asarray(n_valid, np.int32)  # [] or [B] per row
    args = (self.dense, tokens, cache, nv, tiers, self._zero)
    static = dict(cfg=self.cfg, absorbed=absorbed, impl=self.impl)
    # Everything else in the signature is fixed for the engine's life (the slab is allocated
    # whole, the pin pools have fixed slots).
    key = (tokens.shape, None if cache is None else (cache.layers[0].latent.shape,
                                                     cache.pages.shape),
           None if nv is None else nv.shape, slab is None, absorbed)
    if key not in self._fused_compiled:
      t0 = time.perf_counter()
      self._fused_compiled[key] = fused_forward.lower(*args, **static).compile()
      self.stats["fused_compile_s"] += time.perf_counter() - t0
    return self._fused_compiled[key], args

  def _split_record(self, record, n_tokens: int) -> tuple[bool, np.ndarray]:
    """`fused_forward`'s record → (whether any pair missed, ids `[M, T, K]`)."""
    record, m = np.asarray(record), len(self.moe_layers)
    return bool(record[:m].any()), record[m:].reshape(m, n_tokens, -1)

  def settle(self) -> None:
    """Applies the bookkeeping of a fused step that was returned unsettled (every expert held,
    so it could not miss). Every reader of tier state or counters calls this first."""
    if self._unsettled is None:
      return
    record, n_tokens, valid = self._unsettled
    self._unsettled = None
    missed, ids = self._split_record(record, n_tokens)
    if missed:  # the tiers held every expert and nothing evicts between steps
      raise RuntimeError("internal: a fused step run with every expert held missed one")
    self._settle_fused(ids, valid)
    self.heat.decay()  # the step's own decay, after its uses, as a settled step has it

  def _settle_fused(self, ids_all: np.ndarray, valid: np.ndarray) -> None:
    """A fused step's tier bookkeeping: per MoE layer in union order, the lookups, counters,
    heat, LRU recency and pin admissions of the layer steps (`_account`, `_admit`).

    Fused steps predict nothing: a pilot or co-activation hint computed after the step would
    name the experts the step has just been served. Prefetches issued by earlier layer steps
    land once, before the step's lookups, into free room only (they never evict)."""
    unions = [np.unique(ids[valid]).tolist() for ids in ids_all]
    if self.inflight:  # lands into free room only: nothing the step used is evicted
      self._land()
    slab = self.slabs.slabs.get(self.layout)
    n = collections.Counter()
    for layer, union in zip(self.moe_layers, unions):
      self.pilot_pred.pop(layer, None)
      self.heat.use(layer, union)
      dev = self.device.get(layer)
      cached = []
      for e in union:
        if dev is not None and e in dev:
          n["pinned"] += 1
        elif self.host.touch((layer, e)):
          cached.append(e)
        else:  # admissions copy slab → pin and landings only fill free room: never evicted
          raise RuntimeError(f"internal: layer {layer} expert {e} served by a fused step is in "
                             "no tier")
      if self.inflight:
        self._expire(layer)
      if self.landed_unused:
        for e in union:
          if (layer, e) in self.landed_unused:
            self.landed_unused.discard((layer, e))
            n["prefetch_useful"] += 1
      n["used"] += len(union)
      n["cached"] += len(cached)
      if dev is not None:
        self._admit(layer, union,
                    {c: (slab.pool, self.slabs.where[(layer, c)][1]) for c in cached})
    on_device = self._place(n["cached"])
    self.stats["experts_used"] += n["used"]
    self.stats["expert_pin_hits"] += n["pinned"]
    self.stats["expert_host_hits"] += n["cached"]
    self.stats["experts_on_device"] += n["pinned"] + (n["cached"] if on_device else 0)
    self.stats["experts_on_host"] += 0 if on_device else n["cached"]
    if n["prefetch_useful"]:
      self.stats["prefetch_useful"] += n["prefetch_useful"]

  def mtp_forward(self, h, next_tokens, cache, start: int):
    """The MTP block at positions start..start+S-1 over (h `[B, S, D]`, next tokens `[B, S]`).

    Returns (logits `[B, S, V]`, block output `[B, S, D]`, the MTP layer cache). Its routed
    experts come through the same tiers as the main layers' (the store's "mtp" group).
    """
    self.settle()
    return mtp_forward(self.dense, h, jnp.asarray(next_tokens, jnp.int32), self.cfg, cache,
                       jnp.asarray(start, jnp.int32), absorbed=h.shape[1] <= 4,
                       experts=self._provider(), steps=JITTED, impl=self.impl)

  def tier_state(self) -> dict:
    """The tiers' state as plain data (a live trace's starting point for the simulator):
    budgets, each MoE layer's pinned experts by slot, the host LRU order, raw heat."""
    self.settle()
    return {
        "device_bytes": self.budgets.device_bytes, "host_bytes": self.host.budget,
        "chunk_bytes": self.chunk_bytes, "slots": self.slots, "all_resident": self.all_resident,
        "pins": {str(l): list(d.expert_in) for l, d in self.device.items()},
        "host": [list(k) for k in self.host.keys()],
        "heat": {f"{l}/{e}": v for (l, e), v in self.heat.h.items()},
        "heat_scale": self.heat.scale}

  def telemetry(self) -> dict[str, float]:
    """Flat numeric counters since construction (callers take differences)."""
    self.settle()
    out = {k: float(v) for k, v in self.stats.items()}
    out["all_resident"] = float(self.all_resident)  # fast path: no per-expert accounting
    if self.prefetch:
      out["prefetch_unused"] = float(len(self.landed_unused))
      out["prefetch_inflight"] = float(sum(1 for f, k in self.inflight.values() if k != DEMAND))
    out["io_service_s"] = self.reader.service_s
    out["io_wait_s"] = self.reader.wait_s
    return out
