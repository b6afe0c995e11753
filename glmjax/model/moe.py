"""The MoE block in named stages: route, dispatch + expert compute, combine.

Letters: T tokens, D hidden, E routed experts, K experts per token, F expert intermediate.

The combine sums the K expert outputs of a token in top-k rank order with explicit adds, so a
token's result depends only on its own routing, never on where an expert's weights live or on
what else is in the batch's cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glmjax.model.config import Config
# A pool's expert terms and its kernel names are kernels' (re-exported for forward and offload).
from glmjax.model.kernels import KERNELS, combine_in_order, pool_terms, resolve_kernel  # noqa: F401
from glmjax.model.layers import F32, linear
from glmjax.model.weights import Experts

# Above this many (token, expert) pairs the float path switches from gathering each pair's
# weights to tiles of pairs sorted by expert, whose cost does not grow with duplicated experts.
GATHER_MAX_PAIRS = 64


def _scores(x, router, bias, cfg: Config):
  """(sigmoid scores `[T, E]`, biased and group-limited selection scores `[T, E]`)."""
  e = cfg.n_routed_experts
  scores = jax.nn.sigmoid(linear(x.astype(F32), router))  # [T, E]
  choice = scores + bias.astype(F32)
  if cfg.n_group > 1:
    grouped = choice.reshape(-1, cfg.n_group, e // cfg.n_group)  # [T, Gr, E/Gr]
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, Gr]
    _, keep = jax.lax.top_k(group_score, cfg.topk_group)
    group_mask = jnp.any(keep[..., None] == jnp.arange(cfg.n_group), axis=-2)  # [T, Gr]
    choice = jnp.where(jnp.repeat(group_mask, e // cfg.n_group, axis=-1), choice, -jnp.inf)
  return scores, choice


def _weights(scores, ids, cfg: Config):
  w = jnp.take_along_axis(scores, ids, axis=-1)
  if cfg.norm_topk_prob:
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
  return w * cfg.routed_scaling_factor


def route(x, router, bias, cfg: Config):
  """Sigmoid router with a selection-only correction bias.

  Returns (ids `[T, K]` int32 in rank order, weights `[T, K]` float32).
  """
  scores, choice = _scores(x, router, bias, cfg)
  _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)  # [T, K]
  return ids.astype(jnp.int32), _weights(scores, ids, cfg)


def route_capped(x, router, bias, cfg: Config, valid, budget: int):
  """Lossy routing of a step's tokens `x` `[T, D]` within `budget` experts (opt-in
  `expert_budget`, for speculative verify passes): the experts chosen by most real tokens
  (`valid` `[T]`; ties: summed sigmoid score) are kept and each token takes its top-k among
  them. Returns (ids, weights, per-token stats [swaps, 0, 0])."""
  scores, choice = _scores(x, router, bias, cfg)
  k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
  _, ids = jax.lax.top_k(choice, k)  # [T, K] the exact routing
  picked = jnp.zeros((e,), F32).at[ids].add(valid[:, None].astype(F32))  # [E] times chosen
  mass = jnp.sum(jnp.where(valid[:, None], scores, 0.0), axis=0)  # [E] in [0, T]
  key = picked * (x.shape[0] + 1) + mass  # count first; score mass breaks ties
  _, keep = jax.lax.top_k(key, min(budget, e))
  allowed = jnp.zeros((e,), bool).at[keep].set(True)
  _, capped = jax.lax.top_k(jnp.where(allowed, choice, -jnp.inf), k)
  swaps = jnp.sum(~jnp.any(capped[:, :, None] == ids[:, None, :], axis=-1), axis=-1)  # [T]
  stats = jnp.stack([swaps.astype(F32), jnp.zeros_like(swaps, F32),
                     jnp.zeros_like(swaps, F32)], axis=-1)
  return capped.astype(jnp.int32), _weights(scores, capped, cfg), stats


def route_scores(x, router, bias, cfg: Config, ids, top_m: int):
  """What a routing trace keeps of one routing: (weights of `ids` `[T, K]`, the top `top_m`
  experts by selection score `[T, M]` and their sigmoid scores `[T, M]`)."""
  scores, choice = _scores(x, router, bias, cfg)
  _, top = jax.lax.top_k(choice, top_m)
  return (_weights(scores, ids, cfg), top.astype(jnp.int32),
          jnp.take_along_axis(scores, top, axis=-1))


def route_cache_aware(x, router, bias, cfg: Config, resident, keep: int, rank: int):
  """Lossy routing that prefers resident experts (opt-in).

  The true top-`keep` experts always stay; the other K − keep slots go to resident experts
  (`resident` `[E]` bool) among the top-`rank` by biased score, in rank order, and only then
  to the best-ranked non-resident ones. Returns (ids, weights, stats) where stats `[T, 3]`
  holds per token: swapped slots, routing-mass overlap Σ min(w_true, w_chosen), and
  KL(w_true ‖ w_chosen) with the chosen mass smoothed by 1e-6.
  """
  k = cfg.num_experts_per_tok
  rank = min(max(rank, k), cfg.n_routed_experts)
  scores, choice = _scores(x, router, bias, cfg)
  _, cand = jax.lax.top_k(choice, rank)  # [T, M] in rank order
  r = jnp.arange(rank)
  tier = jnp.where(r < keep, 0, jnp.where(resident[cand], 1, 2))  # [T, M]
  # Stable order by (tier, rank): a single key tier·M + rank.
  _, pick = jax.lax.top_k(-(tier * rank + r), k)
  ids = jnp.take_along_axis(cand, pick, axis=-1).astype(jnp.int32)
  true = cand[:, :k]
  w_true, w = _weights(scores, true, cfg), _weights(scores, ids, cfg)
  e = cfg.n_routed_experts
  dense = lambda i, v: jnp.zeros((i.shape[0], e), F32).at[jnp.arange(i.shape[0])[:, None], i].add(v)
  p, q = dense(true, w_true), dense(ids, w)
  p, q = p / jnp.sum(p, -1, keepdims=True), q / jnp.sum(q, -1, keepdims=True)
  swapped = jnp.sum(~jnp.any(ids[..., None] == true[:, None, :], axis=-1), axis=-1)
  overlap = jnp.sum(jnp.minimum(p, q), axis=-1)
  kl = jnp.sum(jnp.where(p > 0, p * (jnp.log(p + 1e-30) - jnp.log(q + 1e-6)), 0.0), axis=-1)
  return ids, w, jnp.stack([swapped.astype(F32), overlap, kl], axis=-1)


def expert_outputs(x, ids, experts: Experts):
  """Unweighted outputs `[T, K, D]` of each token's selected experts (float weights).

  Only the selected experts' weights are read: per-pair gathers for a few pairs (decode),
  otherwise row tiles of pairs sorted by expert (`_tiled_outputs`).
  """
  t, k = ids.shape
  if t * k <= GATHER_MAX_PAIRS:
    gu = experts.gate_up[ids]  # [T, K, 2F, D]
    dn = experts.down[ids]  # [T, K, D, F]
    h = jnp.einsum("td,tkfd->tkf", x, gu.astype(F32))
    g, u = jnp.split(h, 2, axis=-1)
    return jnp.einsum("tkf,tkdf->tkd", jax.nn.silu(g) * u, dn.astype(F32))
  return _tiled_outputs(x, ids, experts)


def _tiled_outputs(x, ids, experts: Experts):
  """The grouped float path: pairs sorted by expert, each expert's rows padded to whole tiles
  of `m`, and one batched matmul over the tiles, each tile with its expert's weights.

  `lax.ragged_dot_general` computes the same thing, but XLA:CPU runs it as a dense product
  against every group: 10-17x slower at T = 1024 (165 against 16 ms per layer of the embedded
  model). Σ ceil(size / m) < P / m + E, so `n` tiles always hold every pair; the spare tiles
  are zero rows.
  """
  t, k = ids.shape
  e, d, p = experts.gate_up.shape[0], x.shape[1], t * k
  m = min(64, max(8, 1 << max(0, (p // e - 1).bit_length())))  # ~ the mean rows per expert
  n = (p + m - 1) // m + e
  flat = ids.reshape(-1)  # [P]
  order = jnp.argsort(flat, stable=True)  # pairs by expert, in token order within one
  expert_of = flat[order]
  sizes = jnp.bincount(flat, length=e)  # [E]
  padded = (sizes + m - 1) // m * m  # [E] each expert's rows, in whole tiles
  tile_end = jnp.cumsum(padded)  # [E] end row of each expert's tiles
  first_row, first_pair = tile_end - padded, jnp.cumsum(sizes) - sizes  # [E]
  dest = first_row[expert_of] + jnp.arange(p) - first_pair[expert_of]  # [P] padded row
  xs = jnp.zeros((n * m, d), F32).at[dest].set(x[order // k])
  tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(n) * m, side="right"), e - 1)
  h = jnp.einsum("nmd,nfd->nmf", xs.reshape(n, m, d), experts.gate_up[tile_expert].astype(F32))
  g, u = jnp.split(h, 2, axis=-1)
  ys = jnp.einsum("nmf,ndf->nmd", jax.nn.silu(g) * u, experts.down[tile_expert].astype(F32))
  return jnp.zeros((p, d), F32).at[order].set(ys.reshape(n * m, d)[dest]).reshape(t, k, d)


# Σ_k w[:, k] · ys[:, k] in rank order k = 0..K-1; explicit adds fix the FP order.
combine = combine_in_order
