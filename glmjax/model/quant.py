"""Group-wise quantized weights as a JAX pytree, and the MoE expert layout.

Quantization
------------
A logical weight ``W [..., O, K]`` (HF orientation: out x in, contraction axis
last) is quantized symmetrically with one scale per (row, group of G input
features). K is zero-padded to ``Kp = ceil(K / G) * G``. For each group::

    s = bf16(amax(|w_group|) / qmax)        # qmax = 7 (int4) or 127 (int8)
    q = clamp(rint(w / s), -8, 7)            # int4;  [-127, 127] for int8

The scale is rounded to bfloat16 *before* the division, so ``q * s`` with the
stored scale is what the rounding decision was made against. An all-zero group
stores ``s = 0`` and ``q = 0``. ``q * s`` is exact in float32 (4 or 8 bit
integer times an 8 bit mantissa), so dequantization has no rounding error.

Stored shapes (``QArray`` leaves)::

    int4: packed uint8 [..., O, Kp // 2]   scales bf16 [..., O, Kp // G]
    int8: packed int8  [..., O, Kp]        scales bf16 [..., O, Kp // G]

int4 nibble layout
------------------
Within each group of G (even) input features, byte ``j`` (0 <= j < G/2) of
the group holds ``q[j] + 8`` in its low nibble and ``q[j + G/2] + 8`` in its
high nibble (both unsigned 0..15)::

    group bytes:  b[0]            b[1]             ...  b[G/2-1]
    low nibble:   q[0]            q[1]             ...  q[G/2-1]
    high nibble:  q[G/2]          q[G/2+1]         ...  q[G-1]

A kernel multiplies all low nibbles of a group with the first half of the
group's activations and all high nibbles with the second half: no
interleaving shuffle is needed after the unpack.

Expert layout
-------------
Per expert: ``gate_up: QArray [2I, D]`` (rows 0..I-1 gate_proj, rows I..2I-1
up_proj, fused so activations are read once) and ``down: QArray [D, I]``. A
layer's device pool stacks experts on a leading slot axis:
``ExpertPool(gate_up [S, 2I, D], down [S, D, I])``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

# The XLA kernels' unpacking is the one definition of the nibble layout below.
from pallas_kernels.xla import dequantize, unpack_int4  # noqa: F401

_QMAX = {4: 7, 8: 127}
_QMIN = {4: -8, 8: -127}


@dataclasses.dataclass(frozen=True)
class QArray:
  """A group-wise quantized matrix ``[..., O, K]`` (see module docstring).

  Leaves: ``packed`` and ``scales``. Static: ``bits``, ``group_size`` and
  ``in_features`` (the unpadded K). No shape validation happens here because
  JAX rebuilds pytrees with placeholder leaves (None, object()) internally;
  consumers call ``check()``.
  """

  packed: Any
  scales: Any
  bits: int = dataclasses.field(default=4, metadata=dict(static=True))
  group_size: int = dataclasses.field(default=64, metadata=dict(static=True))
  in_features: int = dataclasses.field(default=0, metadata=dict(static=True))

  @property
  def padded_in_features(self) -> int:
    """Kp: K rounded up to a whole number of groups."""
    return -(-self.in_features // self.group_size) * self.group_size

  @property
  def out_features(self) -> int:
    return int(self.packed.shape[-2])

  @property
  def lead_shape(self) -> tuple[int, ...]:
    return tuple(self.packed.shape[:-2])

  @property
  def shape(self) -> tuple[int, ...]:
    """Logical (dequantized) shape ``[..., O, K]``."""
    return (*self.lead_shape, self.out_features, self.in_features)

  @property
  def nbytes(self) -> int:
    """Bytes held by the packed weights plus the scales."""
    return sum(
        int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
        for a in (self.packed, self.scales))

  def check(self) -> None:
    """Raises ValueError if the leaves disagree with the static fields."""
    if self.bits not in _QMAX:
      raise ValueError(f"bits must be 4 or 8, got {self.bits}")
    g = self.group_size
    if g <= 0 or (self.bits == 4 and g % 2):
      raise ValueError(f"group_size must be positive (even for int4), got {g}")
    kp = self.padded_in_features
    want_packed = kp // 2 if self.bits == 4 else kp
    want_dtype = np.uint8 if self.bits == 4 else np.int8
    ps, ss = tuple(self.packed.shape), tuple(self.scales.shape)
    if len(ps) < 2 or ps[-1] != want_packed:
      raise ValueError(
          f"packed: expected [..., O, {want_packed}] for int{self.bits} with "
          f"in_features={self.in_features}, group_size={g}; got {ps}")
    if np.dtype(self.packed.dtype) != want_dtype:
      raise ValueError(
          f"packed: expected dtype {np.dtype(want_dtype).name} for "
          f"int{self.bits}, got {np.dtype(self.packed.dtype).name}")
    if ss != (*ps[:-1], kp // g):
      raise ValueError(
          f"scales: expected shape {(*ps[:-1], kp // g)}, got {ss}")


jax.tree_util.register_dataclass(
    QArray, data_fields=["packed", "scales"],
    meta_fields=["bits", "group_size", "in_features"])


@dataclasses.dataclass(frozen=True)
class ExpertPool:
  """Device-resident experts of one layer, stacked on a slot axis.

  ``gate_up: QArray [S, 2I, D]``, ``down: QArray [S, D, I]``.
  """

  gate_up: QArray
  down: QArray

  @property
  def num_slots(self) -> int:
    return int(self.gate_up.packed.shape[0])

  @property
  def hidden(self) -> int:
    """D, the model width."""
    return self.gate_up.in_features

  @property
  def intermediate(self) -> int:
    """I, the expert FFN width."""
    return self.down.in_features

  @property
  def nbytes(self) -> int:
    return self.gate_up.nbytes + self.down.nbytes

  def check(self) -> None:
    """Raises ValueError unless the two matrices form a valid pool."""
    self.gate_up.check()
    self.down.check()
    gu, dn = self.gate_up, self.down
    if gu.packed.ndim != 3 or dn.packed.ndim != 3:
      raise ValueError(
          "pool: expected gate_up [S, 2I, D] and down [S, D, I]; got packed "
          f"shapes {tuple(gu.packed.shape)} and {tuple(dn.packed.shape)}")
    s, two_i, d = gu.shape
    if dn.shape != (s, d, two_i // 2) or two_i % 2:
      raise ValueError(
          f"pool: gate_up logical shape {gu.shape} implies down "
          f"{(s, d, two_i // 2)}, got {dn.shape}")
    if (gu.bits, gu.group_size) != (dn.bits, dn.group_size):
      raise ValueError(
          "pool: gate_up and down must share bits/group_size, got "
          f"{(gu.bits, gu.group_size)} vs {(dn.bits, dn.group_size)}")


jax.tree_util.register_dataclass(
    ExpertPool, data_fields=["gate_up", "down"], meta_fields=[])


class ExpertWeights(NamedTuple):
  """One expert's quantized weights: ``gate_up [2I, D]``, ``down [D, I]``."""

  gate_up: QArray
  down: QArray


