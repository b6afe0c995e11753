"""Continuous batching: a fixed-width decode batch that requests join and leave between steps.

Letters: B batch width (`max_batch`), T cache capacity, V vocabulary.

Each request is prefilled alone (batch 1, the path `Model.generate` takes, with the same cache
capacity, so its first token is `generate`'s), then its cache is copied into a free row of the
batch cache. Every decode step runs all B rows at once with per-row lengths; empty rows are
padding that routes no experts (`n_valid` 0), so the offload engine's union of experts in a
layer step covers the live rows only, and each live row reads the same numbers whatever the
other rows hold: a request's greedy output does not depend on what else is in the batch.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.errors import InputError
from glmjax.model.forward import KVCache, bucket, decode_fn, init_cache


@functools.partial(jax.jit, donate_argnames=("batch",))
def _insert(batch: KVCache, one: KVCache, row):
  """`batch` with `one`'s cache (batch 1, capacity ≤ T) written into row `row`, from position 0
  (what lies past the row's length is never attended to). Lengths are the caller's."""
  def put(dst, src):
    if dst is None:
      return None
    return jax.lax.dynamic_update_slice(dst, src.astype(dst.dtype), (row, 0, 0))
  layers = [dataclasses.replace(d, **{f.name: put(getattr(d, f.name), getattr(s, f.name))
                                      for f in dataclasses.fields(d)})
            for d, s in zip(batch.layers, one.layers)]
  return KVCache(layers, batch.length)


@dataclasses.dataclass
class Row:
  """A live request in the batch: its `_Request`, the token to feed next, its cache length."""
  req: object  # glmjax.api._Request
  token: int
  length: int
  tag: object = None  # the caller's handle (the scheduler's job)


class BatchDecoder:
  """Decodes up to `width` requests together over one model (resident or offloaded).

  `admit` prefills a request and places it in a free row (or finishes it when its first token
  already ends it); `step` advances every live row by one token and returns the rows that
  finished. Not thread-safe: one thread drives it (the scheduler).
  """

  def __init__(self, model, width: int, capacity: int | None = None):
    if width < 1:
      raise InputError(f"batch width must be ≥ 1, got {width}")
    self.model = model
    self.width = width
    limit = capacity or model._max_context()
    self.capacity = bucket(limit, 16)
    self.cache = init_cache(model.config, width, self.capacity)
    self.rows: list[Row | None] = [None] * width
    self._step = None
    # Compiled at start-up, so the first requests that share the batch do not stall on it:
    # the one decode shape of the batch.
    tok = jnp.zeros((width, 1), jnp.int32)
    if not model.offloaded:
      n = jnp.zeros((width,), jnp.int32)
      self._step = decode_fn.lower(model.weights, self._cache(), tok, n_valid=n, cfg=model.config,
                                   kernel=model.options.moe_kernel).compile()
    else:  # the engine's layer steps (and fused step) for [width, 1]; its tiers stay as they are
      self.cache = KVCache(model.engine.precompile(tok, self._cache()).layers, None)

  # --- state ---------------------------------------------------------------------------------
  @property
  def live(self) -> int:
    return sum(r is not None for r in self.rows)

  def free(self) -> int:
    return self.width - self.live

  def _lengths(self) -> np.ndarray:
    return np.asarray([0 if r is None else r.length for r in self.rows], np.int32)  # [B]

  def _cache(self) -> KVCache:
    return KVCache(self.cache.layers, jnp.asarray(self._lengths()))

  def drop(self, tag) -> bool:
    """Frees the row of the request `tag` (a cancelled request); True if it held one."""
    for i, r in enumerate(self.rows):
      if r is not None and r.tag is tag:
        self.rows[i] = None
        return True
    return False

  # --- work ----------------------------------------------------------------------------------
  def admit(self, prompt_ids: np.ndarray, req, tag=None) -> bool:
    """Prefills `prompt_ids` `[S]` alone and emits its first token. Returns True when the
    request is already finished (stop or length), else places it in a free row."""
    from glmjax.api import _bucket, _padded
    model = self.model
    n = len(prompt_ids)
    if n + req.max_new_tokens > self.capacity:
      raise InputError(f"prompt ({n}) + max_tokens ({req.max_new_tokens}) exceed the batch "
                       f"context {self.capacity}")
    # The capacity Model.generate gives the same request: the same prefill, bit for bit.
    cap = _bucket(max(_bucket(n), n + req.max_new_tokens))
    if cap > self.capacity:  # the row's prefix holds it: it must fit
      raise InputError(f"request cache {cap} exceeds the batch context {self.capacity}")
    one = init_cache(model.config, 1, cap)
    toks = _padded(prompt_ids, 0, cap)
    prefill, _ = model._steps(one, toks)
    logits, one = prefill(one, toks, n)
    tok = req.picker.pick(logits[0])
    if req.emit(tok):
      req.finish()
      return True
    row = self.rows.index(None)
    self.cache = _insert(self.cache, one, jnp.asarray(row, jnp.int32))
    self.rows[row] = Row(req, tok, n, tag)
    return False

  def step(self) -> list[Row]:
    """One decode step of every live row. Returns the rows that finished (already freed)."""
    live = np.asarray([r is not None for r in self.rows])
    if not live.any():
      return []
    tokens = np.asarray([[0 if r is None else r.token] for r in self.rows], np.int32)  # [B, 1]
    n_valid = live.astype(np.int32)  # [B]: empty rows are padding, they route nothing
    cache = self._cache()
    if self._step is not None:
      logits, _, new = self._step(self.model.weights, cache, jnp.asarray(tokens),
                                  n_valid=jnp.asarray(n_valid))
      logits = logits[:, 0]  # [B, V]
    else:
      logits, _, new = self.model.engine.forward(jnp.asarray(tokens), cache, absorbed=True,
                                                 n_valid=n_valid)
      logits = logits[:, 0]
    self.cache = KVCache(new.layers, None)  # lengths live on the host, per row
    done = []
    for i, r in enumerate(self.rows):
      if r is None:
        continue
      r.length += 1  # the fed token is now cached
      r.token = r.req.picker.pick(logits[i])
      if r.req.emit(r.token):
        r.req.finish()
        done.append(r)
        self.rows[i] = None
    return done
