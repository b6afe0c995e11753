"""Which kernel computes what: the one place glmjax picks a backend, from the platform and the
weight's format, for dense matmuls (`linear`), an MLA kv_b per head (`per_head`), a pool's
expert terms (`pool_terms`) and one host-held expert (`expert_ffn`).

Model code (layers, attention, moe) and the offload provider call these and never ask for the
platform; this is the only module of glmjax/model that imports `pallas_kernels`
(tests/test_architecture.py).

| weight                  | CPU platform                      | accelerator                      |
|-------------------------|-----------------------------------|----------------------------------|
| QArray `[O, I]`         | numba dense kernel (custom call)  | `dense_matmul`: Pallas <= 32     |
|                         |                                   | rows, XLA dequantize-dot above   |
| bfloat16 `[O, I]`       | numba up to BF16_KERNEL_MAX_ROWS  | XLA's dot, upcast                |
|                         | rows, XLA's dot (upcast) above    |                                  |
| float32, stacked QArray | XLA's dot (float32)               | XLA's dot (float32)              |
| kv_b (QArray, bf16)     | numba per head (`per_head`)       | XLA einsums on the float32 split |
| expert pool ("auto")    | numba ("cpu")                     | Pallas grouped kernel ("pallas") |

Weights arrive as they are stored: float arrays, or QArray-likes (packed, scales, bits,
group_size, in_features: the protocol pallas_kernels reads). This module imports nothing from
glmjax, so `glmjax.model.quant` takes the format's definition (`dequantize`, `unpack_int4`)
from here without an import cycle. The numba kernels load on first use (`pallas_kernels` looks
its names up on access): ~0.5 s from numba's cache, ~15 s on the first run after install, which
models without quantized or bfloat16 weights never pay.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

F32 = jnp.float32
KERNELS = ("auto", "cpu", "xla", "pallas")  # a pool's expert kernels (`pool_terms`)

# The format's definition (the XLA kernels' unpacking), re-exported by glmjax.model.quant.
dequantize, unpack_int4 = pk.dequantize, pk.unpack_int4
# Σ_k w[:, k] · terms[:, k] in rank order k = 0..K-1; explicit adds fix the FP order.
combine_in_order = pk.combine_in_order

# On the CPU platform a bfloat16 matrix applied to more rows than this (prefill chunks) goes to
# XLA's float32 GEMM, upcast: the numba kernel is decode-shaped. Kernel / XLA time at GLM-5's
# [2048, 6144] and [6144, 2048] (DESIGN.md §13): 0.74 / 0.91 at 256 rows, 1.02 / 1.12 at 512,
# 1.44 / 1.36 at 1024 (the default prefill chunk).
BF16_KERNEL_MAX_ROWS = 256


def host_kernels() -> bool:
  """Whether this process computes on the CPU platform, where the numba kernels replace XLA
  for quantized and bfloat16 weights (the only platform question glmjax/model asks)."""
  return jax.default_backend() == "cpu"


def quantized(w) -> bool:
  """Whether `w` is a group-wise quantized matrix (a QArray-like) rather than an array."""
  return hasattr(w, "packed") and hasattr(w, "scales")


def as_f32(w):
  """A weight as float32: upcast, or dequantized by XLA when it is quantized (then the dot runs
  in float32 as for float weights)."""
  return dequantize(w, F32) if quantized(w) else w.astype(F32)


def _matrix(w) -> bool:
  """Whether `w` is one matrix `[O, I]` in a format the numba dense kernels read (int4, int8,
  bfloat16); float32 and stacked weights keep XLA's dot."""
  if quantized(w):
    return w.packed.ndim == 2
  return w.ndim == 2 and w.dtype == jnp.bfloat16


def _host_operands(w):
  """(matrix, scales, format statics) of a `_matrix` weight for the numba custom calls."""
  if quantized(w):
    return w.packed, w.scales, dict(bits=w.bits, group_size=w.group_size,
                                    in_features=w.in_features)
  return w, None, dict(bits=pk.BF16, group_size=0, in_features=w.shape[1])


