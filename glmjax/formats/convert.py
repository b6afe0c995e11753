"""HF checkpoint (bf16/fp16/fp32 or block-scaled FP8) → expert store.

Streams tensor by tensor: one dense part (a layer's attention, norms, router and shared expert)
or a few experts (one per worker) are in memory at a time. Resumable: finished dense parts and
expert chunks are recorded in `.progress.json` only after they are durably written, and a rerun
skips them. Atomic: `manifest.json` is written last, so an interrupted store is never loaded.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import threading
import time

import numpy as np
from tqdm import tqdm

from glmjax.formats import store
from glmjax.formats.checkpoint import (HFCheckpoint, SCALE_SUFFIX, assemble, expand_names, fp8_block_size,
                               plan, read_float)
from glmjax.model.config import Config
from glmjax.errors import CheckpointError
from glmjax.model.quant import quantize_expert
from glmjax.model.weights import MoE, leaves_with_info

_DENSE_DTYPES = ("bfloat16", "float16", "float32")
# Test hook: exit abruptly after this many expert chunks, as a kill would.
_ABORT_ENV = "GLMJAX_CONVERT_ABORT_AFTER"


class _Progress:
  """Durable record of finished work items, rewritten atomically."""

  def __init__(self, dst: str, settings: dict):
    self.path = os.path.join(dst, store.PROGRESS)
    self.lock = threading.Lock()
    state = {"settings": settings, "done": [], "dense": {}}
    if os.path.exists(self.path):
      with open(self.path, encoding="utf-8") as f:
        old = json.load(f)
      if old.get("settings") != settings:
        raise CheckpointError(f"{dst}: holds an interrupted conversion with different settings "
                              f"({old.get('settings')}); use another --dst or delete it")
      state = old
    self.state = state
    self.done = set(state["done"])

  def mark(self, item: str, dense_sums: dict | None = None):
    with self.lock:
      self.done.add(item)
      if dense_sums is not None:
        self.state["dense"][item] = dense_sums
      self.state["done"] = sorted(self.done)
      tmp = self.path + ".tmp"
      with open(tmp, "w", encoding="utf-8") as f:
        json.dump(self.state, f)
      os.replace(tmp, self.path)


def _writable(dst: str) -> None:
  try:
    os.makedirs(dst, exist_ok=True)
    probe = os.path.join(dst, ".write-probe")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise CheckpointError(f"{dst}: destination is not writable ({e.strerror})") from None


def convert(src: str, dst: str, expert_bits: int = 4, group_size: int = 64, mtp_bits: int = 8,
            dense_dtype: str = "bfloat16", workers: int = 2, progress: bool = True) -> dict:
  """Converts the HF checkpoint at `src` into a store at `dst`; returns the manifest."""
  import ml_dtypes
  import orbax.checkpoint as ocp
  import tensorstore as ts

  if expert_bits not in (4, 8) or mtp_bits not in (4, 8):
    raise CheckpointError(f"expert bits must be 4 or 8, got {expert_bits}/{mtp_bits}")
  if group_size < 2 or group_size % 2:
    raise CheckpointError(f"group_size must be an even number ≥ 2, got {group_size}")
  if dense_dtype not in _DENSE_DTYPES:
    raise CheckpointError(f"dense_dtype must be one of {_DENSE_DTYPES}, got {dense_dtype!r}")
  if os.path.abspath(src) == os.path.abspath(dst):
    raise CheckpointError(f"{dst}: destination must differ from the source")
  cfg = Config.from_json(src)
  with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
    raw_config = json.load(f)
  ckpt = HFCheckpoint(src)
  for name in sorted(ckpt.names()):  # open every shard now: a bad one fails before any work
    ckpt.info(name)
  block = fp8_block_size(src)
  tree = plan(ckpt, cfg)
  if os.path.exists(os.path.join(dst, store.MANIFEST)):
    manifest = store.read_manifest(dst)
    if progress:
      print(f"{dst}: already a complete store; nothing to do")
    return manifest

  _writable(dst)
  ddtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dense_dtype]
  settings = {"expert_bits": expert_bits, "mtp_bits": mtp_bits, "group_size": group_size,
              "dense_dtype": dense_dtype, "source_config": raw_config}
  prog = _Progress(dst, settings)

  def read(name):
    return read_float(ckpt, name, block, check_finite=True)

  # Work list and byte totals for the progress bar.
  moe_layers = [i for i, l in enumerate(tree.layers) if isinstance(l.mlp, MoE)]
  mtp_layers = [cfg.num_hidden_layers + j for j in range(len(tree.mtp))]
  groups = {"main": (moe_layers, expert_bits)}
  if mtp_layers:
    groups["mtp"] = (mtp_layers, mtp_bits)
  parts = store.dense_parts(tree)
  names = ckpt.names()
  src_bytes = {n: _src_nbytes(ckpt, n) + (_src_nbytes(ckpt, n + SCALE_SUFFIX)
                                           if n + SCALE_SUFFIX in names else 0)
               for i in leaves_with_info(tree) for n in expand_names(i, cfg.n_routed_experts)}
  total = sum(src_bytes.values())
  bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="converting",
             disable=not progress, smoothing=0.1)
  abort_after = int(os.environ.get(_ABORT_ENV, "0"))
  written = [0]

  # Dense parts, one orbax checkpoint each.
  ckptr = ocp.StandardCheckpointer()
  for pname, part in parts.items():
    infos = store.flat_leaves(part)
    part_bytes = sum(src_bytes[n] for i in infos.values() for n in i.hf_names)
    if pname in prog.done:
      bar.update(part_bytes)
      continue
    arrays = {k: np.asarray(assemble(i, ckpt, cfg, read)).astype(
        np.float32 if np.dtype(i.dtype) == np.float32 and _keep_f32(i) else ddtype)
        for k, i in infos.items()}
    part_dir = os.path.abspath(os.path.join(dst, "dense", pname))
    shutil.rmtree(part_dir, ignore_errors=True)
    ckptr.save(part_dir, arrays)
    ckptr.wait_until_finished()
    prog.mark(pname, {k: store.crc(a) for k, a in arrays.items()})
    bar.update(part_bytes)
    del arrays

  # Routed experts: one chunk per (layer, expert), quantized by a worker pool.
  group_meta = {}
  for gname, (layers, bits) in groups.items():
    layout = store.ExpertLayout.make(cfg.hidden_size, cfg.moe_intermediate_size, bits, group_size)
    path = os.path.join("experts", gname)
    shape = (len(layers), cfg.n_routed_experts, layout.nbytes)
    arr = ts.open(store.expert_spec(os.path.join(dst, path), shape, create=True), create=True,
                  open=True).result()
    if tuple(arr.shape) != shape:
      raise CheckpointError(f"{dst}/{path}: existing array has shape {arr.shape}, expected {shape}")
    group_meta[gname] = {"path": path, "layers": layers, "layout": layout.to_json()}
    exp_infos = {l: (tree.layers[l] if l < cfg.num_hidden_layers
                     else tree.mtp[l - cfg.num_hidden_layers].layer).mlp.experts for l in layers}

    def work(row, layer, e, arr=arr, layout=layout, bits=bits, exp_infos=exp_infos):
      info = exp_infos[layer]
      gate_up = assemble(info.gate_up, ckpt, cfg, read, expert=e)  # [2I, D]
      down = assemble(info.down, ckpt, cfg, read, expert=e)  # [D, I]
      i = cfg.moe_intermediate_size
      blob = layout.pack(quantize_expert(gate_up[:i], gate_up[i:], down, bits, group_size))
      arr[row, e].write(blob).result()
      return f"{gname}/{layer}/{e}", sum(src_bytes[n.format(e=e)] for n in
                                         info.gate_up.hf_names + info.down.hf_names)

    jobs = [(row, layer, e) for row, layer in enumerate(layers)
            for e in range(cfg.n_routed_experts) if f"{gname}/{layer}/{e}" not in prog.done]
    skipped = sum(src_bytes[n.format(e=e)] for row, layer in enumerate(layers)
                  for e in range(cfg.n_routed_experts) if f"{gname}/{layer}/{e}" in prog.done
                  for n in exp_infos[layer].gate_up.hf_names + exp_infos[layer].down.hf_names)
    bar.update(skipped)
    with cf.ThreadPoolExecutor(max(1, workers)) as pool:
      # Bounded submission keeps at most 2 × workers experts in memory.
      pending = set()
      for job in jobs:
        pending.add(pool.submit(work, *job))
        if len(pending) >= 2 * max(1, workers):
          pending = _drain(pending, prog, bar, written, abort_after, wait_all=False)
      _drain(pending, prog, bar, written, abort_after, wait_all=True)
  bar.close()

  for fname in store.CARRIED_FILES:
    if os.path.exists(os.path.join(src, fname)):
      shutil.copyfile(os.path.join(src, fname), os.path.join(dst, fname))
  out_config = {k: v for k, v in raw_config.items() if k != "quantization_config"}
  with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
    json.dump(out_config, f, indent=2)

  manifest = {
      "format": store.FORMAT, "format_version": store.FORMAT_VERSION,
      "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "quant": {"expert_bits": expert_bits, "mtp_bits": mtp_bits, "group_size": group_size,
                "scheme": "symmetric group-wise, bf16 scales, round-to-nearest",
                "dense_dtype": dense_dtype},
      "source": {"path": os.path.abspath(src), "fp8_block_size": block},
      "source_config": out_config,
      "moe_layers": moe_layers, "mtp_layers": mtp_layers,
      "mtp_has_head": bool(tree.mtp) and tree.mtp[0].head is not None,
      "experts": group_meta,
      "integrity": {"experts": "zarr v3 crc32c codec on every chunk",
                    "dense": "zlib crc32 of each array's bytes (below)"},
      "dense": prog.state["dense"],
  }
  tmp = os.path.join(dst, store.MANIFEST + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(manifest, f, indent=1)
  os.replace(tmp, os.path.join(dst, store.MANIFEST))
  os.remove(prog.path)
  return manifest


def _drain(pending, prog, bar, written, abort_after, wait_all):
  done, rest = cf.wait(pending, return_when=cf.ALL_COMPLETED if wait_all else cf.FIRST_COMPLETED)
  for fut in done:
    item, nbytes = fut.result()  # re-raises a worker's CheckpointError here
    prog.mark(item)
    bar.update(nbytes)
    written[0] += 1
    if abort_after and written[0] >= abort_after:
      os._exit(137)
  return rest


def _keep_f32(info) -> bool:
  """Router weights, the routing bias and the indexer's head weights stay float32."""
  name = info.hf_names[0]
  return name.endswith(("mlp.gate.weight", "e_score_correction_bias", "weights_proj.weight"))


def _src_nbytes(ckpt: HFCheckpoint, name: str) -> int:
  dtype, shape = ckpt.info(name)
  return int(np.prod(shape)) * dtype.itemsize
