"""Continuous batching: a fixed-width decode batch that requests join and leave between steps.

Letters: B batch width (`max_batch`), W pages a row can address, V vocabulary.

The batch's rows share one pool of KV pages (glmjax.decoding.pages.KVPool) sized by a byte
budget, not by `max_position_embeddings` per row: a request takes the pages its prompt and
`max_tokens` need when it is admitted and gives them back when it leaves. It is prefilled
alone (batch 1, chunk by chunk, straight into its pages, the steps `Model.generate` runs), then
decodes with the others: every decode step runs all B rows at once with per-row lengths and
page tables. Empty rows are padding that routes no experts (`n_valid` 0), so the offload
engine's union of experts in a layer step covers the live rows only, and each live row reads
the same numbers whatever the other rows hold: a request's greedy output does not depend on
what else is in the batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from glmjax.decoding.pages import GiB, KVPool, free_bytes
from glmjax.errors import ExpertIOError, InputError
from glmjax.model.forward import bucket
from glmjax.runtime.executor import MIN_BUCKET, chunk_plan

AUTO_KV_SHARE = 4  # the automatic KV budget: at most a quarter of the memory still free


@dataclasses.dataclass
class Row:
  """A live request in the batch: its Request, the token to feed next, its cache length."""
  req: object  # glmjax.decoding.generation.Request
  token: int
  length: int
  pages: list
  tag: object = None  # the caller's handle (the scheduler's job)
  prompt: np.ndarray | None = None  # [S] the prompt it was admitted with


def kv_budget(model, width: int, context: int, kv_cache_gb: float | None) -> int:
  """The batch's KV bytes: `kv_cache_gb`, or automatically enough for `width` rows of the
  whole `context` but at most a quarter of the memory still free (at least one page)."""
  layout = model.kv_layout()
  if kv_cache_gb is not None:
    if not kv_cache_gb > 0:
      raise InputError(f"kv_cache_gb must be > 0, got {kv_cache_gb}")
    return int(kv_cache_gb * GiB)
  full = width * layout.pages_for(context) * layout.page_bytes()
  return max(layout.page_bytes(), min(full, free_bytes() // AUTO_KV_SHARE))


def prefill_widths(context: int, chunk: int) -> list[int]:
  """Every chunk width a prompt that leaves room for one new token in `context` is prefilled
  in (glmjax.runtime.executor.chunk_plan: powers of two, capped at `chunk` unless it is 0)."""
  top = bucket(max(1, context - 1), MIN_BUCKET)
  widths = {1 << i for i in range(top.bit_length()) if 1 << i >= MIN_BUCKET}
  return sorted({min(w, chunk) for w in widths} if chunk else widths)


class BatchDecoder:
  """Decodes up to `width` requests together over one model (resident or offloaded).

  `admit` prefills a request into pages of the pool and a free row (or finishes it when its
  first token already ends it); `step` advances every live row by one token and returns the
  rows that finished. Not thread-safe: one thread drives it (the scheduler).
  """

  def __init__(self, model, width: int, context: int | None = None,
               kv_cache_gb: float | None = None, prefix_cache: bool = False):
    if width < 1:
      raise InputError(f"batch width must be ≥ 1, got {width}")
    self.model, self.width = model, width
    self.executor = model.executor
    self.context = min(context or model.max_context, model.max_context)  # tokens a row may hold
    layout = model.kv_layout()
    self.kv_bytes = kv_budget(model, width, self.context, kv_cache_gb)
    n_pages = self.kv_bytes // layout.page_bytes()
    if n_pages < 1:
      raise InputError(f"kv_cache_gb={self.kv_bytes / GiB:.4f} holds no KV page "
                       f"({layout.page_bytes()} bytes of {layout.page_size} positions)")
    from glmjax import sharding
    where = None if model.mesh is None else sharding.replicated(model.mesh)
    self.pool = KVPool(layout, 1 + n_pages, sharding=where, room=lambda: 1 << 62,
                       prefix_cache=prefix_cache)
    self.width_pages = layout.pages_for(self.context)  # W: the pages a row can address
    self.rows: list[Row | None] = [None] * width
    # Compiled at start-up, so the first requests that share the batch do not stall on it:
    # the one decode shape of the batch (the engine's layer and fused steps for [B, 1]).
    tok = np.zeros((width, 1), np.int32)
    cache = self._cache()
    cache = self.executor.warm_batch(cache, tok, self._lengths())
    self.pool.update(cache)
    # The prefill widths a prompt may need and no prefill has met yet, compiled one at a time
    # by `warm_next` (the scheduler, in idle turns): later requests meet compiled steps.
    self.cold_widths = prefill_widths(self.context, self.executor.chunk)

  def _met(self, n_tokens: int) -> None:
    """A prefill of `n_tokens` compiled its width, if it went in one chunk (the program
    `warm_next` compiles): no need to compile it ahead any more."""
    plan = chunk_plan(n_tokens, self.executor.chunk)
    if len(plan) == 1 and plan[0][2] in self.cold_widths:
      self.cold_widths.remove(plan[0][2])

  def warm_next(self) -> int:
    """Compiles the next cold prefill width (as `admit` prefills it, fresh or after a prefix
    hit: the same widths) and returns it."""
    width = self.cold_widths[0]
    one = self.pool.cache([np.zeros(self.width_pages, np.int32)], 0, self.executor.put)
    self.pool.update(self.executor.warm_prefill(one, width))
    self.cold_widths.pop(0)  # only now: /health's `warming` counts it until it is compiled
    return width

  # --- state ---------------------------------------------------------------------------------
  @property
  def live(self) -> int:
    return sum(r is not None for r in self.rows)

  def free(self) -> int:
    return self.width - self.live

  @property
  def capacity_tokens(self) -> int:
    """Positions the whole pool holds: the most one request may take."""
    return min(self.context, (self.pool.n_pages - 1) * self.pool.layout.page_size)

  def pages_needed(self, n_tokens: int) -> int:
    return self.pool.layout.pages_for(n_tokens)

  def check_fits(self, n_tokens: int) -> None:
    """Refuses a request the batch can never hold (its context or the whole KV budget)."""
    if n_tokens > self.context:
      raise InputError(f"prompt + max_tokens = {n_tokens} tokens exceed the context of "
                       f"{self.context} tokens")
    if self.pages_needed(n_tokens) > self.pool.n_pages - 1:
      raise InputError(f"prompt + max_tokens = {n_tokens} tokens exceed the server's KV cache "
                       f"budget of {self.capacity_tokens} tokens ({self.kv_bytes / GiB:.2f} GB, "
                       "--kv_cache_gb)")

  def can_admit(self, n_tokens: int) -> bool:
    """A free row and free pages for `n_tokens` now."""
    return self.free() > 0 and self.pages_needed(n_tokens) <= self.pool.available

  def _lengths(self) -> np.ndarray:
    return np.asarray([0 if r is None else r.length for r in self.rows], np.int32)  # [B]

  def _cache(self, mtp: bool = False):
    tables = np.zeros((self.width, self.width_pages), np.int32)
    for i, r in enumerate(self.rows):
      if r is not None:
        tables[i] = self.pool.table(r.pages, self.width_pages)
    return self.pool.cache(tables, self._lengths(), self.executor.put, mtp)

  def drop(self, tag) -> bool:
    """Frees the row of the request `tag` (a cancelled request); True if it held one."""
    for i, r in enumerate(self.rows):
      if r is not None and r.tag is tag:
        self.pool.release(r.pages)
        self.rows[i] = None
        return True
    return False

  # --- faults ---------------------------------------------------------------------------------
  def damaged(self) -> bool:
    """True when a failed step took the pool's arrays with it (they were donated)."""
    import jax
    return any(a.is_deleted() for a in jax.tree.leaves(self.pool.layers))

  def salvage(self, e: ExpertIOError) -> list | None:
    """After a step failed on an expert read: takes back the KV arrays it left (`e.kv`, set by
    the offload engine), so that no row loses its cache. Returns the tags of the rows whose
    tokens routed to the expert (`e.rows`) when the other rows can simply step again; None
    when the arrays are lost or no row is to blame (then `reset` and `restore` every row)."""
    kv, e.kv = e.kv, None  # the error goes on to clients: it must not hold the pool
    if kv is not None:
      self.pool.update(kv)
    tags = [self.rows[i].tag for i in e.rows or () if i < self.width and self.rows[i] is not None]
    return tags if kv is not None and tags and not self.damaged() else None

  def reset(self) -> None:
    """New zeroed KV arrays after a fault; every live row must then be `restore`d."""
    self.pool.reset()

  def restore(self, tag) -> None:
    """Prefills the live row of `tag` again into its own pages: its prompt and the tokens it
    has fed since (all but the last one emitted, which is the next to feed)."""
    row = next(r for r in self.rows if r is not None and r.tag is tag)
    ids = np.concatenate([row.prompt, np.asarray(row.req.out[:-1], np.int32)]).astype(np.int32)
    assert len(ids) == row.length, (len(ids), row.length)
    one = self.pool.cache([self.pool.table(row.pages, self.width_pages)], 0, self.executor.put)
    self.pool.update(self.executor.prefill(one, ids, 0)[2])
    self._met(len(ids))

  # --- work ----------------------------------------------------------------------------------
  def admit(self, prompt_ids: np.ndarray, req, tag=None) -> bool:
    """Prefills `prompt_ids` `[S]` alone into pages of its own and emits its first token.
    Returns True when the request is already finished (stop or length), else places it in a
    free row. Needs `can_admit` for its tokens."""
    n = len(prompt_ids)
    total = n + req.max_new_tokens
    self.check_fits(total)
    if not self.can_admit(total):
      raise InputError(f"no room now for {total} tokens: wait for a row and KV pages")
    prefix = self.pool.prefix
    # Cached full pages of the prompt (never its last token: its logits pick the first token).
    pages = prefix.lookup(prompt_ids, n - 1) if prefix is not None else []
    start = len(pages) * self.pool.layout.page_size
    try:
      pages += self.pool.alloc(self.pages_needed(total) - len(pages), grow=False)
      one = self.pool.cache([self.pool.table(pages, self.width_pages)], start, self.executor.put)
      try:
        logits, _, one = self.executor.prefill(one, prompt_ids[start:], start)
      except ExpertIOError as e:  # its own pages hold junk now; the other rows' are intact
        kv, e.kv = e.kv, None
        if kv is not None:
          self.pool.update(kv)
        raise
      self.pool.update(one)
      self._met(n - start)
      if prefix is not None:
        prefix.insert(prompt_ids, pages, n)
      req.cached_tokens = start
      tok = req.pick(logits)
    except BaseException:
      self.pool.release(pages)
      raise
    if req.emit(tok):
      req.finish()
      self.pool.release(pages)
      return True
    self.rows[self.rows.index(None)] = Row(req, tok, n, pages, tag, np.asarray(prompt_ids))
    return False

  def step(self) -> list[Row]:
    """One decode step of every live row. Returns the rows that finished (already freed)."""
    live = np.asarray([r is not None for r in self.rows])
    if not live.any():
      return []
    tokens = np.asarray([[0 if r is None else r.token] for r in self.rows], np.int32)  # [B, 1]
    n_valid = live.astype(np.int32)  # [B]: empty rows are padding, they route nothing
    logits, _, cache = self.executor.step(self._cache(), tokens, self._lengths(), n_valid=n_valid)
    self.pool.update(cache)
    logits = logits[:, 0]  # [B, V]
    done = []
    for i, r in enumerate(self.rows):
      if r is None:
        continue
      r.length += 1  # the fed token is now cached
      r.token = r.req.pick(logits[i])
      if r.req.emit(r.token):
        r.req.finish()
        done.append(r)
        self.pool.release(r.pages)
        self.rows[i] = None
    return done
