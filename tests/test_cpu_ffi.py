"""pallas_kernels.cpu_ffi's safety net: the custom call checks itself against the direct kernel
at first use and falls back to jax.pure_callback, with a warning, when the check fails."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.formats.quantize import quantize_expert
from glmjax.model import quant
from pallas_kernels import cpu, cpu_ffi


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


def _run_in_jit(x, leaves, ids, active, kw):
  fn = jax.jit(lambda x, ids, act: cpu_ffi.pool_terms_xla(
      x, *(jnp.asarray(a) for a in leaves), ids, act, **kw))
  return np.asarray(fn(x, ids, active)), fn.lower(x, ids, active).as_text()


def test_self_test_passes_with_the_checked_layout():
  assert cpu_ffi.ffi_api_version() in cpu_ffi.TESTED_API_VERSIONS
  assert cpu_ffi.self_test() is None
  assert cpu_ffi.backend() == "ffi"
  x, leaves, ids, active, kw = _problem()
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no fallback warning on the checked path
    got, hlo = _run_in_jit(x, leaves, ids, active, kw)
  np.testing.assert_array_equal(got, cpu.pool_terms(x, *leaves, ids, active, **kw))
  assert cpu_ffi.target_name(cpu_ffi.FRAME_LAYOUT) in hlo


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
def test_a_wrong_frame_offset_falls_back_with_a_warning(monkeypatch, bits, group):
  """As if a jaxlib release inserted a field before the call frame's arguments: the handler
  must not read through the shifted words, the self-test must see the mismatch, and every
  call must take the pure_callback path with the direct kernel's bits."""
  wrong = cpu_ffi.FRAME_LAYOUT._replace(args=cpu_ffi.FRAME_LAYOUT.args + 1)
  assert "differ from pallas_kernels.cpu.pool_terms" in cpu_ffi.self_test(wrong)
  monkeypatch.setattr(cpu_ffi, "FRAME_LAYOUT", wrong)
  monkeypatch.setattr(cpu_ffi, "_backend", None)  # a fresh process: first use still ahead
  monkeypatch.setattr(cpu_ffi, "_ffi_target", None)
  x, leaves, ids, active, kw = _problem(bits, group, seed=bits)
  with pytest.warns(RuntimeWarning, match="failed its self-test .*differ.*pure_callback"):
    got, hlo = _run_in_jit(x, leaves, ids, active, kw)
  assert cpu_ffi.backend() == "callback"
  assert cpu_ffi.TARGET not in hlo  # the custom call is not used at all
  np.testing.assert_array_equal(got, cpu.pool_terms(x, *leaves, ids, active, **kw))
  assert (got[~active] == 0).all()


def test_an_unknown_api_version_or_an_error_falls_back(monkeypatch):
  monkeypatch.setattr(cpu_ffi, "TESTED_API_VERSIONS", frozenset({(0, 999)}))
  assert "API version" in cpu_ffi.self_test()
  monkeypatch.setattr(cpu_ffi, "_backend", None)
  monkeypatch.setattr(cpu_ffi, "_ffi_target", None)
  x, leaves, ids, active, kw = _problem(seed=3)
  with pytest.warns(RuntimeWarning, match="API version"):
    got, _ = _run_in_jit(x, leaves, ids, active, kw)
  np.testing.assert_array_equal(got, cpu.pool_terms(x, *leaves, ids, active, **kw))
  monkeypatch.undo()

  def refuse(*args, **kwargs):
    raise RuntimeError("no handler for you")
  monkeypatch.setattr(cpu_ffi, "_register", refuse)
  assert cpu_ffi.self_test() == "RuntimeError: no handler for you"
