"""Routing records: what a MoE layer chose and what its router ranked next to it, recorded as
the forward pass goes by (`recording` wraps any expert provider) for replay, the simulator and
the offload engine's traces.

Letters: T tokens (rows), K experts a token, M recorded scores, P the pilot's predictions.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from glmjax.model.config import Config
from glmjax.model.layers import F32, rms_norm
from glmjax.model.moe import route_scores
from glmjax.model.weights import MoE, Weights


@dataclasses.dataclass(frozen=True)
class RecordOptions:
  """What `recording` keeps per MoE layer besides the ids: the top `top_m` selection scores and
  the pilot's top `pilot_p` prediction of the next MoE layer (both capped at E)."""
  top_m: int = 64
  pilot_p: int = 16


def route_record(m: MoE, next_lw, x, flat, ids, cfg: Config, opts: RecordOptions):
  """One MoE layer's routing record for `flat` `[T, D]` routed to `ids` `[T, K]` (post-attention
  residual `x` `[B, S, D]`): a dict of ids, weights `[T, K]`; score_ids, scores `[T, M]`; pilot,
  pilot_scores `[T, P]`: the next MoE layer's router applied to this layer's residual, ranked
  by selection score (-1 and 0 when the next layer is not a MoE layer)."""
  e = cfg.n_routed_experts
  m_, p_ = min(opts.top_m, e), min(opts.pilot_p, e)
  w, score_ids, scores = route_scores(flat, m.router, m.bias, cfg, ids, m_)
  rec = dict(ids=ids, weights=w, score_ids=score_ids, scores=scores)
  if next_lw is not None:
    h = rms_norm(x, next_lw.mlp_norm, cfg.rms_norm_eps).reshape(-1, x.shape[-1])
    _, pilot, pilot_scores = route_scores(h, next_lw.mlp.router, next_lw.mlp.bias, cfg, ids, p_)
  else:
    pilot = jnp.full((flat.shape[0], p_), -1, jnp.int32)
    pilot_scores = jnp.zeros((flat.shape[0], p_), F32)
  return {**rec, "pilot": pilot, "pilot_scores": pilot_scores}


route_record_step = jax.jit(route_record, static_argnames=("cfg", "opts"))


def next_moe(w: Weights, layer: int):
  """The weights of the layer after `layer` when it is a MoE layer (the pilot's), else None."""
  nxt = w.layers[layer + 1] if layer + 1 < len(w.layers) else None
  return nxt if nxt is not None and isinstance(nxt.mlp, MoE) else None


def recording(experts: Callable, next_of: Callable, cfg: Config, out: list,
              opts: RecordOptions = RecordOptions(), jitted: bool = False) -> Callable:
  """The expert provider `experts` (`forward.ExpertProvider`), appending each MoE layer's
  `route_record` to `out` as it goes by (`next_of(layer)`: the next MoE layer's weights or
  None, as `next_moe`); inside a jit the records are traced values: return them;
  `jitted=True` runs each record as its own jit, for providers called between jitted steps."""
  record = route_record_step if jitted else route_record

  def provide(layer, m, chunks):
    nxt = next_of(layer)
    recs = [record(m, nxt, r.x, r.flat, r.ids, cfg=cfg, opts=opts) for r in chunks]
    out.append(recs[0] if len(recs) == 1 else  # a layer-major prefill: one record per layer
               {k: jnp.concatenate([r[k] for r in recs]) for k in recs[0]})
    yield from experts(layer, m, chunks)
  return provide


def stack_records(records: list) -> dict:
  """Per-layer records → one dict of `[L, T, ...]` arrays."""
  return {k: jnp.stack([r[k] for r in records]) for k in records[0]}
