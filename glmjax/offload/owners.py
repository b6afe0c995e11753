"""Expert ownership on a mesh, across processes: which process (and which of its devices) owns
each routed expert, and the one collective that combines every owner's terms.

The rule: expert e of every MoE layer belongs to index e // (E/n) of the mesh's `expert` axis
(n devices along it), the contiguous split `forward.sharded_terms` uses, and so to the process
whose devices sit at that index. Each process's tiers (pins, host cache, prefetch, reads) deal
with its own experts only; every process sees every token's routing, so what a process decides
depends on routing and its own state alone, never on another process's reads or timing.

Per MoE layer step, every process calls `Ownership.combine` once per chunk (always: a collective
skipped by one process would leave the others waiting). Each device of the `expert` axis
contributes the terms of the pairs it owns (pinned ones computed there, host-held ones computed
by its process's CPU kernel) and zeros elsewhere; one psum over `expert` adds a term to exact
zeros, so the result is bitwise what one process computes.

Also here: a collective failing because a peer died becomes a PeerError naming it
(`peers_named`), and the counters each process keeps for its own experts are summed for
process 0's report (`sum_counters`).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from glmjax.errors import InputError, PeerError
from glmjax.model.moe import pool_terms
from glmjax.sharding import axis_size, put, replicated


class Ownership:
  """Who owns which expert on `mesh` (None: this process owns every expert, one device)."""

  def __init__(self, mesh, n_experts: int):
    self.mesh, self.n_experts = mesh, n_experts
    self.n = axis_size(mesh, "expert")
    self.block = n_experts // self.n  # experts per index of the `expert` axis
    self.local: list[int] = list(range(self.n))  # `expert` indices on this process's devices
    if mesh is not None and jax.process_count() > 1:
      self.local = self._local_indices(mesh)
    owned = np.zeros(n_experts, bool)
    for d in self.local:
      owned[d * self.block:(d + 1) * self.block] = True
    self.owned = owned  # [E] bool: experts this process owns

  @staticmethod
  def _local_indices(mesh) -> list[int]:
    """The `expert` indices whose devices all belong to this process; an index whose devices
    span processes has no single owner, which the rule cannot serve."""
    ax = mesh.axis_names.index("expert")
    me, local = jax.process_index(), []
    for d in range(mesh.shape["expert"]):
      procs = {dev.process_index for dev in np.take(mesh.devices, [d], axis=ax).ravel()}
      if len(procs) > 1:
        raise InputError(
            f"mesh {dict(mesh.shape)}: the devices at expert index {d} belong to processes "
            f"{sorted(procs)}; the offload engine needs each expert index on one process "
            "(put `expert` first in --mesh so that each process's devices form whole indices)")
      if procs == {me}:
        local.append(d)
    return local

  def mine(self, experts) -> list[int]:
    """`experts` (in their order) that this process owns."""
    return [e for e in experts if self.owned[e]]

  def rows(self, shape, dtype, fill) -> jax.Array:
    """A global `[n, *shape]` array split along `expert`: row d is `fill(d)` (a numpy array of
    `shape`) for this process's indices; other processes build their own rows."""
    def shard(index):
      lo = index[0].start or 0
      hi = self.n if index[0].stop is None else index[0].stop
      return np.stack([fill(d) for d in range(lo, hi)]).astype(dtype)
    return jax.make_array_from_callback((self.n, *shape), NamedSharding(self.mesh, P("expert")),
                                        shard)

  def combine(self, x: np.ndarray, host_terms: np.ndarray, pinned, kernel: str) -> jax.Array:
    """Every owner's terms `[T, K, D]`, replicated on the mesh: `host_terms` (this process's
    host-computed pairs, zero elsewhere) from its first `expert` index, and the pinned pairs
    `pinned` = (pool `[n·S, ...]` split along `expert`, `slot_of(d)` → (active `[T, K]`, local
    slots `[T, K]`) of index d) computed by their devices; one psum over `expert`."""
    first = self.local[0]
    zeros = np.zeros_like(host_terms)
    host = self.rows(host_terms.shape, np.float32,
                     lambda d: host_terms if d == first else zeros)
    flat = put(np.asarray(x, np.float32), replicated(self.mesh))  # the same in every process
    if pinned is None:
      return _sum_rows(host, mesh=self.mesh)
    pool, slot_of = pinned
    grids = {d: slot_of(d) for d in self.local}
    active = self.rows(host_terms.shape[:2], bool, lambda d: grids[d][0])
    slots = self.rows(host_terms.shape[:2], np.int32, lambda d: grids[d][1])
    return _pinned_and_host(pool, flat, slots, active, host, mesh=self.mesh, kernel=kernel)


