"""The expert store: quantized routed experts in tensorstore zarr v3 arrays, dense weights in
orbax checkpoints, and a manifest written last.

Layout of a store directory (format 1):

    manifest.json          written last; a directory without it is never loaded
    config.json            the source config (minus any FP8 quantization_config)
    generation_config.json, tokenizer.json, tokenizer_config.json   copied when present
    dense/<part>/          orbax checkpoints, one per part: "global" (embed, final norm,
                           lm_head), "layer_NNN" (attention, norms, router, shared expert or
                           dense MLP of layer NNN), "mtp_N" (the MTP block's dense weights).
                           With a quantized dense format (manifest quant.dense_bits 8 | 4) a
                           quantized leaf `k` is stored as two arrays, `k#packed` and
                           `k#scales`, in the QArray layout the experts use.
    experts/<group>/       zarr v3 uint8 arrays [layers, E, B]; group "main" holds the MoE
                           layers, "mtp" the MTP layer(s). One chunk = one (layer, expert) =
                           B bytes: the expert's packed weights and scales back to back, in
                           the kernel layout (see `ExpertLayout`), protected by a crc32c codec.

Reading an expert is one tensorstore read of one chunk; the bytes are then viewed (not copied or
transformed) as the `QArray`s the MoE kernels consume.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import time
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.model.config import Config
from glmjax.formats import durable
from glmjax.formats.checkpoint import require_finite
from glmjax.formats.read_buffers import ALIGN, ReadBuffers
from glmjax.errors import CheckpointError
from glmjax.model.quant import ExpertPool, ExpertWeights, QArray, qarray_shapes
from glmjax.model.weights import (ArrayInfo, Weights, abstract, dense_format, dense_only,
                                   is_info, strip_routed, to_device)

FORMAT = "glmjax-expert-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PROGRESS = ".progress.json"
CARRIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "special_tokens_map.json")
# Field offsets inside a chunk: page-aligned. (A second module constant once shadowed a 64 here,
# so every store so far was written with 4096, and `from_json` holds manifests to it.)
_FIELD_ALIGN = 4096


# --- the chunk layout ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Field:
  name: str  # gate_up.packed | gate_up.scales | down.packed | down.scales
  dtype: str
  shape: tuple[int, ...]
  offset: int

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
  """Byte layout of one expert chunk: four fields at fixed, aligned offsets."""

  bits: int
  group_size: int
  hidden: int  # D
  intermediate: int  # I
  fields: tuple[Field, ...]
  nbytes: int

  @classmethod
  def make(cls, hidden: int, intermediate: int, bits: int, group_size: int) -> "ExpertLayout":
    gu = qarray_shapes(2 * intermediate, hidden, bits, group_size)
    dn = qarray_shapes(hidden, intermediate, bits, group_size)
    fields, offset = [], 0
    for name, sds in (("gate_up.packed", gu.packed), ("gate_up.scales", gu.scales),
                      ("down.packed", dn.packed), ("down.scales", dn.scales)):
      f = Field(name, np.dtype(sds.dtype).name, tuple(sds.shape), offset)
      fields.append(f)
      offset += -(-f.nbytes // _FIELD_ALIGN) * _FIELD_ALIGN
    return cls(bits, group_size, hidden, intermediate, tuple(fields), offset)

  def pack(self, e: ExpertWeights) -> np.ndarray:
    """The chunk bytes `[B]` of one quantized expert."""
    blob = np.zeros(self.nbytes, np.uint8)
    arrays = (e.gate_up.packed, e.gate_up.scales, e.down.packed, e.down.scales)
    for f, a in zip(self.fields, arrays):
      a = np.ascontiguousarray(a)
      if a.shape != f.shape or a.dtype != np.dtype(f.dtype):
        raise ValueError(f"{f.name}: expected {f.dtype}{list(f.shape)}, got {a.dtype}{list(a.shape)}")
      blob[f.offset:f.offset + f.nbytes] = a.reshape(-1).view(np.uint8)
    return blob

  def unpack(self, blob: np.ndarray) -> ExpertWeights:
    """Views chunk bytes `[..., B]` as an expert (leading axes are kept: `[E, B]` → pool)."""
    lead = blob.shape[:-1]

    def view(f):
      part = blob[..., f.offset:f.offset + f.nbytes]
      return np.ascontiguousarray(part).view(np.dtype(f.dtype)).reshape(*lead, *f.shape)

    gp, gs, dp, ds = (view(f) for f in self.fields)
    return ExpertWeights(
        QArray(gp, gs, self.bits, self.group_size, self.hidden),
        QArray(dp, ds, self.bits, self.group_size, self.intermediate))

  def to_json(self) -> dict:
    return {"bits": self.bits, "group_size": self.group_size, "hidden": self.hidden,
            "intermediate": self.intermediate, "nbytes": self.nbytes,
            "fields": [dataclasses.asdict(f) for f in self.fields]}

  @classmethod
  def from_json(cls, d: dict) -> "ExpertLayout":
    layout = cls.make(d["hidden"], d["intermediate"], d["bits"], d["group_size"])
    if json.loads(json.dumps(layout.to_json())) != d:
      raise CheckpointError(f"expert layout in the manifest does not match format "
                            f"{FORMAT_VERSION}: {d}")
    return layout


def expert_spec(path: str, shape=None, create: bool = False) -> dict:
  """tensorstore spec of one expert array; reads of missing chunks fail instead of zero-fill."""
  spec: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path},
                          "fill_missing_data_reads": False}
  if create:
    spec["metadata"] = {
        "shape": list(shape), "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, 1, shape[2]]}},
        "codecs": [{"name": "bytes"}, {"name": "crc32c"}], "fill_value": 0}
  return spec


# --- dense parts -----------------------------------------------------------------------------

def dense_parts(tree: Weights) -> dict[str, Any]:
  """The dense (non-routed-expert) weights, split into the parts stored one orbax checkpoint
  each, so that conversion and loading only ever hold one layer's dense weights."""
  parts = {"global": {"embed": tree.embed, "norm": tree.norm, "lm_head": tree.lm_head}}
  for i, layer in enumerate(tree.layers):
    parts[f"layer_{i:03d}"] = strip_routed(layer)
  for j, m in enumerate(tree.mtp):
    parts[f"mtp_{j}"] = dataclasses.replace(m, layer=strip_routed(m.layer))
  return parts


