"""The sharding plan: the logical axes declared in `glmjax.model.weights` mapped onto a mesh.

A mesh's axis names come from `MESH_AXES`. `RULES` sends each logical axis to at most one mesh
axis: routed experts along `expert`, attention heads and dense MLP columns along `tensor`,
batch along `data`; every other logical axis (embed, vocab, norms, latent ranks, the router's
expert scores) is replicated. A mesh axis missing from the mesh, or of size 1, shards nothing.

The same plan drives loading (`glmjax.formats.checkpoint.load_hf` reads only each process's
shards through `jax.make_array_from_callback`) and the jitted forward (GSPMD partitions the
dense math from the weights' shardings; the MoE block runs under `shard_map`,
`glmjax.model.forward.sharded_experts`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from glmjax.errors import InputError
from glmjax.model.config import Config
from glmjax.model.quant import QArray
from glmjax.model.weights import ArrayInfo, MoE, Weights, abstract, is_info, map_infos

MESH_AXES = ("data", "expert", "tensor")

# logical axis → mesh axis. Router scores ("router") stay replicated: every token needs all E
# of them for its top-k, and an all-gather there would buy nothing at these sizes.
RULES = (("experts", "expert"), ("heads", "tensor"), ("mlp", "tensor"), ("batch", "data"))


def check_mesh(mesh, cfg: Config) -> None:
  """Raises InputError unless `mesh` is a Mesh over `MESH_AXES` names that fits `cfg`."""
  if not isinstance(mesh, Mesh):
    raise InputError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  unknown = [a for a in mesh.axis_names if a not in MESH_AXES]
  if unknown:
    raise InputError(f"mesh axis name(s) {unknown} unknown; a mesh's axes come from "
                     f"{list(MESH_AXES)}")
  e, n = cfg.n_routed_experts, axis_size(mesh, "expert")
  if e % n:
    raise InputError(f"the mesh's expert axis ({n} devices) must divide the model's "
                     f"{e} routed experts")


def axis_size(mesh: Mesh | None, name: str) -> int:
  """Devices along mesh axis `name` (1 when the mesh lacks it)."""
  return 1 if mesh is None or name not in mesh.axis_names else int(mesh.shape[name])


def spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh, where: str = "") -> P:
  """The PartitionSpec of a leaf with logical `axes` under `RULES` on `mesh`.

  A dimension goes to a mesh axis only when that axis is in the mesh with more than one device
  and not already used by an earlier dimension; a dimension it does not divide is an error
  (silently replicating would hide a plan that does not hold).
  """
  rules, used, out = dict(RULES), set(), []
  for logical, size in zip(axes, shape):
    target = rules.get(logical)
    if target is None or axis_size(mesh, target) == 1 or target in used:
      out.append(None)
      continue
    if size % axis_size(mesh, target):
      raise InputError(f"{where}: dimension {logical!r} of size {size} is not divisible by the "
                       f"mesh's {target} axis ({axis_size(mesh, target)} devices)")
    used.add(target)
    out.append(target)
  return P(*out)


def shardings(tree: Weights, mesh: Mesh) -> Weights:
  """The `NamedSharding` of every `ArrayInfo` leaf of an abstract tree (same structure)."""
  def one(info: ArrayInfo):
    return NamedSharding(mesh, spec(info.axes, info.shape, mesh, ", ".join(info.hf_names)))
  return map_infos(one, tree)


def place_dense(dense: Weights, cfg: Config, mesh: Mesh) -> Weights:
  """A store's dense weights (routed experts None; `glmjax.formats.store.load_dense`) moved
  onto `mesh` by the plan."""
  tree = abstract(cfg, with_mtp=bool(dense.mtp))
  for lw in tree.layers + [m.layer for m in tree.mtp]:
    if isinstance(lw.mlp, MoE):
      lw.mlp.experts = None
  for m, d in zip(tree.mtp, dense.mtp):
    m.head = None if d.head is None else tree.embed
  def place(info: ArrayInfo, a):
    where = ", ".join(info.hf_names)
    if isinstance(a, QArray):  # packed weights and scales split by rows as the float matrix
      # is; their last axes (packed inputs, groups) stay whole on each device.
      return dataclasses.replace(a, **{f: put(x, NamedSharding(mesh, spec(
          (*info.axes[:-1], None), x.shape, mesh, where))) for f, x in
          (("packed", a.packed), ("scales", a.scales))})
    return put(a, NamedSharding(mesh, spec(info.axes, info.shape, mesh, where)))

  return jax.tree_util.tree_map(place, tree, dense, is_leaf=is_info)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_split(mesh: Mesh) -> NamedSharding:
  """Inputs `[B, ...]` with the batch along `data` (the `batch` rule)."""
  return NamedSharding(mesh, P(dict(RULES)["batch"]))


def gather(x: jax.Array, mesh: Mesh) -> jax.Array:
  """`x` replicated on every device of `mesh` (a jitted identity: works across processes)."""
  return jax.jit(lambda a: a, out_shardings=replicated(mesh))(x)


def put(x, sharding: NamedSharding) -> jax.Array:
  """A host value (identical on every process) as a global array with `sharding`: each process
  builds only its addressable shards, so this works across processes too."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def describe(mesh: Mesh | None) -> dict | None:
  """{axis: size} of `mesh` in axis order, or None."""
  return None if mesh is None else {a: int(mesh.shape[a]) for a in mesh.axis_names}


def parse(text: str) -> dict[str, int]:
  """"expert:4" or "expert:2,tensor:2" → {"expert": 4} (InputError on anything else)."""
  out: dict[str, int] = {}
  for part in (p.strip() for p in text.split(",") if p.strip()):
    name, sep, size = part.partition(":")
    if not sep or not size.isdigit() or int(size) < 1:
      raise InputError(f"--mesh wants axis:size pairs such as expert:2,tensor:2, got {text!r}")
    if name not in MESH_AXES:
      raise InputError(f"--mesh axis {name!r} unknown; axes come from {list(MESH_AXES)}")
    if name in out:
      raise InputError(f"--mesh names axis {name!r} twice")
    out[name] = int(size)
  if not out:
    raise InputError("--mesh is empty")
  return out


def make_mesh(sizes: dict[str, int], devices=None) -> Mesh:
  """A Mesh of `sizes` over `devices` (default: every global device, which the sizes must use
  exactly)."""
  devices = jax.devices() if devices is None else list(devices)
  n = int(np.prod(list(sizes.values())))
  if n != len(devices):
    raise InputError(f"mesh {sizes} needs {n} devices; {len(devices)} are available")
  return Mesh(np.asarray(devices).reshape(tuple(sizes.values())), tuple(sizes))
