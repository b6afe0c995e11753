"""pallas_kernels.cpu: the numba CPU expert kernel against a float64 numpy reference.

Covers every decode variant (int4 G=64, G%64==0, G%64==32, G with a half group that is not a
multiple of 16; int8 G%32==0, G%32==16, other G), K not a multiple of G, n = 1, 3, 17 rows,
pools with repeated slots and inactive pairs, bitwise independence of a row from the batch,
the pool and the numba thread count, and the jax.pure_callback wrapper under jit.
"""

import glmjax  # noqa: F401  (imported before pallas_kernels: the package imports glmjax)
import jax
import jax.numpy as jnp
import numba
import numpy as np
import pytest

from glmjax.formats.quantize import quantize_expert
from glmjax.model import quant
from pallas_kernels import cpu, cpu_rows

# (bits, group_size, hidden D, intermediate I): each selects a different code path.
CASES = [
    (4, 64, 199, 96),  # GLM-5 layout (unrolled), K padded, odd row count in down
    (4, 128, 200, 96),  # int4, even chunk count per half group
    (4, 32, 100, 72),  # int4, odd chunk count per half group (rotating accumulators)
    (4, 6, 20, 14),  # int4, half group not a multiple of 16: scalar decode
    (8, 32, 101, 72),  # int8, even chunk count per group
    (8, 16, 100, 72),  # int8, odd chunk count per group
    (8, 10, 30, 18),  # int8, scalar decode
]
IDS = [f"int{b}-G{g}-D{d}-I{i}" for b, g, d, i in CASES]


def _pool(bits, group, hidden, inter, slots, seed):
  rng = np.random.default_rng(seed)
  experts = [
      quantize_expert(rng.standard_normal((inter, hidden)),
                      rng.standard_normal((inter, hidden)),
                      rng.standard_normal((hidden, inter)) / np.sqrt(inter), bits, group)
      for _ in range(slots)
  ]
  return quant.stack_experts(experts)


def _dequant64(packed, scales, bits, group, k):
  """Independent float64 dequantization of packed [..., O, Kb] -> [..., O, K]."""
  packed = np.asarray(packed)
  lead = packed.shape[:-1]
  s = np.asarray(scales).astype(np.float64)  # bf16 -> float64 is exact
  ng = s.shape[-1]
  if bits == 4:
    b = packed.reshape(*lead, ng, group // 2).astype(np.int64)
    q = np.concatenate([(b & 15) - 8, (b >> 4) - 8], axis=-1)
  else:
    q = packed.view(np.int8).reshape(*lead, ng, group).astype(np.int64)
  w = q.astype(np.float64) * s[..., None]
  return w.reshape(*lead, ng * group)[..., :k]


def _ref_expert(x, gu, dn):
  """float64 expert: gu [2I, D], dn [D, I] float64 -> [n, D]."""
  inter = dn.shape[1]
  h = np.asarray(x, np.float64) @ gu.T
  g, u = h[:, :inter], h[:, inter:]
  return (g / (1.0 + np.exp(-g)) * u) @ dn.T


def _args(pool, slot=None):
  gu, dn = pool.gate_up, pool.down
  arrs = (gu.packed, gu.scales, dn.packed, dn.scales)
  if slot is not None:
    arrs = tuple(a[slot] for a in arrs)
  return arrs


def _kw(pool):
  return dict(bits=pool.gate_up.bits, group_size=pool.gate_up.group_size, hidden=pool.hidden,
              intermediate=pool.intermediate)


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def case(request):
  bits, group, hidden, inter = request.param
  pool = _pool(bits, group, hidden, inter, slots=3, seed=hidden * 7 + group + bits)
  gu = _dequant64(pool.gate_up.packed, pool.gate_up.scales, bits, group, hidden)
  dn = _dequant64(pool.down.packed, pool.down.scales, bits, group, inter)
  # The reference dequantization agrees with glmjax's (exact in float32).
  np.testing.assert_array_equal(gu.astype(np.float32), np.asarray(quant.dequantize(pool.gate_up)))
  x = np.random.default_rng(hidden).standard_normal((17, hidden)).astype(np.float32)
  return pool, gu, dn, x


def _rel_err(got, want):
  return np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()


@pytest.mark.parametrize("n", [1, 3, 17])
def test_expert_ffn_matches_float64_reference(case, n):
  pool, gu, dn, x = case
  y = cpu.expert_ffn(x[:n], *_args(pool, 1), **_kw(pool))
  assert y.shape == (n, pool.hidden) and y.dtype == np.float32
  assert _rel_err(y, _ref_expert(x[:n], gu[1], dn[1])) <= 1e-6


def test_expert_ffn_out_and_uint16_scales(case):
  pool, _, _, x = case
  gp, gs, dp, ds = _args(pool, 0)
  want = cpu.expert_ffn(x[:3], gp, gs, dp, ds, **_kw(pool))
  out = np.full((3, pool.hidden), np.nan, np.float32)
  got = cpu.expert_ffn(x[:3], gp, np.asarray(gs).view(np.uint16), dp,
                       np.asarray(ds).view(np.uint16), out=out, **_kw(pool))
  assert got is out
  np.testing.assert_array_equal(out, want)


def _routing(t, k, slots, seed):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, slots, (t, k)).astype(np.int32)
  ids[0, :] = 1  # one token picks the same slot for every rank
  active = rng.random((t, k)) < 0.75
  active[0, :] = True
  active[2, :] = False  # a token with no active pair
  ids[~active] = 99  # ignored: out of range on purpose
  return ids, active