@functools.partial(jax.jit, static_argnames=("mesh",))
def _sum_rows(host, mesh):
  """The psum over `expert` of rows `[n, T, K, D]` (no pins: host-held terms only)."""
  return jax.shard_map(lambda h: jax.lax.psum(h[0], "expert"), mesh=mesh,
                       in_specs=P("expert"), out_specs=P())(host)


@functools.partial(jax.jit, static_argnames=("mesh", "kernel"))
def _pinned_and_host(pool, flat, slots, active, host, mesh, kernel: str):
  """Each `expert` index's pinned pairs over its own pool block (local slots), its host rows
  elsewhere, then one psum over `expert`: `[T, K, D]` replicated."""
  def local(pool, flat, slots, active, host):
    terms = pool_terms(flat, pool, slots[0], active[0], kernel)
    return jax.lax.psum(jnp.where(active[0][..., None], terms, host[0]), "expert")

  p_spec = jax.tree_util.tree_map(lambda _: P("expert"), pool)
  return jax.shard_map(local, mesh=mesh, in_specs=(p_spec, P(), P("expert"), P("expert"),
                                                   P("expert")),
                       out_specs=P())(pool, flat, slots, active, host)


# What a collective's failure says when a peer's connection is gone (gloo on CPU) or the
# coordination service declared a peer dead.
PEER_SIGNS = ("Gloo", "gloo", "heartbeat", "coordination service", "Connection closed")


@contextlib.contextmanager
def peers_named(where: str):
  """Turns a collective failing because another process died or left into a PeerError naming
  the other processes (with two, the one that failed). Only with several processes."""
  try:
    yield
  except (RuntimeError, ValueError) as e:
    if jax.process_count() == 1 or not any(s in str(e) for s in PEER_SIGNS):
      raise
    me = jax.process_index()
    others = [p for p in range(jax.process_count()) if p != me]
    who = f"process {others[0]}" if len(others) == 1 else f"one of processes {others}"
    raise PeerError(f"{where}: {who} of this {jax.process_count()}-process run died or left "
                    f"(a collective failed on process {me}): {str(e).splitlines()[0][:300]}"
                    ) from None


def peer_guarded(method):
  """An engine method whose collectives' failures from a dead peer become a PeerError naming
  the store and the peer (`peers_named`)."""
  @functools.wraps(method)
  def call(self, *args, **kw):
    with peers_named(self.store.path):
      return method(self, *args, **kw)
  return call


# The engine's counters that each process keeps for its own experts (sums over processes give
# one process's count); routing statistics, timings and gauges are the same everywhere or not
# additive, and stay process 0's.
ADDITIVE = ("experts_used", "expert_pin_hits", "expert_host_hits", "expert_misses",
            "expert_bytes_read", "experts_on_device", "experts_on_host", "h2d_bytes", "repins",
            "prefill_expert_bytes", "pilot_hits", "pilot_predicted", "pilot_actual",
            "prefetch_issued", "prefetch_dropped", "prefetch_landed", "prefetch_useful",
            "prefetch_late", "prefetch_wasted", "prefetch_failed", "prefetch_unused",
            "prefetch_inflight", "io_service_s", "io_wait_s")


def additive_counters(layers) -> list[str]:
  """The names `sum_counters` adds up, for an engine whose MoE layers are `layers`."""
  return list(ADDITIVE) + [f"misses_layer_{l}" for l in layers]


def counter_layers(engine) -> range:
  """The layers of `engine`'s per-layer counters (its pin tables' rows: the MoE layers, then
  the MTP layer's), as `additive_counters` and `sum_counters` take them."""
  return range(engine.tiers.pin_tables.shape[0])


def sum_counters(stats: dict, layers) -> dict:
  """`stats` with the additive counters summed over every process (a collective: every
  process calls it), and the pilot's rates recomputed from the sums."""
  from jax.experimental import multihost_utils
  names = additive_counters(layers)
  mine = np.asarray([float(stats.get(k, 0.0)) for k in names], np.float64)
  # float64 travels as its bits (uint32 pairs): JAX would narrow it to float32
  got = np.asarray(multihost_utils.process_allgather(mine.view(np.uint32)), np.uint32)
  total = got.reshape(-1, 2 * len(names)).view(np.float64).sum(0)
  out = dict(stats)
  out.update({k: float(v) for k, v in zip(names, total) if k in stats or v})
  if out.get("pilot_actual"):
    out["pilot_recall"] = out["pilot_hits"] / out["pilot_actual"]
    out["pilot_precision"] = out["pilot_hits"] / max(out["pilot_predicted"], 1.0)
  return out
