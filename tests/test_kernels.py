"""Tests for pallas_kernels.ops.grouped_moe against a float64 numpy loop.

Pallas kernels run in interpret mode here (CPU); the lowering tests check
that the GPU (Triton) and TPU (Mosaic) paths still lower, without running
them. Compiled GPU runs are checked on a device by scripts/check_gpu.py
(CI has no accelerator).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.formats.quantize import quantize_expert
from glmjax.model import quant
import pallas_kernels
from pallas_kernels import backend, common, ops, xla, tuning

# Output scale-relative tolerance. Every output is a chain of float32 dot
# products of length <= D + I (<= 640 here) plus a K-term combine; float32
# unit roundoff is 6e-8, so accumulated rounding is ~sqrt(640) * 6e-8 ~ 2e-6
# of the term magnitudes for random-sign data (observed: 2e-7..5e-7), and
# silu's exp adds ~1e-7. A wrong nibble, scale, row or slot gives O(1) errors,
# so 1e-5 keeps a wide margin on both sides.
RTOL = 1e-5


def _deq64(packed, scales, bits, group, k):
  """Independent float64 dequantization straight from the documented layout."""
  p = np.asarray(packed)
  s = np.asarray(scales).astype(np.float64)
  if bits == 4:
    p = p.astype(np.int64).reshape(*p.shape[:-1], -1, group // 2)
    lo, hi = (p & 15) - 8, (p >> 4) - 8  # q[j], q[j + G/2]
    ints = np.concatenate([lo, hi], axis=-1)  # [..., KG, G]
  else:
    ints = p.astype(np.int64).reshape(*p.shape[:-1], -1, group)
  w = ints * s[..., None]
  return w.reshape(*w.shape[:-2], -1)[..., :k]


def _loop_reference(x, pool, slot_ids, weights):
  """Rows, then ranks in order; SwiGLU and weighted sum in float64."""
  gu, dn = pool.gate_up, pool.down
  r_total, k_total = slot_ids.shape
  i = pool.intermediate
  out = np.zeros((r_total, pool.hidden))
  for r in range(r_total):
    xr = np.asarray(x[r], np.float64)
    for k in range(k_total):
      e = int(slot_ids[r, k])
      w_gu = _deq64(gu.packed[e], gu.scales[e], gu.bits, gu.group_size,
                    gu.in_features)  # [2I, D]
      w_dn = _deq64(dn.packed[e], dn.scales[e], dn.bits, dn.group_size,
                    dn.in_features)  # [D, I]
      h = w_gu @ xr
      g, u = h[:i], h[i:]
      act = g / (1.0 + np.exp(-g)) * u
      out[r] += float(weights[r, k]) * (w_dn @ act)
  return out


def _make_problem(seed, rows, k, slots, d, i, group, bits, unused=2):
  """Random pool + routing with repeats and `unused` never-selected slots.

  Unused slots get NaN scales: if a kernel reads (and uses) any weight that
  was not selected, the output turns NaN.
  """
  rng = np.random.default_rng(seed)
  experts = []
  for _ in range(slots):
    gate, up = rng.standard_normal((2, i, d)) / np.sqrt(d)
    down = rng.standard_normal((d, i)) / np.sqrt(i)
    experts.append(quantize_expert(gate, up, down, bits, group))
  pool = quant.stack_experts(experts)
  used = slots - unused
  ids = np.stack([rng.choice(used, size=k, replace=k > used)
                  for _ in range(rows)]).astype(np.int32)  # [R, K]
  if k > 1:
    ids[0, 1] = ids[0, 0]  # same expert twice in one row
  if rows > 1:
    ids[1, -1] = ids[0, 0]  # and shared across rows
  nan_scales = lambda s: s.copy().astype(s.dtype)
  gu_s, dn_s = nan_scales(pool.gate_up.scales), nan_scales(pool.down.scales)
  gu_s[used:] = np.nan
  dn_s[used:] = np.nan
  pool = quant.ExpertPool(
      gate_up=dataclasses.replace(pool.gate_up, scales=gu_s),
      down=dataclasses.replace(pool.down, scales=dn_s))
  x = rng.standard_normal((rows, d)).astype(np.float32)
  w = rng.random((rows, k)).astype(np.float32)
  return x, pool, ids, w


CASES = [
    # rows, k, slots, D, I, group, bits, flavour, config
    (1, 8, 12, 128, 96, 32, 4, "prefetch", None),
    (1, 1, 4, 96, 64, 32, 4, "pointer", None),
    (4, 3, 8, 200, 160, 64, 4, "pointer",
     tuning.BlockConfig(block_n=64, block_n_down=64, block_k=128)),
    (4, 4, 7, 192, 100, 64, 8, "prefetch",
     tuning.BlockConfig(mode="dot", block_n=32, block_n_down=64, block_k=64)),
    (3, 5, 9, 160, 96, 32, 8, "pointer", None),
    (16, 2, 6, 96, 320, 128, 4, "pointer",
     tuning.BlockConfig(mode="dot", block_n=128, block_n_down=32)),
    (16, 8, 10, 64, 96, 32, 4, "prefetch", None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "r{}k{}s{}d{}i{}g{}q{}-{}".format(*c[:8]))
def test_matches_float64_loop(case):
  rows, k, slots, d, i, group, bits, flavour, config = case
  x, pool, ids, w = _make_problem(rows * 100 + k, rows, k, slots, d, i, group,
                                  bits)
  ref = _loop_reference(x, pool, ids, w)
  scale = np.abs(ref).max()
  assert scale > 0.1  # the problem is not trivially zero
  outs = {
      "pallas": ops.grouped_moe(
          x, pool, ids, w, backend="pallas", interpret=True, flavour=flavour,
          config=config),
      "xla": ops.grouped_moe(x, pool, ids, w, backend="xla"),
  }
  for name, out in outs.items():
    out = np.asarray(out)
    assert out.shape == (rows, d) and out.dtype == np.float32, name
    err = np.abs(out - ref).max() / scale
    assert err < RTOL, f"{name}: relative error {err:.3g}"


def _permuted(pool, perm):
  take = lambda a: np.asarray(a)[perm]
  return quant.ExpertPool(
      gate_up=dataclasses.replace(pool.gate_up, packed=take(pool.gate_up.packed),
                                  scales=take(pool.gate_up.scales)),
      down=dataclasses.replace(pool.down, packed=take(pool.down.packed),
                               scales=take(pool.down.scales)))


@pytest.mark.parametrize("k,kwargs", [
    (4, dict(backend="pallas", interpret=True, flavour="prefetch")),
    (4, dict(backend="pallas", interpret=True, flavour="pointer",
             config=tuning.BlockConfig(mode="dot", block_k=64))),
    (4, dict(backend="xla")),  # R*K > S
    (2, dict(backend="xla")),  # R*K <= S
], ids=["prefetch-fma", "pointer-dot", "xla-more-pairs-than-slots", "xla-fewer"])
def test_bitwise_invariant_to_slot_permutation(k, kwargs):
  x, pool, ids, w = _make_problem(11, 4, k, 10, 96, 64, 32, 4)
  base = np.asarray(ops.grouped_moe(x, pool, ids, w, **kwargs))
  perm = np.random.default_rng(0).permutation(pool.num_slots)
  new_slot_of = np.argsort(perm)  # new pool[new_slot_of[e]] == old pool[e]
  out = np.asarray(ops.grouped_moe(
      x, _permuted(pool, perm), new_slot_of[ids].astype(np.int32), w,
      **kwargs))
  np.testing.assert_array_equal(out, base)
  # A row's result does not depend on what the other rows selected.
  ids2 = ids.copy()
  ids2[1:] = (ids2[1:] + 3) % 8
  out2 = np.asarray(ops.grouped_moe(x, pool, ids2, w, **kwargs))
  np.testing.assert_array_equal(out2[0], base[0])
  assert not np.array_equal(out2[1:], base[1:])


def test_dedupe_slots():
  ids = jnp.array([[5, 2, 5], [9, 2, 2]], jnp.int32)
  uniq, n, inv = ops.dedupe_slots(ids)
  assert int(n[0]) == 3
  np.testing.assert_array_equal(uniq, [2, 5, 9, 9, 9, 9])
  np.testing.assert_array_equal(np.asarray(uniq)[np.asarray(inv)], ids)
  np.testing.assert_array_equal(inv, [[1, 0, 1], [2, 0, 0]])
  uniq, n, inv = ops.dedupe_slots(ids, bound=4)  # e.g. bounded by pool size
  np.testing.assert_array_equal(uniq, [2, 5, 9, 9])
  np.testing.assert_array_equal(np.asarray(uniq)[np.asarray(inv)], ids)


def test_auto_backend_resolution_and_args_checked():
  assert ops.resolve_backend("auto", "cpu") == "xla"
  assert ops.resolve_backend("auto", "gpu") == "pallas"
  assert ops.resolve_backend("auto", "tpu") == "pallas"
  assert ops.resolve_backend("xla", "gpu") == "xla"
  x, pool, ids, w = _make_problem(3, 2, 2, 4, 64, 32, 32, 4, unused=0)
  with pytest.raises(ValueError, match="x:"):
    ops.grouped_moe(x[:, :10], pool, ids, w)
  with pytest.raises(ValueError, match="weights:"):
    ops.grouped_moe(x, pool, ids, w[:, :1])
  with pytest.raises(ValueError, match="slot_ids:"):
    ops.grouped_moe(x, pool, ids[:1], w)
  with pytest.raises(ValueError, match="backend:"):
    ops.grouped_moe(x, pool, ids, w, backend="cuda")


def test_combine_is_in_rank_order():
  # In float32, (1e8 + 1) - 1e8 == 0 but (1e8 - 1e8) + 1 == 1: only the
  # k = 0, 1, 2 order gives 0.
  terms = jnp.array([[[1e8], [1.0], [-1e8]]], jnp.float32)  # [R=1, K=3, D=1]
  out = xla.combine_in_order(terms, jnp.ones((1, 3), jnp.float32))
  assert float(out[0, 0]) == 0.0


def test_edge_blocks_stay_in_bounds():
  # Interpret mode clamps out-of-range slices silently, so check the GPU
  # block arithmetic directly: in bounds, and every row covered.
  for n in (1, 5, 64, 96, 100, 160, 2048, 6144):
    bn = tuning.fit(64, 256, n, 1, 32).block_n
    starts = [int(backend.block_start(j, bn, n)) for j in range(-(-n // bn))]
    assert all(0 <= s <= n - bn for s in starts), (n, bn, starts)
    covered = set().union(*(range(s, s + bn) for s in starts))
    assert covered == set(range(n)), (n, bn)


def test_tuning_fit():
  for n in (1, 7, 96, 100, 2048):
    t = tuning.fit(64, 256, n, 6, 64)
    assert t.block_n <= n and t.block_n & (t.block_n - 1) == 0
  assert tuning.fit(64, 256, 2048, 96, 64).groups == 4  # 4 * 64 == 256
  assert tuning.fit(64, 256, 2048, 3, 64).groups == 1  # must divide KG
  assert tuning.fit(64, 256, 6144, 96, 64, "tpu").block_n == 128
  assert tuning.fit(64, 256, 96, 3, 32, "tpu").block_n == 96  # whole dim
  assert tuning.lookup(3, 1, 1, 4, 64) == tuning.lookup(4, 1, 1, 4, 64)


def test_hbm_table():
  @dataclasses.dataclass
  class FakeDevice:
    platform: str
    device_kind: str
  assert common.hbm_bandwidth(FakeDevice("gpu", "NVIDIA H200")) == 4.8e12
  assert common.hbm_bandwidth(FakeDevice("gpu", "NVIDIA H100 80GB HBM3")) == 3.35e12
  assert common.hbm_bandwidth(FakeDevice("tpu", "TPU v5 lite")) == 0.819e12
  assert common.hbm_bandwidth(FakeDevice("gpu", "Mystery 9000")) is None
  assert common.hbm_bandwidth(FakeDevice("cpu", "cpu")) is None


# --- lowering checks: compile-free proof that the device paths still lower.

def _lower(platform, flavour, config, bits=4, rows=3):
  x, pool, ids, w = _make_problem(5, rows, 4, 6, 256, 192, 64, bits, unused=0)
  fn = lambda *a: ops._pallas_moe(*a, interpret=False, flavour=flavour,
                                  config=config, platform=platform)
  args = (jnp.asarray(x), pool, jnp.asarray(ids), jnp.asarray(w))
  lowering_platform = "cuda" if platform == "gpu" else platform
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(lowering_platform,))


def _capture_triton_modules(monkeypatch):
  """Records Triton modules built during lowering (jax internals: if they move, this test fails
  and must be updated, rather than passing without checking anything)."""
  from jax._src.pallas.triton import lowering as tl
  modules, orig = [], tl.lower_jaxpr_to_triton_module

  def capture(*args, **kwargs):
    result = orig(*args, **kwargs)
    modules.append(result.module)
    return result

  monkeypatch.setattr(tl, "lower_jaxpr_to_triton_module", capture)
  return modules


@pytest.mark.parametrize("config,bits", [
    (tuning.BlockConfig(mode="fma"), 4),
    (tuning.BlockConfig(mode="dot", precision="tf32x3"), 4),
    (tuning.BlockConfig(mode="dot", block_k=64), 8),
], ids=["fma-q4", "dot-q4-tf32x3", "dot-q8"])
def test_triton_lowering(config, bits, monkeypatch):
  import re
  modules = _capture_triton_modules(monkeypatch)
  _lower("gpu", "pointer", config, bits)
  assert len(modules) == 2  # gate/up and down
  for m in modules:
    assert m.operation.verify()
    # Triton tensors must have power-of-two dims; catch it before a GPU does.
    dims = re.findall(r"tensor<([0-9x]+)x[a-z!]", m.operation.get_asm())
    bad = [t for t in dims if any(int(v) & (int(v) - 1) for v in t.split("x"))]
    assert not bad, bad


@pytest.mark.parametrize("mode", ["fma", "dot"])
def test_tpu_lowering(mode):
  text = _lower("tpu", "prefetch", tuning.BlockConfig(mode=mode), rows=2).as_text()
  assert text.count("tpu_custom_call") == 2  # gate/up and down, each one Mosaic kernel


def _run_python(code: str):
  import subprocess
  import sys
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]


def test_kernel_package_imports_nothing_from_glmjax():
  """pallas_kernels stands alone (as megablox does beside MaxText's layers)."""
  modules = ", ".join(f"pallas_kernels.{m}" for m in (
      "ops", "xla", "cpu_vec", "cpu_rows", "cpu", "cpu_dense", "ffi_common", "cpu_ffi",
      "cpu_dense_ffi", "cpu_stream"))
  _run_python(f"import sys, pallas_kernels, {modules}; "
              "bad = [m for m in sys.modules if m.split('.')[0] == 'glmjax']; assert not bad, bad")


def test_the_package_exports_resolve_and_load_numba_on_use():
  """Every exported name is its module's own object; `import pallas_kernels` loads no numba
  (models without CPU-kernel weights never pay for it) until a CPU kernel is asked for."""
  for name in pallas_kernels.__all__:
    owner = pallas_kernels._EXPORTS[name]  # pylint: disable=protected-access
    assert getattr(pallas_kernels, name) is getattr(getattr(pallas_kernels, owner), name)
  with pytest.raises(AttributeError):
    pallas_kernels.not_a_kernel  # pylint: disable=pointless-statement
  _run_python("import sys, pallas_kernels; assert 'numba' not in sys.modules; "
              "pallas_kernels.dequantize; assert 'numba' not in sys.modules; "
              "pallas_kernels.expert_ffn; assert 'numba' in sys.modules")
