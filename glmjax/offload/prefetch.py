"""The offload engine's prefetcher: predicts the next MoE layer's experts (the pilot router and
co-activation), queues their reads as hints, lands finished reads into free room only, drops
held reads their step did not use, and fills a host cache that can hold every expert.

The rules (what lands, what a held read becomes, the pilot's union, the co-activation pick)
are glmjax.offload.rules', shared with the simulator; this class runs them over real reads.
Keys are (layer, expert); a read's handle is (future, priority kind).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from glmjax.offload.expert_io import COUPLE, DEMAND, FILL, PILOT
from glmjax.offload.rules import PrefetchLedger, couple_top, land_free, learn_couple, pilot_union
from glmjax.offload.shared import EngineShared
from glmjax.offload.tiers import atomic_write


COUPLE_FILE = "couple.npy"  # the co-activation table, beside the store's experts
# A pilot union covering at least 1/WHOLE_LAYER of a layer's experts reads the whole layer.
WHOLE_LAYER = 2


def load_couple(path: str, layers: int, experts: int) -> np.ndarray:
  """Co-activation counts expert(L) → expert(L+1) `[layers, E, E]`, persisted between runs."""
  try:
    table = np.load(path)
    if table.shape == (layers, experts, experts):
      return table
  except (OSError, ValueError):
    pass
  return np.zeros((layers, experts, experts), np.float32)


def _failed(fut) -> bool:
  return fut.cancelled() or fut.exception() is not None


class Prefetcher:
  """Hints, landing, expiry and the host fill for one engine's `tiers`, reading through
  `reader`. Its state is its own: `enabled`, whether prefetch runs at all; `predicting`,
  whether this forward predicts (off while every expert is held; `start_step`); `filling`,
  whether the host fill still runs (`fill`: the host cache can hold every main-layer expert);
  `paused`, a precompile step's (`pause`)."""

  def __init__(self, shared: EngineShared, enabled: bool, pilot_k: int, couple_k: int,
               fill: bool = False):
    self.tiers, self.reader, self.store, self.stats = (shared.tiers, shared.reader, shared.store,
                                                       shared.stats)
    self.moe_layers, self.n_experts = shared.moe_layers, shared.n_experts
    self.enabled, self.pilot_k, self.couple_k = enabled, pilot_k, couple_k
    self.ledger = PrefetchLedger(self.stats, layer_of=lambda key: key[0])
    self.tiers.on_evict = self.ledger.evicted  # a landed read evicted unused was wasted
    self.pilot_pred: dict[int, set] = {}  # layer → experts the pilot predicted this step
    self.couple_path = os.path.join(self.store.path, COUPLE_FILE)
    self.couple = load_couple(self.couple_path, shared.n_layers, self.n_experts)
    self.prev_union: tuple[int, list] | None = None  # the last layer step's, for learning
    self.predicting = enabled
    self.filling = enabled and fill
    self.paused = False  # a precompile step: lands, expires and fills nothing
    self._fill_order, self._fill_next = None, 0

  def start_step(self, all_cached: bool) -> None:
    """A forward's start. With every expert held there is nothing to fetch: prediction (pilot,
    co-activation learning and their statistics) pauses rather than cost time per layer;
    otherwise the host fill queues what it has room for (not in a precompile step)."""
    self.prev_union = None
    self.predicting = self.enabled and not all_cached
    if self.filling and not all_cached and not self.paused:
      self.fill_host()

  @contextlib.contextmanager
  def pause(self):
    """A precompile step runs inside: it lands, expires, fills and learns nothing (its rows
    are padding: it routes nothing, so it reads and hints nothing either)."""
    prev, self.paused = self.prev_union, True
    try:
      yield
    finally:
      self.paused, self.prev_union = False, prev

  @property
  def inflight(self) -> dict:
    """(layer, expert) → (future, kind) of the reads issued and not yet landed or dropped."""
    return self.ledger.pending

  def resident(self, layer: int, e: int) -> bool:
    """Held by a tier, or already being read."""
    return self.tiers.holds(layer, e) or (layer, e) in self.ledger.pending

  def hint(self, layer: int, experts, kind: int) -> None:
    """Queues non-resident `experts` of `layer` for reading at priority `kind` (those this
    process owns: another process reads its own)."""
    for e in experts:
      e = int(e)
      if not self.tiers.owned[e] or self.resident(layer, e):
        continue
      fut = self.reader.submit(layer, e, kind)
      if fut is None:
        self.stats["prefetch_dropped"] += 1
        continue
      self.ledger.issue((layer, e), (fut, kind))

  def land(self) -> None:
    """Moves finished prefetches into free room (`land_free`): the host cache's unused bytes,
    or a free slot of their layer's pin pool. A prefetch never evicts a cached expert: one
    that finds no room is held for its layer's next step, whose miss takes the read, and is
    dropped if that step does not use it (`expire`). Landing by eviction let wrong guesses push
    out what the next tokens needed (at a 12.5% host cache: 900 against 713 kB read per token,
    DESIGN.md §17)."""
    done = [k for k, (fut, kind) in self.ledger.pending.items() if kind != DEMAND and fut.done()]
    self.ledger.hold(land_free(done, self.room_for, self._store))
    self.tiers.slabs.flush()

  def _store(self, key) -> None:
    fut = self.ledger.pending[key][0]
    if _failed(fut):
      self.ledger.resolve(key, "failed")  # a hint failing is not an error; demand retries
      return
    blob = fut.result()
    self.stats["expert_bytes_read"] += blob.nbytes
    self.tiers.put_host(key, blob)  # into free room: evicts nothing
    dev = self.tiers.pin_pool(*key)  # on a mesh only its owner's pool may take it
    slot = dev.free_slot() if dev is not None else None
    if slot is not None:
      dev.install(key[1], self.store.layout(key[0]).unpack(blob), slot)
    stayed = key in self.tiers.host or (dev is not None and key[1] in dev)
    self.ledger.resolve(key, "landed" if stayed else "wasted")

  def room_for(self, key) -> bool:
    """Whether `key` can land without evicting anything: free host-cache bytes for it, or a
    free slot in its layer's pin pool."""
    if self.tiers.host.has_room(key, self.store.layout(key[0]).nbytes):
      return True
    dev = self.tiers.pin_pool(*key)
    return dev is not None and dev.free_slot() is not None

  def take(self, layer: int, e: int):
    """A miss of a key being prefetched takes its read instead of reading again: useful when
    it had arrived (held for want of room), late (promoted to demand) when still loading, and
    read again when it failed. Returns the future to wait on, or None when not prefetched."""
    handle = self.ledger.pending.get((layer, e))
    if handle is None:
      return None
    fut = handle[0]
    if not fut.done():  # still loading: wait for it
      self.reader.promote(fut)  # a hint still queued is now a demand
      outcome = "late"
    elif _failed(fut):  # a hint failing is not an error: read it again
      outcome = "failed"
      fut = self.reader.submit(layer, e)
    else:  # read in time, held for this step because it found no room (`land`)
      outcome = "useful"
    self.ledger.take((layer, e), outcome)
    return fut

  def expire(self, layer: int) -> None:
    """Drops `layer`'s reads that the last `land` held for want of room: its step has come and
    did not use them (the held-prefetch expiry). A read that finished since is kept: it lands
    at the next `land` like any other."""
    gone = self.ledger.expire(layer, lambda h: "failed" if _failed(h[0]) else "wasted")
    for _, (fut, _) in gone:
      if not _failed(fut):
        self.stats["expert_bytes_read"] += fut.result().nbytes  # read, and for nothing

  def count_pilot(self, layer: int, union) -> None:
    """Scores the pilot's prediction for `layer` against the experts it used (those this
    process owns, on both sides, so that the processes' counts add up to one process's)."""
    pred = self.pilot_pred.pop(layer, None)
    if pred is not None:
      owned = self.tiers.owned
      pred = {e for e in pred if owned[e]}
      union = [e for e in union if owned[e]]
      self.stats["pilot_hits"] += len(pred & set(union))
      self.stats["pilot_predicted"] += len(pred)
      self.stats["pilot_actual"] += len(union)

  def predict(self, layer: int, union: list, next_layer: int | None, pilot) -> None:
    """Pilot and co-activation hints for `next_layer` after `layer`'s union is known (`pilot`
    `[T, k]`: the real rows' pilot ids, or None), then learns co-activation from this step."""
    if next_layer is not None:
      if pilot is not None:
        self.hint_pilot(next_layer, pilot)
      if self.couple_k:
        self.hint(next_layer, couple_top(self.couple[layer], union, self.couple_k), COUPLE)
    if self.prev_union is not None and self.prev_union[0] < layer:
      learn_couple(self.couple[self.prev_union[0]], self.prev_union[1], union)
    self.prev_union = (layer, union)

  def hint_pilot(self, layer: int, pilot) -> None:
    """Hints the pilot's union `pilot` `[T, k]` (real rows only) for `layer`; when that union
    covers at least half of the layer's experts (a prefill's many rows), the whole layer,
    the predicted experts first: its reads then overlap this layer's compute instead of
    waiting for its routing (a 4-token prompt on 16 experts uses ~15 of them)."""
    pred = pilot_union(pilot)[1].tolist()
    self.pilot_pred[layer] = set(pred)
    if WHOLE_LAYER * len(pred) >= self.n_experts:
      pred += [e for e in range(self.n_experts) if e not in self.pilot_pred[layer]]
    self.hint(layer, pred, PILOT)

  def save(self) -> None:
    """Persists the co-activation table (when prefetch is on)."""
    if self.enabled:
      atomic_write(self.couple_path, lambda f: np.save(f, self.couple))

  # -- the host fill ----------------------------------------------------------------------------
  def fill_keys(self) -> list:
    """Main-layer (layer, expert) keys in fill order: each layer's experts this process owns,
    hottest first by the usage history, layers interleaved (a fixed order, whatever the reads'
    timing)."""
    e, owned = self.n_experts, self.tiers.owned
    ranked = [[x for x in dict.fromkeys(self.tiers.heat.hottest(l, e, e) + list(range(e)))
               if owned[x]] for l in self.moe_layers]
    return [(l, r[i]) for i in range(len(ranked[0]) if ranked else 0)
            for l, r in zip(self.moe_layers, ranked)]

  def fill_host(self) -> None:
    """Queues FILL reads of main-layer experts no tier holds, as far as the reader has room
    for hints; they land like any prefetch. One pass over `fill_keys` (fixed at the first
    call): an expert evicted later is not read again."""
    if self._fill_order is None:
      self._fill_order = self.fill_keys()
    room = self.reader.hint_room
    while room and self._fill_next < len(self._fill_order):
      key = self._fill_order[self._fill_next]
      self._fill_next += 1
      if not self.resident(*key):
        self.hint(key[0], [key[1]], FILL)
        room -= 1
    if self._fill_next == len(self._fill_order):
      self.filling = False

  def warm_host(self) -> None:
    """Reads, now, every main-layer expert that no tier holds into the host cache, as far as
    its budget allows, in `fill_keys` order (the reads run in parallel on the I/O threads;
    inserts follow the fixed order, so the cache's contents do not depend on their timing)."""
    host = self.tiers.host
    room = (host.budget - host.used) // self.tiers.chunk_bytes
    keys = [k for k in self.fill_keys() if not self.resident(*k)][:max(0, room)]
    for i in range(0, len(keys), 64):  # a bounded transient: 64 chunks in flight at most
      part = keys[i:i + 64]
      futures = {self.reader.submit(*k): k for k in part}
      blobs = dict(self.reader.as_completed(futures))
      for k in part:
        self.stats["expert_bytes_read"] += blobs[k].nbytes
        self.tiers.put_host(k, blobs[k])
      self.tiers.slabs.flush()