def linear(x, w):
  """`x [..., I] @ wᵀ` -> float32 `[..., O]`, w in HF `[out, in]` orientation (a float array
  or a QArray); the kernel per the module table. The numba kernel reads the weight as stored,
  accumulates in float32, and gives each output row bits independent of the token count."""
  rows = math.prod(x.shape[:-1])
  if host_kernels() and _matrix(w) and (quantized(w) or rows <= BF16_KERNEL_MAX_ROWS):
    mat, scales, fmt = _host_operands(w)
    return pk.matmul_xla(x, mat, scales, **fmt)
  if quantized(w) and w.packed.ndim == 2:
    return pk.dense_matmul(x, w)
  return jnp.einsum("...i,oi->...o", x, as_f32(w))


def per_head_kernel(w) -> bool:
  """Whether an MLA kv_b `w` is applied per head by the numba kernel (`per_head`): a QArray or
  a bfloat16 matrix on the CPU platform (float32 keeps XLA's einsums, bit for bit)."""
  return host_kernels() and _matrix(w)


def per_head(x, w, heads: int, n_dim: int, keys: bool):
  """An MLA kv_b `w` `[heads·(N+V), C]` (a QArray, or bfloat16) applied per head without
  dequantizing or upcasting it whole (numba; only where `per_head_kernel`).

  keys: `x [..., heads, N]` -> `[..., heads, C]`, x times each head's N key rows (the query
  absorbed into latent space). Else: `x [..., heads, C]` -> `[..., heads, V]`, each head's V
  value rows times x (the latent context out to values).
  """
  mat, scales, fmt = _host_operands(w)
  y = pk.heads_xla(x.reshape(*x.shape[:-2], -1), mat, scales, **fmt, heads=heads, n_dim=n_dim,
                   part=pk.KEYS if keys else pk.VALUES)
  return y.reshape(*x.shape[:-1], -1)


def resolve_kernel(kernel: str) -> str:
  """A pool's expert kernel: "auto" is the numba CPU kernel on a CPU-only machine, the Pallas
  kernel on an accelerator; the others ("cpu", "xla", "pallas") as named."""
  if kernel == "auto":
    return "cpu" if host_kernels() else "pallas"
  return kernel


def pool_terms(x, pool, slot_ids, active, kernel: str = "auto"):
  """Unweighted terms `[T, K, D]` of quantized experts held in a pool (an ExpertPool: gate_up
  `[S, 2I, D]`, down `[S, D, I]`), inside a jit; x `[T, D]`, slot_ids `[T, K]`.

  `active` `[T, K]` bool: inactive pairs (padding, or experts served elsewhere) are 0. The CPU
  kernel computes each distinct slot once over all its rows; every backend gives a (token,
  rank) term that depends only on that token and that expert's weights.
  """
  kernel = resolve_kernel(kernel)
  active = jnp.broadcast_to(active, slot_ids.shape)
  if kernel == "cpu":
    gu, dn = pool.gate_up, pool.down
    return pk.pool_terms_xla(x.astype(F32), gu.packed, gu.scales, dn.packed, dn.scales,
                             slot_ids, active, bits=gu.bits, group_size=gu.group_size,
                             hidden=pool.hidden, intermediate=pool.intermediate)
  if kernel == "pallas":
    return pk.grouped_terms(x, pool, slot_ids, active)
  return pk.expert_terms(x, pool, slot_ids, active)


def expert_ffn(x, expert) -> np.ndarray:
  """One host-held expert (an ExpertWeights: gate_up `[2I, D]`, down `[D, I]`, quantized) on
  token rows `x` `[n, D]` (numpy, outside any jit): float32 `[n, D]`, unweighted, each row
  bitwise the pool kernels' term for that row (the numba CPU kernel)."""
  gu, dn = expert.gate_up, expert.down
  return pk.expert_ffn(x, gu.packed, gu.scales, dn.packed, dn.scales, gu.bits, gu.group_size,
                       dn.out_features, dn.in_features)
