"""The paged latent KV cache: per-layer pools of fixed-size pages and a page table per sequence.

Letters: P pages in the pool, PS positions per page, B sequences (rows), W table width (pages a
row can address), X the cached width (C latent, R rope key, I indexer key).

A layer's pool holds `[P, PS, X]`; row b's position t lives in page `pages[b, t // PS]` at
offset `t % PS`. Page 0 is the null page: table entries no row owns point at it, padding
positions past a row's pages are written there, and nothing ever reads it as a visible key
(attention masks keys by position, and a row's positions past its length are not visible).
Rows of one batch share the pool, so a batch holds the pages its requests need rather than a
whole context per row (PagedAttention's layout, on the MLA latent: C + R values per position,
plus the indexer key on full-indexer layers).

Everything here is pure array code; which pages a row owns is the host's business
(glmjax.decoding.pages).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from glmjax.model.config import Config

PAGE_SIZE = 256  # positions per page
NULL_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
  """One layer's pool of pages."""
  latent: Any  # [P, PS, C] normalised kv latent
  k_rope: Any  # [P, PS, R] roped shared key
  index_k: Any  # [P, PS, I] indexer keys (full-indexer layers), else None


@dataclasses.dataclass
class PagedLayer:
  """One layer's pool and the rows' page table `[B, W]` that addresses it: where attention
  writes its fresh keys and what it attends over."""
  cache: LayerCache
  pages: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """Per-layer pools, the rows' page tables and the number of positions written.

  `length` is int32 `[]` (every row alike) or `[B]` (batched decoding: each row a sequence of
  its own length). The MTP layer's cache is a KVCache of its own holding one layer, sharing
  the main cache's page table."""
  layers: Any  # list[LayerCache]
  pages: Any  # [B, W] int32
  length: Any

  def layer(self, i: int) -> "PagedLayer":
    """Layer `i`'s pool with the page table that addresses it."""
    return PagedLayer(self.layers[i], self.pages)

  @property
  def capacity(self) -> int:
    """Positions a row can address (static): W · PS."""
    return self.pages.shape[1] * self.layers[0].latent.shape[1]


def layer_shapes(cfg: Config, layer: int) -> dict[str, int | None]:
  """The cached widths of `layer` (the MTP layer included): latent, rope key, indexer key."""
  return dict(latent=cfg.kv_lora_rank, k_rope=cfg.qk_rope_head_dim,
              index_k=cfg.index_head_dim if cfg.has_indexer(layer) else None)


def bytes_per_position(cfg: Config, dtype, index_dtype, layers) -> int:
  """KV bytes one position takes over `layers` (indices; the MTP layer is num_hidden_layers)."""
  total = 0
  for i in layers:
    s = layer_shapes(cfg, i)
    total += (s["latent"] + s["k_rope"]) * jnp.dtype(dtype).itemsize
    if s["index_k"]:
      total += s["index_k"] * jnp.dtype(index_dtype).itemsize
  return total


def init_pool(cfg: Config, n_pages: int, layers, dtype=jnp.float32, index_dtype=None,
              page_size: int = PAGE_SIZE, sharding=None) -> list[LayerCache]:
  """Zeroed pools of `n_pages` pages (the null page included) for `layers`, on the first
  device or with `sharding` (a `NamedSharding`, replicated on a mesh)."""
  index_dtype = dtype if index_dtype is None else index_dtype
  specs = []  # (shape, dtype name) of each layer's latent, k_rope and index_k (or None)
  for i in layers:
    s = layer_shapes(cfg, i)
    specs += [((n_pages, page_size, n), jnp.dtype(dt).name) if n else None
              for n, dt in ((s["latent"], dtype), (s["k_rope"], dtype),
                            (s["index_k"], index_dtype))]
  flat = _zeros_on(sharding)(tuple(specs))
  return [LayerCache(*flat[k:k + 3]) for k in range(0, len(flat), 3)]


def _zeros(specs: tuple) -> list:
  return [None if spec is None else jnp.zeros(*spec) for spec in specs]


