"""Page-aligned chunk read buffers that are reused instead of freed.

A fresh 20 MB buffer per expert read is faulted in page by page while the read fills it: in a
cold prefill a quarter of the process's time went to the kernel zeroing those pages
(DESIGN.md §26). Reusing a buffer whose pages are already mapped skips that.

A buffer may be reused only once nothing can read it any more, and its readers are not all
ours: JAX on the CPU computes straight from a page-aligned numpy argument (no copy) and holds
that array until the computation ends. So each buffer handed out is a numpy array over a small
ctypes view of the pool's memory, and a finalizer on that view gives the memory back: it runs
when the last array that reaches it (slices included, and JAX's hold) is gone. Reference
counting is the ledger; nobody has to call `release`.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import weakref

import numpy as np

ALIGN = 4096  # O_DIRECT alignment of buffer, offset and length


class ReadBuffers:
  """Buffers of a few lengths, at most `keep_bytes` of them kept while free.

  `take(length)` returns a page-aligned `uint8[length]` array: a kept buffer when one is free,
  a new one otherwise. When its last reference dies its memory is kept for the next `take` of
  that length, unless the free buffers already hold `keep_bytes`. `prefault` maps a number of
  buffers up front (outside a timed step). Thread-safe: reads take buffers on the I/O threads,
  and a buffer comes back on whichever thread drops it last.
  """

  def __init__(self, keep_bytes: int = 0):
    self.keep_bytes = int(keep_bytes)
    # Reentrant: a collection inside a locked block may run another buffer's finalizer here.
    self._lock = threading.RLock()
    self._free: dict[int, collections.deque] = collections.defaultdict(collections.deque)
    self._free_bytes = 0
    self.reused = 0  # takes served by a kept buffer
    self.fresh = 0  # takes that allocated (and faulted in) a new buffer

  def take(self, length: int) -> np.ndarray:
    with self._lock:
      free = self._free[length]
      raw = free.pop() if free else None
      if raw is not None:
        self._free_bytes -= raw.nbytes
        self.reused += 1
      else:
        self.fresh += 1
    if raw is None:
      raw = _aligned(length)
    view = (ctypes.c_uint8 * length).from_buffer(raw)
    weakref.finalize(view, self._give_back, length, raw).atexit = False  # nothing to keep then
    return np.frombuffer(view, np.uint8)

  def _give_back(self, length: int, raw: np.ndarray) -> None:
    with self._lock:
      if self._free_bytes + raw.nbytes <= self.keep_bytes:
        self._free[length].append(raw)
        self._free_bytes += raw.nbytes

  def prefault(self, length: int, count: int) -> int:
    """Maps up to `count` more free buffers of `length` bytes, within `keep_bytes`; returns how
    many it added. Writing one byte a page faults every page in (the mapping is private)."""
    added = 0
    while added < count and self._free_bytes + length <= self.keep_bytes:
      raw = _aligned(length)
      raw[::ALIGN] = 0
      self._give_back(length, raw)
      added += 1
    return added

  @property
  def free_bytes(self) -> int:
    return self._free_bytes

  def clear(self) -> None:
    """Frees every kept buffer; buffers still in use are freed when they are dropped."""
    with self._lock:
      self._free.clear()
      self._free_bytes, self.keep_bytes = 0, 0


def _aligned(length: int) -> np.ndarray:
  """A new `uint8[length]` array starting on an ALIGN boundary (a view into a larger one)."""
  raw = np.empty(length + ALIGN, np.uint8)
  start = (-raw.ctypes.data) % ALIGN
  return raw[start:start + length]
