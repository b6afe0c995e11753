"""Cache tiers of the offload engine: the device-resident pinned pools (`DevicePool`; on a mesh
`MeshPins`), the host LRU's storage (`HostSlabs`), LFRU heat (`Heat`), and `Tiers`, which runs
the shared tier rules (glmjax.offload.rules.TierRules) over these bytes.

Storage only: the rules are glmjax.offload.rules', and nothing here does I/O. Keys are
(layer, expert).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from glmjax.model.quant import ExpertPool, ExpertWeights
from glmjax.offload.rules import HostCache, PinSlots, TierRules
from glmjax.sharding import axis_size

# Heat is a use count that decays by this factor per decode step (recency in LFRU).
HEAT_DECAY = 0.995


WRITE_BATCH = 8  # experts per slab write: few calls per layer step, a small transient


class HostSlab:
  """The host-cached experts of one chunk layout, in the slots of one pool on the CPU device.

  Slot-addressed storage lets one jitted call compute every cached expert of a layer through a
  slot table (the engine's fused step), and writes are donated in-place calls of a few
  experts each. The pool holds raw bits (uint16 scales) and is reserved whole at load
  (`reserve`; `max_slots`: the sum of its layers' host shares): the LRU fills it in a long run
  anyway, a pool that grew would change the fused step's shapes and recompile it, and zeroing
  4 GB inside the first prefill took 2.7-3.9 s.
  """

  def __init__(self, layout, max_slots: int):
    self.layout, self.max_slots = layout, int(max_slots)
    self.pool: ExpertPool | None = None
    self.free: list[int] = []

  def reserve(self) -> None:
    """Allocates the pool, zero-filled, if it is not yet: the engine does it at load, since a
    4 GB slab takes 2.7-3.9 s to fill, which the first insert (in a prefill) paid before."""
    if self.pool is None:
      # Raw bits (uint16 scales): installs update it in place, whatever its size. Writing 8
      # experts into a 200-slot slab of bfloat16 scales took 350-410 ms, a pass over the
      # whole slab; as raw bits it takes ~12 ms (DESIGN.md §15).
      self.pool = empty_pool(self.layout, self.max_slots, cpu_device(), raw=True)
      self.free = list(range(self.max_slots - 1, -1, -1))  # lowest slot popped first

  def alloc(self) -> int:
    self.reserve()
    if not self.free:
      raise RuntimeError("host slab full")  # the LRU budget keeps this from happening
    return self.free.pop()

  def weights(self, slot: int) -> ExpertWeights:
    """The expert in `slot` as numpy weights in the layout's dtypes (a copy)."""
    raw = gather_slot(self.pool, slot)
    dtypes = [np.dtype(f.dtype) for f in self.layout.fields]
    gp, gs, dp, ds = (np.asarray(a).view(d) for a, d in zip(
        (raw.gate_up.packed, raw.gate_up.scales, raw.down.packed, raw.down.scales), dtypes))
    return ExpertWeights(dataclasses.replace(raw.gate_up, packed=gp, scales=gs),
                         dataclasses.replace(raw.down, packed=dp, scales=ds))

  def write(self, slots: list[int], blobs: list[np.ndarray]) -> None:
    """Writes chunk bytes into `slots`, up to WRITE_BATCH experts per donated in-place call.
    Each chunk goes in as its own argument (page-aligned reads are taken without a copy) and
    is copied once, into its slot: stacking the chunks first cost two more copies of each and
    the page faults of two fresh buffers."""
    i = 0
    while i < len(slots):  # calls of a power-of-two size: 4 compiled shapes, not 8
      n = 1 << (min(len(slots) - i, WRITE_BATCH).bit_length() - 1)
      self.pool = _install_blobs(self.pool, np.asarray(slots[i:i + n], np.int32),
                                 tuple(blobs[i:i + n]), self.layout)
      i += n


class HostSlabs:
  """Where each host-cached (layer, expert) lives: a slab per chunk layout, a slot in it."""

  def __init__(self, layout_of, max_slots_of, n_layers: int, n_experts: int):
    self._layout_of, self._max_slots_of = layout_of, max_slots_of
    self.slabs: dict = {}  # layout → HostSlab
    self.where: dict[tuple[int, int], tuple[HostSlab, int]] = {}
    # [layers, E]: each expert's slot in its layer's slab, -1 if not cached
    self.tables = np.full((n_layers, n_experts), -1, np.int32)
    self._pending: dict = {}  # slab → [(slot, chunk bytes)] stored, not yet written

  def slab(self, layer: int) -> HostSlab:
    layout = self._layout_of(layer)
    if layout not in self.slabs:
      self.slabs[layout] = HostSlab(layout, self._max_slots_of(layout))
    return self.slabs[layout]

  def store(self, key, blob: np.ndarray) -> None:
    """Takes a slot for `key` now; its bytes are written by the next `flush`, which must come
    before anything reads the slab."""
    slab = self.slab(key[0])
    slot = slab.alloc()
    self.where[key] = (slab, slot)
    self.tables[key] = slot
    self._pending.setdefault(slab, []).append((slot, blob))

  def flush(self) -> None:
    """Writes every stored-but-unwritten chunk: one call per slab."""
    for slab, writes in self._pending.items():
      slab.write([s for s, _ in writes], [b for _, b in writes])
    self._pending.clear()

  def release(self, key) -> None:
    slab, slot = self.where.pop(key)
    slab.free.append(slot)
    if slab in self._pending:  # evicted before its bytes were written: never write them
      self._pending[slab] = [(s, b) for s, b in self._pending[slab] if s != slot]
    self.tables[key] = -1


class Heat:
  """LFRU heat per (layer, expert): decayed use counts, persisted as a usage histogram.

  Decay is lazy: values are stored divided by the running decay factor, so a decode step's
  decay is one multiplication however many experts have heat (19,968 at GLM-5's size).
  """

  def __init__(self, counts: dict | None = None):
    self.scale = 1.0  # the decay applied since the stored values were last rescaled
    self.h: dict[tuple[int, int], float] = collections.defaultdict(float, counts or {})

  def use(self, layer: int, experts) -> None:
    unit = 1.0 / self.scale
    for e in experts:
      self.h[(layer, int(e))] += unit

  def decay(self) -> None:
    self.scale *= HEAT_DECAY
    if self.scale < 1e-30:  # fold it in long before float64 runs out of range
      for k in self.h:
        self.h[k] *= self.scale
      self.scale = 1.0

  def __getitem__(self, key) -> float:
    return self.h.get(key, 0.0) * self.scale

  def hottest(self, layer: int, n: int, n_experts: int) -> list[int]:
    scores = [(-self.h.get((layer, e), 0.0), e) for e in range(n_experts)]
    return [e for s, e in sorted(scores)[:n] if s < 0]

  def save(self, path: str) -> None:
    data = {f"{l}/{e}": v * self.scale for (l, e), v in self.h.items() if v > 0}
    atomic_write(path, lambda f: f.write(json.dumps(data).encode()))

  @classmethod
  def load(cls, path: str) -> "Heat":
    try:
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
      return cls({tuple(int(x) for x in k.split("/")): float(v) for k, v in data.items()})
    except (OSError, ValueError):
      return cls()


def atomic_write(path: str, write) -> bool:
  """Writes `path` through a uniquely named temporary sibling and an atomic rename
  (`formats.durable`), so processes sharing a store never see (or clobber) a half-written
  file, and a temporary left by a killed process (kill point "stats.write") is removed by the
  next write. `write(f)` gets a binary file. Returns False (and leaves `path` as it was) when
  the directory is not writable: a read-only store just does not learn across runs."""
  from glmjax.formats import durable
  durable.clear_stale(path)
  tmp = durable.temp_path(path)
  try:
    with open(tmp, "wb") as f:
      write(f)
    durable.kill_point("stats.write")
    os.replace(tmp, path)
    return True
  except OSError:
    return False
  finally:
    if os.path.lexists(tmp):
      try:
        os.unlink(tmp)
      except OSError:
        pass


def _bits(a):
  """`a` viewed as unsigned integers of its width. XLA:CPU turns a dynamic update of a
  bfloat16 array into a pass over the whole array (float normalization) and a bitcast of a
  whole array into a copy, while an integer update of a donated buffer happens in place: so
  the host slab holds raw bits (`empty_pool(raw=True)`). A bfloat16 pool (the pin pools,
  small) is updated through this view too, but its view back still costs a pass over it."""
  width = np.dtype(a.dtype).itemsize
  return a if np.issubdtype(a.dtype, np.unsignedinteger) else (
      jax.lax.bitcast_convert_type(a, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[width]))


def _put_slot(leaf, slot, part):
  """`leaf` `[S, ...]` with `part` `[...]` (same dtype) written at `slot`, in place when `leaf`
  is donated and unsigned: the update runs on the integer view (`_bits`)."""
  start = (slot,) + (0,) * part.ndim
  out = jax.lax.dynamic_update_slice(_bits(leaf), _bits(part)[None], start)
  return out if out.dtype == leaf.dtype else jax.lax.bitcast_convert_type(out, leaf.dtype)


def _with_leaves(pool: ExpertPool, leaves) -> ExpertPool:
  gp, gs, dp, ds = leaves
  return ExpertPool(dataclasses.replace(pool.gate_up, packed=gp, scales=gs),
                    dataclasses.replace(pool.down, packed=dp, scales=ds))


def _leaves(pool: ExpertPool) -> list:
  return [pool.gate_up.packed, pool.gate_up.scales, pool.down.packed, pool.down.scales]


# The pool is donated: an install writes one expert's bytes in place instead of copying the
# whole layer pool.
@functools.partial(jax.jit, donate_argnums=(0,))
def _install(pool: ExpertPool, slot, expert: ExpertPool) -> ExpertPool:
  return _with_leaves(pool, [_put_slot(p, slot, e[0])
                             for p, e in zip(_leaves(pool), _leaves(expert))])


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(3,))
def _install_blobs(pool: ExpertPool, slots, blobs: tuple, layout) -> ExpertPool:
  """Chunks (a tuple of n `[B]` byte arrays) unpacked (the store layout's fields, bitcast in
  the jit) into `slots` `[n]` of a donated pool, each by an in-place slice update."""
  leaves = _leaves(pool)
  for i, blob in enumerate(blobs):
    for j, f in enumerate(layout.fields):
      dtype = np.dtype(f.dtype)
      raw = blob[f.offset:f.offset + f.nbytes]
      if dtype.itemsize > 1:
        raw = raw.reshape(-1, dtype.itemsize)
      part = jax.lax.bitcast_convert_type(raw, _bits(leaves[j]).dtype).reshape(f.shape)
      leaves[j] = _put_slot(leaves[j], slots[i], jax.lax.bitcast_convert_type(
          part, leaves[j].dtype) if part.dtype != leaves[j].dtype else part)
  return _with_leaves(pool, leaves)


# Copies one pool slot into another pool on the same device (host slab → pin pool on a CPU-only
# machine) without a numpy view: a live view of a pool turns the next donated install into a
# copy of the whole pool.
@functools.partial(jax.jit, donate_argnums=(0,))
def _install_from(pool: ExpertPool, slot, source: ExpertPool, source_slot) -> ExpertPool:
  return _with_leaves(pool, [_put_slot(p, slot, s[source_slot])
                             for p, s in zip(_leaves(pool), _leaves(source))])


@jax.jit
def _gather(pool: ExpertPool, slot) -> ExpertPool:
  return jax.tree_util.tree_map(lambda p: p[slot], pool)


def gather_slot(pool: ExpertPool, slot: int) -> ExpertWeights:
  """One slot of a pool as numpy expert weights (a copy, so no view of the pool stays alive)."""
  one = _gather(pool, jnp.int32(slot))
  return ExpertWeights(*(jax.tree_util.tree_map(np.asarray, q) for q in (one.gate_up, one.down)))


def cpu_device():
  """This process's first CPU device (with several processes `jax.devices("cpu")[0]` is
  process 0's, which no other process can address)."""
  return jax.local_devices(backend="cpu")[0]


class DevicePool(PinSlots):
  """One MoE layer's pinned experts on the device: the slots and their pool `[S, ...]`."""

  def __init__(self, layer: int, slots: int, empty: ExpertPool, table: np.ndarray | None = None):
    super().__init__(layer, slots, table)
    self.pool = empty  # [S, ...] on device

  def install(self, expert: int, weights: ExpertWeights, slot: int) -> None:
    """Puts `expert` into `slot` (evicting whatever was there)."""
    one = ExpertPool(*(jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], q)
                       for q in weights))
    self.pool = _install(self.pool, jnp.int32(slot), one)
    self.assign(expert, slot)

  def install_from(self, expert: int, source: ExpertPool, source_slot: int, slot: int) -> None:
    """Puts `expert`, held in `source_slot` of `source`, into `slot`."""
    if source.gate_up.packed.devices() == self.pool.gate_up.packed.devices():
      self.pool = _install_from(self.pool, jnp.int32(slot), source, jnp.int32(source_slot))
      self.assign(expert, slot)
    else:
      self.install(expert, gather_slot(source, source_slot), slot)


