"""The custom calls' safety net (pallas_kernels.ffi_common.CheckedCall, for cpu_ffi and
cpu_dense_ffi): a custom call checks itself against the direct kernel at first use and falls back
to jax.pure_callback, with a warning, when the check fails."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.formats.quantize import quantize_expert
from glmjax.model import quant
from glmjax.formats.quantize import quantize
from pallas_kernels import cpu, cpu_dense, cpu_dense_ffi, cpu_ffi, ffi_common


def _problem(bits=4, group=64, seed=0):
  """A 4-slot pool at small odd dims, 6 tokens × top-2 with some pairs inactive."""
  rng = np.random.default_rng(seed)
  d, inter, s, t, k = 100, 72, 4, 6, 2
  pool = quant.stack_experts([quantize_expert(
      rng.standard_normal((inter, d)), rng.standard_normal((inter, d)),
      rng.standard_normal((d, inter)), bits, group) for _ in range(s)])
  gu, dn = pool.gate_up, pool.down
  leaves = (gu.packed, gu.scales, dn.packed, dn.scales)
  x = rng.standard_normal((t, d)).astype(np.float32)
  ids = rng.integers(0, s, (t, k)).astype(np.int32)
  active = rng.random((t, k)) < 0.7
  kw = dict(bits=bits, group_size=group, hidden=d, intermediate=inter)
  return x, leaves, ids, active, kw


def _fresh_process(monkeypatch, call, layout=None):
  """As in a fresh process (first use still ahead), with `layout` its handler's frame layout."""
  monkeypatch.setattr(call, "choice", None)
  monkeypatch.setattr(call, "target", None)
  if layout is not None:
    monkeypatch.setattr(call, "layout", layout)


def _run_in_jit(x, leaves, ids, active, kw):
  fn = jax.jit(lambda x, ids, act: cpu_ffi.pool_terms_xla(
      x, *(jnp.asarray(a) for a in leaves), ids, act, **kw))
  return np.asarray(fn(x, ids, active)), fn.lower(x, ids, active).as_text()


def test_self_test_passes_with_the_checked_layout():
  assert ffi_common.ffi_api_version() in ffi_common.TESTED_API_VERSIONS
  assert cpu_ffi.self_test() is None
  assert cpu_ffi.backend() == "ffi"
  x, leaves, ids, active, kw = _problem()
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no fallback warning on the checked path
    got, hlo = _run_in_jit(x, leaves, ids, active, kw)
  np.testing.assert_array_equal(got, cpu.pool_terms(x, *leaves, ids, active, **kw))
  assert cpu_ffi.CALL.target_name(ffi_common.FRAME_LAYOUT) in hlo


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
def test_a_wrong_frame_offset_falls_back_with_a_warning(monkeypatch, bits, group):
  """As if a jaxlib release inserted a field before the call frame's arguments: the handler
  must not read through the shifted words, the self-test must see the mismatch, and every
  call must take the pure_callback path with the direct kernel's bits."""
  wrong = ffi_common.FRAME_LAYOUT._replace(args=ffi_common.FRAME_LAYOUT.args + 1)
  assert "differ from pallas_kernels.cpu.pool_terms" in cpu_ffi.self_test(wrong)
  _fresh_process(monkeypatch, cpu_ffi.CALL, wrong)
  x, leaves, ids, active, kw = _problem(bits, group, seed=bits)
  with pytest.warns(RuntimeWarning, match="failed its self-test .*differ.*pure_callback"):
    got, hlo = _run_in_jit(x, leaves, ids, active, kw)
  assert cpu_ffi.backend() == "callback"
  assert cpu_ffi.TARGET not in hlo  # the custom call is not used at all
  np.testing.assert_array_equal(got, cpu.pool_terms(x, *leaves, ids, active, **kw))
  assert (got[~active] == 0).all()


def test_an_unknown_api_version_or_an_error_falls_back(monkeypatch):
  monkeypatch.setattr(ffi_common, "TESTED_API_VERSIONS", frozenset({(0, 999)}))
  assert "API version" in cpu_ffi.self_test()
  _fresh_process(monkeypatch, cpu_ffi.CALL)
  x, leaves, ids, active, kw = _problem(seed=3)
  with pytest.warns(RuntimeWarning, match="API version"):
    got, _ = _run_in_jit(x, leaves, ids, active, kw)
  np.testing.assert_array_equal(got, cpu.pool_terms(x, *leaves, ids, active, **kw))
  monkeypatch.undo()

  def refuse(*args, **kwargs):
    raise RuntimeError("no handler for you")
  monkeypatch.setattr(cpu_ffi.CALL, "register", refuse)
  assert cpu_ffi.self_test() == "RuntimeError: no handler for you"


@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16"])
def test_the_dense_call_falls_back_the_same_way(monkeypatch, fmt):
  """cpu_dense_ffi's targets (bf16; int4/int8) share the check and the fallback: a shifted
  frame is a mismatch, and every call (matmul and kv_b heads) of that target then takes
  jax.pure_callback with the direct kernels' bits, the other target's choice untouched."""
  wrong = ffi_common.FRAME_LAYOUT._replace(args=ffi_common.FRAME_LAYOUT.args + 1)
  call = cpu_dense_ffi.call_for(cpu_dense.BF16 if fmt == "bf16" else int(fmt[3:]))
  other = cpu_dense_ffi.QUANT_CALL if call is cpu_dense_ffi.BF16_CALL else cpu_dense_ffi.BF16_CALL
  assert call is not other
  reasons = dict(r.split(": ", 1) for r in cpu_dense_ffi.self_test(wrong).split("; "))
  assert set(reasons) == {call.name, other.name}  # both targets see the mismatch
  assert all("differ from pallas_kernels.cpu_dense" in r for r in reasons.values()), reasons
  _fresh_process(monkeypatch, call, wrong)
  other_choice = other.backend()
  rng = np.random.default_rng(7)
  x = rng.standard_normal((3, 90)).astype(np.float32)
  w = (rng.standard_normal((36, 90)) / 10).astype(np.float32)
  if fmt == "bf16":
    mat, scales, fmt_kw = w.astype(jnp.bfloat16), None, dict(bits=cpu_dense.BF16, group_size=0)
    want = cpu_dense.bf16_matmul(x, mat)
  else:
    q = quantize(w, int(fmt[3:]), 32)
    mat, scales, fmt_kw = q.packed, q.scales, dict(bits=q.bits, group_size=32)
    want = cpu_dense.qmatmul(x, mat, scales, in_features=90, **fmt_kw)
  fmt_kw["in_features"] = 90
  with pytest.warns(RuntimeWarning, match="failed its self-test .*differ.*copies the weight"):
    got = jax.jit(lambda a: cpu_dense_ffi.matmul_xla(a, mat, scales, **fmt_kw))(x)
  assert call.backend() == "callback" and other.backend() == other_choice == "ffi"
  np.testing.assert_array_equal(np.asarray(got), want)
  xv = rng.standard_normal((3, 3 * 90)).astype(np.float32)  # 3 heads x (N = 5 + V = 7) rows
  heads = dict(fmt_kw, heads=3, n_dim=5, part=cpu_dense.VALUES)
  got = jax.jit(lambda a: cpu_dense_ffi.heads_xla(a, mat, scales, **heads))(xv)
  np.testing.assert_array_equal(np.asarray(got),
                                cpu_dense.heads_matmul(xv, mat, scales, **heads))
