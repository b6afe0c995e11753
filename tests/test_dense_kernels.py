"""The dense CPU kernels (issue 28): `pallas_kernels.cpu_dense` (int8, int4, bfloat16 weights)
against a float64 reference, their custom call (`cpu_dense_ffi`) against the direct kernel bit
for bit, and `layers.linear` under jit on the CPU platform against the kernel."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from glmjax.formats.quantize import quantize
from glmjax.model import kernels
from glmjax.model.attention import KvB
from glmjax.model.layers import linear
from pallas_kernels import cpu_dense, cpu_dense_ffi, cpu_rows

O_ROWS = 45  # not a multiple of a row block or a prange chunk
I_FEATURES = 200  # not a multiple of the group (64), of 16 lanes or of 32
# 200: padded input (int: K padded to the group; bf16: the row-buffer path at every T);
# 256: whole groups and chunks (bf16 decode streams rows in registers, one at a time);
# 6144 (GLM-5's hidden): bf16 decode streams four rows at a time (`_BF16_ROWS4_MIN_K`), 45 rows
# leave one for the one-row loop.
WIDTHS = (200, 256, 6144)
assert cpu_dense._BF16_ROWS4_MIN_K <= WIDTHS[-1]


def reference(x, w):
  """x @ wᵀ in float64, written plainly: one multiply-add per term."""
  t_count, o_count = x.shape[0], w.shape[0]
  y = np.zeros((t_count, o_count), np.float64)
  for t in range(t_count):
    for o in range(o_count):
      y[t, o] = np.sum(np.float64(x[t]) * np.float64(w[o]))
  return y


def dequantized(q):
  """The float64 weight a QArray stands for: code × scale, codes unpacked by hand."""
  p = np.asarray(q.packed)
  s = np.asarray(q.scales).astype(np.float64)
  g = q.group_size
  if q.bits == 8:
    codes = p.astype(np.float64)
  else:
    o, kb = p.shape
    grp = p.reshape(o, kb // (g // 2), g // 2).astype(np.int64)
    codes = np.concatenate([(grp & 15) - 8, (grp >> 4) - 8], axis=-1).reshape(o, 2 * kb)
  w = codes.reshape(codes.shape[0], -1, g) * s[..., None]
  return w.reshape(codes.shape[0], -1)[:, :q.in_features]


def make_weights(i_features):
  rng = np.random.default_rng(i_features)
  w = (rng.standard_normal((O_ROWS, i_features)) / np.sqrt(i_features)).astype(np.float32)
  return {"int8": quantize(w, 8, 64), "int4": quantize(w, 4, 64),
          "bf16": w.astype(ml_dtypes.bfloat16)}


@pytest.fixture(scope="module")
def weights():
  return make_weights(I_FEATURES)


@pytest.fixture(scope="module")
def by_width():
  return {i: make_weights(i) for i in WIDTHS}


def direct(fmt, x, w):
  if fmt == "bf16":
    return cpu_dense.bf16_matmul(x, w)
  return cpu_dense.qmatmul(x, w.packed, w.scales, w.bits, w.group_size, w.in_features)


def as_float64(fmt, w):
  return np.asarray(w, np.float64) if fmt == "bf16" else dequantized(w)


@pytest.fixture(params=[0, None], ids=["threads", "serial"])
def parallel(request, monkeypatch):
  """Every matrix on numba's thread pool (threshold 0), or the default (small: serial)."""
  if request.param is not None:
    monkeypatch.setattr(cpu_rows, "PARALLEL_MIN_WEIGHTS", request.param)


