"""The multi-token-prediction (MTP) head as pure functions.

For main-model position i with final pre-norm hidden state h_i and the next token t_{i+1}:

  u_i  = eh_proj · [rms_norm(embed(t_{i+1}), enorm) ; rms_norm(h_i, hnorm)]   (embedding half first)
  h'_i = decoder_block(mtp.layer, u)_i      (a full MoE decoder layer, causal over the MTP sequence,
                                             never DSA: the MTP layer has no indexer)
  logits_i = head(rms_norm(h'_i, head_norm))   predicting t_{i+2}

`head` is the MTP layer's own `shared_head.head` when the checkpoint has one, else the main
lm_head (or the embedding when tied). The same functions serve training (teacher forcing over a
whole sequence) and speculative decoding (one cached step).
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from glmjax.attention import LayerCache
from glmjax.config import Config
from glmjax.layers import F32, linear, rms_norm
from glmjax.weights import MTP, Weights


def _head(w: Weights, m: MTP):
  if m.head is not None:
    return m.head
  return w.embed if w.lm_head is None else w.lm_head


def mtp_input(w: Weights, m: MTP, h, next_tokens, cfg: Config):
  """u `[B, S, D]`: eh_proj of the normed next-token embedding and normed hidden state."""
  e = rms_norm(w.embed[next_tokens].astype(F32), m.enorm, cfg.rms_norm_eps)
  hn = rms_norm(h, m.hnorm, cfg.rms_norm_eps)
  return linear(jnp.concatenate([e, hn], axis=-1), m.eh_proj)


def mtp_output_logits(w: Weights, m: MTP, x, cfg: Config):
  """Logits `[..., V]` from the MTP block's output residual."""
  return linear(rms_norm(x, m.head_norm, cfg.rms_norm_eps), _head(w, m))


def mtp_logits(w: Weights, h, next_tokens, cfg: Config, positions=None, block: Callable | None = None,
               depth: int = 0):
  """Teacher-forced MTP logits.

  Args:
    w: the model weights (uses `w.mtp[depth]`, `w.embed`, and the main head when needed).
    h: `[B, S, D]` the main model's final pre-norm hidden states (`forward(...)[1]`).
    next_tokens: `[B, S]` int, t_{i+1} for each position i.
    positions: `[S]` positions of the MTP sequence (default 0..S-1).
    block: `block(layer, u, positions) -> h'`; default glmjax's `layer_forward` without cache.

  Returns:
    (logits `[B, S, V]` predicting t_{i+2}, the MTP block's output residual `[B, S, D]`).
  """
  from glmjax.model import layer_forward

  m = w.mtp[depth]
  if positions is None:
    positions = jnp.arange(h.shape[1], dtype=jnp.int32)
  u = mtp_input(w, m, h, next_tokens, cfg)
  if block is None:
    x, _, _ = layer_forward(m.layer, u, positions, cfg)
  else:
    x = block(m.layer, u, positions)
  return mtp_output_logits(w, m, x, cfg), x


def init_mtp_cache(cfg: Config, batch: int, capacity: int, dtype=jnp.float32) -> LayerCache:
  """An empty latent cache for the MTP block's own attention."""
  z = lambda n: jnp.zeros((batch, capacity, n), dtype)
  return LayerCache(latent=z(cfg.kv_lora_rank), k_rope=z(cfg.qk_rope_head_dim), index_k=None)


def mtp_step(w: Weights, h, next_tokens, cfg: Config, cache: LayerCache, start, depth: int = 0,
             absorbed: bool = True):
  """Cached MTP step(s) for speculative decoding.

  `h` `[B, S, D]` and `next_tokens` `[B, S]` for MTP positions start..start+S-1; the MTP block's
  latent cache is written there. Returns (logits `[B, S, V]`, new cache).
  """
  from glmjax.model import layer_forward

  m = w.mtp[depth]
  positions = start + jnp.arange(h.shape[1], dtype=jnp.int32)
  u = mtp_input(w, m, h, next_tokens, cfg)
  x, cache, _ = layer_forward(m.layer, u, positions, cfg, cache, start, None, absorbed)
  return mtp_output_logits(w, m, x, cfg), cache
