"""The host side of the paged KV cache: a pool of pages, which ones are free, who holds what.

One `KVPool` serves a model's batch-1 calls (generate, chat sessions: `Model.kv`), another a
server's decode batch. Its device arrays (glmjax.model.kvcache pools, the MTP layer's made on
first use) pass through every step, which donates them; `update` takes the step's output
back. A request takes the pages its positions need (`alloc`), never the next power of two of
them, and gives them back when done. A pool that must hold more grows to what is asked (and
half its size again when it already held pages, so that a growing conversation compiles its
steps for few pool sizes), after checking that the bytes fit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.decoding.prefix import PrefixCache
from glmjax.errors import InputError
from glmjax.model import kvcache
from glmjax.model.config import Config
from glmjax.model.kvcache import KVCache

GiB = 1 << 30
KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
INDEX_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
                "float8": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class KVLayout:
  """What one position of the cache stores and in which dtypes (`kv_dtype` for the latent and
  rope key, `index_dtype` for the indexer key), and the page size."""
  cfg: Config
  kv_dtype: str = "float32"
  index_dtype: str = "float32"
  page_size: int = kvcache.PAGE_SIZE

  def page_bytes(self, mtp: bool = False) -> int:
    """Bytes of one page over the main layers (and the MTP layer with `mtp`)."""
    layers = list(range(self.cfg.num_hidden_layers))
    if mtp:
      layers.append(self.cfg.num_hidden_layers)
    return self.page_size * kvcache.bytes_per_position(
        self.cfg, KV_DTYPES[self.kv_dtype], INDEX_DTYPES[self.index_dtype], layers)

  def pages_for(self, positions: int) -> int:
    return -(-positions // self.page_size)


def free_bytes() -> int:
  """Memory the KV cache may still take: free accelerator memory less max(1 GiB, 5%), or on a
  CPU-only machine the RAM automatic budgets may take (`offload.budget.host_available`: within
  GLMJAX_MEMORY_GB or the cgroup's limit, less max(4 GiB, 25% of the memory total))."""
  dev = jax.devices()[0]
  stats = dev.memory_stats() if dev.platform != "cpu" else None
  if stats and "bytes_limit" in stats:
    free = int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return free - max(GiB, free // 20)
  from glmjax.offload.budget import host_available  # budget imports the engine, which imports this
  return host_available()


class KVPool:
  """Pages of the KV cache on the device, and the free list (page 0, the null page, is never
  handed out). Not thread-safe: one thread drives it."""

  def __init__(self, layout: KVLayout, n_pages: int = 1, sharding=None, room=free_bytes,
               prefix_cache: bool = False):
    self.layout, self.sharding, self.room = layout, sharding, room
    # Full prompt pages kept for reuse (glmjax.decoding.prefix): evicted when pages run short.
    self.prefix = PrefixCache(layout.page_size) if prefix_cache else None
    self.n_pages = 0
    self.layers: list = []
    self.mtp_layers: list | None = None
    self.free: list[int] = []
    self.epoch = 0  # bumped when the arrays are lost (a failed step) and made anew
    self._grow_to(max(1, n_pages))

  # --- sizes --------------------------------------------------------------------------------
  @property
  def cfg(self) -> Config:
    return self.layout.cfg

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in jax.tree_util.tree_leaves((self.layers, self.mtp_layers)))

  @property
  def used_pages(self) -> int:
    return self.n_pages - 1 - self.available

  @property
  def available(self) -> int:
    """Pages a request can take now: free ones, and cached prefixes no row uses."""
    return len(self.free) + (len(self.prefix.idle) if self.prefix else 0)

  def _arrays(self, n_pages: int, mtp: bool) -> list:
    lay = self.layout
    which = [self.cfg.num_hidden_layers] if mtp else range(self.cfg.num_hidden_layers)
    return kvcache.init_pool(self.cfg, n_pages, which, KV_DTYPES[lay.kv_dtype],
                             INDEX_DTYPES[lay.index_dtype], lay.page_size, self.sharding)

  def check_fits(self, extra_pages: int, what: str) -> None:
    """Refuses, before anything is allocated, `extra_pages` more pages that memory cannot hold."""
    need = extra_pages * self.layout.page_bytes(self.mtp_layers is not None)
    room = self.room()
    if need > room:
      raise InputError(
          f"{what}: the KV cache needs {need / GiB:.2f} GB more ({extra_pages} pages of "
          f"{self.layout.page_size} positions, {self.layout.kv_dtype}) but only "
          f"{max(room, 0) / GiB:.2f} GB are available; use a shorter context, "
          "kv_dtype='bfloat16' or a smaller batch")

  def _grow_to(self, n_pages: int) -> None:
    add = n_pages - self.n_pages
    if add <= 0:
      return
    def grown(old, mtp):
      new = self._arrays(add, mtp)
      if not old:
        return new
      cat = lambda a, b: None if a is None else jnp.concatenate([a, b])
      return jax.tree_util.tree_map(cat, old, new, is_leaf=lambda x: x is None)
    self.layers = grown(self.layers, False)
    if self.mtp_layers is not None:
      self.mtp_layers = grown(self.mtp_layers, True)
    start = max(self.n_pages, 1)  # page 0 is the null page
    self.free.extend(range(n_pages - 1, start - 1, -1))
    self.free.sort(reverse=True)  # lowest first from the end: a fresh request gets pages 1, 2..
    self.n_pages = n_pages

  # --- pages --------------------------------------------------------------------------------
  def alloc(self, n: int, what: str = "request", grow: bool = True) -> list[int]:
    """`n` free pages, growing the pool when `grow` (a fixed budget does not grow); cached
    prefixes no row uses give up their pages first, least recently used first."""
    if n > len(self.free) and self.prefix is not None:
      self.free.extend(self.prefix.evict(n - len(self.free)))
    if n > len(self.free):
      if not grow:
        raise InputError(f"{what}: needs {n} KV pages, {len(self.free)} are free")
      short = n - len(self.free)
      target = self.n_pages + short
      if self.used_pages:  # a pool in use grows geometrically: few sizes, few compiles
        target = max(target, self.n_pages + self.n_pages // 2)
      self.check_fits(target - self.n_pages, what)
      self._grow_to(target)
    out = [self.free.pop() for _ in range(n)]
    return out

  def release(self, pages) -> None:
    """Gives pages back (cached prefixes stay cached until evicted)."""
    if self.prefix is not None:
      pages = self.prefix.release(pages)
    self.free.extend(int(p) for p in pages)
    self.free.sort(reverse=True)

  def ensure_mtp(self) -> None:
    """Makes the MTP layer's arrays (speculative decoding's draft cache) on first use."""
    if self.mtp_layers is None and self.cfg.num_nextn_predict_layers:
      extra = self.layout.page_bytes(True) - self.layout.page_bytes(False)
      if extra * self.n_pages > self.room():
        raise InputError(f"the MTP layer's KV cache ({extra * self.n_pages / GiB:.2f} GB) does "
                         "not fit in memory")
      self.mtp_layers = self._arrays(self.n_pages, True)

  def reset(self) -> None:
    """New zeroed arrays after a step failed with the old ones donated: every holder's
    contents are gone (its pages stay its own); `epoch` tells holders to rebuild."""
    self.layers = self._arrays(self.n_pages, False)
    if self.mtp_layers is not None:
      self.mtp_layers = self._arrays(self.n_pages, True)
    if self.prefix is not None:  # the cached prefixes went with the old arrays
      self.release(self.prefix.clear())
    self.epoch += 1

  # --- caches for a step --------------------------------------------------------------------
  def table(self, pages, width: int | None = None) -> np.ndarray:
    """One row's page table `[W]` (W: every page of the pool, or `width`), unowned entries 0."""
    w = self.n_pages - 1 if width is None else width
    row = np.zeros((w,), np.int32)
    row[:len(pages)] = pages
    return row

  def cache(self, tables, length, put=jnp.asarray, mtp: bool = False) -> KVCache:
    """A KVCache over the pool's arrays for rows with page `tables` `[B, W]` at `length`."""
    layers = self.mtp_layers if mtp else self.layers
    return KVCache(layers, put(np.asarray(tables, np.int32)), put(np.asarray(length, np.int32)))

  def update(self, cache: KVCache, mtp: bool = False) -> None:
    """Takes a step's output arrays back (the step donated the pool's)."""
    if mtp:
      self.mtp_layers = cache.layers
    else:
      self.layers = cache.layers
