"""Small pure building blocks: norms, interleaved RoPE, SwiGLU.

Activations are float32 throughout; weights may be stored narrower and are upcast at use.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from glmjax.model.quant import QArray, dequantize

F32 = jnp.float32

# q_a_layernorm, kv_a_layernorm and the indexer's k_norm use this eps in GLM-5 regardless of
# `rms_norm_eps` (their HF modules are built without passing the config value).
LATENT_NORM_EPS = 1e-6


def rms_norm(x, w, eps: float):
  """x * w / sqrt(mean(x²) + eps), over the last axis."""
  x = x.astype(F32)
  var = jnp.mean(x * x, axis=-1, keepdims=True)
  return w.astype(F32) * (x * jax.lax.rsqrt(var + eps))


def layer_norm(x, w, b, eps: float = LATENT_NORM_EPS):
  """Standard LayerNorm (mean and bias) over the last axis."""
  x = x.astype(F32)
  mu = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
  return (x - mu) * jax.lax.rsqrt(var + eps) * w.astype(F32) + b.astype(F32)


def as_f32(w):
  """A weight as float32: upcast, or dequantized when it is a QArray (a quantized dense format:
  XLA dequantizes, then the dot runs in float32 as for float weights)."""
  return dequantize(w, F32) if isinstance(w, QArray) else w.astype(F32)


def host_kernels() -> bool:
  """Whether this process computes on the CPU platform, where the numba kernels
  (`pallas_kernels.cpu*`) replace XLA for quantized and bfloat16 weights."""
  return jax.default_backend() == "cpu"


# On the CPU platform a bfloat16 matrix applied to more rows than this (prefill chunks) goes to
# XLA's float32 GEMM, upcast: the numba kernel is decode-shaped. Kernel / XLA time at GLM-5's
# [2048, 6144] and [6144, 2048] (BUILD_NOTES §22): 0.74 / 0.91 at 256 rows, 1.02 / 1.12 at 512,
# 1.44 / 1.36 at 1024 (the default prefill chunk).
BF16_KERNEL_MAX_ROWS = 256


def linear(x, w):
  """x @ wᵀ with w in HF `[out, in]` orientation (a float array or a QArray).

  float32 weights: XLA's dot. On the CPU platform, a QArray, or a bfloat16 matrix applied to at
  most `BF16_KERNEL_MAX_ROWS` rows, goes to the numba dense kernel (custom call; the weight is
  read as stored, accumulated in float32, each output row bitwise independent of the token
  count); a bfloat16 matrix on more rows goes to XLA's dot, upcast. On accelerators a QArray
  goes to `pallas_kernels.ops.dense_matmul` (the Pallas grouped kernel for up to 32 rows: decode
  and verify; XLA's dequantize-then-dot for prefill chunks).
  """
  rows = math.prod(x.shape[:-1])
  if host_kernels() and (isinstance(w, QArray) and w.packed.ndim == 2
                         or not isinstance(w, QArray) and w.ndim == 2 and w.dtype == jnp.bfloat16
                         and rows <= BF16_KERNEL_MAX_ROWS):
    # Imported on first use: models without such weights never load the custom call.
    from pallas_kernels import cpu_dense, cpu_dense_ffi
    if isinstance(w, QArray):
      return cpu_dense_ffi.matmul_xla(x, w.packed, w.scales, bits=w.bits,
                                      group_size=w.group_size, in_features=w.in_features)
    return cpu_dense_ffi.matmul_xla(x, w, bits=cpu_dense.BF16, in_features=w.shape[1])
  if isinstance(w, QArray) and w.packed.ndim == 2:
    from pallas_kernels import ops
    return ops.dense_matmul(x, w)
  return jnp.einsum("...i,oi->...o", x, as_f32(w))


def per_head_kernel(w) -> bool:
  """Whether an MLA kv_b `w` is applied per head by the numba kernel (`per_head`): a QArray or
  a bfloat16 matrix on the CPU platform (float32 keeps XLA's einsums, bit for bit)."""
  if not host_kernels():
    return False
  if isinstance(w, QArray):
    return w.packed.ndim == 2
  return w.ndim == 2 and w.dtype == jnp.bfloat16


def per_head(x, w, heads: int, n_dim: int, keys: bool):
  """An MLA kv_b `w` `[heads·(N+V), C]` (a QArray, or bfloat16) applied per head without
  dequantizing or upcasting it whole (`pallas_kernels.cpu_dense.heads_core`; CPU platform only,
  see `per_head_kernel`).

  keys: `x [..., heads, N]` -> `[..., heads, C]`, x times each head's N key rows (the query
  absorbed into latent space). Else: `x [..., heads, C]` -> `[..., heads, V]`, each head's V
  value rows times x (the latent context out to values).
  """
  from pallas_kernels import cpu_dense, cpu_dense_ffi
  if isinstance(w, QArray):
    mat, scales, fmt = w.packed, w.scales, dict(bits=w.bits, group_size=w.group_size,
                                                in_features=w.in_features)
  else:
    mat, scales, fmt = w, None, dict(bits=cpu_dense.BF16, group_size=0, in_features=w.shape[1])
  y = cpu_dense_ffi.heads_xla(
      x.reshape(*x.shape[:-2], -1), mat, scales, **fmt, heads=heads, n_dim=n_dim,
      part=cpu_dense.KEYS if keys else cpu_dense.VALUES)
  return y.reshape(*x.shape[:-1], -1)


def embed_rows(table, tokens):
  """Rows `tokens` of the embedding `table` `[V, D]` as float32 `[*tokens.shape, D]`; a QArray
  table is gathered first (packed rows and their scales), then only those rows dequantized."""
  if isinstance(table, QArray):
    return dequantize(QArray(table.packed[tokens], table.scales[tokens], table.bits,
                             table.group_size, table.in_features), F32)
  return table[tokens].astype(F32)


def rope_angles(positions, dim: int, theta: float):
  """cos, sin of shape `[*positions.shape, dim // 2]`."""
  inv = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=F32) / dim))  # [R/2]
  ang = positions.astype(F32)[..., None] * inv
  return jnp.cos(ang), jnp.sin(ang)


def rope_interleaved(x, cos, sin):
  """Rotates interleaved pairs (x[2j], x[2j+1]) and writes them half-split.

  This is GLM-5's layout (DeepSeek's `rope_interleave`): output j is the rotated even element,
  output j + R/2 the rotated odd element. `cos`/`sin` broadcast against `x[..., :R/2]`.
  """
  a, b = x[..., 0::2], x[..., 1::2]
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def swiglu(x, gate_up, down):
  """down(silu(gate x) * up x) with the fused `[2F, D]` gate_up matrix."""
  h = linear(x, gate_up)  # [..., 2F]
  g, u = jnp.split(h, 2, axis=-1)
  return linear(jax.nn.silu(g) * u, down)