def empty_pool(layout, slots: int, device=None, raw: bool = False) -> ExpertPool:
  """A zero-filled pool of `slots` experts in `layout` (a store `ExpertLayout`) on `device`
  (the default device if None). `raw`: every leaf as unsigned integers of its width (bfloat16
  scales as their uint16 bits), for the CPU kernel, which reads raw bytes (see `_bits`)."""
  def zeros(f):
    dtype = np.dtype(f.dtype)
    if raw and not np.issubdtype(dtype, np.unsignedinteger):
      dtype = np.dtype(f"u{dtype.itemsize}")
    return jnp.zeros((slots, *f.shape), dtype, device=device)
  gp, gs, dp, ds = (zeros(f) for f in layout.fields)
  proto = layout.unpack(np.zeros((1, layout.nbytes), np.uint8))
  return ExpertPool(dataclasses.replace(proto.gate_up, packed=gp, scales=gs),
                    dataclasses.replace(proto.down, packed=dp, scales=ds))


def as_device_pool(weights: list[ExpertWeights]) -> ExpertPool:
  """Stacks host expert weights into one device pool (the transient working set)."""
  def stack(attr, field):
    return np.stack([getattr(getattr(w, attr), field) for w in weights])

  def q(attr):
    first = getattr(weights[0], attr)
    return type(first)(packed=jnp.asarray(stack(attr, "packed")),
                       scales=jnp.asarray(stack(attr, "scales")), bits=first.bits,
                       group_size=first.group_size, in_features=first.in_features)

  return ExpertPool(q("gate_up"), q("down"))



