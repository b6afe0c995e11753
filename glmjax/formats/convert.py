"""HF checkpoint (bf16/fp16/fp32 or block-scaled FP8) → expert store.

Streams tensor by tensor: one dense part (a layer's attention, norms, router and shared expert)
or a few experts (one per worker) are in memory at a time. Resumable: finished dense parts and
expert chunks are recorded in `.progress.json` only after they are durably written, and a rerun
skips them. Atomic: `manifest.json` is written last, so an interrupted store is never loaded
(the writers' rule, `formats.durable`; its kill points here: "convert.dense_part",
"convert.expert_chunk", then the store's "store.manifest" and "store.finish").
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import threading

import numpy as np
from tqdm import tqdm

from glmjax.formats import durable, store
from glmjax.formats.calibration import METHODS, Calibration, quantize_matrix
from glmjax.formats.checkpoint import (HFCheckpoint, SCALE_SUFFIX, assemble, expand_names,
                                      fp8_block_size, plan, read_float, require_finite)
from glmjax.formats.quantize import quantize, quantize_into
from glmjax.model.config import Config
from glmjax.errors import CheckpointError, InputError
from glmjax.model.weights import DENSE_BITS, MoE, dense_format, dense_settings, leaves_with_info

_DENSE_DTYPES = ("bfloat16", "float16", "float32")


class _Progress:
  """Durable record of finished work items: an append-only log, one JSON line per item.

  The first line holds the settings; each later line one finished item (with its checksums for
  dense parts), appended and fsync'd after the item's data is durably written. Appending keeps
  marking O(1): rewriting the whole record per item was O(N²) over a model's ~19k experts. A
  torn last line (a crash mid-append) is ignored on resume: that item is simply redone.
  """

  def __init__(self, dst: str, settings: dict):
    self.path = os.path.join(dst, store.PROGRESS)
    self.lock = threading.Lock()
    self.done, self.dense = set(), {}
    old = self._read(dst) if os.path.exists(self.path) else None
    calibrated = lambda d: (d.get("method", "rtn"), d.get("calibration"))
    if old is not None and calibrated(old) != calibrated(settings):
      raise InputError(f"{dst}: holds an interrupted conversion quantized by other method or "
                       f"statistics ({calibrated(old)}); resume with the same --quant and "
                       "--calibration, or use another --dst")
    if old is not None and old != settings:
      raise CheckpointError(f"{dst}: holds an interrupted conversion with different settings "
                            f"({old}); use another --dst or delete it")
    self.f = open(self.path, "a" if old is not None else "w", encoding="utf-8")
    if old is None:  # a new log (or one cut off before its first line)
      self._append({"settings": settings})

  def _read(self, dst: str):
    """Loads the finished items; returns the recorded settings. Cuts off a torn last line."""
    with open(self.path, "rb") as f:
      data = f.read()
    lines = data.split(b"\n")
    if lines[-1]:  # no final newline: a torn append, or the former one-document format
      try:
        json.loads(lines[-1])
        with open(self.path, "ab") as f:
          f.write(b"\n")
      except ValueError:
        os.truncate(self.path, len(data) - len(lines[-1]))  # the next append starts a line
        lines.pop()
    settings = None
    for n, line in enumerate(lines):
      if not line:
        continue
      try:
        rec = json.loads(line)
      except ValueError:
        raise CheckpointError(f"{self.path}: corrupt progress record (line {n + 1}); delete "
                              f"{dst} and convert again") from None
      settings = rec.get("settings", settings)
      item = rec.get("done", [])
      if isinstance(item, str):
        self.done.add(item)
        if "dense" in rec:
          self.dense[item] = rec["dense"]
      else:  # the former format: one document with every item
        self.done.update(item)
        self.dense.update(rec.get("dense", {}))
    return settings

  def _append(self, rec: dict):
    self.f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    self.f.flush()
    os.fsync(self.f.fileno())

  def mark(self, item: str, dense_sums: dict | None = None):
    with self.lock:
      self.done.add(item)
      rec = {"done": item}
      if dense_sums is not None:
        self.dense[item] = dense_sums
        rec["dense"] = dense_sums
      self._append(rec)

  def close(self):
    self.f.close()


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
            dense_dtype: str = "bfloat16", workers: int = 4, progress: bool = True,
            dense_bits: int = 0, dense_group_size: int | None = None, quant: str = "rtn",
            calibration: str | None = None, dense_first_layer_bits: int | None = None) -> dict:
  """Converts the HF checkpoint at `src` into a store at `dst`; returns the manifest.

  `dense_bits` 8 or 4 stores the quantizable dense leaves (`ArrayInfo.quantizable`) as
  group-wise QArrays of `dense_group_size` (None: the recipe's, `weights.DENSE_GROUP_SIZES`)
  at the widths of `weights.DENSE_RECIPES`, the first
  decoder layer's at `dense_first_layer_bits` (None: the recipe's; 0: kept in `dense_dtype`);
  the other dense leaves stay in `dense_dtype`.
  `quant` "imatrix" or "gptq" quantizes the main model's routed experts with the calibration
  statistics in directory `calibration` (`formats.calibration`; same store format); the MTP
  layer's experts stay round-to-nearest."""
  import ml_dtypes
  import tensorstore as ts

  if expert_bits not in (4, 8) or mtp_bits not in (4, 8):
    raise CheckpointError(f"expert bits must be 4 or 8, got {expert_bits}/{mtp_bits}")
  if group_size < 2 or group_size % 2:
    raise CheckpointError(f"group_size must be an even number ≥ 2, got {group_size}")
  if dense_dtype not in _DENSE_DTYPES:
    raise CheckpointError(f"dense_dtype must be one of {_DENSE_DTYPES}, got {dense_dtype!r}")
  if dense_bits not in DENSE_BITS:
    raise CheckpointError(f"dense_bits must be 8 or 4 (0: unquantized), got {dense_bits}")
  try:
    # The dense format's keys appear only when it is quantized: a store converted before they
    # existed resumes, and its manifest reads the same.
    dense_quant = dense_settings(dense_bits, dense_group_size, dense_first_layer_bits)
  except ValueError as e:
    raise CheckpointError(str(e)) from None
  if os.path.abspath(src) == os.path.abspath(dst):
    raise CheckpointError(f"{dst}: destination must differ from the source")
  cfg = Config.from_json(src)
  with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
    raw_config = json.load(f)
  ckpt = HFCheckpoint(src)
  for name in sorted(ckpt.names()):  # open every shard now: a bad one fails before any work
    ckpt.info(name)
  block = fp8_block_size(src)
  tree = dense_format(plan(ckpt, cfg), dense_bits, dense_group_size, dense_first_layer_bits)
  moe_layers = [i for i, l in enumerate(tree.layers) if isinstance(l.mlp, MoE)]
  calib = _calibration(quant, calibration, moe_layers, cfg)
  calibrated = ({"method": quant, "calibration": calib.sha256} if calib is not None else {})
  if os.path.exists(os.path.join(dst, store.MANIFEST)):
    manifest = store.read_manifest(dst)
    done = {k: manifest["quant"].get(k) for k in ("method", "calibration")}
    if done != {"method": calibrated.get("method"), "calibration": calibrated.get("calibration")}:
      raise InputError(f"{dst}: a complete store quantized with {done}, not {calibrated or 'rtn'}")
    store.finish(dst)  # a kill between the manifest and dropping the progress log
    if progress:
      print(f"{dst}: already a complete store; nothing to do")
    return manifest

  _writable(dst)
  ddtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dense_dtype]
  settings = {"expert_bits": expert_bits, "mtp_bits": mtp_bits, "group_size": group_size,
              "dense_dtype": dense_dtype, **dense_quant, **calibrated, "source_config": raw_config}
  prog = _Progress(dst, settings)

  def read(name):
    return read_float(ckpt, name, block, check_finite=True)

  def read_raw(name, out):  # experts: the quantizer finds NaN/Inf in the same pass
    return read_float(ckpt, name, block, out=out)

  # Work list and byte totals for the progress bar.
  mtp_layers = [cfg.num_hidden_layers + j for j in range(len(tree.mtp))]
  groups = {"main": (moe_layers, expert_bits)}
  if mtp_layers:
    groups["mtp"] = (mtp_layers, mtp_bits)
  parts = store.dense_parts(tree)
  names = ckpt.names()
  src_bytes = {n: ckpt.nbytes(n) + (ckpt.nbytes(n + SCALE_SUFFIX) if n + SCALE_SUFFIX in names
                                     else 0)
               for i in leaves_with_info(tree) for n in expand_names(i, cfg.n_routed_experts)}
  total = sum(src_bytes.values())
  bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="converting",
             disable=not progress, smoothing=0.1)

  # Dense parts first (overlapping them with the experts on a thread measured no faster on 2
  # cores, and held the largest dense part beside the experts), then the routed experts: one
  # chunk per (layer, expert), quantized by a worker pool.
  _save_dense(parts, ckpt, cfg, dst, ddtype, read, prog, src_bytes, bar)
  group_meta, jobs = {}, []
  for gname, (layers, bits) in groups.items():
    layout = store.ExpertLayout.make(cfg.hidden_size, cfg.moe_intermediate_size, bits, group_size)
    path = os.path.join("experts", gname)
    shape = (len(layers), cfg.n_routed_experts, layout.nbytes)
    arr = ts.open(store.expert_spec(os.path.join(dst, path), shape, create=True), create=True,
                  open=True).result()
    if tuple(arr.shape) != shape:
      raise CheckpointError(f"{dst}/{path}: existing array has shape {arr.shape}, expected {shape}")
    group_meta[gname] = {"path": path, "layers": layers, "layout": layout.to_json()}
    for row, layer in enumerate(layers):
      info = (tree.layers[layer] if layer < cfg.num_hidden_layers
              else tree.mtp[layer - cfg.num_hidden_layers].layer).mlp.experts
      for e in range(cfg.n_routed_experts):
        item = f"{gname}/{layer}/{e}"
        nbytes = sum(src_bytes[n.format(e=e)] for n in info.gate_up.hf_names + info.down.hf_names)
        if item in prog.done:
          bar.update(nbytes)
        else:
          jobs.append((arr[row, e], layout, info, e, item, nbytes,
                       calib.expert(layer, e) if calib is not None and gname == "main" else None))

  def work(cell, layout, info, e, item, nbytes, stats):
    cell.write(_expert_chunk(layout, info, ckpt, read_raw, e, quant, stats)).result()
    return item, nbytes

  workers = max(1, workers)
  with cf.ThreadPoolExecutor(workers) as pool:
    # Bounded submission keeps at most 2 × workers experts queued.
    pending = set()
    for job in jobs:
      pending.add(pool.submit(work, *job))
      if len(pending) >= 2 * workers:
        pending = _drain(pending, prog, bar, wait_all=False)
    _drain(pending, prog, bar, wait_all=True)
  bar.close()

  for fname in store.CARRIED_FILES:
    if os.path.exists(os.path.join(src, fname)):
      shutil.copyfile(os.path.join(src, fname), os.path.join(dst, fname))
  out_config = {k: v for k, v in raw_config.items() if k != "quantization_config"}
  with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
    json.dump(out_config, f, indent=2)

  if calib is not None:
    calibrated["fallback_experts"] = len(calib.fallbacks())
  manifest = store.write_manifest(
      dst, quant={"expert_bits": expert_bits, "mtp_bits": mtp_bits, "group_size": group_size,
                  "scheme": "symmetric group-wise, bf16 scales, " + (
                      f"{quant}-calibrated routed experts" if calib is not None
                      else "round-to-nearest"),
                  "dense_dtype": dense_dtype, **dense_quant, **calibrated},
      source={"path": os.path.abspath(src), "fp8_block_size": block}, source_config=out_config,
      moe_layers=moe_layers, mtp_layers=mtp_layers,
      mtp_has_head=bool(tree.mtp) and tree.mtp[0].head is not None, experts=group_meta,
      dense=prog.dense)
  prog.close()
  store.finish(dst)
  return manifest