@functools.cache
def _zeros_on(sharding):
  """One program makes every pool of a cache (eager `jnp.zeros` compiled one per shape)."""
  return jax.jit(_zeros, static_argnums=0,
                 out_shardings=sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def identity_pages(batch: int, pages_per_row: int):
  """Page tables `[B, W]` of rows owning consecutive pages 1.. (page 0 is the null page)."""
  return 1 + jnp.arange(batch * pages_per_row, dtype=jnp.int32).reshape(batch, pages_per_row)


def init_cache(cfg: Config, batch: int, capacity: int, dtype=jnp.float32, sharding=None,
               index_dtype=None, page_size: int = PAGE_SIZE) -> KVCache:
  """An empty cache of `batch` rows of `capacity` positions each (rounded up to whole pages),
  every row owning its own pages: the simple form, for tests and one-off callers."""
  w = -(-capacity // page_size)
  layers = init_pool(cfg, 1 + batch * w, range(cfg.num_hidden_layers), dtype, index_dtype,
                     page_size, sharding)
  device = jax.devices()[0] if sharding is None else sharding
  return KVCache(layers, jax.device_put(identity_pages(batch, w), device),
                 jax.device_put(jnp.zeros((), jnp.int32), device))


# --- addressing ---------------------------------------------------------------------------------

def slot_rows(pages, t, page_size: int):
  """Rows of the flattened pool `[P·PS, X]` holding positions `t` `[B, ...]` (int, ≥ 0) of
  each row of `pages` `[B, W]`; positions past the table map to the null page."""
  b, w = pages.shape
  j = jax.lax.div(t, page_size)
  page = jnp.take_along_axis(pages, jnp.minimum(j, w - 1).reshape(b, -1), axis=1)
  page = jnp.where(j < w, page.reshape(j.shape), NULL_PAGE)
  return page * page_size + jax.lax.rem(t, page_size)


def write(pools, news, pages, start):
  """`pools` (a pytree of `[P, PS, X]`: a `LayerCache`) with `news` (the same tree of `[B, S, X]`)
  written at positions start.. of each row.

  `start` is int32 `[]` or `[B]`. Positions past a row's table go to the null page. Each
  (row, position) is one dynamic_update_slice per pool, which XLA does in place on the donated
  pools: one loop over the B·S pairs writes all of a layer's pools (a loop per pool and row
  made the embedded model's prefill program 9% larger and 11% slower to compile). A scatter of
  the rows instead made XLA copy the pool three times per step to serve the reads that follow
  (807 MB of temporaries for a 131k-position latent pool), and rewriting whole pages copied it
  once per page."""
  ps = jax.tree_util.tree_leaves(pools)[0].shape[1]
  b, s = jax.tree_util.tree_leaves(news)[0].shape[:2]
  w = pages.shape[1]
  starts = jnp.broadcast_to(start, (b,))
  news = jax.tree_util.tree_map(lambda p, n: n.astype(p.dtype), pools, news)

  def put(k, pools):  # the k-th (row, position) pair, row-major
    r = 0 if b == 1 else k if s == 1 else jax.lax.div(k, s)
    i = 0 if s == 1 else k if b == 1 else jax.lax.rem(k, s)
    t = starts[r] + i
    j = jax.lax.div(t, ps)  # t ≥ 0: truncating division is floor division, in fewer ops
    page = jnp.where(j < w, pages[r, jnp.minimum(j, w - 1)], NULL_PAGE)
    at = (page, jax.lax.rem(t, ps), 0)
    return jax.tree_util.tree_map(lambda p, n: jax.lax.dynamic_update_slice(
        p, jax.lax.dynamic_slice(n, (r, i, 0), (1, 1, n.shape[2])), at), pools, news)

  if b * s == 1:
    return put(jnp.int32(0), pools)
  return jax.lax.fori_loop(0, b * s, put, pools)


def gather(pool, rows):
  """The pool rows `rows` (`slot_rows`' output, any shape) as `[..., X]` in the pool's dtype."""
  p, ps, x = pool.shape
  return pool.reshape(p * ps, x).at[rows].get(mode="promise_in_bounds")


def read_pages(pool, pages, first, count: int):
  """Positions first·PS .. (first + count)·PS - 1 of every row: `[B, count·PS, X]` (whole pages
  copied; table columns past W read the null page)."""
  b, w = pages.shape
  cols = first + jnp.arange(count, dtype=jnp.int32)
  page = jnp.where(cols < w, pages[:, jnp.minimum(cols, w - 1)], NULL_PAGE)  # [B, count]
  return pool[page].reshape(b, count * pool.shape[1], pool.shape[2])


def as_pool(fresh, page_size: int):
  """Fresh keys `[B, T, X]` seen as a pool: (`[B·n, PS, X]`, pages `[B, n]`), T padded to
  whole pages of `page_size` (never more than T's bucket), so the cache-less forward reads its
  keys through the same code as a cache."""
  b, t, x = fresh.shape
  ps = min(page_size, t)
  n = -(-t // ps)
  fresh = jnp.pad(fresh, ((0, 0), (0, n * ps - t), (0, 0)))
  return fresh.reshape(b * n, ps, x), jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