def _check_bits_group(bits: int, group_size: int) -> None:
  if bits not in _QMAX:
    raise ValueError(f"bits must be 4 or 8, got {bits}")
  if group_size <= 0 or (bits == 4 and group_size % 2):
    raise ValueError(
        f"group_size must be positive (and even for int4), got {group_size}")


def pack_int4(q: np.ndarray, group_size: int) -> np.ndarray:
  """Packs int values in [-8, 7], shape ``[..., Kp]``, into uint8 ``[..., Kp/2]``.

  Uses the split-group nibble layout of the module docstring; Kp must be a
  multiple of ``group_size``.
  """
  q = np.asarray(q)
  _check_bits_group(4, group_size)
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

  The result is the float64 rule of the module docstring, bit for bit (see
  ``quantize_into`` for how the kernel gets there without float64 work).
  """
  _check_bits_group(bits, group_size)
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
  _check_bits_group(bits, group_size)
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
  return int(_kernel()(np.ascontiguousarray(src), kind, _QMAX[bits], _QMIN[bits], bits,
                       group_size, packed.view(np.uint8), scales.view(np.uint16), buf,
                       buf.view(np.uint32 if ftype == np.float32 else np.uint64)))


_KERNEL = []


def _kernel():
  """The compiled row kernel (numba is imported on first use; builds are cached on disk)."""
  if not _KERNEL:
    import numba
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


def qarray_shapes(out_features: int, in_features: int, bits: int = 4,
                  group_size: int = 64, lead: Sequence[int] = ()) -> QArray:
  """A QArray whose leaves are ``jax.ShapeDtypeStruct`` (no data).

  Used to size and type store chunks: one chunk holds exactly these leaves,
  in this layout, so a read needs no transform.
  """
  _check_bits_group(bits, group_size)
  lead = tuple(int(d) for d in lead)
  kp = -(-in_features // group_size) * group_size
  packed = jax.ShapeDtypeStruct(
      (*lead, out_features, kp // 2 if bits == 4 else kp),
      jnp.uint8 if bits == 4 else jnp.int8)
  scales = jax.ShapeDtypeStruct(
      (*lead, out_features, kp // group_size), jnp.bfloat16)
  return QArray(packed=packed, scales=scales, bits=bits,
                group_size=group_size, in_features=in_features)


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


def _stack_q(qs: Sequence[QArray]) -> QArray:
  first = qs[0]
  for q in qs[1:]:
    if ((q.bits, q.group_size, q.in_features, q.packed.shape) !=
        (first.bits, first.group_size, first.in_features, first.packed.shape)):
      raise ValueError(
          "experts: all experts must share bits/group_size/shape, got "
          f"{(q.bits, q.group_size, q.packed.shape)} vs "
          f"{(first.bits, first.group_size, first.packed.shape)}")
  is_np = all(isinstance(q.packed, np.ndarray) for q in qs)
  stack = np.stack if is_np else jnp.stack
  return QArray(packed=stack([q.packed for q in qs]),
                scales=stack([q.scales for q in qs]),
                bits=first.bits, group_size=first.group_size,
                in_features=first.in_features)


def stack_experts(experts: Sequence[ExpertWeights]) -> ExpertPool:
  """Stacks per-expert weights on a leading slot axis into an ExpertPool."""
  if not experts:
    raise ValueError("experts: need at least one expert")
  pool = ExpertPool(gate_up=_stack_q([e[0] for e in experts]),
                    down=_stack_q([e[1] for e in experts]))
  pool.check()
  return pool


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
