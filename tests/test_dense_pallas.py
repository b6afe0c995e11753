"""The accelerator path of quantized dense weights (issue 28): `pallas_kernels.ops.dense_matmul`
runs the grouped Pallas kernel with the matrix as its only expert. Here in interpret mode (CI
has no GPU; `scripts/check_gpu.py` runs it compiled) against a float64 loop, for both kernel
flavours and both tilings, and the backend choice that `layers.linear` relies on."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.formats.quantize import quantize
from glmjax.model import kernels, layers
from pallas_kernels import ops, tuning
from test_dense_kernels import I_FEATURES, O_ROWS, dequantized, reference

FMA = tuning.BlockConfig(mode="fma", block_n=16, block_n_down=16, block_k=64)
DOT = tuning.BlockConfig(mode="dot", block_n=32, block_n_down=32, block_k=128)


@functools.lru_cache(maxsize=None)
def matrix(bits: int, group: int):
  rng = np.random.default_rng(bits * 100 + group)
  w = (rng.standard_normal((O_ROWS, I_FEATURES)) / np.sqrt(I_FEATURES)).astype(np.float32)
  return quantize(w, bits, group)


def rel_err(got, want) -> float:
  return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


CASES = [  # (bits, group, rows, flavour, config): each format, tiling and flavour at least twice
    (4, 64, 1, "prefetch", None), (4, 64, 5, "prefetch", None), (8, 64, 1, "prefetch", None),
    (4, 32, 1, "prefetch", None), (4, 64, 5, "prefetch", DOT), (8, 64, 5, "prefetch", DOT),
    (4, 32, 3, "pointer", FMA), (8, 64, 3, "pointer", FMA)]


@pytest.mark.parametrize("bits,group,rows,flavour,config", CASES)
def test_pallas_dense_matches_float64_reference(bits, group, rows, flavour, config):
  q = matrix(bits, group)
  x = np.random.default_rng(rows).standard_normal((rows, I_FEATURES)).astype(np.float32)
  want = reference(x, dequantized(q))
  got = ops.dense_matmul(jnp.asarray(x), q, backend="pallas", flavour=flavour, config=config)
  assert got.shape == (rows, O_ROWS) and got.dtype == jnp.float32
  # float32 accumulation of 200 terms against a float64 sum (as tests/test_kernels.py).
  assert rel_err(got, want) < 1e-5


def test_xla_dense_path_and_leading_dims():
  """backend="xla" (prefill chunks, and CPU): dequantize-then-dot, `[B, S, K]` activations."""
  q = matrix(4, 64)
  x = np.random.default_rng(7).standard_normal((2, 3, I_FEATURES)).astype(np.float32)
  got = jax.jit(lambda a: ops.dense_matmul(a, q, backend="xla"))(x)
  assert got.shape == (2, 3, O_ROWS)
  assert rel_err(np.asarray(got).reshape(6, O_ROWS),
                 reference(x.reshape(6, I_FEATURES), dequantized(q))) < 1e-5


def test_dense_backend_choice():
  q = matrix(8, 64)
  assert ops.dense_backend("auto", "cpu", 1, q) == "xla"  # Pallas only interprets on CPU
  assert ops.dense_backend("auto", "gpu", 1, q) == "pallas"
  assert ops.dense_backend("auto", "tpu", ops.DENSE_PALLAS_ROWS, q) == "pallas"
  assert ops.dense_backend("auto", "gpu", ops.DENSE_PALLAS_ROWS + 1, q) == "xla"  # prefill
  odd_group = quantize(np.ones((4, 96), np.float32), 8, 48)
  assert ops.dense_backend("auto", "gpu", 1, odd_group) == "xla"  # Triton: powers of two
  assert ops.dense_backend("pallas", "cpu", 100, q) == "pallas"
  with pytest.raises(ValueError, match="backend"):
    ops.dense_backend("triton", "gpu", 1, q)


def test_bad_dense_operands_are_refused():
  q = matrix(4, 64)
  with pytest.raises(ValueError, match="dense_matmul"):
    ops.dense_matmul(jnp.zeros((1, I_FEATURES - 1)), q)
  with pytest.raises(ValueError, match="interpret=True"):
    ops.dense_matmul(jnp.zeros((1, I_FEATURES)), q, backend="pallas", interpret=False)


def test_linear_off_the_cpu_platform_goes_to_dense_matmul(monkeypatch):
  """Where the numba kernels do not run (an accelerator), `layers.linear` hands a QArray to
  `ops.dense_matmul` (here forced to the interpreted Pallas kernel) and leaves float32 weights
  to XLA's dot."""
  calls = []
  real = ops.dense_matmul

  def spy(x, w):
    calls.append(w.bits)
    return real(x, w, backend="pallas")

  monkeypatch.setattr(kernels, "host_kernels", lambda: False)
  monkeypatch.setattr(ops, "dense_matmul", spy)
  q = matrix(4, 64)
  x = np.random.default_rng(3).standard_normal((1, 2, I_FEATURES)).astype(np.float32)
  got = np.asarray(layers.linear(jnp.asarray(x), q))
  assert calls == [4] and got.shape == (1, 2, O_ROWS)
  assert rel_err(got.reshape(2, O_ROWS), reference(x.reshape(2, I_FEATURES), dequantized(q))) < 1e-5
  w = np.asarray(dequantized(q), np.float32)
  layers.linear(jnp.asarray(x), jnp.asarray(w))
  assert calls == [4]


def test_check_gpu_dense_step_interpreted():
  """check_gpu.py's dense kernel step (compiled on a GPU machine) runs here interpreted: every
  case reports and agrees with the float64 loop."""
  import os
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
  import check_gpu  # pylint: disable=import-outside-toplevel
  rows = check_gpu.dense_kernel_checks()
  assert len(rows) == 12 and all(r["ok"] for r in rows), rows
  assert all(r["rel_err"] < check_gpu.RTOL for r in rows)