@pytest.mark.parametrize("i_features", WIDTHS)
@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("t_count", [1, 3, 17])
def test_kernel_matches_float64_reference(by_width, i_features, fmt, t_count, parallel):
  rng = np.random.default_rng(t_count)
  x = rng.standard_normal((t_count, i_features)).astype(np.float32)
  w = by_width[i_features][fmt]
  got = direct(fmt, x, w)
  assert got.shape == (t_count, O_ROWS) and got.dtype == np.float32
  want = reference(x, as_float64(fmt, w))
  # float32 accumulation of 200 terms of size ~|x|/sqrt(I): a few ulps of the row's scale.
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("i_features", WIDTHS)
@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
def test_rows_are_independent_of_the_token_count(by_width, i_features, fmt, parallel):
  """Decode (T = 1), verify (T = 3) and prefill (T = 17) give each row the same bits."""
  w = by_width[i_features][fmt]
  x = np.random.default_rng(1).standard_normal((17, i_features)).astype(np.float32)
  full = direct(fmt, x, w)
  for t in (0, 5, 16):
    np.testing.assert_array_equal(direct(fmt, x[t:t + 1], w)[0], full[t])
  np.testing.assert_array_equal(direct(fmt, x[4:7], w), full[4:7])


@pytest.mark.parametrize("family", ["bf16", "quant"])
def test_custom_call_passes_its_self_test(family):
  """Each weight family's target (bf16; int4/int8) checks only its own formats and passes."""
  call = {"bf16": cpu_dense_ffi.BF16_CALL, "quant": cpu_dense_ffi.QUANT_CALL}[family]
  assert call.self_test() is None
  assert call.backend() == "ffi"
  labels = {c.label.split(",")[0] for c in call._cases()}  # pylint: disable=protected-access
  assert labels == ({f"bits={cpu_dense.BF16}"} if family == "bf16" else {"bits=4", "bits=8"})
  assert cpu_dense_ffi.self_test() is None  # both targets (the suite's warm-up builds both)


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_a_target_refuses_the_other_family(weights, fmt):
  """A target given a weight of the other family computes nothing (NaN), never reads its
  bytes as its own format; `matmul_xla` itself always picks the weight's own target."""
  w = weights[fmt]
  x = np.ones((2, I_FEATURES), np.float32)
  if fmt == "bf16":
    call, args, fmt_kw = cpu_dense_ffi.QUANT_CALL, (x, w, None), dict(bits=cpu_dense.BF16,
                                                                     group_size=0)
  else:
    call, args, fmt_kw = cpu_dense_ffi.BF16_CALL, (x, w.packed, w.scales), dict(
        bits=w.bits, group_size=w.group_size)
  assert call.backend() == "ffi" and cpu_dense_ffi.call_for(fmt_kw["bits"]) is not call
  got = jax.jit(lambda *a: cpu_dense_ffi._ffi_matmul(  # pylint: disable=protected-access
      call.target, *a, in_features=I_FEATURES, **fmt_kw))(*args)
  assert np.isnan(np.asarray(got)).all()


@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("t_count", [1, 3, 17])
def test_custom_call_equals_direct_kernel(weights, fmt, t_count):
  w = weights[fmt]
  x = np.random.default_rng(t_count + 10).standard_normal((t_count, I_FEATURES)).astype(np.float32)
  if fmt == "bf16":
    got = jax.jit(lambda a, b: cpu_dense_ffi.matmul_xla(a, b, bits=cpu_dense.BF16,
                                                        in_features=I_FEATURES))(x, w)
  else:
    got = jax.jit(lambda a, p, s: cpu_dense_ffi.matmul_xla(
        a, p, s, bits=w.bits, group_size=w.group_size, in_features=w.in_features))(
            x, w.packed, w.scales)
  np.testing.assert_array_equal(np.asarray(got), direct(fmt, x, w))


@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
def test_jitted_linear_on_cpu_uses_the_kernel(weights, fmt):
  """`layers.linear` inside jit on the CPU platform: [B, S, I] activations give the kernel's
  bits (not XLA's dequantize-then-dot), for QArrays and bfloat16 matrices alike."""
  assert jax.default_backend() == "cpu"
  w = weights[fmt]
  w_j = jnp.asarray(w) if fmt == "bf16" else jax.tree.map(jnp.asarray, w)
  x = np.random.default_rng(5).standard_normal((2, 3, I_FEATURES)).astype(np.float32)
  got = np.asarray(jax.jit(linear)(x, w_j))
  assert got.shape == (2, 3, O_ROWS)
  np.testing.assert_array_equal(got.reshape(6, O_ROWS), direct(fmt, x.reshape(6, I_FEATURES), w))


