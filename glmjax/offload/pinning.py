"""The pin tier's starting contents: every expert when all are resident (one pool per MoE
layer, split along the mesh's `expert` axis on a mesh), otherwise each layer's hottest experts
of past runs (the persisted usage histogram), read in parallel through the I/O threads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

from glmjax.model.quant import ExpertPool
from glmjax.offload.shared import EngineShared
from glmjax.offload.tiers import DevicePool, MeshPins, Tiers, empty_pool
from glmjax.sharding import axis_size


def pin_device_tier(shared: EngineShared, slots: int, dev_slots: int, all_resident: bool,
                    mtp_layers: list[int], progress: bool) -> None:
  """Fills `shared.tiers.device`: `slots` experts per MoE layer (on a mesh `dev_slots` per
  device of the `expert` axis, each of the experts that device owns). `mtp_layers`: the MTP
  block's MoE layers, pinned only when every expert is resident."""
  if slots == 0:
    return
  tiers, store, reader, mesh = shared.tiers, shared.store, shared.reader, shared.mesh
  moe_layers, n_experts = shared.moe_layers, shared.n_experts
  layout = store.layout(moe_layers[0])
  if all_resident:
    for layer in tqdm(moe_layers + mtp_layers, desc="loading experts", disable=not progress,
                      leave=False):
      pool = DevicePool(layer, slots, sharded_layer(store, layer, n_experts, mesh) if mesh else
                        jax.tree_util.tree_map(jnp.asarray, store.read_layer(layer)))
      pool.slot_of = {x: x for x in range(slots)}
      pool.expert_in = list(range(slots))
      tiers.device[layer] = pool
    return
  # Pin the hottest experts of past runs (the persisted usage histogram), read in parallel
  # through the I/O threads and installed as they land.
  futures = {}
  for layer in moe_layers:
    if mesh is not None:
      _rank_mesh_pins(tiers, reader, layer, layout, n_experts, dev_slots, mesh, futures)
      continue
    # The table is a row view of pin_tables: installs keep the fused step's table current.
    tiers.device[layer] = DevicePool(layer, slots, empty_pool(layout, slots),
                                     tiers.pin_tables[layer])
    # Slots by heat rank, not by read completion: where an expert sits decides LFRU ties.
    for slot, e in enumerate(tiers.heat.hottest(layer, slots, n_experts)):
      futures[reader.submit(layer, e)] = (layer, e, slot)
  with tqdm(total=len(futures), desc="pinning experts", disable=not progress or not futures,
            leave=False) as bar:
    for (layer, e, slot), blob in reader.as_completed(futures):
      tiers.pin_pool(layer, e).install(e, layout.unpack(blob), slot)
      bar.update()


def _rank_mesh_pins(tiers: Tiers, reader, layer: int, layout, n_experts: int, dev_slots: int,
                    mesh, futures: dict) -> None:
  """On a mesh: each device's pool gets the hottest experts it owns, slots by heat rank (the
  same heat in every process: each sees every token's routing)."""
  local = [d for d in range(axis_size(mesh, "expert"))
           if tiers.owned[d * (n_experts // axis_size(mesh, "expert"))]]
  pins = MeshPins(layer, dev_slots, layout, mesh, n_experts, tiers.pin_tables[layer], local)
  tiers.device[layer] = pins
  ranked = tiers.heat.hottest(layer, n_experts, n_experts)
  for d in local:  # this process's indices only: another process pins its own
    own = [x for x in ranked if pins.owner(x) == d][:dev_slots]
    for slot, x in enumerate(own):
      futures[reader.submit(layer, x)] = (layer, x, slot)


def sharded_layer(store, layer: int, n_experts: int, mesh) -> ExpertPool:
  """Every expert of `layer` as a pool in slot = expert id order, split along the mesh's
  `expert` axis: each process reads only the chunks of its own devices' experts."""
  layout = store.layout(layer)
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
    rows = range(n_experts)

    def shard(index):
      r = rows[index[0]]
      return leaves(r.start, r.stop)[i][(slice(None), *index[1:])]
    return jax.make_array_from_callback((len(rows), *leaf.shape[1:]),
                                        NamedSharding(mesh, spec), shard)

  return jax.tree_util.tree_unflatten(treedef, [make(i, l) for i, l in enumerate(proto_leaves)])
