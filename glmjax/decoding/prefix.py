"""The prefix cache: full KV pages of prompts already prefilled, found again by their tokens.

A page is keyed by a hash chained over every token up to its end (page i's key hashes page
i-1's key and its own tokens), so equal keys mean equal whole prefixes, and a request whose
prompt starts like an earlier one maps those pages into its table instead of computing them.
Only full pages that hold prompt tokens are shared: a row writes its own tokens from the first
position after them, never into a shared page. Pages in use are counted; a page no row uses
stays cached, oldest use first out, until the pool needs its room.

Keys are `hashlib.blake2b` digests (16 bytes): a collision, which would hand one prompt
another's cache, is as unlikely as a 128-bit hash collision.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np


class PrefixCache:
  """Which pool pages hold which prompt prefixes, and who uses them. Not thread-safe: the
  pool's thread drives it."""

  def __init__(self, page_size: int):
    self.page_size = page_size
    self.page_of: dict[bytes, int] = {}  # prefix key → page
    self.key_of: dict[int, bytes] = {}  # page → its key (cached pages only)
    self.refs: collections.Counter = collections.Counter()  # page → rows using it
    self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # unused, LRU first
    self.hits_tokens = 0  # prompt tokens found cached, over the cache's life

  def keys(self, ids: np.ndarray, n_tokens: int) -> list[bytes]:
    """The chained keys of the full pages within the first `n_tokens` of `ids`."""
    ids = np.asarray(ids, np.int32)
    out, key = [], b""
    for i in range(n_tokens // self.page_size):
      page = ids[i * self.page_size:(i + 1) * self.page_size]
      key = hashlib.blake2b(key + page.tobytes(), digest_size=16).digest()
      out.append(key)
    return out

  def lookup(self, ids: np.ndarray, limit: int) -> list[int]:
    """The cached pages of the longest prefix of `ids` within its first `limit` tokens, now
    used by the caller (release them with `release`)."""
    pages = []
    for key in self.keys(ids, limit):
      page = self.page_of.get(key)
      if page is None:
        break
      pages.append(page)
    for page in pages:
      self._use(page)
    self.hits_tokens += len(pages) * self.page_size
    return pages

  def insert(self, ids: np.ndarray, pages: list[int], n_tokens: int) -> None:
    """Registers the caller's full pages within the first `n_tokens` of `ids` (pages[i] holds
    positions i·page_size onwards); the caller keeps using them. A page whose key is cached
    already (another row's) stays the caller's own."""
    for key, page in zip(self.keys(ids, n_tokens), pages):
      if key in self.page_of or page in self.key_of:
        continue
      self.page_of[key], self.key_of[page] = page, key
      self._use(page)

  def _use(self, page: int) -> None:
    self.refs[page] += 1
    self.idle.pop(page, None)

  def release(self, pages) -> list[int]:
    """The caller stops using `pages`: cached ones it was the last user of become idle (kept);
    the others are returned, to go back to the free list."""
    free = []
    for page in pages:
      page = int(page)
      if self.refs[page] == 0:  # never shared or cached: the caller's own page
        free.append(page)
        continue
      self.refs[page] -= 1
      if self.refs[page] == 0:  # its last user: keep it cached, or free it if forgotten
        del self.refs[page]
        if page in self.key_of:
          self.idle[page] = None
        else:
          free.append(page)
    return free

  def evict(self, n: int) -> list[int]:
    """Up to `n` idle pages, least recently used first, forgotten and handed back."""
    out = []
    while self.idle and len(out) < n:
      page, _ = self.idle.popitem(last=False)
      del self.page_of[self.key_of.pop(page)]
      out.append(page)
    return out

  def clear(self) -> list[int]:
    """Forgets every prefix (the pool's arrays were made anew: the pages hold nothing). The
    idle pages are handed back; pages in use stay their users' until released."""
    free = list(self.idle)
    self.idle.clear()
    self.page_of.clear()
    self.key_of.clear()
    return free

  @property
  def cached_pages(self) -> int:
    return len(self.key_of)