def test_float32_linear_keeps_xlas_dot():
  """float32 weights are not routed to the kernel: XLA's einsum, bit for bit as before."""
  rng = np.random.default_rng(9)
  w = rng.standard_normal((O_ROWS, I_FEATURES)).astype(np.float32)
  x = rng.standard_normal((1, 4, I_FEATURES)).astype(np.float32)
  want = jax.jit(lambda a, b: jnp.einsum("...i,oi->...o", a, b))(x, w)
  hlo = jax.jit(linear).lower(x, w).as_text()
  assert "custom_call" not in hlo
  np.testing.assert_array_equal(np.asarray(jax.jit(linear)(x, w)), np.asarray(want))


def test_bf16_prefill_rows_go_to_xlas_dot(weights):
  """A bfloat16 matrix on more than `BF16_KERNEL_MAX_ROWS` rows (a prefill chunk) is XLA's
  float32 dot of the upcast weight, bit for bit; at the bound it is still the kernel. Quantized
  matrices stay on the kernel at any row count."""
  w = weights["bf16"]
  n = kernels.BF16_KERNEL_MAX_ROWS
  rng = np.random.default_rng(11)
  for rows, kernel in ((n, True), (n + 1, False)):
    x = rng.standard_normal((1, rows, I_FEATURES)).astype(np.float32)
    hlo = jax.jit(linear).lower(x, jnp.asarray(w)).as_text()
    assert ("custom_call" in hlo) == kernel, rows
    got = np.asarray(jax.jit(linear)(x, jnp.asarray(w)))
    if kernel:
      want = direct("bf16", x[0], w)
    else:
      want = jax.jit(lambda a, b: jnp.einsum("...i,oi->...o", a, b.astype(jnp.float32)))(
          x, jnp.asarray(w))[0]
    np.testing.assert_array_equal(got[0], np.asarray(want))
  x = rng.standard_normal((1, n + 1, I_FEATURES)).astype(np.float32)
  assert "custom_call" in jax.jit(linear).lower(x, jax.tree.map(jnp.asarray, weights["int8"])).as_text()


# An MLA kv_b [H·(N+V), C]: H = 3, N = 7, V = 8; C = 200 (not a multiple of the group or of
# 32: padded rows) and 512 (GLM-5's kv_lora_rank: bf16 values take the decode loop at T = 1).
HEADS, N_NOPE, V_DIM = 3, 7, 8
KV_WIDTHS = (200, 512)


@pytest.fixture(scope="module")
def kv_b():
  """{(format, C): (the kv_b as stored, its values in float64)}; formats 8, 4 and "bf16"."""
  out = {}
  for c in KV_WIDTHS:
    rng = np.random.default_rng(11 + c)
    w = rng.standard_normal((HEADS * (N_NOPE + V_DIM), c)).astype(np.float32) / 14
    for bits in (8, 4):
      q = quantize(w, bits, 64)
      out[bits, c] = (q, dequantized(q))
    wb = w.astype(ml_dtypes.bfloat16)
    out["bf16", c] = (wb, wb.astype(np.float64))
  return out


def heads_args(fmt, w, c):
  """heads_matmul's weight arguments for kv_b `w` of width `c`."""
  if fmt == "bf16":
    return (w, None, cpu_dense.BF16, 0, c, HEADS, N_NOPE)
  return (w.packed, w.scales, fmt, 64, c, HEADS, N_NOPE)


