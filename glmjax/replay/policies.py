"""Cache replacement policies of the replay simulator, one small class each.

A policy is one cache of `capacity` equal-sized expert slots. Keys are ints, `j * E + expert`
for MoE layer index j. The simulator drives it (see `glmjax.replay.simulate`):

  hits = p.access(union, q)          # serve request q; list[bool], one per key of `union`
  evicted = p.admit(keys, q, protect, prefetch=False)   # insert what fits, in order
  p.end_step(step)                   # after the last layer of each step
  p.stats()                          # extra counters merged into simulate's result

`admit` never evicts a key in `protect` (the union being served) and skips a key for which no
room can be made (it was streamed through), like `glmjax.offload.rules.HostCache.put`.
New policies register themselves in `POLICIES` with `@register("name")`.
"""

from __future__ import annotations

import collections
import heapq
from typing import Callable

import numpy as np

POLICIES: dict[str, type["Policy"]] = {}


def register(name: str) -> Callable[[type["Policy"]], type["Policy"]]:
  """Class decorator: makes a policy available to `simulate(trace, name, ...)`."""
  def add(cls):
    cls.name = name
    POLICIES[name] = cls
    return cls
  return add


class Policy:
  """Base class. `stream` is the simulator's `Stream` (request CSR, next uses, key counts);
  `layers` the MoE layer indices whose keys this cache holds (one for per-layer caches)."""
  name = ""
  prefetch_ok = True  # False for oracle/fixed policies, where prefetching is meaningless

  def __init__(self, capacity: int, stream, layers: list[int]):
    self.capacity = int(capacity)
    self.stream = stream
    self.layers = layers

  def __contains__(self, key: int) -> bool:
    raise NotImplementedError

  def __len__(self) -> int:
    raise NotImplementedError

  def access(self, keys: list[int], q: int) -> list[bool]:
    """Serves the union `keys` of request q: hit flags; updates recency/frequency."""
    raise NotImplementedError

  def admit(self, keys: list[int], q: int, protect, prefetch: bool = False) -> list[int]:
    """Inserts `keys` (not resident) in order as room allows; returns the evicted keys."""
    raise NotImplementedError

  def end_step(self, step: int) -> None:
    """Called after the last MoE layer of each step (decay hooks go here)."""

  def stats(self) -> dict:
    """Extra numeric counters for simulate's result (summed over per-layer caches)."""
    return {}


@register("lru")
class LRU(Policy):
  """Least recently used: HostCache's rule with unit-sized entries."""

  def __init__(self, capacity, stream, layers):
    super().__init__(capacity, stream, layers)
    self.od: collections.OrderedDict[int, None] = collections.OrderedDict()

  def __contains__(self, key):
    return key in self.od

  def __len__(self):
    return len(self.od)

  def access(self, keys, q):
    od, hits = self.od, []
    for k in keys:
      if k in od:
        od.move_to_end(k)
        hits.append(True)
      else:
        hits.append(False)
    return hits

  def admit(self, keys, q, protect, prefetch=False):
    od, evicted = self.od, []
    for k in keys:
      if len(od) >= self.capacity:
        # The union was just moved to the back, so the scan ends within a few entries.
        victim = next((v for v in od if v not in protect), None)
        if victim is None:
          continue
        del od[victim]
        evicted.append(victim)
      od[k] = None
    return evicted


class _Heaped(Policy):
  """Residents ordered by a priority kept in a lazy heap: an entry (prio..., key) is live
  while `self.prio[key]` still equals its priority, so updates are pushes, not searches.
  A key's last priority component must differ between its pushes (a tick, a next use):
  liveness compares that component only."""

  def __init__(self, capacity, stream, layers):
    super().__init__(capacity, stream, layers)
    self.res: set[int] = set()
    self.prio: dict[int, tuple] = {}
    self.heap: list[tuple] = []

  def __contains__(self, key):
    return key in self.res

  def __len__(self):
    return len(self.res)

  def _push(self, key: int, prio: tuple) -> None:
    self.prio[key] = prio
    heapq.heappush(self.heap, (*prio, key))
    if len(self.heap) > 8 * len(self.res) + 1024:  # drop dead entries now and then
      self.heap = [(*self.prio[k], k) for k in self.res]
      heapq.heapify(self.heap)

  def _top(self, protect) -> tuple | None:
    """The live entry with the smallest priority outside `protect` (left in the heap)."""
    heap, stash, top, res, prio = self.heap, [], None, self.res, self.prio
    while heap:
      k = heap[0][-1]
      if k not in res or prio[k][-1] != heap[0][-2]:
        heapq.heappop(heap)
      elif k in protect:
        stash.append(heapq.heappop(heap))
      else:
        top = heap[0]
        break
    for e in stash:
      heapq.heappush(heap, e)
    return top

  def _evict(self, key: int) -> None:
    self.res.discard(key)


