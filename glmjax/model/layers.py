"""Small pure building blocks: norms, interleaved RoPE, SwiGLU.

Activations are float32 throughout; weights may be stored narrower and are upcast at use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glmjax.model import kernels
# A weight as float32, and an MLA kv_b per head (attention's names; the choice is kernels').
from glmjax.model.kernels import as_f32, per_head, per_head_kernel  # noqa: F401
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


def linear(x, w):
  """x `[..., I]` @ wᵀ -> `[..., O]` with w in HF `[out, in]` orientation (a float array or a
  QArray), computed by the kernel `kernels.linear` picks for the platform and the format."""
  return kernels.linear(x, w)


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