@pytest.mark.parametrize("c", KV_WIDTHS)
@pytest.mark.parametrize("fmt", [8, 4, "bf16"])
@pytest.mark.parametrize("t_count", [1, 3, 17])
def test_per_head_kv_b_matches_float64_reference(kv_b, fmt, c, t_count, parallel):
  """The absorbed form's two per-head products of a quantized or bfloat16 kv_b (never
  dequantized or upcast whole): keys (query into latent space) and values (latent context
  out), against float64, and each row independent of T."""
  stored, w64 = kv_b[fmt, c]
  w = w64.reshape(HEADS, N_NOPE + V_DIM, c)
  rng = np.random.default_rng(t_count)
  xk = rng.standard_normal((t_count, HEADS * N_NOPE)).astype(np.float32)
  xv = rng.standard_normal((t_count, HEADS * c)).astype(np.float32)
  args = heads_args(fmt, stored, c)
  keys = cpu_dense.heads_matmul(xk, *args, cpu_dense.KEYS)
  values = cpu_dense.heads_matmul(xv, *args, cpu_dense.VALUES)
  want_k = np.einsum("thn,hnc->thc", xk.reshape(t_count, HEADS, N_NOPE).astype(np.float64),
                     w[:, :N_NOPE])
  want_v = np.einsum("thc,hvc->thv", xv.reshape(t_count, HEADS, c).astype(np.float64),
                     w[:, N_NOPE:])
  np.testing.assert_allclose(keys.reshape(want_k.shape), want_k, rtol=0,
                             atol=2e-5 * np.abs(want_k).max())
  np.testing.assert_allclose(values.reshape(want_v.shape), want_v, rtol=0,
                             atol=2e-5 * np.abs(want_v).max())
  last = t_count - 1
  np.testing.assert_array_equal(
      cpu_dense.heads_matmul(xk[last:], *args, cpu_dense.KEYS)[0], keys[last])
  np.testing.assert_array_equal(
      cpu_dense.heads_matmul(xv[last:], *args, cpu_dense.VALUES)[0], values[last])


@pytest.mark.parametrize("fmt", [8, 4, "bf16"])
def test_absorbed_kv_b_on_cpu_uses_the_per_head_kernel(kv_b, fmt):
  """`attention.KvB` with a QArray or a bfloat16 kv_b on the CPU platform: the jitted absorbed
  products are the custom call's, bit for bit the direct kernel's, and agree with the float32
  split kv_b."""
  c = KV_WIDTHS[0]
  stored = kv_b[fmt, c][0]
  wj = jnp.asarray(stored) if fmt == "bf16" else jax.tree.map(jnp.asarray, stored)
  kvb = KvB(wj, HEADS, N_NOPE)
  rng = np.random.default_rng(2)
  q_nope = rng.standard_normal((2, 3, HEADS, N_NOPE)).astype(np.float32)
  ctx = rng.standard_normal((2, 3, HEADS, c)).astype(np.float32)
  got_k = np.asarray(jax.jit(lambda w, x: KvB(w, HEADS, N_NOPE).absorb_query(x))(wj, q_nope))
  got_v = np.asarray(jax.jit(lambda w, x: KvB(w, HEADS, N_NOPE).absorb_output(x))(wj, ctx))
  args = heads_args(fmt, stored, c)
  np.testing.assert_array_equal(
      got_k.reshape(6, -1), cpu_dense.heads_matmul(q_nope.reshape(6, -1), *args, cpu_dense.KEYS))
  np.testing.assert_array_equal(
      got_v.reshape(6, -1), cpu_dense.heads_matmul(ctx.reshape(6, -1), *args, cpu_dense.VALUES))
  w_uk, w_uv = (np.asarray(a) for a in kvb.split())
  np.testing.assert_allclose(got_k, np.einsum("bshn,hnc->bshc", q_nope, w_uk), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(got_v, np.einsum("bshc,hvc->bshv", ctx, w_uv), rtol=1e-5,
                             atol=1e-5)


def test_a_float32_kv_b_keeps_xlas_einsums():
  """A float32 kv_b is not sent to the per-head kernel (float models keep their bits)."""
  w = jnp.zeros((HEADS * (N_NOPE + V_DIM), 200), jnp.float32)
  assert not kernels.per_head_kernel(w) and kernels.per_head_kernel(w.astype(jnp.bfloat16))


def test_bad_operands_are_refused(weights):
  x = np.zeros((1, I_FEATURES), np.float32)
  q = weights["int8"]
  with pytest.raises(ValueError, match="x: expected"):
    cpu_dense.qmatmul(x[:, :10], q.packed, q.scales, 8, 64, I_FEATURES)
  with pytest.raises(ValueError, match="packed: expected"):
    cpu_dense.qmatmul(x, q.packed, q.scales, 4, 64, I_FEATURES)
  with pytest.raises(ValueError, match="w: expected bfloat16"):
    cpu_dense.bf16_matmul(x, np.zeros((3, I_FEATURES), np.float32))