def test_pool_terms_matches_reference_and_zeroes_inactive(case):
  pool, gu, dn, x = case
  ids, active = _routing(17, 4, 3, seed=1)
  terms = cpu.pool_terms(x, *_args(pool), ids, active, **_kw(pool))
  assert terms.shape == (17, 4, pool.hidden) and terms.dtype == np.float32
  assert np.all(terms[~active] == 0) and not np.signbit(terms[~active]).any()
  want = np.zeros(terms.shape)
  for s in range(3):
    rows, ranks = np.nonzero(active & (ids == s))
    want[rows, ranks] = _ref_expert(x[rows], gu[s], dn[s])
  assert _rel_err(terms, want) <= 1e-6


@pytest.fixture(params=["serial", "parallel"])
def split(request, monkeypatch):
  """Small matrices run on the calling thread unless the parallel threshold is lowered."""
  if request.param == "parallel":
    monkeypatch.setattr(cpu_rows, "PARALLEL_MIN_WEIGHTS", 0)
  return request.param


def test_rows_bitwise_independent_of_batch_and_pool(case, split):
  """A row alone (n=1), in a batch of 17, and inside pool_terms: the same bits."""
  pool, _, _, x = case
  batch = cpu.expert_ffn(x, *_args(pool, 2), **_kw(pool))
  for t in (0, 5, 16):
    alone = cpu.expert_ffn(x[t:t + 1], *_args(pool, 2), **_kw(pool))
    np.testing.assert_array_equal(alone[0], batch[t])
  three = cpu.expert_ffn(x[4:7], *_args(pool, 2), **_kw(pool))
  np.testing.assert_array_equal(three, batch[4:7])
  ids, active = _routing(17, 4, 3, seed=2)
  terms = cpu.pool_terms(x, *_args(pool), ids, active, **_kw(pool))
  rows, ranks = np.nonzero(active & (ids == 2))
  assert rows.size
  np.testing.assert_array_equal(terms[rows, ranks], batch[rows])
  # One token alone in the pool, all ranks active: decode-path rows.
  one = cpu.pool_terms(x[5:6], *_args(pool), np.array([[2, 0, 2, 1]]), None, **_kw(pool))
  np.testing.assert_array_equal(one[0, 0], batch[5])
  np.testing.assert_array_equal(one[0, 2], batch[5])


def test_thread_count_does_not_change_bits(case, monkeypatch):
  pool, _, _, x = case
  ids, active = _routing(17, 4, 3, seed=3)
  default = numba.get_num_threads()
  serial = (cpu.expert_ffn(x[:1], *_args(pool, 0), **_kw(pool)),
            cpu.expert_ffn(x, *_args(pool, 0), **_kw(pool)),
            cpu.pool_terms(x, *_args(pool), ids, active, **_kw(pool)))
  monkeypatch.setattr(cpu_rows, "PARALLEL_MIN_WEIGHTS", 0)  # every matmul in a parallel region
  want = (cpu.expert_ffn(x[:1], *_args(pool, 0), **_kw(pool)),
          cpu.expert_ffn(x, *_args(pool, 0), **_kw(pool)),
          cpu.pool_terms(x, *_args(pool), ids, active, **_kw(pool)))
  numba.set_num_threads(1)
  try:
    got = (cpu.expert_ffn(x[:1], *_args(pool, 0), **_kw(pool)),
           cpu.expert_ffn(x, *_args(pool, 0), **_kw(pool)),
           cpu.pool_terms(x, *_args(pool), ids, active, **_kw(pool)))
  finally:
    numba.set_num_threads(default)
  for g, w, s in zip(got, want, serial):
    np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(s, w)