QSUFFIXES = ("#packed", "#scales")  # a quantized leaf's two stored arrays


def stored_arrays(key: str, info: ArrayInfo, value) -> dict[str, Any]:
  """{stored key: array} of one dense leaf: itself, or a QArray's packed weights and scales."""
  if info.quantized:
    return {key + QSUFFIXES[0]: value.packed, key + QSUFFIXES[1]: value.scales}
  return {key: value}


def stored_infos(infos: dict[str, ArrayInfo]) -> dict[str, tuple[str, Any]]:
  """{stored key: (leaf key, shape struct of that stored array)} of a part's leaves."""
  out = {}
  for k, info in infos.items():
    s = info.shape_struct()
    out.update({sk: (k, a) for sk, a in stored_arrays(k, info, s).items()})
  return out


def flat_leaves(part) -> dict[str, Any]:
  """{key path: leaf} of one part (ArrayInfo or array leaves)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(part, is_leaf=is_info)
  return {jax.tree_util.keystr(p): leaf for p, leaf in flat}


def crc(a) -> int:
  return zlib.crc32(np.ascontiguousarray(np.asarray(a)).view(np.uint8).reshape(-1))


def write_manifest(dst: str, *, quant: dict, source: dict, source_config: dict, moe_layers,
                   mtp_layers, mtp_has_head: bool, experts: dict, dense: dict,
                   **extra) -> dict:
  """Writes `dst`'s manifest, last and atomically (a store without one is never loaded), from
  what the writer knows: quantization settings, the source, the MoE/MTP layers, each expert
  group's metadata and the dense checksums (`extra`: further top-level keys). Returns it."""
  manifest = {
      "format": FORMAT, "format_version": FORMAT_VERSION,
      "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "quant": quant, "source": source, "source_config": source_config,
      "moe_layers": list(moe_layers), "mtp_layers": list(mtp_layers),
      "mtp_has_head": bool(mtp_has_head), "experts": experts,
      "integrity": {"experts": "zarr v3 crc32c codec on every chunk",
                    "dense": "zlib crc32 of each array's bytes (below)"},
      "dense": dense, **extra,
  }
  durable.write_file(os.path.join(dst, MANIFEST), json.dumps(manifest, indent=1),
                     point="store.manifest")
  return manifest


