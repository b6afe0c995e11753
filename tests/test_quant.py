"""Tests for glmjax.model.quant (the format) and glmjax.formats.quantize (the quantizer):
quantization error, packing layout, FP8 blocks."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from glmjax.formats.quantize import (fp8_block_dequantize, pack_int4, quantize, quantize_expert,
                                     quantize_into)
from glmjax.model import quant

QMAX = {4: 7, 8: 127}


def _scaled_random(rng, shape):
  # Rows with very different magnitudes, so per-group scales matter.
  w = rng.standard_normal(shape)
  return (w * np.exp(rng.uniform(-6, 3, shape[:-1] + (1,)))).astype(np.float32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("shape", [(48, 256), (3, 20, 100)])
def test_error_within_half_step(bits, group, shape):
  rng = np.random.default_rng(bits * 1000 + group)
  w = _scaled_random(rng, shape)
  q = quantize(w, bits=bits, group_size=group)
  q.check()
  deq = np.asarray(quant.dequantize(q)).astype(np.float64)
  assert deq.shape == w.shape
  k = shape[-1]
  s = np.repeat(np.asarray(q.scales, np.float64), group, axis=-1)[..., :k]
  err = np.abs(w.astype(np.float64) - deq)
  # Rounding to the nearest multiple of s is off by at most s/2. When bf16
  # rounds the scale down, amax/s exceeds qmax by at most qmax * 2^-9 < 0.5,
  # which still rounds to qmax, so no element breaks the bound; the relative
  # slack only absorbs float64 rounding in w / s.
  assert np.all(err <= s / 2 * (1 + 1e-9)), np.max(err / np.maximum(s, 1e-300))


def test_int4_packed_layout_exact_bytes():
  # One group of G=4: byte j holds q[j] (low) and q[j + 2] (high), +8 offset.
  q = np.array([[-8, 7, 0, -1]])
  packed = pack_int4(q, group_size=4)
  assert packed.dtype == np.uint8
  np.testing.assert_array_equal(packed, [[(0 | (8 << 4)), (15 | (7 << 4))]])


@pytest.mark.parametrize("group", [2, 32, 64, 128])
def test_pack_unpack_round_trip(group):
  rng = np.random.default_rng(group)
  q = rng.integers(-8, 8, size=(3, 5, 4 * group)).astype(np.int8)
  packed = pack_int4(q, group)
  assert packed.shape == (3, 5, 2 * group)
  np.testing.assert_array_equal(np.asarray(quant.unpack_int4(packed, group)), q)
  # Every byte pattern is a valid encoding: bytes -> ints -> bytes is exact.
  raw = rng.integers(0, 256, size=(7, 2 * group)).astype(np.uint8)
  back = pack_int4(np.asarray(quant.unpack_int4(raw, group)), group)
  np.testing.assert_array_equal(back, raw)


@pytest.mark.parametrize("bits", [4, 8])
def test_representable_values_are_exact(bits):
  rng = np.random.default_rng(7)
  o, k, g = 16, 128, 32
  qmax = QMAX[bits]
  ints = rng.integers(-qmax, qmax + 1, size=(o, k))
  ints[:, ::g] = qmax  # amax of every group is exactly qmax * s
  s = rng.uniform(0.01, 2.0, size=(o, k // g)).astype(ml_dtypes.bfloat16)
  w = ints * np.repeat(s.astype(np.float64), g, axis=1)
  q = quantize(w, bits=bits, group_size=g)
  np.testing.assert_array_equal(np.asarray(q.scales), s)
  np.testing.assert_array_equal(np.asarray(quant.dequantize(q), np.float64), w)


def test_non_divisible_in_features():
  rng = np.random.default_rng(3)
  w = _scaled_random(rng, (10, 100))
  q = quantize(w, bits=4, group_size=64)
  assert q.packed.shape == (10, 64) and q.scales.shape == (10, 2)
  assert q.in_features == 100 and q.padded_in_features == 128
  assert q.shape == (10, 100)
  ints = np.asarray(quant.unpack_int4(q.packed, 64))
  np.testing.assert_array_equal(ints[:, 100:], 0)  # zero padding stays zero
  deq = np.asarray(quant.dequantize(q))
  assert deq.shape == (10, 100)
  s = np.repeat(np.asarray(q.scales, np.float64), 64, axis=1)[:, :100]
  assert np.all(np.abs(deq - w) <= s / 2 * (1 + 1e-9))


def test_int8_layout():
  rng = np.random.default_rng(4)
  w = _scaled_random(rng, (6, 96))
  q = quantize(w, bits=8, group_size=32)
  assert q.packed.dtype == np.int8 and q.packed.shape == (6, 96)
  assert q.scales.dtype == jnp.bfloat16 and q.scales.shape == (6, 3)
  assert np.abs(q.packed).max() == 127  # the amax element hits qmax
  assert q.packed.min() >= -127


def test_all_zero_group():
  rng = np.random.default_rng(5)
  w = rng.standard_normal((4, 128)).astype(np.float32)
  w[1, 64:] = 0.0  # one zero group
  w[2] = 0.0  # a zero row
  with np.errstate(all="raise"):  # no division by zero anywhere
    q = quantize(w, bits=4, group_size=64)
  scales = np.asarray(q.scales, np.float32)
  assert scales[1, 1] == 0 and np.all(scales[2] == 0) and np.all(scales[0] > 0)
  ints = np.asarray(quant.unpack_int4(q.packed, 64))
  np.testing.assert_array_equal(ints[1, 64:], 0)
  deq = np.asarray(quant.dequantize(q))
  assert np.isfinite(deq).all()
  np.testing.assert_array_equal(deq[1, 64:], 0)
  np.testing.assert_array_equal(deq[2], 0)


def _fp8_loop_reference(w8, scale_inv, bo, bi):
  w = w8.astype(np.float64)
  out = np.empty(w.shape, np.float64)
  for i in range(w.shape[0]):
    for j in range(w.shape[1]):
      out[i, j] = w[i, j] * np.float64(scale_inv[i // bo, j // bi])
  return out


@pytest.mark.parametrize("shape,block", [
    ((256, 384), (128, 128)),
    ((200, 300), (128, 128)),  # partial edge blocks in both dims
    ((130, 70), (64, 32)),  # non-square blocks, partial edges
])
def test_fp8_block_dequantize(shape, block):
  rng = np.random.default_rng(shape[0])
  w8 = (rng.standard_normal(shape) * 50).astype(ml_dtypes.float8_e4m3fn)
  sshape = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
  scale_inv = rng.uniform(1e-4, 1e-2, sshape).astype(np.float32)
  out = fp8_block_dequantize(w8, scale_inv, block_size=block)
  assert out.dtype == np.float32 and out.shape == shape
  ref = _fp8_loop_reference(w8, scale_inv, *block)
  # fp8 (4 significant bits) x f32 scale (24 bits) is exact in float64, so
  # float32 product rounds once, exactly like casting the reference: no slack.
  np.testing.assert_array_equal(out, ref.astype(np.float32))
  out_j = fp8_block_dequantize(jnp.asarray(w8), jnp.asarray(scale_inv),
                               block_size=block)
  np.testing.assert_array_equal(np.asarray(out_j), out)


def test_fp8_scale_shape_checked():
  w8 = np.zeros((200, 300), ml_dtypes.float8_e4m3fn)
  with pytest.raises(ValueError, match="scale_inv"):
    fp8_block_dequantize(w8, np.ones((1, 2), np.float32))


@pytest.mark.parametrize("bits", [4, 8])
def test_qarray_shapes_match_quantize(bits):
  w = np.random.default_rng(0).standard_normal((2, 24, 100)).astype(np.float32)
  q = quantize(w, bits=bits, group_size=32)
  abstract = quant.qarray_shapes(24, 100, bits, 32, lead=(2,))
  for leaf, spec in zip(jax.tree.leaves(q), jax.tree.leaves(abstract)):
    assert leaf.shape == spec.shape and leaf.dtype == spec.dtype
  assert abstract.nbytes == q.nbytes == q.packed.nbytes + q.scales.nbytes
  assert jax.tree.structure(abstract) == jax.tree.structure(q)


def test_pytree_and_jit():
  w = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
  q = quantize(w, bits=4, group_size=32)
  leaves, tree = jax.tree.flatten(q)
  assert len(leaves) == 2
  q2 = jax.tree.unflatten(tree, leaves)
  assert (q2.bits, q2.group_size, q2.in_features) == (4, 32, 64)
  np.testing.assert_array_equal(np.asarray(jax.jit(quant.dequantize)(q)),
                                np.asarray(quant.dequantize(q)))


def test_expert_layout_and_stack():
  rng = np.random.default_rng(2)
  i, d = 48, 80
  experts = []
  for _ in range(3):
    gate, up = rng.standard_normal((2, i, d))
    down = rng.standard_normal((d, i))
    experts.append(quantize_expert(gate, up, down, bits=4, group_size=32))
  e0 = experts[0]
  assert e0.gate_up.shape == (2 * i, d) and e0.down.shape == (d, i)
  pool = quant.stack_experts(experts)
  assert pool.num_slots == 3 and pool.hidden == d and pool.intermediate == i
  assert pool.gate_up.shape == (3, 2 * i, d) and pool.down.shape == (3, d, i)
  # Rows I.. of the fused matrix are up_proj.
  np.testing.assert_array_equal(
      np.asarray(quant.dequantize(pool.gate_up))[1, i:],
      np.asarray(quant.dequantize(experts[1].gate_up))[i:])
  bad = quantize_expert(*rng.standard_normal((2, i, d)),
                        rng.standard_normal((d, i)), bits=4,
                        group_size=16)
  with pytest.raises(ValueError, match="experts"):
    quant.stack_experts([e0, bad])


def test_bad_arguments():
  w = np.ones((4, 64), np.float32)
  with pytest.raises(ValueError, match="bits"):
    quantize(w, bits=3)
  with pytest.raises(ValueError, match="group_size"):
    quantize(w, bits=4, group_size=5)
  with pytest.raises(ValueError, match="w:"):
    quantize(np.ones(8), bits=4)
  with pytest.raises(ValueError, match="down"):
    quantize_expert(np.ones((8, 16)), np.ones((8, 16)), np.ones((8, 16)))
  q = quantize(w, bits=4, group_size=32)
  with pytest.raises(ValueError, match="scales"):
    quant.QArray(q.packed, q.scales[:, :1], 4, 32, 64).check()


# --- the kernel against a float64 reference ---------------------------------------------------

def _float64_reference(w, bits, g):
  """The module docstring's rule, written out directly in float64: (int codes, bf16 scales)."""
  w = np.asarray(w).astype(np.float64)
  o, k = w.shape
  kp = -(-k // g) * g
  w = np.pad(w, [(0, 0), (0, kp - k)])
  codes = np.zeros((o, kp), np.int64)
  scales = np.zeros((o, kp // g), ml_dtypes.bfloat16)
  for r in range(o):
    for j in range(kp // g):
      grp = w[r, j * g:(j + 1) * g]
      s = np.float64(np.array(np.abs(grp).max() / QMAX[bits]).astype(ml_dtypes.bfloat16))
      scales[r, j] = s
      if s > 0:
        codes[r, j * g:(j + 1) * g] = np.clip(np.rint(grp / s), -QMAX[bits] - (bits == 4), QMAX[bits])
  return codes, scales


def _codes(q):
  if q.bits == 4:
    return np.asarray(quant.unpack_int4(q.packed, q.group_size)).astype(np.int64)
  return np.asarray(q.packed).astype(np.int64)


def _near_ties(rng, o, g, bits, dtype):
  """Rows whose groups have scale s (one element is qmax * s) and whose other elements sit on,
  or one float32 ulp either side of, (k + 1/2) * s: where float32 division rounds onto a tie."""
  s = rng.uniform(0.01, 2.0, (o, 1)).astype(ml_dtypes.bfloat16).astype(np.float32)
  k = rng.integers(-QMAX[bits], QMAX[bits], (o, g)).astype(np.float32) + np.float32(0.5)
  x = k * s  # exact: few significant bits
  step = rng.integers(-1, 2, (o, g))
  x = np.where(step > 0, np.nextafter(x, np.float32(np.inf)),
               np.where(step < 0, np.nextafter(x, np.float32(-np.inf)), x))
  x[:, 0] = QMAX[bits] * s[:, 0]
  return x.astype(dtype)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32, np.float64])
@pytest.mark.parametrize("bits,group,k", [(4, 64, 256), (4, 32, 100), (8, 64, 192), (8, 7, 50)])
def test_quantize_equals_float64_reference(dtype, bits, group, k):
  """The numba kernel (float32 arithmetic for 16/32-bit inputs) gives the float64 rule's codes
  and scales exactly: rows scaled over ~140 binades (the smallest are float32 subnormals,
  giving subnormal or zero bf16 scales), zero groups, and elements on or one float32 ulp from
  a rounding tie."""
  rng = np.random.default_rng(bits * 1000 + group + k)
  w = rng.standard_normal((64, k)) * np.exp(rng.uniform(-95, 5, (64, 1)))
  w[3] = 0.0
  w[5, :group] = 0.0
  w = w.astype(dtype)
  q = quantize(w, bits=bits, group_size=group)
  codes, scales = _float64_reference(w, bits, group)
  np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint16), scales.view(np.uint16))
  np.testing.assert_array_equal(_codes(q), codes)
  if group % 2 == 0 and dtype in (np.float32, np.float64):
    t = _near_ties(rng, 48, group, bits, dtype)
    s32 = np.repeat(np.asarray(quantize(t, bits, group).scales, np.float32), group, 1)
    v = t.astype(np.float32) / s32
    assert np.sum(np.abs(v - np.rint(v)) == 0.5) > 100  # the float32 quotients do tie
    codes, scales = _float64_reference(t, bits, group)
    np.testing.assert_array_equal(_codes(quantize(t, bits, group)), codes)


def test_quantize_into_views_and_non_finite():
  """`quantize_into` fills caller-owned views (the converter's chunk) like `quantize`, and counts
  NaN/Inf groups instead of raising; `quantize` raises on them."""
  rng = np.random.default_rng(9)
  w = _scaled_random(rng, (12, 192)).astype(ml_dtypes.bfloat16)
  want = quantize(w, 4, 64)
  blob = np.zeros(12 * 96 + 12 * 3 * 2, np.uint8)
  packed, scales = blob[:12 * 96].reshape(12, 96), blob[12 * 96:].view(np.uint16).reshape(12, 3)
  assert quantize_into(w, 4, 64, packed, scales) == 0
  np.testing.assert_array_equal(packed, want.packed)
  np.testing.assert_array_equal(scales, np.asarray(want.scales).view(np.uint16))
  w[2, 70] = np.inf
  w[7, 0] = np.nan
  assert quantize_into(w, 4, 64, packed, scales) == 2
  with pytest.raises(ValueError, match="non-finite"):
    quantize(w, 4, 64)
  with pytest.raises(ValueError, match="packed"):
    quantize_into(w, 4, 64, packed[:, :90], scales)