def _save_dense(parts, ckpt, cfg, dst, ddtype, read, prog, src_bytes, bar) -> None:
  """Writes the dense parts not yet done, one orbax checkpoint each, recording their checksums.

  Synchronous saves with no deep copy of each array (that copy is for callers that mutate arrays
  during an async save), uncompressed: zstd saved ~22% of the dense bytes, 1-2% of a GLM-5
  store, for ~3x this phase's CPU. StandardCheckpointer restores either kind.
  """
  import orbax.checkpoint as ocp
  registry = ocp.type_handlers.create_type_handler_registry(
      (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)))
  ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False,
                                                       type_handler_registry=registry))
  for pname, part in parts.items():
    infos = store.flat_leaves(part)
    part_bytes = sum(src_bytes[n] for i in infos.values() for n in i.hf_names)
    if pname not in prog.done:
      arrays = {}
      for k, i in infos.items():
        a = np.asarray(assemble(i, ckpt, cfg, read))
        if i.quantized:  # from the source values, as the experts are
          arrays.update(store.stored_arrays(k, i, quantize(a, i.bits, i.group_size)))
        else:
          arrays[k] = a.astype(np.float32 if np.dtype(i.dtype) == np.float32 and _keep_f32(i)
                               else ddtype, copy=False)
      # Saved beside its place and renamed in: a kill mid-save (orbax's own temporary
      # included) leaves only a temporary, which the rerun's `clear_stale` removes.
      part_dir = os.path.abspath(os.path.join(dst, "dense", pname))
      shutil.rmtree(part_dir, ignore_errors=True)
      durable.clear_stale(part_dir)
      tmp = durable.temp_path(part_dir)
      ckptr.save(tmp, arrays)
      durable.kill_point("convert.dense_part")
      os.rename(tmp, part_dir)
      prog.mark(pname, {k: store.crc(a) for k, a in arrays.items()})
      del arrays
    bar.update(part_bytes)