@register("lfu")
class LFU(_Heaped):
  """Least frequently used: use counts since the start (hits and misses), ties → least
  recently used. A prefetch is not a use: it enters with its count and a fresh recency."""

  def __init__(self, capacity, stream, layers):
    super().__init__(capacity, stream, layers)
    self.freq: dict[int, int] = {}
    self.tick = 0

  def access(self, keys, q):
    hits, freq, res = [], self.freq, self.res
    for k in keys:
      self.tick += 1
      f = freq[k] = freq.get(k, 0) + 1
      if k in res:
        self._push(k, (f, self.tick))
        hits.append(True)
      else:
        self.prio[k] = (f, self.tick)  # its priority if admitted
        hits.append(False)
    return hits

  def admit(self, keys, q, protect, prefetch=False):
    evicted = []
    for k in keys:
      if len(self.res) >= self.capacity:
        top = self._top(protect)
        if top is None:
          continue
        self._evict(top[-1])
        evicted.append(top[-1])
      if prefetch:
        self.tick += 1
        self.prio[k] = (self.freq.get(k, 0), self.tick)
      self.res.add(k)
      self._push(k, self.prio[k])
    return evicted


@register("belady")
class Belady(_Heaped):
  """Belady's MIN with bypass, the optimum of this demand model: the union's misses are
  admitted soonest-needed first, each only if it is needed before the evictable resident
  needed last, which it replaces. "Sooner" compares next uses, then the uses after them
  (`Stream.future_rank_list`). Keys never used again are not kept."""
  prefetch_ok = False

  def __init__(self, capacity, stream, layers):
    super().__init__(capacity, stream, layers)
    self.rank = stream.future_rank_list()  # per flat union entry
    self.dead = max(self.rank, default=0)
    self.fut: dict[int, int] = {}

  def access(self, keys, q):
    hits, res, fut, base = [], self.res, self.fut, self.stream.offsets[q]
    for i, k in enumerate(keys):
      r = fut[k] = self.rank[base + i]
      if k in res:
        self._push(k, (-r,))  # max-heap on the future's rank
        hits.append(True)
      else:
        hits.append(False)
    return hits

  def admit(self, keys, q, protect, prefetch=False):
    evicted = []
    for k in sorted(keys, key=self.fut.__getitem__):
      r = self.fut[k]
      if r >= self.dead:
        break  # this and every later key are never used again
      if len(self.res) >= self.capacity:
        top = self._top(protect)
        if top is None or -top[0] <= r:
          break  # the rest are needed even later: keeping the residents is no worse
        self._evict(top[-1])
        evicted.append(top[-1])
      self.res.add(k)
      self._push(k, (-r,))
    return evicted


@register("static")
class Static(Policy):
  """A fixed placement: the `capacity` keys of `layers` requested most over the whole trace
  (ties → lower key), as llama.cpp --n-cpu-moe / KTransformers frequency placement. It starts
  cold like every other policy (a member is read on first use, then stays); nothing else is
  ever cached."""
  prefetch_ok = False

  def __init__(self, capacity, stream, layers):
    super().__init__(capacity, stream, layers)
    e = stream.n_experts
    keys = np.concatenate([np.arange(j * e, (j + 1) * e) for j in layers])
    counts = stream.key_counts[keys]
    order = np.lexsort((keys, -counts))[:self.capacity]
    self.fixed = set(keys[order].tolist())
    self.res: set[int] = set()

  def __contains__(self, key):
    return key in self.res

  def __len__(self):
    return len(self.res)

  def access(self, keys, q):
    return [k in self.res for k in keys]

  def admit(self, keys, q, protect, prefetch=False):
    self.res.update(k for k in keys if k in self.fixed)
    return []