class MeshPins:
  """One MoE layer's pin tier on a mesh: a DevicePool per index of the `expert` axis that this
  process's devices hold (`local`; every index in one process), each holding only experts that
  index owns (expert e belongs to index e // (E/n), the plan's contiguous split). The pools
  share one `[E]` table row (an expert's slot in its owner's pool). The pinned terms run on the
  mesh over the pools assembled, without a copy, into one pool `[n·S, ...]` split along
  `expert` (index d holds global slots d·S .. d·S+S-1; each process gives its own blocks)."""

  def __init__(self, layer: int, slots: int, layout, mesh, n_experts: int, table: np.ndarray,
               local: list[int] | None = None):
    self.layer, self.slots, self.mesh = layer, slots, mesh
    n = axis_size(mesh, "expert")
    self.block = n_experts // n
    ax = mesh.axis_names.index("expert")
    self.shards: list[DevicePool | None] = [None] * n  # None: another process's index
    for d in range(n) if local is None else local:
      # the devices at expert index d hold pool d (replicated over other axes)
      sub = Mesh(np.take(mesh.devices, [d], axis=ax), mesh.axis_names)
      pool = jax.device_put(empty_pool(layout, slots), NamedSharding(sub, P()))
      self.shards[d] = DevicePool(layer, slots, pool, table)

  def owner(self, e: int) -> int:
    """The device index (along `expert`) that owns expert `e`."""
    return e // self.block

  def shard(self, e: int) -> DevicePool | None:
    """The pool of `e`'s owner, or None when another process owns it."""
    return self.shards[self.owner(e)]

  def __contains__(self, e: int) -> bool:
    shard = self.shard(e)
    return shard is not None and e in shard

  @property
  def local(self) -> list[int]:
    return [d for d, s in enumerate(self.shards) if s is not None]

  @property
  def expert_in(self) -> list:
    return [e for d in self.local for e in self.shards[d].expert_in]

  def slot_grid(self, d: int, step, experts) -> tuple[np.ndarray, np.ndarray]:
    """(active `[T, K]`, local slots `[T, K]`) of the pairs of `experts` pinned at index `d`."""
    return step.slot_grid([e for e in experts if self.owner(e) == d],
                          self.shards[d].slot_of.__getitem__)

  def pool(self) -> ExpertPool:
    """The shards' pools as one pool `[n·S, ...]` split along `expert` (no copy; rebuilt per
    step, since an install donates a shard's buffers). Each process gives its own shards."""
    sharding = NamedSharding(self.mesh, P("expert"))
    n = len(self.shards)

    def whole(*leaves):
      arrays = [s.data for leaf in leaves for s in leaf.addressable_shards]
      return jax.make_array_from_single_device_arrays(
          (n * leaves[0].shape[0], *leaves[0].shape[1:]), sharding, arrays)
    return jax.tree_util.tree_map(whole, *[self.shards[d].pool for d in self.local])