def _drain(pending, prog, bar, wait_all):
  done, rest = cf.wait(pending, return_when=cf.ALL_COMPLETED if wait_all else cf.FIRST_COMPLETED)
  for fut in done:
    item, nbytes = fut.result()  # re-raises a worker's CheckpointError here
    prog.mark(item)
    bar.update(nbytes)
    durable.kill_point("convert.expert_chunk")
  return rest


_scratch = threading.local()  # per worker thread: a read buffer and one chunk buffer per layout


def _buffer(key, nbytes: int) -> np.ndarray:
  """This thread's reusable uint8 buffer `key` of at least `nbytes`. Reuse matters: a fresh
  ~25 MB array per tensor costs thousands of page faults and kernel page zeroing, which
  measured more CPU than the quantization itself."""
  bufs = _scratch.__dict__.setdefault("bufs", {})
  if key not in bufs or bufs[key].size < nbytes:
    bufs[key] = np.zeros(nbytes, np.uint8)
  return bufs[key]


def _calibration(quant: str, path: str | None, moe_layers, cfg: Config):
  """The checked statistics for a calibrated `quant` (None for "rtn")."""
  if quant not in METHODS:
    raise InputError(f"quant must be one of {METHODS}, got {quant!r}")
  if quant == "rtn":
    if path is not None:
      raise InputError("--calibration is only used by --quant=imatrix or gptq")
    return None
  if path is None:
    raise InputError(f"--quant={quant} needs --calibration=STATS (scripts/calibrate.py)")
  calib = Calibration(path)
  calib.check(moe_layers, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, quant)
  return calib


