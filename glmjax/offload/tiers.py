"""Cache tiers of the offload engine: the device-resident pinned pool and the host LRU.

Both are bookkeeping plus storage; neither does I/O. Keys are (layer, expert).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import jax
import jax.numpy as jnp
import numpy as np

from glmjax.model.quant import ExpertPool, ExpertWeights

# LFRU re-pin hysteresis: a candidate replaces the coldest pinned expert only when its heat
# exceeds the incumbent's by 25% plus 4 uses, so two near-equal experts never ping-pong.
REPIN_RATIO = 1.25
REPIN_MARGIN = 4.0
# Heat is a use count that decays by this factor per decode step (recency in LFRU).
HEAT_DECAY = 0.995


class HostCache:
  """LRU of expert chunk bytes under a byte budget (0 disables it)."""

  def __init__(self, budget_bytes: int):
    self.budget = int(budget_bytes)
    self.used = 0
    self._items: collections.OrderedDict[tuple[int, int], np.ndarray] = collections.OrderedDict()

  def __contains__(self, key) -> bool:
    return key in self._items

  def __len__(self) -> int:
    return len(self._items)

  def get(self, key):
    """The chunk bytes for `key`, marking it most recently used; None on a miss."""
    blob = self._items.get(key)
    if blob is not None:
      self._items.move_to_end(key)
    return blob

  def put(self, key, blob: np.ndarray, protect=()) -> list:
    """Inserts `blob`, evicting least recently used entries (never those in `protect`) to stay
    within the budget. Returns the evicted keys; `blob` is not inserted if no room can be made.
    """
    if key in self._items:
      self._items.move_to_end(key)
      return []
    victims, room = [], self.budget - self.used
    for k, v in self._items.items():  # least recently used first
      if room >= blob.nbytes:
        break
      if k not in protect:
        victims.append(k)
        room += v.nbytes
    if room < blob.nbytes:
      return []
    for k in victims:
      self.used -= self._items.pop(k).nbytes
    self._items[key] = blob
    self.used += blob.nbytes
    return victims

  def keys(self) -> list:
    """Keys from least to most recently used."""
    return list(self._items)


class Heat:
  """LFRU heat per (layer, expert): decayed use counts, persisted as a usage histogram."""

  def __init__(self, counts: dict | None = None):
    self.h: dict[tuple[int, int], float] = collections.defaultdict(float, counts or {})

  def use(self, layer: int, experts) -> None:
    for e in experts:
      self.h[(layer, int(e))] += 1.0

  def decay(self) -> None:
    for k in self.h:
      self.h[k] *= HEAT_DECAY

  def __getitem__(self, key) -> float:
    return self.h.get(key, 0.0)

  def hottest(self, layer: int, n: int, n_experts: int) -> list[int]:
    scores = [(-self.h.get((layer, e), 0.0), e) for e in range(n_experts)]
    return [e for s, e in sorted(scores)[:n] if s < 0]

  def save(self, path: str) -> None:
    data = {f"{l}/{e}": v for (l, e), v in self.h.items() if v > 0}
    atomic_write(path, lambda f: f.write(json.dumps(data).encode()))

  @classmethod
  def load(cls, path: str) -> "Heat":
    try:
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
      return cls({tuple(int(x) for x in k.split("/")): float(v) for k, v in data.items()})
    except (OSError, ValueError):
      return cls()


def atomic_write(path: str, write) -> bool:
  """Writes `path` through a uniquely named temporary file and an atomic rename, so processes
  sharing a store never see (or clobber) a half-written file. `write(f)` gets a binary file.
  Returns False (and leaves `path` as it was) when the directory is not writable."""
  import tempfile
  try:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                               prefix=os.path.basename(path) + ".", suffix=".tmp")
  except OSError:
    return False  # a read-only store just does not learn across runs
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
    os.replace(tmp, path)
    return True
  except OSError:
    return False
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def should_repin(candidate_heat: float, incumbent_heat: float) -> bool:
  """The LFRU hysteresis rule."""
  return candidate_heat > REPIN_RATIO * incumbent_heat + REPIN_MARGIN


# The pool is donated: an install writes one expert's bytes in place instead of copying the
# whole layer pool.
@functools.partial(jax.jit, donate_argnums=(0,))
def _install(pool: ExpertPool, slot, expert: ExpertPool) -> ExpertPool:
  return jax.tree_util.tree_map(lambda p, e: p.at[slot].set(e[0]), pool, expert)


class DevicePool:
  """One MoE layer's pinned experts on the device: `slots` fixed slots, expert → slot map."""

  def __init__(self, layer: int, slots: int, empty: ExpertPool):
    self.layer = layer
    self.slots = slots
    self.pool = empty  # [S, ...] on device
    self.slot_of: dict[int, int] = {}
    self.expert_in: list[int | None] = [None] * slots

  def __contains__(self, expert: int) -> bool:
    return expert in self.slot_of

  def free_slot(self) -> int | None:
    for s, e in enumerate(self.expert_in):
      if e is None:
        return s
    return None

  def install(self, expert: int, weights: ExpertWeights, slot: int) -> None:
    """Puts `expert` into `slot` (evicting whatever was there)."""
    old = self.expert_in[slot]
    if old is not None:
      del self.slot_of[old]
    one = ExpertPool(*(jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], q)
                       for q in weights))
    self.pool = _install(self.pool, jnp.int32(slot), one)
    self.slot_of[expert] = slot
    self.expert_in[slot] = expert

  def coldest(self, heat: Heat) -> tuple[int, int] | None:
    """(slot, expert) of the least heated pinned expert."""
    live = [(heat[(self.layer, e)], s, e) for s, e in enumerate(self.expert_in) if e is not None]
    if not live:
      return None
    _, s, e = min(live)
    return s, e


def empty_pool(layout, slots: int) -> ExpertPool:
  """A zero-filled device pool of `slots` experts in `layout` (a store `ExpertLayout`)."""
  blob = np.zeros((slots, layout.nbytes), np.uint8)
  e = layout.unpack(blob)
  return ExpertPool(*(jax.tree_util.tree_map(jnp.asarray, q) for q in e))


def as_device_pool(weights: list[ExpertWeights]) -> ExpertPool:
  """Stacks host expert weights into one device pool (the transient working set)."""
  def stack(attr, field):
    return np.stack([getattr(getattr(w, attr), field) for w in weights])

  def q(attr):
    first = getattr(weights[0], attr)
    return type(first)(packed=jnp.asarray(stack(attr, "packed")),
                       scales=jnp.asarray(stack(attr, "scales")), bits=first.bits,
                       group_size=first.group_size, in_features=first.in_features)

  return ExpertPool(q("gate_up"), q("down"))