def test_tiling_boundaries_bitwise():
  """Rows across token tiles (64) and reduction blocks (1024 features) of the grouped path."""
  pool = _pool(4, 64, 1100, 40, slots=1, seed=9)
  gu = _dequant64(pool.gate_up.packed, pool.gate_up.scales, 4, 64, 1100)
  dn = _dequant64(pool.down.packed, pool.down.scales, 4, 64, 40)
  x = np.random.default_rng(10).standard_normal((70, 1100)).astype(np.float32)
  batch = cpu.expert_ffn(x, *_args(pool, 0), **_kw(pool))
  assert _rel_err(batch, _ref_expert(x, gu[0], dn[0])) <= 1e-6
  for t in (0, 63, 64, 69):
    np.testing.assert_array_equal(cpu.expert_ffn(x[t:t + 1], *_args(pool, 0), **_kw(pool))[0],
                                  batch[t])
  np.testing.assert_array_equal(cpu.expert_ffn(x[60:63], *_args(pool, 0), **_kw(pool)),
                                batch[60:63])


@pytest.mark.parametrize("with_active", [True, False])
def test_pool_terms_jax_under_jit_is_bitwise_equal(with_active):
  pool = _pool(4, 32, 100, 72, slots=3, seed=5)
  x = np.random.default_rng(6).standard_normal((5, 100)).astype(np.float32)
  ids, active = _routing(5, 2, 3, seed=7)
  if not with_active:
    ids[ids == 99] = 0
    active = None
  kw = _kw(pool)
  want = cpu.pool_terms(x, *_args(pool), ids, active, **kw)
  compiled = len(cpu.moe_core.signatures)

  @jax.jit
  def f(x, gp, gs, dp, ds, ids, act):
    return cpu.pool_terms_jax(x * 1.0, gp, gs, dp, ds, ids, act, **kw)

  gp, gs, dp, ds = (jnp.asarray(a) for a in _args(pool))
  assert gs.dtype == jnp.bfloat16
  got = f(jnp.asarray(x), gp, gs, dp, ds, jnp.asarray(ids),
          None if active is None else jnp.asarray(active))
  assert got.dtype == jnp.float32 and got.shape == want.shape
  np.testing.assert_array_equal(np.asarray(got), want)
  # Writable numpy and read-only jax buffers reach numba with the same types: no new compile.
  # (pallas_kernels.cpu_ffi's custom call adds one specialization of its own, for raw buffers.)
  assert len(cpu.moe_core.signatures) == compiled


def test_bad_inputs_raise():
  pool = _pool(4, 32, 100, 72, slots=2, seed=8)
  kw = _kw(pool)
  x = np.zeros((2, 100), np.float32)
  with pytest.raises(ValueError, match="x:"):
    cpu.expert_ffn(np.zeros((2, 99), np.float32), *_args(pool, 0), **kw)
  with pytest.raises(ValueError, match="gate_up packed"):
    cpu.expert_ffn(x, *_args(pool, 0), **{**kw, "hidden": 200})
  with pytest.raises(ValueError, match="bits"):
    cpu.expert_ffn(x, *_args(pool, 0), **{**kw, "bits": 3})
  with pytest.raises(ValueError, match="slot_ids"):
    cpu.pool_terms(x, *_args(pool), np.array([[0, 2], [1, 0]]), None, **kw)
  with pytest.raises(ValueError, match="scales"):
    gp, gs, dp, ds = _args(pool, 0)
    cpu.expert_ffn(x, gp, np.asarray(gs).astype(np.float32), dp, ds, **kw)
  # Inactive pairs may carry any id; an empty selection gives zeros.
  terms = cpu.pool_terms(x, *_args(pool), np.array([[7, -1], [9, 9]]),
                         np.zeros((2, 2), bool), **kw)
  assert terms.shape == (2, 2, 100) and not terms.any()