def finish(dst: str) -> None:
  """Drops the progress log of `dst`, whose manifest is written: the store is complete. A
  rerun after a kill just before this (the kill point "store.finish") calls it again."""
  durable.kill_point("store.finish")
  try:
    os.remove(os.path.join(dst, PROGRESS))
  except FileNotFoundError:
    pass


# --- reading ---------------------------------------------------------------------------------

def read_manifest(path: str) -> dict:
  mpath = os.path.join(path, MANIFEST)
  if not os.path.exists(mpath):
    if os.path.exists(os.path.join(path, PROGRESS)) or os.path.isdir(os.path.join(path, "experts")):
      raise CheckpointError(f"{path}: incomplete expert store (no {MANIFEST}); the conversion "
                            "was interrupted: rerun scripts/convert.py with the same --dst")
    raise CheckpointError(f"{path}: no {MANIFEST}: not an expert store")
  try:
    with open(mpath, encoding="utf-8") as f:
      m = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{mpath}: corrupt manifest ({e})") from None
  if m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION:
    raise CheckpointError(f"{mpath}: unsupported store format {m.get('format')!r} "
                          f"v{m.get('format_version')!r} (this glmjax reads v{FORMAT_VERSION})")
  return m


def is_store(path: str) -> bool:
  return os.path.exists(os.path.join(path, MANIFEST)) or os.path.exists(
      os.path.join(path, PROGRESS))


