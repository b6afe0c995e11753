"""The GLM-5 forward pass as pure functions over a `Weights` pytree and a `KVCache`.

Letters: B batch, S sequence (queries), T cache capacity, D hidden, V vocabulary.

jit boundaries are the three entry points at the bottom (`score_fn`, `prefill_fn`, `decode_fn`);
inside them the decoder layers are a Python loop, so each layer keeps its own structure (dense or
MoE, full or shared indexer) and the offload engine can later call `layer_forward` one at a time.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from glmjax.attention import LayerCache, attention
from glmjax.config import Config
from glmjax.layers import F32, linear, rms_norm, swiglu
from glmjax.moe import moe
from glmjax.weights import MoE, Weights


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """Per-layer latent caches plus the number of positions written (`length`, int32 [])."""
  layers: Any  # list[LayerCache]
  length: Any


def init_cache(cfg: Config, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
  """An empty cache for `batch` sequences of up to `capacity` positions."""
  def layer(i):
    z = lambda n: jnp.zeros((batch, capacity, n), dtype)
    return LayerCache(latent=z(cfg.kv_lora_rank), k_rope=z(cfg.qk_rope_head_dim),
                      index_k=z(cfg.index_head_dim) if cfg.has_indexer(i) else None)
  return KVCache(layers=[layer(i) for i in range(cfg.num_hidden_layers)],
                 length=jnp.zeros((), jnp.int32))


def layer_forward(lw, x, positions, cfg: Config, cache=None, start=None, selection=None,
                  absorbed=False, kernel="xla"):
  """One decoder layer: x + attn(norm x), then + ffn(norm x). Returns (x, cache, selection)."""
  with jax.named_scope("attention"):
    h = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)
    a, cache, selection = attention(lw.attn, h, positions, cfg, cache, start, selection, absorbed)
    x = x + a
  h = rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps)
  if isinstance(lw.mlp, MoE):
    with jax.named_scope("moe"):
      x = x + moe(lw.mlp, h, cfg, kernel)
  else:
    with jax.named_scope("mlp"):
      x = x + swiglu(h, lw.mlp.gate_up, lw.mlp.down)
  return x, cache, selection


def logits_of(w: Weights, x, cfg: Config):
  """Final norm and lm_head (tied to the embedding when the checkpoint says so)."""
  head = w.embed if w.lm_head is None else w.lm_head
  return linear(rms_norm(x, w.norm, cfg.rms_norm_eps), head)


def forward(w: Weights, tokens, cfg: Config, cache: KVCache | None = None, absorbed=False,
            kernel="xla"):
  """Logits `[B, S, V]` for `tokens` `[B, S]` placed after the cache's `length` positions.

  Also returns the final pre-norm hidden states (the MTP head's input) and the new cache.
  """
  start = jnp.zeros((), jnp.int32) if cache is None else cache.length
  positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)  # [S]
  x = w.embed[tokens].astype(F32)  # [B, S, D]
  new_layers, selection = [], None
  for i, lw in enumerate(w.layers):
    lc = None if cache is None else cache.layers[i]
    x, lc, selection = layer_forward(lw, x, positions, cfg, lc, start, selection, absorbed,
                                     kernel)
    new_layers.append(lc)
  new_cache = None if cache is None else KVCache(new_layers, cache.length)
  return logits_of(w, x, cfg), x, new_cache


# --- jitted entry points -------------------------------------------------------------------

# `kernel` ("xla" | "pallas") selects the MoE backend for quantized experts; it is static because
# it selects different code, not because it changes shapes.

@functools.partial(jax.jit, static_argnames=("cfg", "kernel"))
def score_fn(w: Weights, tokens, cfg: Config, kernel: str = "xla"):
  """Teacher-forced logits `[B, S, V]` of a whole sequence, no cache."""
  return forward(w, tokens, cfg, kernel=kernel)[0]


@functools.partial(jax.jit, static_argnames=("cfg", "kernel"), donate_argnames=("cache",))
def prefill_fn(w: Weights, cache: KVCache, tokens, n_valid, cfg: Config, kernel: str = "xla"):
  """Writes `tokens` `[B, S]` (right-padded; the first `n_valid` are real) into the cache.

  Returns (logits `[B, V]` at the last real token, hidden `[B, D]` there, cache). Padding
  positions land beyond `length` and are overwritten before any query can see them.
  """
  logits, x, cache = forward(w, tokens, cfg, cache, kernel=kernel)
  last = n_valid - 1
  cache = KVCache(cache.layers, cache.length + n_valid)
  return logits[:, last], x[:, last], cache


@functools.partial(jax.jit, static_argnames=("cfg", "kernel"), donate_argnames=("cache",))
def decode_fn(w: Weights, cache: KVCache, tokens, cfg: Config, kernel: str = "xla"):
  """One step for `tokens` `[B, S]` (S = 1, or 1 + drafts) on the absorbed path."""
  logits, x, cache = forward(w, tokens, cfg, cache, absorbed=True, kernel=kernel)
  return logits, x, KVCache(cache.layers, cache.length + tokens.shape[1])
