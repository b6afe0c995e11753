"""The offload engine's fused step: the one forward pass over the CPU-resident tiers (the pin
pools and the host slab, addressed through slot tables), for a step whose experts are (probably)
all held, with no host round trip per layer: each decoder layer two jitted halves (the resident
`attention_step`, then `fused_mlp`), shared by identical halves, or for a shallow model all of
them inlined into one program (the resident rule, `forward.entry_points`). Its tier
bookkeeping is the layer path's own
(`TierRules.lookup`, then `TierRules.fold`), applied after the step from its routing record.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.model.config import Config, Runtime
from glmjax.model.forward import (JITTED, ONE_PROGRAM, Chunk, entry_points, fresh_start,
                                  layer_step, mlp_through, through_layers, valid_rows)
from glmjax.model.layers import F32
from glmjax.model.moe import pool_terms
from glmjax.model.weights import Weights
from glmjax.offload.prefetch import Prefetcher
from glmjax.offload.provider import Placement
from glmjax.offload.rules import LayerUse
from glmjax.offload.shared import EngineShared
from glmjax.runtime import compile_cache
from glmjax.runtime.clock import CompileClock

# A step of more tokens than this runs fused only when the tiers hold every expert.
FUSED_GUESS_TOKENS = 16


def _tier_terms(flat, valid, ids, pool, table):
  """Terms of the experts `table` `[E]` (slot, or -1) places in `pool`: (terms, found `[T, K]`)."""
  slots = table[ids]  # [T, K]
  found = slots >= 0
  return pool_terms(flat, pool, jnp.maximum(slots, 0), valid & found, "cpu"), found


@functools.partial(jax.jit, static_argnames=("cfg",))
def fused_mlp(lw, chunk: Chunk, tiers: dict | None, cfg: Config):
  """A decoder layer's MLP half in the fused step (`forward.mlp_through`). A MoE layer gathers
  its experts from its pin pool and the host slab through slot tables (`tiers`: "pins" the pool
  or None, "pin" its table `[E]`, "slab" the slab or None, "host" its table `[E]`). Returns (x
  after it, (missing: real (token, rank) pairs no tier held `[]`, ids `[T, K]`) at a MoE layer,
  else None)."""
  seen = []

  def provide(layer, m, chunks):
    (r,) = chunks
    flat, ids = r.flat, r.ids
    valid = valid_rows(r.x.shape, r.n_valid, jnp)[:, None]  # [T, 1]
    terms, found = jnp.zeros((*ids.shape, flat.shape[-1]), F32), jnp.zeros(ids.shape, bool)
    if tiers["slab"] is not None:
      terms, found = _tier_terms(flat, valid, ids, tiers["slab"], tiers["host"])
    if tiers["pins"] is not None:
      pinned, on_pin = _tier_terms(flat, valid, ids, tiers["pins"], tiers["pin"])
      terms, found = jnp.where(on_pin[..., None], pinned, terms), found | on_pin
    seen.append((jnp.sum(valid & ~found).astype(jnp.int32), ids.astype(jnp.int32)))
    yield terms

  return mlp_through(lw, chunk, cfg, provide), seen[0] if seen else None


def fused_forward(dense: Weights, tokens, cache, n_valid, tiers: list, start, cfg: Config,
                  absorbed: bool, runtime: Runtime = Runtime()):
  """The one forward pass over the CPU-resident tiers, each layer's MLP a `fused_mlp` (`tiers[i]`:
  layer i's, None at a dense layer), for a step whose experts are (probably) all cached.

  Returns (logits, hidden, cache, record): `record` holds, per MoE layer, the real (token,
  rank) pairs whose expert no tier held and the ids `[T, K]`. A step with anything missing is
  void; the caller re-runs it through the tiers (the cache writes of this step sit past
  `length` and are rewritten)."""
  chunk = Chunk(JITTED.embed(dense, tokens), start if cache is None else cache.length, n_valid,
                pages=None if cache is None else cache.pages)
  step = lambda i, lw, chunk, pool: layer_step(
      lw, chunk, pool, cfg, absorbed, runtime, lambda m, c: fused_mlp(m, c, tiers[i], cfg=cfg))
  chunk, cache, record = through_layers(dense, chunk, cache, step)
  return JITTED.logits(dense, chunk.x, cfg=cfg), chunk.x, cache, record


# A shallow model's fused step as one program (compiled ahead, `FusedStep.executable`).
fused_program = jax.jit(fused_forward, static_argnames=("cfg", "absorbed", "runtime"),
                        donate_argnames=("cache",))


class FusedStep:
  """Runs steps through `fused_forward` and folds their records into the tiers.

  It needs every expert in CPU memory addressable by slot, and exact routing (`enabled`). It
  is tried when the tiers hold every expert, or, for a step of at most FUSED_GUESS_TOKENS
  tokens, after a step that missed nothing (`ready`): a cold cache does not pay for void
  attempts, and neither does a long prefill, whose union is most of a layer's experts (a void
  1024-token attempt cost 0.3 s). A step run while every expert is held cannot miss: it returns
  without waiting for its record, which is folded (`pending`) at the engine's next call."""

  def __init__(self, shared: EngineShared, prefetcher: Prefetcher, placement: Placement,
               runtime: Runtime, enabled: bool, unit: str = "auto"):
    self.cfg, self.dense, self.tiers, self.stats = (shared.cfg, shared.dense, shared.tiers,
                                                    shared.stats)
    self.moe_layers, self.layout = shared.moe_layers, shared.store.layout(shared.moe_layers[0])
    self.prefetcher, self.placement, self.runtime, self.enabled = (prefetcher, placement, runtime,
                                                                   enabled)
    self.ready = False
    self.pending = None  # (record, tokens, valid) of a step returned before its bookkeeping
    self._compiled: dict = {}
    self._zero = fresh_start()  # a cache-less fused step's start (see forward)
    self._tables = None  # (host copy, device rows) of the pin and host slot tables
    # one program, or a jitted step per layer (`unit`: Options.compile_unit)
    self.one_program = entry_points(self.dense, unit) is ONE_PROGRAM

  @property
  def deferred(self) -> bool:
    """A step ran with its bookkeeping deferred to `fold_deferred`."""
    return self.pending is not None

  def after_layer_steps(self, missed: bool) -> None:
    """A step ran layer by layer: a short step is tried fused next time if it missed nothing."""
    self.ready = not missed

  def worth_trying(self, n_tokens: int, all_cached: bool) -> bool:
    """Whether a step of `n_tokens` tokens is tried fused."""
    return self.enabled and ((self.ready and n_tokens <= FUSED_GUESS_TOKENS) or all_cached)

  def run(self, tokens, cache, absorbed, n_valid, sure: bool = False):
    """Tries the step as one jit over the tiers (`fused_forward`). On success applies the same
    tier bookkeeping as the layer-by-layer path, layer by layer in union order, and returns
    (output, None); when a routed expert was not cached returns (None, cache) to re-run."""
    compiled, args = self.executable(tokens, cache, absorbed, n_valid)
    logits, x, new_cache, record = compiled(*args)
    valid = valid_rows(tokens.shape, n_valid)
    if sure:  # nothing can be missing: folded later, so this call does not wait for the step
      self.stats["fused_steps"] += 1
      self.pending = (record, tokens.size, valid)
      return (logits, x, new_cache), None
    missed, ids = self._split_record(record, tokens.size)
    if missed:
      self.ready = False
      self.stats["fused_void"] += 1
      return None, new_cache
    self.stats["fused_steps"] += 1
    self._bookkeeping(ids, valid)
    return (logits, x, new_cache), None

  def executable(self, tokens, cache, absorbed, n_valid):
    """(the step for this step's shapes, its arguments): `fused_program` compiled ahead once per
    shape, or `fused_forward`'s layer steps, compiled at their first call; either way the
    compilation is accounted apart (`fused_compile_s`)."""
    n_layers = self.cfg.num_hidden_layers
    slab = self.tiers.slabs.slabs.get(self.layout)
    tables = np.stack([self.tiers.pin_tables[:n_layers], self.tiers.slabs.tables[:n_layers]])
    if self._tables is None or not np.array_equal(self._tables[0], tables):
      # uploaded when the tiers changed, a row a layer (indexing a device array is a dispatch)
      rows = jax.device_put([*tables[0], *tables[1]], jax.devices()[0])
      self._tables = (tables, rows[:n_layers], rows[n_layers:])
    pins, moe = self.tiers.device, set(self.moe_layers)
    tiers = [None if i not in moe else {
        "pins": pins[i].pool if i in pins else None, "pin": self._tables[1][i],
        "slab": None if slab is None else slab.pool, "host": self._tables[2][i]}
        for i in range(n_layers)]
    nv = None if n_valid is None else np.asarray(n_valid, np.int32)  # [] or [B] per row
    args = (self.dense, tokens, cache, nv, tiers, self._zero)
    static = dict(cfg=self.cfg, absorbed=absorbed, runtime=self.runtime)
    # Everything else in the signature is fixed for the engine's life (the slab is allocated
    # whole, the pin pools have fixed slots).
    key = (tokens.shape, None if cache is None else (cache.layers[0].latent.shape,
                                                     cache.pages.shape),
           None if nv is None else nv.shape, slab is None, absorbed)
    first = key not in self._compiled
    if first:
      compile_cache.relieve_map_pressure()
    if self.one_program:
      if first:
        t0 = time.perf_counter()
        self._compiled[key] = fused_program.lower(*args, **static).compile()
        self.stats["fused_compile_s"] += time.perf_counter() - t0
      return self._compiled[key], args
    self._compiled[key] = True
    return functools.partial(self._layers, first, static), args

  def _layers(self, first: bool, static: dict, *args):
    """`fused_forward` over `args`; the first call of a shape is timed for its compilation."""
    if not first:
      return fused_forward(*args, **static)
    with CompileClock() as clock:
      out = fused_forward(*args, **static)
    self.stats["fused_compile_s"] += clock.seconds
    return out

  def _split_record(self, record, n_tokens: int) -> tuple[bool, np.ndarray]:
    """`fused_forward`'s record → (whether any pair missed, ids `[M, T, K]`)."""
    record = jax.device_get(record)
    missing = np.array([m for m, _ in record])
    return bool(missing.any()), np.stack([ids for _, ids in record]).reshape(
        len(record), n_tokens, -1)

  def fold_deferred(self) -> None:
    """Folds the record of a step that was returned before its bookkeeping (every expert held,
    so it could not miss), as `run` folds any other: the engine's entry points call this
    first (glmjax.offload.engine.folded)."""
    if self.pending is None:
      return
    record, n_tokens, valid = self.pending
    self.pending = None
    missed, ids = self._split_record(record, n_tokens)
    if missed:  # the tiers held every expert and nothing evicts between steps
      raise RuntimeError("internal: a fused step run with every expert held missed one")
    self._bookkeeping(ids, valid)
    self.tiers.heat.decay()  # its own decay, after its uses, as in a step folded at once

  def _bookkeeping(self, ids_all: np.ndarray, valid: np.ndarray) -> None:
    """A fused step's tier bookkeeping: per MoE layer in union order, the lookups of the layer
    steps (`TierRules.lookup`), then its record folded in as theirs is (`TierRules.fold`).

    Fused steps predict nothing: a pilot or co-activation hint computed after the step would
    name the experts the step has just been served. Prefetches issued by earlier layer steps
    land once, before the step's lookups, into free room only (they never evict)."""
    unions = [np.unique(ids[valid]).tolist() for ids in ids_all]
    pf = self.prefetcher
    if pf.inflight:  # lands into free room only: nothing the step used is evicted
      pf.land()
    for layer, union in zip(self.moe_layers, unions):
      pf.pilot_pred.pop(layer, None)
      pinned, cached, missing = self.tiers.lookup(layer, union)
      if missing:  # admissions copy slab → pin and landings only fill free room: never evicted
        raise RuntimeError(f"internal: layer {layer} expert {missing[0]} served by a fused step "
                           "is in no tier")
      if pf.inflight:
        pf.expire(layer)
      pf.ledger.used([(layer, e) for e in union])
      self.tiers.fold(LayerUse(layer, union, union, pinned, cached, [],
                               on_device=self.placement.place(len(cached))))
