"""The training forward (the inference forward pass, differentiated) and its losses.

Next-token cross-entropy, the MTP head's next-next-token cross-entropy (weight `mtp_weight`)
and the indexer's distillation (weight `index_weight`): KL(mean-over-heads dense attention
probabilities ‖ softmax of the index scores) over the causal keys, averaged over queries and
over the layers with an indexer. The indexer's inputs and the target carry no gradient, so the
indexer learns from the KL only and the KL moves nothing else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glmjax.model.attention import Taps
from glmjax.model.config import Config, Runtime
from glmjax.model.forward import Drive, forward, mtp_forward
from glmjax.model.weights import Weights
from glmjax.train.experts import capacity_experts


def train_forward(w: Weights, tokens, next_tokens, cfg: Config, select: bool, capacity: float):
  """`forward` and `mtp_forward` over `tokens` `[B, S]` (the MTP head reading `next_tokens`,
  t_{i+1} `[B, S]`), with dense attention, the capacity expert provider and attention taps.

  `select` False attends to every causal key (no DSA selection). Returns (logits `[B, S, V]`
  predicting t_{i+1}, MTP logits `[B, S, V]` predicting t_{i+2}, aux): aux["index"] the
  (target, index scores) of each layer with an indexer (`Taps.index`), aux["load"] `[L, E]`
  and aux["dropped"] `[L]` per MoE layer (main layers, then the MTP layer)."""
  routing: list = []
  experts = capacity_experts(capacity, routing)
  taps = Taps(select=select)
  logits, h, _ = forward(w, tokens, cfg, drive=Drive(experts, runtime=Runtime(impl="dense",
                                                                              taps=taps)))
  mtp_logits, _, _ = mtp_forward(w, h, next_tokens, cfg,
                                 drive=Drive(experts, runtime=Runtime(impl="dense")))
  aux = dict(index=taps.index, load=jnp.stack([l for l, _ in routing]),
             dropped=jnp.stack([d for _, d in routing]))
  return logits, mtp_logits, aux


def xent(logits, targets):
  """Mean cross-entropy of `targets` `[...]` under `logits` `[..., V]`."""
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def index_kl(target, index_score):
  """KL(target ‖ softmax(index_score)) per query over its visible keys (index scores -inf
  elsewhere; the target is 0 there), averaged over the queries."""
  visible = jnp.isfinite(index_score)
  logq = jnp.where(visible, jax.nn.log_softmax(index_score, axis=-1), 0.0)
  plogp = jnp.where(target > 0, target * jnp.log(jnp.maximum(target, 1e-30)), 0.0)
  return jnp.mean(jnp.sum(plogp - target * logq, axis=-1))


def loss_fn(w: Weights, tokens, cfg: Config, select: bool, capacity: float, mtp_weight: float,
            index_weight: float):
  """tokens `[B, S+2]` → (total loss, (metrics, loads `[L, E]`)). The main loss predicts
  t_{i+1}, the MTP loss t_{i+2}, for the S positions i."""
  s = tokens.shape[1] - 2
  logits, mtp_logits, aux = train_forward(w, tokens[:, :s], tokens[:, 1:s + 1], cfg, select,
                                          capacity)
  ce = xent(logits, tokens[:, 1:s + 1])
  mtp_ce = xent(mtp_logits, tokens[:, 2:s + 2])
  kls = [index_kl(p, q) for p, q in aux["index"]]
  kl = jnp.mean(jnp.stack(kls)) if kls else jnp.zeros(())
  total = ce + mtp_weight * mtp_ce + index_weight * kl
  metrics = dict(loss=total, ce=ce, mtp_ce=mtp_ce, index_kl=kl, dropped=jnp.mean(aux["dropped"]))
  return total, (metrics, aux["load"])