class ExpertStore:
  """Read side of a store's routed experts: one chunk read per (layer, expert)."""

  def __init__(self, path: str, manifest: dict | None = None):
    import tensorstore as ts
    self.path = path
    self.manifest = manifest or read_manifest(path)
    self.groups = {}
    self.where = {}  # layer → (group, row)
    self._chunk_dirs: dict[str, str | None] = {}  # group → its chunk files' root (read_chunk)
    # read_chunk's buffers; none kept until an owner sets `buffers.keep_bytes` (the engine)
    self.buffers = ReadBuffers()
    for name, g in self.manifest["experts"].items():
      layout = ExpertLayout.from_json(g["layout"])
      try:
        arr = ts.open(expert_spec(os.path.join(path, g["path"]))).result()
      except ValueError as e:
        raise CheckpointError(f"{path}: cannot open expert array {g['path']}: {e}") from None
      self.groups[name] = (arr, layout)
      for row, layer in enumerate(g["layers"]):
        self.where[layer] = (name, row)

  @property
  def layers(self) -> list[int]:
    return sorted(self.where)

  def layout(self, layer: int) -> ExpertLayout:
    return self.groups[self.where[layer][0]][1]

  def read_async(self, layer: int, expert: int):
    """A tensorstore future for the chunk bytes `[B]` of (layer, expert)."""
    group, row = self.where[layer]
    return self.groups[group][0][row, expert].read()

  def read_chunk(self, layer: int, expert: int) -> np.ndarray:
    """The chunk bytes `[B]` of (layer, expert), read straight from its zarr v3 chunk file and
    checked against the file's crc32c: what `read_async` returns, without tensorstore's two
    copies of 20 MB (decode, then into the result) and the page faults of their buffers.

    Chunks of `DIRECT_MIN_BYTES` or more are read with O_DIRECT (no page-cache copy: the
    engine's host cache is the cache); smaller ones, and filesystems without O_DIRECT, read
    through the page cache. Only arrays whose codecs are exactly the store's own (little-endian
    bytes, then crc32c; default chunk keys) are read this way; others go through tensorstore.
    """
    group, row = self.where[layer]
    layout = self.groups[group][1]
    if group not in self._chunk_dirs:
      self._chunk_dirs[group] = _chunk_dir(self.path, self.manifest["experts"][group]["path"])
    root = self._chunk_dirs[group]
    if root is None:
      return self._result(self.read_async(layer, expert), f"layer {layer} expert {expert}")
    what = f"{self.path}: layer {layer} expert {expert}"
    return _read_checked(os.path.join(root, str(row), str(expert), "0"), layout.nbytes, what,
                         self.buffers)

  def read_nbytes(self, layer: int) -> int:
    """The bytes of the buffer `read_chunk` fills for one of `layer`'s chunks."""
    nbytes = self.layout(layer).nbytes
    return _read_length(nbytes, _direct(nbytes))

  def prefault_reads(self, count: int) -> int:
    """Maps `count` of `read_chunk`'s buffers now (within `buffers.keep_bytes`), so that the
    first reads do not fault theirs in; returns how many it mapped."""
    return self.buffers.prefault(self.read_nbytes(self.layers[0]), count)

  def _result(self, future, what: str) -> np.ndarray:
    try:
      return future.result()
    except ValueError as e:
      raise CheckpointError(f"{self.path}: failed to read {what}: {e}") from None

  def read(self, layer: int, expert: int) -> ExpertWeights:
    blob = self._result(self.read_async(layer, expert), f"layer {layer} expert {expert}")
    return self.layout(layer).unpack(blob)

  def read_layer(self, layer: int) -> ExpertPool:
    """Every expert of `layer` as a pool in slot = expert id order."""
    group, row = self.where[layer]
    arr, layout = self.groups[group]
    futures = [arr[row, e].read() for e in range(arr.shape[1])]
    blobs = np.stack([self._result(f, f"layer {layer} expert {e}") for e, f in enumerate(futures)])
    e = layout.unpack(blobs)
    return ExpertPool(e.gate_up, e.down)


DIRECT_MIN_BYTES = 1 << 20  # O_DIRECT for chunks this large; small ones gain from the page cache


def _chunk_dir(path: str, array_path: str) -> str | None:
  """The directory of an expert array's chunk files when its zarr.json is the layout
  `expert_spec` creates (default chunk keys "c/row/expert/0", bytes little-endian + crc32c),
  else None (read through tensorstore)."""
  try:
    with open(os.path.join(path, array_path, "zarr.json"), encoding="utf-8") as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return None
  codecs = [c.get("name") for c in meta.get("codecs", [])]
  endian = (meta.get("codecs") or [{}])[0].get("configuration", {}).get("endian", "little")
  keys = meta.get("chunk_key_encoding", {"name": "default"})
  sep = keys.get("configuration", {}).get("separator", "/")
  if codecs != ["bytes", "crc32c"] or endian != "little" or keys.get("name") != "default" or sep != "/":
    return None
  return os.path.join(path, array_path, "c")


def _direct(nbytes: int) -> bool:
  return nbytes >= DIRECT_MIN_BYTES and hasattr(os, "O_DIRECT")


