"""The expert-cache rules, written once: the offload engine runs them over its bytes and the
replay simulator (glmjax.replay) runs them as they are, so a change to a rule changes both.

Bookkeeping over keys only (no bytes, threads or files):
- the host LRU (`HostCache`) and a pin pool's slots (`PinSlots`);
- a layer step's lookups and end-of-step admissions in union order, never in read completion
  order (`TierRules`): pin, then host, else a miss; the misses into the host cache (never
  evicting a member of the union); then the unpinned experts offered to the pin pool by LFRU,
  hottest first with hysteresis (`lfru_admissions`, `should_repin`);
- what becomes of a prefetched read (`PrefetchLedger`): it lands only into free room
  (`land_free`), else it is held for its layer's next step, whose miss takes it and which drops
  the held reads it did not use (the held-prefetch expiry);
- what is predicted: the pilot's union over a step's positions (`pilot_union`) and
  co-activation (`couple_top`, learned by `learn_couple`).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

# LFRU re-pin hysteresis: a candidate replaces the coldest pinned expert only when its heat
# exceeds the incumbent's by 25% plus 4 uses, so two near-equal experts never ping-pong.
REPIN_RATIO = 1.25
REPIN_MARGIN = 4.0
# A co-activation pair predicts only when seen COUPLE_MIN times and its count beats
# independence's (from the pair's row and column totals) by COUPLE_LIFT times (GLM-5's median
# pair: 1.8×, colibri's trace study) and by COUPLE_SIGMA Poisson deviations: a table holds
# 65,536 pairs at GLM-5's width, and over 1,000-3,000 tokens of independent top-8-of-256
# routing 4 deviations let ~1 chance pair a union through, 6 about 0.08 a table, 7 none in 12.
# Routing with no pair structure (the synthetic stores) then hints nothing; there the top-k
# were 8.6% of a 77-layer decode's reads, all wasted (DESIGN.md §17).
COUPLE_MIN = 12
COUPLE_LIFT = 1.5
COUPLE_SIGMA = 7.0


def layer_quotas(budget: int, layers, chunk: int, cap: int) -> tuple[dict, int]:
  """Each layer's share of a host cache of `budget` bytes, and the bytes left over: its whole
  `chunk`s split evenly over `layers`, at most `cap` each (a layer's experts), one more to each
  of the first layers while any remain (4 GiB of 20.05 MB chunks over 77 layers: 214 slots, 60
  layers of 3 and 17 of 2; an even split in bytes held 2 each and left 28% unused)."""
  layers = list(layers)
  if not layers or chunk <= 0:
    return {}, int(budget)
  slots = int(budget) // int(chunk)
  base = min(int(cap), slots // len(layers))
  extra = 0 if base >= cap else slots - base * len(layers)
  quotas = {l: (base + (i < extra)) * int(chunk) for i, l in enumerate(layers)}
  return quotas, int(budget) - sum(quotas.values())


class HostCache:
  """LRU bookkeeping of host-cached experts under a byte budget (0 disables it), with a share
  of it per layer (`quotas`: layer → bytes, `layer_quotas`; None: one LRU over every key).

  Keys only: the bytes live in `glmjax.offload.tiers.HostSlabs`. Keeping the policy apart from
  the storage lets the engine and the simulator (glmjax.replay) run the very same rule.

  With quotas, a layer (`key[0]`) holds at most its share and makes room within it, least
  recently used first: an LRU per layer. One LRU over every layer meets the decode's cyclic
  pattern (layer 0..L-1, then again) and, when smaller than one token's experts, evicts each
  expert just before its next use: at 2.8 slots per layer over 77 layers it hit 0-7.9% where
  an LRU per layer hits 12.5% (DESIGN.md §16). Letting a layer borrow room another left
  unused measured no better (equal or up to 0.4% fewer hits on random traces: the borrowed
  entries displace the order an LRU keeps).
  """

  def __init__(self, budget_bytes: int, quotas: dict | None = None):
    self.budget = int(budget_bytes)
    self.used = 0
    self.quotas = quotas  # layer -> bytes it may hold, or None
    self._by_layer: collections.Counter = collections.Counter()  # layer -> bytes held
    self._items: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()

  def share(self, layer: int) -> float:
    """Bytes `layer` may hold."""
    return self.budget if self.quotas is None else self.quotas.get(layer, 0)

  def __contains__(self, key) -> bool:
    return key in self._items

  def __len__(self) -> int:
    return len(self._items)

  def touch(self, key) -> bool:
    """A hit marks `key` most recently used; False on a miss."""
    if key not in self._items:
      return False
    self._items.move_to_end(key)
    return True

  def put(self, key, nbytes: int, protect=()) -> list:
    """Inserts `key` (`nbytes` large), evicting least recently used entries (never those in
    `protect`; with quotas, only entries of the key's own layer, which may hold at most its
    share) to stay within the budget. Returns the evicted keys; `key` is not inserted (check
    `key in cache`) if no room can be made.
    """
    if key in self._items:
      self._items.move_to_end(key)
      return []
    layer = key[0]
    room, held, share = self.budget - self.used, self._by_layer[layer] + nbytes, self.share(layer)
    fits = lambda: room >= nbytes and held <= share
    victims = []
    for k, v in self._items.items():  # least recently used first
      if fits():
        break
      if k in protect or (self.quotas is not None and k[0] != layer):
        continue
      victims.append(k)
      room += v
      held -= v if k[0] == layer else 0
    if not fits():
      return []
    for k in victims:
      self._drop(k)
    self._items[key] = int(nbytes)
    self.used += int(nbytes)
    self._by_layer[layer] += int(nbytes)
    return victims

  def _drop(self, key) -> None:
    n = self._items.pop(key)
    self.used -= n
    self._by_layer[key[0]] -= n

  def has_room(self, key, nbytes: int) -> bool:
    """Whether `key` (`nbytes` more) fits in the unused budget, and in its layer's share,
    evicting nothing."""
    return (self.used + nbytes <= self.budget
            and self._by_layer[key[0]] + nbytes <= self.share(key[0]))

  def keys(self) -> list:
    """Keys from least to most recently used."""
    return list(self._items)


class PinSlots:
  """The slot bookkeeping of one MoE layer's pin tier: `slots` fixed slots, expert ↔ slot.

  Storage-free, so the simulator (glmjax.replay) runs the engine's pin rule exactly."""

  def __init__(self, layer: int, slots: int, table: np.ndarray | None = None):
    self.layer = layer
    self.slots = slots
    self.slot_of: dict[int, int] = {}
    self.expert_in: list[int | None] = [None] * slots
    self.table = table  # optional [E] slot per expert (-1: not pinned), kept current

  def __contains__(self, expert: int) -> bool:
    return expert in self.slot_of

  def free_slot(self) -> int | None:
    for s, e in enumerate(self.expert_in):
      if e is None:
        return s
    return None

  def assign(self, expert: int, slot: int) -> None:
    """Records `expert` in `slot`, evicting whatever was there."""
    old = self.expert_in[slot]
    if old is not None:
      del self.slot_of[old]
      if self.table is not None:
        self.table[old] = -1
    self.slot_of[expert] = slot
    self.expert_in[slot] = expert
    if self.table is not None:
      self.table[expert] = slot

  def coldest(self, heat) -> tuple[int, int] | None:
    """(slot, expert) of the least heated pinned expert (ties: the lowest slot)."""
    live = [(heat[(self.layer, e)], s, e) for s, e in enumerate(self.expert_in) if e is not None]
    if not live:
      return None
    _, s, e = min(live)
    return s, e


def should_repin(candidate_heat: float, incumbent_heat: float) -> bool:
  """The LFRU hysteresis rule."""
  return candidate_heat > REPIN_RATIO * incumbent_heat + REPIN_MARGIN


def lfru_admissions(pins: PinSlots, heat, union, candidates):
  """The LFRU rule: yields (expert, slot, repinned) for just-used `candidates` (in union order),
  hottest first: a free slot, else the coldest incumbent's slot when `should_repin` says so
  (never an expert the current union uses). The caller assigns each before the next."""
  for e in sorted(candidates, key=lambda e: -heat[(pins.layer, e)]):  # stable: union order
    slot = pins.free_slot()
    if slot is not None:
      yield e, slot, False
      continue
    cold = pins.coldest(heat)
    if cold is None or cold[1] in union or not should_repin(heat[(pins.layer, e)],
                                                           heat[(pins.layer, cold[1])]):
      continue
    yield e, cold[0], True


@dataclasses.dataclass
class LayerUse:
  """One MoE layer's step as it was served: the record that the layer steps, the fused step
  and the simulator's engine policy each hand to `TierRules.fold`. Lists in union order."""
  layer: int
  union: list  # every expert the step routed to (heat learns from all of them)
  owned: list  # those this process serves (on a mesh its share; else the union)
  pinned: list  # served by the pin pool
  cached: list  # served by the host cache
  missed: list  # read from the store
  on_device: bool = False  # whether the host-held experts ran on the device (`Placement`)


class TierRules:
  """The two cache tiers' rules over bookkeeping alone: a pin pool per MoE layer (`pins`,
  layer → `PinSlots` or a pool shaped like one), the host LRU (`host`) and LFRU heat (`heat`,
  glmjax.offload.tiers.Heat). Re-pins are counted in `stats`.

  The simulator's engine policy runs these as they are; the engine's `Tiers` runs them over
  the bytes by overriding the storage hooks (`insert_host`, `inserted`, `pin_groups`,
  `install`), never the rules."""

  def __init__(self, pins: dict, host: HostCache, heat, chunk_bytes: int, stats=None):
    self.pins, self.host, self.heat = pins, host, heat
    self.chunk_bytes = int(chunk_bytes)
    self.stats = collections.Counter() if stats is None else stats

  def lookup(self, layer: int, union) -> tuple[list, list, list]:
    """A layer step's lookups in union order: (pinned, host-cached, missing). A pinned expert
    is served by its pool; otherwise a host hit becomes the most recently used entry; anything
    else misses."""
    pool = self.pins.get(layer)
    pinned, cached, missing = [], [], []
    for e in union:
      if pool is not None and e in pool:
        pinned.append(e)
      elif self.host.touch((layer, e)):
        cached.append(e)
      else:
        missing.append(e)
    return pinned, cached, missing

  def fold(self, use: LayerUse, data=None) -> None:
    """A served step's record into the tiers and counters, in union order: the heat of its
    whole union, the tier counters of its own experts, then `settle`. The one place a layer
    step's bookkeeping happens, whichever path served it."""
    self.heat.use(use.layer, use.union)
    held, s = len(use.cached) + len(use.missed), self.stats
    s["experts_used"] += len(use.owned)
    s["expert_pin_hits"] += len(use.pinned)
    s["expert_host_hits"] += len(use.cached)
    s["expert_misses"] += len(use.missed)
    s[f"misses_layer_{use.layer}"] += len(use.missed)
    s["experts_on_device"] += len(use.pinned) + (held if use.on_device else 0)
    s["experts_on_host"] += 0 if use.on_device else held
    self.settle(use.layer, use.owned, use.pinned, use.missed, data)

  def settle(self, layer: int, union, pinned, missed, data=None) -> None:
    """A layer step's tier updates once it has been served, in union order whatever order its
    reads completed in: each of the `missed` experts into the host cache (never evicting a
    member of the union), then every unpinned member offered to the pin pool (`admit`).
    `data` goes to the storage hooks (the engine: the misses' bytes and weights)."""
    missed = set(missed)
    protect = {(layer, e) for e in union}
    for e in union:
      if e in missed:
        self.insert_host((layer, e), protect, data)
    self.inserted()
    self.admit(layer, union, [e for e in union if e not in pinned], data)

  def admit(self, layer: int, union, candidates, data=None) -> None:
    """Moves just-used `candidates` (in union order) into the pin pool: free slots first, then
    LFRU swaps (`lfru_admissions`)."""
    for pool, mine in self.pin_groups(layer, candidates):
      for e, slot, repinned in lfru_admissions(pool, self.heat, union, mine):
        self.stats["repins"] += repinned
        self.install(pool, layer, e, slot, data)

  # -- storage hooks (bookkeeping only here) --------------------------------------------------
  def insert_host(self, key, protect, data) -> None:
    """Puts `key` into the host cache, evicting least recently used entries outside `protect`."""
    self.host.put(key, self.chunk_bytes, protect)

  def inserted(self) -> None:
    """Called once a step's host inserts are done, before its admissions."""

  def pin_groups(self, layer: int, candidates) -> list:
    """[(pool, its candidates)]: the pools that may admit `candidates` of `layer`."""
    pool = self.pins.get(layer)
    return [] if pool is None else [(pool, list(candidates))]

  def install(self, pool, layer: int, e: int, slot: int, data) -> None:
    """Records `e` in `slot` of `pool` (evicting whatever was there)."""
    pool.assign(e, slot)


def land_free(keys, room, store) -> list:
  """The landing rule: each finished prefetch of `keys` (in order) lands only into free room.
  `room(key)` says whether it fits without evicting anything (counting those landed before it);
  if so `store(key)` puts it there, otherwise it is held, for its layer's next step (returned).
  A prefetch never evicts: landing by eviction let wrong guesses push out what the next tokens
  needed (DESIGN.md §17)."""
  held = []
  for key in keys:
    if room(key):
      store(key)
    else:
      held.append(key)
  return held


class PrefetchLedger:
  """What becomes of each prefetched read. Keys are the caller's (the engine: (layer, expert);
  the simulator: j·E + expert), `layer_of(key)` their layer. Counters go to `stats` as
  prefetch_issued, prefetch_useful, prefetch_late, prefetch_failed and prefetch_wasted.

  - An issued read waits in `pending` (key → the caller's handle) until it lands, into free
    room only (`land_free`); one with no room stays pending, held for its layer's next step
    (`hold`: the keys the last landing held).
  - That step's miss takes the held read instead of reading again (`take`); then the held reads
    it did not use are dropped as wasted (`expire`: the held-prefetch expiry). A read that
    finished after the last landing is not held: it has not had its chance to land yet
    (dropping it made the engine's tiers depend on read timing).
  - A landed read (`landed`) is useful when a step uses it and wasted if it is evicted first
    (`used`, `evicted`)."""

  def __init__(self, stats, layer_of):
    self.stats, self.layer_of = stats, layer_of
    self.pending: dict = {}
    self.held: set = set()  # pending keys the last landing found no room for
    self.landed: set = set()

  def issue(self, key, handle=None) -> None:
    self.pending[key] = handle
    self.stats["prefetch_issued"] += 1

  def hold(self, keys) -> None:
    """Records the keys a landing held for want of room (`land_free`'s result): the ones the
    next `expire` of their layer may drop. Each landing replaces the last's."""
    self.held = set(keys)

  def resolve(self, key, outcome: str):
    """`key`'s read leaves `pending`: "landed" (stored; it waits to be used), or counted as
    prefetch_`outcome` ("useful", "late", "failed", "wasted"). Returns its handle."""
    handle = self.pending.pop(key)
    self.held.discard(key)  # a later read of the key is held only by a later landing
    if outcome == "landed":
      self.landed.add(key)
    else:
      self.stats["prefetch_" + outcome] += 1
    return handle

  def take(self, key, outcome: str):
    """A step's miss of `key` takes its pending read, if any, instead of reading again: useful,
    or late when it had not finished by then (or failed). Returns the handle, or None."""
    if key not in self.pending:
      return None
    return self.resolve(key, outcome)

  def expire(self, layer: int, outcome=lambda handle: "wasted") -> list:
    """The held-prefetch expiry: once `layer`'s step has taken what it used, its reads the last
    landing held are dropped, counted by `outcome(handle)` (wasted, or failed). Returns their
    [(key, handle)]."""
    gone = [(k, h) for k, h in self.pending.items()
            if self.layer_of(k) == layer and k in self.held]
    for k, h in gone:
      self.resolve(k, outcome(h))
    return gone

  def used(self, keys, late=()) -> int:
    """Counts the landed reads among the `keys` a step used: useful, or late for those in
    `late` (the read arrived after the step needed it; the step still missed). Returns how many
    were late."""
    n_late = 0
    for k in keys:
      if k in self.landed:
        self.landed.discard(k)
        if k in late:
          self.stats["prefetch_late"] += 1
          n_late += 1
        else:
          self.stats["prefetch_useful"] += 1
    return n_late

  def evicted(self, keys) -> None:
    """Landed reads evicted before any step used them: wasted."""
    for k in keys:
      if k in self.landed:
        self.landed.discard(k)
        self.stats["prefetch_wasted"] += 1

  def unused(self) -> int:
    """Reads landed or held but not (yet) used."""
    return len(self.landed) + len(self.pending)


def pilot_union(ids, take=None, group=None):
  """The pilot's union: per group of rows (a step's positions; the simulator's groups are its
  requests), the distinct experts among each row's pilot ids `ids` `[R, P]` (rank order) where
  `take` `[R, P]` (default all) is set; ids < 0 (no prediction) never count. Each expert comes
  with its best (lowest) rank. Returns (group `[U]`, expert `[U]`, rank `[U]`), ordered by
  group, then expert."""
  ids = np.asarray(ids)
  rank = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
  rows = np.zeros(ids.shape[0], np.int64) if group is None else np.asarray(group)
  grp = np.broadcast_to(rows[:, None], ids.shape)
  sel = ids >= 0 if take is None else np.asarray(take) & (ids >= 0)
  grp, rank, ids = grp[sel], rank[sel], ids[sel].astype(np.int64)
  o = np.lexsort((rank, ids, grp))  # one entry per (group, expert): its best rank first
  grp, rank, ids = grp[o], rank[o], ids[o]
  first = np.ones(len(grp), bool)
  first[1:] = (grp[1:] != grp[:-1]) | (ids[1:] != ids[:-1])
  return grp[first], ids[first], rank[first]


def couple_top(table, union, k: int) -> list[int]:
  """Co-activation prediction: the `k` next-layer experts with the most counts with this
  layer's `union` (`table` `[E, E]`: counts this layer's expert → the next layer's), ties by
  the lower id, counting only the pairs associated beyond chance (`COUPLE_MIN`,
  `COUPLE_LIFT`, `COUPLE_SIGMA`)."""
  rows = table[union]  # [U, E]
  if not rows.any():  # nothing seen with the union: nothing to predict (nor to divide by)
    return []
  col = table.sum(axis=0)  # [E]: the next layer's counts, one pass over the table
  expected = np.outer(rows.sum(axis=1), col / col.sum())  # [U, E]: the counts with no association
  kept = ((rows >= COUPLE_MIN) & (rows >= COUPLE_LIFT * expected)
          & (rows - expected >= COUPLE_SIGMA * np.sqrt(expected)))
  score = (rows * kept).sum(axis=0)  # [E]
  return [int(e) for e in np.argsort(-score, kind="stable")[:k] if score[e] > 0]


def learn_couple(table, prev_union, union) -> None:
  """Counts one co-activation of each expert of the previous layer's union (rows of `table`)
  with each of this layer's (columns)."""
  table[np.ix_(prev_union, union)] += 1
