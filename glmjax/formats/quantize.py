"""Weight conversion to the quantized expert format: the numba group-wise quantizer and the
block-scaled FP8 dequantizer of HF checkpoints.

The format itself (rounding rule, nibble layout, ``QArray``) is defined in
``glmjax.model.quant``; this module writes it. ``quantize_into`` fills caller-owned views (the
converter's store chunks) with the GIL released, so converter threads quantize in parallel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from glmjax.model.quant import QMAX, QMIN, ExpertWeights, QArray, check_bits_group


def pack_int4(q: np.ndarray, group_size: int) -> np.ndarray:
  """Packs int values in [-8, 7], shape ``[..., Kp]``, into uint8 ``[..., Kp/2]``.

  Uses the split-group nibble layout of ``glmjax.model.quant``; Kp must be a
  multiple of ``group_size``.
  """
  q = np.asarray(q)
  check_bits_group(4, group_size)
  if q.shape[-1] % group_size:
    raise ValueError(
        f"q: last dim {q.shape[-1]} is not a multiple of group_size "
        f"{group_size}")
  if q.size and (q.min() < -8 or q.max() > 7):
    raise ValueError("q: values must lie in [-8, 7]")
  half = group_size // 2
  u = (q.astype(np.int16) + 8).astype(np.uint8)
  u = u.reshape(*q.shape[:-1], q.shape[-1] // group_size, 2, half)
  packed = u[..., 0, :] | (u[..., 1, :] << 4)  # [..., Kp/G, G/2]
  return packed.reshape(*q.shape[:-1], q.shape[-1] // 2)


def quantize(w, bits: int = 4, group_size: int = 64) -> QArray:
  """Group-wise symmetric quantization of ``w [..., O, K]`` (numpy, host side).

  The result is the float64 rule of ``glmjax.model.quant``, bit for bit (see
  ``quantize_into`` for how the kernel gets there without float64 work).
  """
  check_bits_group(bits, group_size)
  w = np.asarray(w)
  if w.ndim < 2:
    raise ValueError(f"w: expected [..., O, K], got shape {w.shape}")
  k = w.shape[-1]
  kp = -(-k // group_size) * group_size
  packed = np.empty((*w.shape[:-1], kp // 2 if bits == 4 else kp),
                    np.uint8 if bits == 4 else np.int8)
  scales = np.empty((*w.shape[:-1], kp // group_size), ml_dtypes.bfloat16)
  rows = int(np.prod(w.shape[:-1]))
  if quantize_into(w.reshape(rows, k), bits, group_size, packed.reshape(rows, -1),
                   scales.reshape(rows, -1)):
    raise ValueError("w: contains non-finite values")
  return QArray(packed=packed, scales=scales, bits=bits,
                group_size=group_size, in_features=k)


def quantize_into(w, bits: int, group_size: int, packed: np.ndarray,
                  scales: np.ndarray) -> int:
  """Quantizes rows ``w [O, K]`` into caller-owned ``packed`` and ``scales``.

  ``packed``: uint8 (int4) or int8/uint8 (int8) ``[O, Kp/2 or Kp]``;
  ``scales``: bf16 or uint16 ``[O, Kp/G]``; both C-contiguous (they may be
  views into a store chunk, so nothing is copied afterwards). Returns the
  number of groups holding NaN/Inf (0 when clean); those groups are written
  as zeros, and the caller decides how to report them.

  A numba kernel, one pass over ``w`` with the GIL released, so threads
  quantize experts in parallel. For 16/32-bit float inputs its float32
  arithmetic gives the float64 rule's result exactly: amax is exact; the
  scale is ``f32(f64(amax) / qmax)`` rounded to bf16, the same two roundings
  ``astype(bfloat16)`` makes from float64; and ``rint(f32(w / s))`` equals
  the rounding of the exact quotient, because a tie ``(k + 1/2) * s`` has at
  most 17 significant bits, so a ``w`` off it is at least one ulp(w) away, a
  relative 2^-24 or more, which keeps the float32 quotient off the tie.
  float64 inputs are divided in float64.
  """
  check_bits_group(bits, group_size)
  w = np.asarray(w)
  if w.ndim != 2:
    raise ValueError(f"w: expected [O, K], got shape {w.shape}")
  o, k = w.shape
  kp = -(-k // group_size) * group_size
  want = ((o, kp // 2 if bits == 4 else kp), (o, kp // group_size))
  for name, a, shape in (("packed", packed, want[0]), ("scales", scales, want[1])):
    if a.shape != shape or not a.flags.c_contiguous or a.itemsize != (1 if name == "packed" else 2):
      raise ValueError(f"{name}: expected a C-contiguous {shape} array, got {a.dtype}{a.shape}")
  if w.dtype == ml_dtypes.bfloat16:
    src, kind, ftype = w.view(np.uint16), 0, np.float32
  elif w.dtype == np.float32:
    src, kind, ftype = w, 1, np.float32
  elif w.dtype == np.float64:
    src, kind, ftype = w, 2, np.float64
  else:  # float16 and others widen exactly to float32 or float64 first
    wide = np.float32 if w.dtype.itemsize <= 2 and w.dtype.kind == "f" else np.float64
    return quantize_into(w.astype(wide), bits, group_size, packed, scales)
  buf = np.zeros(kp, ftype)  # one row, zero-padded to whole groups
  return int(_kernel()(np.ascontiguousarray(src), kind, QMAX[bits], QMIN[bits], bits,
                       group_size, packed.view(np.uint8), scales.view(np.uint16), buf,
                       buf.view(np.uint32 if ftype == np.float32 else np.uint64)))


_KERNEL = []


def _kernel():
  """The compiled row kernel (numba is imported on first use; builds are cached on disk)."""
  if not _KERNEL:
    import numba
    from pallas_kernels import numba_cache
    numba_cache.install()  # processes that compile at once keep numba's cache consistent
    _KERNEL.append(numba.njit(nogil=True, cache=True)(_quantize_rows))
  return _KERNEL[0]


def _quantize_rows(src, kind, qmax, qmin, bits, g, packed, scales, buf, bufu):
  """Kernel body of ``quantize_into`` (numba). ``kind``: 0 bf16 bits, 1 f32,
  2 f64; ``buf``/``bufu`` are one float row and its bits.

  Loops index [group, j] views with ``range(g)`` counters: numba cannot prove
  ``k0 + j`` non-negative, and its negative-index wraparound check then stops
  LLVM from vectorizing (measured 8x slower on the amax loop).
  """
  o_rows, k = src.shape
  ngroups = buf.shape[0] // g
  half = g // 2
  wide = kind == 2
  fmax, fmin = np.float32(qmax), np.float32(qmin)
  one_f = np.zeros(1, np.float32)  # scalar bit casts go through one-element arrays
  one_u = one_f.view(np.uint32)
  qbuf = np.zeros(g, np.int32)
  bg, bug = buf.reshape(ngroups, g), bufu.reshape(ngroups, g)
  bad = 0
  for o in range(o_rows):
    row = src[o]
    if kind == 0:  # bf16 bits are the high half of float32's
      for j in range(k):
        bufu[j] = np.uint32(row[j]) << 16
    else:
      for j in range(k):
        buf[j] = row[j]
    prow = packed[o].reshape(ngroups, half if bits == 4 else g)
    for gi in range(ngroups):
      gf = bg[gi]
      if wide:
        amax = 0.0
        finite = 0.0
        for j in range(g):
          a = abs(gf[j])
          amax = a if a > amax else amax
          finite += gf[j] * 0.0  # NaN unless every element is finite
        ok = finite == 0.0
      else:
        # |w| as float32 bits: an integer max is exact, vectorizes, and bits >= inf's
        # mean a NaN/Inf in the group.
        gu = bug[gi]
        m = np.uint32(0)
        for j in range(g):
          y = gu[j] & np.uint32(0x7FFFFFFF)
          m = y if y > m else m
        ok = m < np.uint32(0x7F800000)
        one_u[0] = m
        amax = np.float64(one_f[0])
      if not ok:
        bad += 1
        amax = 0.0
      one_f[0] = np.float32(amax / qmax)
      b = one_u[0]
      b = (b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) >> 16  # to bf16, nearest-even
      scales[o, gi] = np.uint16(b)
      one_u[0] = b << 16
      s = one_f[0]
      if s == 0:
        for j in range(g):
          qbuf[j] = 0
      elif wide:
        for j in range(g):
          r = np.rint(gf[j] / np.float64(s))
          qbuf[j] = np.int32(min(max(r, qmin), qmax))
      else:
        for j in range(g):
          r = np.rint(gf[j] / s)
          r = r if r > fmin else fmin
          r = r if r < fmax else fmax
          qbuf[j] = np.int32(r)
      pg = prow[gi]
      if bits == 4:
        for j in range(half):
          pg[j] = np.uint8((qbuf[j] + 8) | ((qbuf[j + half] + 8) << 4))
      else:
        for j in range(g):
          pg[j] = np.uint8(qbuf[j] & 0xFF)
  return bad


def quantize_expert(gate, up, down, bits: int = 4,
                    group_size: int = 64) -> ExpertWeights:
  """Quantizes one expert: gate/up ``[I, D]`` fused to ``[2I, D]``; down ``[D, I]``."""
  gate, up, down = np.asarray(gate), np.asarray(up), np.asarray(down)
  if gate.ndim != 2 or gate.shape != up.shape:
    raise ValueError(
        f"gate/up: expected equal [I, D] shapes, got {gate.shape} and "
        f"{up.shape}")
  i, d = gate.shape
  if down.shape != (d, i):
    raise ValueError(f"down: expected [D, I] = {(d, i)}, got {down.shape}")
  gate_up = np.concatenate([gate, up], axis=0)  # [2I, D]
  return ExpertWeights(quantize(gate_up, bits, group_size),
                       quantize(down, bits, group_size))


def fp8_block_dequantize(w_fp8, scale_inv, block_size=(128, 128)):
  """Block-scaled FP8 -> float32: ``w[i, j] = fp8[i, j] * scale_inv[i // bo, j // bi]``.

  This is the HF GLM-5-FP8 ``weight_scale_inv`` convention. Edge blocks may be
  partial, so ``scale_inv`` is ``[..., ceil(O/bo), ceil(I/bi)]``. Works on
  numpy (host) or jax arrays; returns the same kind.
  """
  bo, bi = (int(b) for b in block_size)
  if bo <= 0 or bi <= 0:
    raise ValueError(f"block_size: must be positive, got {block_size}")
  xp = jnp if isinstance(w_fp8, jax.Array) else np
  w = xp.asarray(w_fp8)
  s = xp.asarray(scale_inv)
  if w.ndim < 2:
    raise ValueError(f"w_fp8: expected [..., O, I], got shape {w.shape}")
  o, i = w.shape[-2:]
  want = (*w.shape[:-2], -(-o // bo), -(-i // bi))
  if tuple(s.shape) != want:
    raise ValueError(
        f"scale_inv: expected shape {want} for weight {tuple(w.shape)} and "
        f"block_size {(bo, bi)}, got {tuple(s.shape)}")
  # Expand the scales to element resolution; partial edge blocks are cut off.
  s_full = xp.repeat(xp.repeat(s.astype(xp.float32), bo, axis=-2), bi, axis=-1)
  return w.astype(xp.float32) * s_full[..., :o, :i]