def _read_length(nbytes: int, direct: bool) -> int:
  """The bytes a read of a chunk of `nbytes` (and its crc32c) fills: whole pages for O_DIRECT."""
  return -(-(nbytes + 4) // ALIGN) * ALIGN if direct else nbytes + 4


def _read_checked(fname: str, nbytes: int, what: str, buffers: ReadBuffers) -> np.ndarray:
  """`nbytes` of chunk data followed by their crc32c (little-endian), from `fname`, read into
  a buffer from `buffers` (page-aligned: O_DIRECT needs it, and JAX then takes it uncopied)."""
  import crc32c
  size = nbytes + 4
  direct = _direct(nbytes)
  fd = None
  try:
    if direct:
      try:
        fd = os.open(fname, os.O_RDONLY | os.O_DIRECT)
      except OSError as e:
        if e.errno != errno.EINVAL:  # a filesystem without O_DIRECT: buffered below
          raise
        direct = False
    if fd is None:
      fd = os.open(fname, os.O_RDONLY)
    buf = buffers.take(_read_length(nbytes, direct))
    done = 0
    while done < size:
      n = os.preadv(fd, [memoryview(buf[done:])], done)
      if n == 0:
        break
      done += n
  except OSError as e:
    raise CheckpointError(f"{what}: cannot read chunk {fname}: {e.strerror or e}") from None
  finally:
    if fd is not None:
      os.close(fd)
  if done != size:
    raise CheckpointError(f"{what}: chunk {fname} holds {done} bytes, expected {size} "
                          "(truncated or resized)")
  data = buf[:nbytes]
  want = int.from_bytes(buf[nbytes:size].tobytes(), "little")
  if crc32c.crc32c(data) != want:
    raise CheckpointError(f"{what}: chunk {fname} fails its checksum (crc32c digest mismatch): "
                          "the store is damaged")
  return data


def stored_dtype(path: str) -> str:
  """The float dtype the store's dense weights were written in (`convert --dense_dtype`)."""
  return jnp.dtype(read_manifest(path)["quant"].get("dense_dtype", "float32")).name


def dense_abstract(path: str, dtype=jnp.float32) -> tuple[Config, Weights]:
  """A store's config and the abstract tree (`ArrayInfo` leaves) of its dense weights in
  `dtype` (routed experts None; quantized leaves as the store's dense format declares them):
  what `load_dense` will allocate, known before it does."""
  manifest = read_manifest(path)
  cfg = Config.from_dict(manifest["source_config"], source=os.path.join(path, MANIFEST))
  quant = manifest["quant"]
  tree = abstract(cfg, dtype, with_mtp=bool(manifest["mtp_layers"]))
  if manifest.get("mtp_has_head"):  # the MTP layer's own shared_head.head, declared as the
    for j, m in enumerate(tree.mtp):  # converter's `plan` declares it
      m.head = dataclasses.replace(tree.embed, quantizable="head", hf_names=(
          f"model.layers.{cfg.num_hidden_layers + j}.shared_head.head.weight",))
  bits = quant.get("dense_bits", 0)
  # No first-layer key: a store written before that kind existed, its first layer at `bits`.
  tree = dense_format(tree, bits, quant.get("dense_group_size", 64),
                      quant.get("dense_first_layer_bits", bits))
  stored = jnp.dtype(quant.get("dense_dtype", "float32"))
  if (not cfg.tie_word_embeddings and not tree.embed.quantized
      and stored.itemsize < jnp.dtype(dtype).itemsize):
    # The embedding is a gather, not a matmul: its rows are upcast as they are read, to the
    # same values a wider table holds (1.9 GB saved at GLM-5's vocabulary in float32).
    tree = dataclasses.replace(tree, embed=dataclasses.replace(tree.embed, dtype=stored))
  # Without the routed experts (the tiers hold them): `load()` plans memory from these bytes,
  # which used to count every routed expert again in the dense dtype.
  return cfg, dense_only(tree)


WHOLE_PART_BYTES = 256 << 20  # dense parts up to this size are restored in one call


def _restore_groups(ckptr, part_dir: str, infos) -> list[list[str]]:
  """The part's leaf keys in restore calls: all at once for a small part, else one by one."""
  try:
    stored = ckptr.metadata(part_dir).item_metadata.tree
  except Exception as e:  # orbax raises many types; all mean a damaged part
    raise CheckpointError(f"{part_dir}: cannot read dense part metadata ({type(e).__name__}: "
                          f"{e})") from None
  missing = sorted(set(infos) - set(stored))
  if missing:
    raise CheckpointError(f"{part_dir}: dense part lacks {', '.join(missing)}")
  size = sum(int(np.prod(stored[k].shape)) * np.dtype(stored[k].dtype).itemsize for k in infos)
  keys = list(infos)
  return [keys] if size <= WHOLE_PART_BYTES else [[k] for k in keys]


def _restore(ckptr, part_dir: str, keys: list[str]) -> dict:
  """The stored arrays of `keys` of one dense part, as numpy in their stored dtype."""
  import orbax.checkpoint as ocp
  try:
    stored = ckptr.metadata(part_dir).item_metadata.tree
    item = {k: np.zeros((), stored[k].dtype) for k in keys}
    args = {k: ocp.RestoreArgs(restore_type=np.ndarray, dtype=stored[k].dtype) for k in keys}
    out = ocp.PyTreeCheckpointer().restore(part_dir, args=ocp.args.PyTreeRestore(
        item=item, restore_args=args, partial_restore=True))
  except Exception as e:  # orbax raises many types; all mean a damaged part
    raise CheckpointError(f"{part_dir}: cannot restore dense part ({type(e).__name__}: {e})"
                          ) from None
  return dict(out)


def _leaf(key: str, info: ArrayInfo, got: dict):
  """Leaf `key` from its restored arrays: the array, or the QArray of its packed weights and
  scales."""
  if not info.quantized:
    return got.pop(key)
  return QArray(got.pop(key + QSUFFIXES[0]), got.pop(key + QSUFFIXES[1]), info.bits,
                info.group_size, info.shape[-1])


def load_dense(path: str, dtype=jnp.float32, progress: bool = True, verify: bool = True
               ) -> tuple[Config, Weights]:
  """A store's config and dense weights; routed experts are left as None (served by tiers)."""
  import orbax.checkpoint as ocp
  from tqdm import tqdm

  manifest = read_manifest(path)
  cfg, tree = dense_abstract(path, dtype)
  parts = dense_parts(tree)
  ckptr = ocp.StandardCheckpointer()
  filled = {}
  for name, part in tqdm(parts.items(), desc="loading dense", disable=not progress, leave=False):
    flat, treedef = jax.tree_util.tree_flatten_with_path(part, is_leaf=is_info)
    infos = {jax.tree_util.keystr(p): i for p, i in flat}
    part_dir = os.path.abspath(os.path.join(path, "dense", name))
    sums = manifest["dense"][name]
    stored = stored_infos(infos)
    got = {}
    # Restored in the dtype the converter stored (bf16 by default): integrity is checked on
    # those bytes, and only then is each array cast to the requested dtype and the stored copy
    # dropped. A large part is restored leaf by leaf (orbax holds about twice what it
    # restores while it reads), so that loading never holds much more than the weights.
    # A quantized leaf's packed weights and scales are kept as stored (never cast).
    for keys in _restore_groups(ckptr, part_dir, stored):
      arrays = _restore(ckptr, part_dir, keys)
      for sk in keys:
        k, want = stored[sk]
        info, a = infos[k], np.asarray(arrays[sk])
        if a.shape != tuple(want.shape):
          raise CheckpointError(f"{part_dir}: {sk} ({', '.join(info.hf_names)}) has shape "
                                f"{a.shape}, the config says {tuple(want.shape)}")
        if verify and crc(a) != sums[sk]:
          raise CheckpointError(f"{part_dir}: checksum mismatch for {sk} "
                                f"({', '.join(info.hf_names)})")
        if not np.issubdtype(a.dtype, np.integer):
          require_finite(a, part_dir, ", ".join(info.hf_names))
        got[sk] = to_device(arrays.pop(sk), want.dtype if info.quantized else info.dtype)
    leaves = [_leaf(k, i, got) for k, i in infos.items()]
    filled[name] = jax.tree_util.tree_unflatten(treedef, leaves)
  g = filled["global"]
  return cfg, Weights(embed=g["embed"], layers=[filled[f"layer_{i:03d}"] for i in
                                                range(cfg.num_hidden_layers)],
                      norm=g["norm"], lm_head=g["lm_head"],
                      mtp=[filled[f"mtp_{j}"] for j in range(len(tree.mtp))])
