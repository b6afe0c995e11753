"""Group-wise quantized weights as a JAX pytree, and the MoE expert layout.

This module defines the format; the quantizer that writes it (numba, host side) is
``glmjax.formats.quantize``.

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
import numpy as np

# The XLA kernels' unpacking is the one definition of the nibble layout below (reached through
# glmjax.model.kernels, the model's one door to pallas_kernels).
from glmjax.model.kernels import dequantize, unpack_int4  # noqa: F401

QMAX = {4: 7, 8: 127}  # largest code per bit width (the scale's divisor)
QMIN = {4: -8, 8: -127}  # smallest code per bit width


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
    if self.bits not in QMAX:
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


def check_bits_group(bits: int, group_size: int) -> None:
  """Raises ValueError unless ``bits`` is 4 or 8 and ``group_size`` is positive (even for
  int4, whose nibble layout splits each group in halves)."""
  if bits not in QMAX:
    raise ValueError(f"bits must be 4 or 8, got {bits}")
  if group_size <= 0 or (bits == 4 and group_size % 2):
    raise ValueError(
        f"group_size must be positive (and even for int4), got {group_size}")


def qarray_shapes(out_features: int, in_features: int, bits: int = 4,
                  group_size: int = 64, lead: Sequence[int] = ()) -> QArray:
  """A QArray whose leaves are ``jax.ShapeDtypeStruct`` (no data).

  Used to size and type store chunks: one chunk holds exactly these leaves,
  in this layout, so a read needs no transform.
  """
  check_bits_group(bits, group_size)
  lead = tuple(int(d) for d in lead)
  kp = -(-in_features // group_size) * group_size
  packed = jax.ShapeDtypeStruct(
      (*lead, out_features, kp // 2 if bits == 4 else kp),
      jnp.uint8 if bits == 4 else jnp.int8)
  scales = jax.ShapeDtypeStruct(
      (*lead, out_features, kp // group_size), jnp.bfloat16)
  return QArray(packed=packed, scales=scales, bits=bits,
                group_size=group_size, in_features=in_features)


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