def _expert_chunk(layout: store.ExpertLayout, info, ckpt: HFCheckpoint, read, e: int,
                  quant: str = "rtn", stats: dict | None = None) -> np.ndarray:
  """The chunk bytes of expert `e`: each source matrix is read into a reused buffer and
  quantized straight into its rows of the chunk (no fused gate_up copy, no per-field arrays to
  pack afterwards). The chunk is this thread's buffer: valid until its next call. Its
  alignment gaps are never written, so they stay zero. With `stats` (the expert's calibration
  statistics) the matrices are quantized by `quant` instead of round-to-nearest."""
  blob = _buffer(("chunk", layout), layout.nbytes)[:layout.nbytes]
  fields = {f.name: f for f in layout.fields}

  def view(name):
    f = fields[name]
    return blob[f.offset:f.offset + f.nbytes].view(f.dtype).reshape(f.shape)

  for key, matrix in (("gate_up", info.gate_up), ("down", info.down)):
    packed, scales = view(key + ".packed"), view(key + ".scales")
    rows = packed.shape[0] // len(matrix.hf_names)
    want = (rows, matrix.shape[-1])
    for j, fmt in enumerate(matrix.hf_names):
      name = fmt.format(e=e)
      a = read(name, _buffer("read", ckpt.nbytes(name)))
      if tuple(a.shape) != want:
        raise CheckpointError(f"{ckpt.path}: tensor {name}: shape {tuple(a.shape)}, expected "
                              f"{want} for this config")
      part = slice(j * rows, (j + 1) * rows)
      if stats is not None:
        require_finite(a, ckpt.path, name)
        q = quantize_matrix(a, quant, stats, key, layout.bits, layout.group_size)
        packed[part], scales[part] = q.packed, q.scales
      elif quantize_into(a, layout.bits, layout.group_size, packed[part], scales[part]):
        require_finite(a, ckpt.path, name)  # raises, naming the tensor
  return blob


def _keep_f32(info) -> bool:
  """Router weights, the routing bias and the indexer's head weights stay float32."""
  name = info.hf_names[0]
  return name.endswith(("mlp.gate.weight", "e_score_correction_bias", "weights_proj.weight"))