class Tiers(TierRules):
  """The engine's two cache tiers over their bytes: the pin pools (`device`, layer →
  DevicePool or MeshPins; `pin_tables` `[L, E]` their slots), the host LRU (`host`) with its
  slabs (`slabs`), LFRU heat and the tier counters. The rules are `TierRules`' (shared with the
  simulator); this class only stores what they decide. `on_evict(keys)` hears of host
  evictions (the prefetcher counts a landed prefetch evicted unused as wasted)."""

  def __init__(self, device: dict, host: HostCache, slabs: HostSlabs, pin_tables: np.ndarray,
               heat: Heat, chunk_bytes: int, stats):
    super().__init__(device, host, heat, chunk_bytes, stats)
    self.device, self.slabs, self.pin_tables = device, slabs, pin_tables
    self.on_evict = lambda keys: None
    # [E] bool: the experts this process owns (`owners.Ownership`; all of them in one process)
    self.owned = np.ones(pin_tables.shape[1], bool)

  def pin_pool(self, layer: int, e: int) -> DevicePool | None:
    """The pool that may hold expert `e` of `layer` (on a mesh: its owner's), or None."""
    dev = self.device.get(layer)
    return dev.shard(e) if isinstance(dev, MeshPins) else dev

  def holds(self, layer: int, e: int) -> bool:
    """Whether a tier holds expert `e` of `layer`."""
    dev = self.device.get(layer)
    return (dev is not None and e in dev) or (layer, e) in self.host

  def put_host(self, key, blob: np.ndarray, protect=()) -> None:
    """`key`'s chunk into the host cache (the LRU rule evicts outside `protect`); its bytes
    are written to the slab by the next `slabs.flush`, before the slab is read."""
    victims = self.host.put(key, blob.nbytes, protect)
    for victim in victims:
      self.slabs.release(victim)
      self.on_evict([victim])
    if key in self.host and key not in self.slabs.where:
      self.slabs.store(key, blob)

  def all_cached(self, layers) -> bool:
    """Every routed expert of `layers` that this process owns is held by a tier: no step can
    miss."""
    held = (self.pin_tables[layers] >= 0) | (self.slabs.tables[layers] >= 0)
    return bool((held | ~self.owned).all())

  # -- TierRules' storage hooks: `data` is (the misses' chunks, their unpacked weights) ---------
  def insert_host(self, key, protect, data) -> None:
    self.put_host(key, data[0][key[1]], protect)

  def inserted(self) -> None:
    self.slabs.flush()

  def pin_groups(self, layer: int, candidates) -> list:
    dev = self.device.get(layer)
    if isinstance(dev, MeshPins):  # each device's pool admits only experts it owns
      return [(dev.shards[d], [e for e in candidates if dev.owner(e) == d]) for d in dev.local]
    return super().pin_groups(layer, candidates)

  def install(self, pool: DevicePool, layer: int, e: int, slot: int, data) -> None:
    """A just-read miss from its unpacked weights, a host-cached expert from its slab slot."""
    weights = {} if data is None else data[1]
    if e in weights:
      pool.install(e, weights[e], slot)
    else:
      slab, source_slot = self.slabs.where[(layer, e)]
      pool.install_from(e, slab.pool, source_slot, slot)
