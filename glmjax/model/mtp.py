"""The multi-token-prediction (MTP) head as pure functions.

For main-model position i with final pre-norm hidden state h_i and the next token t_{i+1}:

  u_i  = eh_proj · [rms_norm(embed(t_{i+1}), enorm) ; rms_norm(h_i, hnorm)]   (embedding half first)
  h'_i = decoder_block(mtp.layer, u)_i      (a full MoE decoder layer, causal over the MTP sequence,
                                             never DSA: the MTP layer has no indexer)
  logits_i = head(rms_norm(h'_i, head_norm))   predicting t_{i+2}

`head` is the MTP layer's own `shared_head.head` when the checkpoint has one, else the main
lm_head (or the embedding when tied). The block itself runs through glmjax.model.forward.mtp_forward,
the one MTP step for training (teacher forcing over a whole sequence), speculative drafting and
the offload engine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glmjax.model.config import Config
from glmjax.model.kvcache import PAGE_SIZE, KVCache, identity_pages, init_pool
from glmjax.model.layers import embed_rows, linear, rms_norm
from glmjax.model.weights import MTP, Weights


def _head(w: Weights, m: MTP):
  if m.head is not None:
    return m.head
  return w.embed if w.lm_head is None else w.lm_head


def mtp_input(w: Weights, m: MTP, h, next_tokens, cfg: Config):
  """u `[B, S, D]`: eh_proj of the normed next-token embedding and normed hidden state."""
  e = rms_norm(embed_rows(w.embed, next_tokens), m.enorm, cfg.rms_norm_eps)
  hn = rms_norm(h, m.hnorm, cfg.rms_norm_eps)
  return linear(jnp.concatenate([e, hn], axis=-1), m.eh_proj)


def mtp_output_logits(w: Weights, m: MTP, x, cfg: Config):
  """Logits `[..., V]` from the MTP block's output residual."""
  return linear(rms_norm(x, m.head_norm, cfg.rms_norm_eps), _head(w, m))


def mtp_logits(w: Weights, h, next_tokens, cfg: Config, depth: int = 0):
  """Teacher-forced MTP logits (no cache) through glmjax.model.forward.mtp_forward, the one MTP
  step (training differentiates the same step, with its own options).

  Args:
    w: the model weights (uses `w.mtp[depth]`, `w.embed`, and the main head when needed).
    h: `[B, S, D]` the main model's final pre-norm hidden states (`forward(...)[1]`).
    next_tokens: `[B, S]` int, t_{i+1} for each position i.

  Returns:
    (logits `[B, S, V]` predicting t_{i+2}, the MTP block's output residual `[B, S, D]`).
  """
  from glmjax.model.forward import mtp_forward
  logits, x, _ = mtp_forward(w, h, next_tokens, cfg, depth=depth)
  return logits, x


def init_mtp_cache(cfg: Config, batch: int, capacity: int, dtype=jnp.float32,
                   sharding=None) -> KVCache:
  """An empty paged cache for the MTP block's own attention: `batch` rows of `capacity`
  positions each, every row owning its pages (placed with `sharding`, a `NamedSharding`, on a
  mesh). The simple form; generation takes the MTP layer's pages from its KV pool."""
  w = -(-capacity // PAGE_SIZE)
  layers = init_pool(cfg, 1 + batch * w, [cfg.num_hidden_layers], dtype, sharding=sharding)
  device = jax.devices()[0] if sharding is None else sharding
  return KVCache(layers, jax.device_put(identity_pages(batch, w), device),
                 jax.device_put(jnp.zeros((), jnp.int32), device))
