"""Asynchronous expert reads: a pool of daemon I/O threads over the expert store.

Daemon threads (not a ThreadPoolExecutor, whose threads are joined at exit) so that a read
stalled in the kernel can never hang the process: the waiter times out with an error naming the
layer and expert, and the stuck thread dies with the process.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import threading
import time
from typing import Callable

import numpy as np

from glmjax.errors import ExpertIOError  # noqa: F401 - its home before glmjax.errors; re-exported


# Read priorities: lower is served first. Demand misses (including a verify pass's union)
# before pilot predictions before co-activation predictions before the background fill of a
# host cache that can hold every expert.
DEMAND, PILOT, COUPLE, FILL = 0, 2, 3, 4
# Hints queued at most; with the reads they held (their layer's next step takes or drops them),
# what prefetch holds in memory beyond the working set (counted in the memory plan).
MAX_HINTS = 64


class ExpertReader:
  """Reads expert chunk bytes with `workers` threads from a priority queue.

  `submit` returns a Future of the bytes. Hints (priority > DEMAND) are dropped rather than
  queued once `max_hints` are waiting, so prediction never delays demand for long; `promote`
  moves a queued hint to demand priority. `close()` stops and joins the threads.

  `read_fn` must not hold whatever owns this reader (the engine): the threads keep it alive,
  and a reference back would keep the owner from being garbage-collected.
  """

  def __init__(self, read_fn: Callable[[int, int], np.ndarray], workers: int = 4,
               timeout_s: float = 60.0, max_hints: int = MAX_HINTS):
    if workers < 1:
      raise ValueError(f"io_workers must be ≥ 1, got {workers}")
    self.read_fn = read_fn
    self.timeout_s = timeout_s
    self.max_hints = max_hints
    self.service_s = 0.0  # summed time the reads themselves took
    self.wait_s = 0.0  # time the compute thread spent blocked on reads
    self._lock = threading.Lock()
    self._q: queue.PriorityQueue = queue.PriorityQueue()
    self._seq = 0
    self._hints = 0
    self._queued: dict[cf.Future, tuple] = {}  # future → (priority, layer, expert), not started
    self._active = 0  # reads submitted and not yet finished (queued or running)
    self._idle = threading.Condition(self._lock)
    self._closed = False
    self._threads = [threading.Thread(target=self._worker, name=f"glmjax-io-{i}", daemon=True)
                     for i in range(workers)]
    for t in self._threads:
      t.start()

  def _worker(self):
    while True:
      priority, _, layer, expert, fut = self._q.get()
      if fut is None:  # the stop sentinel from close()
        return
      with self._lock:
        if self._queued.get(fut, (None,))[0] != priority:
          continue  # a stale entry of a promoted hint: its demand entry serves it
        del self._queued[fut]
        if priority > DEMAND:
          self._hints -= 1
      if not fut.set_running_or_notify_cancel():
        self._finished(0.0)
        continue
      t0 = time.perf_counter()
      try:
        blob = self.read_fn(layer, expert)
      except Exception as e:  # any failure becomes a named, clean error at the waiter
        fut.set_exception(ExpertIOError(f"reading layer {layer} expert {expert} failed: {e}",
                                        layer, expert))
      else:
        fut.set_result(blob)
      finally:
        self._finished(time.perf_counter() - t0)

  def _finished(self, seconds: float) -> None:
    """Counts a read's time and its end (one lock: `drain` sees both or neither)."""
    with self._lock:
      self.service_s += seconds
      self._active -= 1
      if self._active == 0:
        self._idle.notify_all()

  def drain(self, timeout_s: float | None = None) -> None:
    """Blocks until every submitted read has finished (its bytes, or its failure, set and its
    time counted), or raises ExpertIOError after `timeout_s` (default: the reader's). Lets a
    caller see the engine's counters at rest: nothing still lands behind its back."""
    timeout_s = self.timeout_s if timeout_s is None else timeout_s
    with self._lock:
      if not self._idle.wait_for(lambda: self._active == 0 or self._closed, timeout_s):
        raise ExpertIOError(f"{self._active} reads did not finish within {timeout_s:.1f} s "
                            "(stalled storage?)")

  def _put(self, priority: int, layer: int, expert: int, fut: cf.Future) -> None:
    self._seq += 1
    self._queued[fut] = (priority, layer, expert)
    self._q.put((priority, self._seq, layer, expert, fut))

  @property
  def hint_room(self) -> int:
    """How many more hints `submit` would queue now."""
    return max(0, self.max_hints - self._hints)

  def submit(self, layer: int, expert: int, priority: int = DEMAND) -> cf.Future | None:
    """Queues a read; None when a hint was dropped because the hint queue is full."""
    fut: cf.Future = cf.Future()
    with self._lock:
      if self._closed:
        raise ExpertIOError(f"reading layer {layer} expert {expert}: the reader is closed")
      if priority > DEMAND:
        if self._hints >= self.max_hints:
          return None
        self._hints += 1
      self._active += 1
      self._put(priority, layer, expert, fut)
    return fut

  def promote(self, fut: cf.Future) -> bool:
    """Raises a still-queued hint to demand priority. True if it was queued as a hint."""
    with self._lock:
      entry = self._queued.get(fut)
      if entry is None or entry[0] == DEMAND:
        return False
      self._hints -= 1
      self._put(DEMAND, entry[1], entry[2], fut)  # the old entry is skipped when dequeued
      return True

  def wait(self, fut: cf.Future, layer: int, expert: int) -> np.ndarray:
    """The bytes of a submitted read, blocking at most `timeout_s`."""
    t0 = time.perf_counter()
    try:
      return fut.result(timeout=self.timeout_s)
    except cf.TimeoutError:
      fut.cancel()
      raise self._stalled(layer, expert) from None
    finally:
      self.wait_s += time.perf_counter() - t0

  def as_completed(self, futures: dict):
    """Yields (key, bytes) for `futures` {Future: key = (layer, expert, ...)} as reads finish.

    Reads finishing together are yielded in (layer, expert) order. Raises ExpertIOError for a
    failed read, or when no read finishes within `timeout_s`.
    """
    pending = set(futures)
    while pending:
      t0 = time.perf_counter()
      done, pending = cf.wait(pending, timeout=self.timeout_s, return_when=cf.FIRST_COMPLETED)
      self.wait_s += time.perf_counter() - t0
      if not done:
        # The stalled read is one that started: a queued one only waits behind it.
        running = [f for f in pending if f.running()] or pending
        layer, expert = min(futures[f] for f in running)[:2]
        for fut in pending:
          fut.cancel()
        raise self._stalled(layer, expert)
      for fut in sorted(done, key=futures.get):
        if fut.cancelled():
          layer, expert = futures[fut][:2]
          raise ExpertIOError(f"reading layer {layer} expert {expert} was cancelled", layer,
                              expert)
        yield futures[fut], fut.result()

  def _stalled(self, layer: int, expert: int) -> ExpertIOError:
    return ExpertIOError(f"reading layer {layer} expert {expert} did not complete within "
                         f"{self.timeout_s:.1f} s (stalled storage?)", layer, expert)

  @property
  def threads_alive(self) -> int:
    return sum(t.is_alive() for t in self._threads)

  def close(self) -> None:
    """Cancels queued reads, stops the threads and joins them (a read stalled in the kernel is
    waited for at most `timeout_s`, then left to die with the process). Idempotent."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      for fut in list(self._queued):
        fut.cancel()
      self._queued.clear()
      self._hints = 0
      self._idle.notify_all()
      for _ in self._threads:  # sentinels sort after every real priority
        self._seq += 1
        self._q.put((1 << 30, self._seq, -1, -1, None))
    deadline = time.monotonic() + self.timeout_s
    for t in self._threads:
      if t is not threading.current_thread():
        t.join(max(0.0, deadline - time.monotonic()))


def drop_page_cache(root: str) -> int:
  """Asks the OS to drop cached pages of every file under `root` (cold-start measurements).

  Returns the number of files advised. Pages of files being written are unaffected.
  """
  n = 0
  for d, _, files in os.walk(root):
    for name in files:
      try:
        fd = os.open(os.path.join(d, name), os.O_RDONLY)
      except OSError:
        continue
      try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        n += 1
      finally:
        os.close(fd)
  return n
