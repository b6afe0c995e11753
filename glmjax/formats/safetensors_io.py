"""Lazy reading and writing of the safetensors format, with every dtype GLM-5 ships.

Hand-written because the `safetensors` package's numpy and flax front ends refuse bfloat16 and
float8 tensors (they need torch), and torch is a test-only dependency here. The format is small:
an 8-byte little-endian header length, a JSON header of {name: {dtype, shape, data_offsets}},
then the raw bytes. Tensors are read one at a time with pread, so a checkpoint is never
in memory at once, and the header is checked against the file size so a truncated shard is
reported before any tensor is used.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from glmjax.errors import CheckpointError

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20


class SafetensorsFile:
  """One `.safetensors` file, validated on open and read tensor by tensor."""

  def __init__(self, path: str):
    self.path = path
    try:
      size = os.path.getsize(path)
      with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
          raise CheckpointError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
          raise CheckpointError(f"{path}: truncated or corrupt safetensors header ({n} bytes "
                                f"claimed, file is {size} bytes)")
        header = json.loads(f.read(n))
    except FileNotFoundError:
      raise CheckpointError(f"{path}: safetensors file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
      raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
    header.pop("__metadata__", None)
    self._base = 8 + n
    self._entries = {}
    for name, e in header.items():
      dtype = DTYPES.get(e.get("dtype"))
      if dtype is None:
        raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {e.get('dtype')!r}")
      shape = tuple(e["shape"])
      lo, hi = e["data_offsets"]
      if hi - lo != int(np.prod(shape)) * np.dtype(dtype).itemsize:
        raise CheckpointError(f"{path}: tensor {name} byte range does not match shape {shape}")
      if self._base + hi > size:
        raise CheckpointError(f"{path}: truncated file: tensor {name} ends at byte "
                              f"{self._base + hi} but the file has {size} bytes")
      self._entries[name] = (np.dtype(dtype), shape, lo)

  def keys(self):
    return self._entries.keys()

  def info(self, name):
    """(dtype, shape) of tensor `name`."""
    dtype, shape, _ = self._entries[name]
    return dtype, shape

  def read(self, name, out: np.ndarray | None = None) -> np.ndarray:
    """The tensor, read with one pread into a fresh buffer, or into the uint8 buffer `out`
    (at least the tensor's size; the result is then a view of it, valid until it is reused).

    Not a memory map: mapped pages stay in the process's RSS after use, so streaming a
    checkpoint through a map would grow RSS to the checkpoint's size. A reused `out` also
    spares the page faults (and kernel zeroing) of a fresh allocation per tensor.
    """
    dtype, shape, lo = self._entries[name]
    n = int(np.prod(shape)) * dtype.itemsize
    if out is None:
      buf = np.empty(n, np.uint8)  # not bytearray(n): that zero-fills what the read overwrites
    else:
      if out.dtype != np.uint8 or out.ndim != 1 or out.size < n or not out.flags.c_contiguous:
        raise ValueError(f"out: need a contiguous uint8 buffer of ≥ {n} bytes for {name}")
      buf = out[:n]
    fd = os.open(self.path, os.O_RDONLY)
    try:
      got, view = 0, memoryview(buf)
      while got < n:
        k = os.preadv(fd, [view[got:]], self._base + lo + got)
        if k <= 0:
          raise CheckpointError(f"{self.path}: short read of tensor {name}")
        got += k
    finally:
      os.close(fd)
    return buf.view(dtype).reshape(shape)


def write(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
  """Writes `tensors` atomically (to a temporary name, then renamed)."""
  header, offset = {}, 0
  arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
  for name, a in arrays.items():
    if a.dtype not in _NAMES:
      raise ValueError(f"tensor {name}: dtype {a.dtype} cannot be written to safetensors")
    header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
  if metadata:
    header["__metadata__"] = metadata
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for a in arrays.values():
      f.write(a.tobytes())
  os.replace(tmp, path)
