"""The engine's own tier rules replayed over a trace: `policy="engine"` (pin tier + host LRU,
exactly as glmjax.offload.engine applies them) and `policy="lfru"` (the pin rule alone, as a
cache of `capacity` slots for the capacity sweeps).

Both run the engine's rules (glmjax.offload.rules: `TierRules`, `HostCache`, `PinSlots`,
`lfru_admissions`; `Heat`), not copies of them, so a change to the engine's policy changes the
simulator with it.
"""

from __future__ import annotations


from glmjax.errors import InputError
from glmjax.offload.rules import (HostCache, LayerUse, PinSlots, TierRules, layer_quotas,
                                  lfru_admissions)
from glmjax.offload.tiers import Heat
from glmjax.replay.policies import Policy, register
from glmjax.replay.trace import Trace

GiB = 1 << 30


def _heat(state: dict) -> Heat:
  heat = Heat({tuple(int(x) for x in k.split("/")): float(v)
               for k, v in state.get("heat", {}).items()})
  heat.scale = float(state.get("heat_scale", 1.0))
  return heat


def simulate_engine(trace: Trace, *, device_cache_gb: float | None = None,
                    host_cache_gb: float | None = None, per_token: bool = False) -> dict:
  """The engine's tiers over `trace` with prefetch off: returns `pin_hits`, `host_hits`,
  `misses`, `hits`, `bytes_read`, `repins`, `requests`, `hit_rate`.

  Budgets default to the live run's (`trace.live["initial"]`, written by
  `Model.generate(trace=...)` on an offloaded model); with those budgets the run starts from the
  recorded pinned sets, host LRU order and heat, and its counters equal the live run's
  `expert_pin_hits`, `expert_host_hits` and `expert_misses`. Other budgets start as a fresh
  engine would: pins chosen from the recorded heat, the host cache empty.
  """
  init = trace.live.get("initial")
  if init is None and (device_cache_gb is None or host_cache_gb is None):
    raise InputError("policy 'engine' needs device_cache_gb= and host_cache_gb=, or a live "
                     "trace (Model.generate(trace=...) on an offloaded model)")
  init = init or {}
  chunk = int(trace.expert_bytes)
  if chunk <= 0:
    raise InputError("policy 'engine' needs a trace with expert_bytes > 0 (an offloaded run)")
  dev_bytes = init.get("device_bytes") if device_cache_gb is None else int(device_cache_gb * GiB)
  host_bytes = init.get("host_bytes") if host_cache_gb is None else int(host_cache_gb * GiB)
  layers, n_exp = list(trace.moe_layers), trace.n_experts
  slots = min(n_exp, dev_bytes // max(1, chunk * len(layers)))
  same = (dev_bytes, host_bytes) == (init.get("device_bytes"), init.get("host_bytes"))
  heat = _heat(init)
  pins = {l: PinSlots(l, slots) for l in layers} if slots else {}
  # the live run's shares of the host cache (its MTP layer's included), else an even split
  host_bytes = 0 if slots == n_exp else host_bytes
  quotas = ({int(l): int(q) for l, q in init["host_quotas"].items()}
            if same and "host_quotas" in init else layer_quotas(host_bytes, layers, chunk, n_exp)[0])
  host = HostCache(host_bytes, quotas)
  if same:  # the live run's starting point
    for l, experts in init.get("pins", {}).items():
      for s, e in enumerate(experts):
        if e is not None and int(l) in pins:
          pins[int(l)].assign(int(e), s)
    for key in init.get("host", []):
      host.put(tuple(key), chunk)
  else:  # a fresh engine: the hottest experts pinned by rank
    for l in pins:
      for s, e in enumerate(heat.hottest(l, slots, n_exp)):
        pins[l].assign(e, s)
  rules = TierRules(pins, host, heat, chunk)  # the engine's lookups and end-of-step updates
  all_resident = slots == n_exp
  for unions in trace.step_unions(per_token):
    for layer, union in zip(layers, unions):
      union = [int(e) for e in union]
      if all_resident:  # the engine runs one jit and counts nothing; every use is pinned
        rules.stats["expert_pin_hits"] += len(union)
        continue
      rules.fold(LayerUse(layer, union, union, *rules.lookup(layer, union)))
    if not all_resident:
      heat.decay()
  c = {name: rules.stats[key] for name, key in (("pin_hits", "expert_pin_hits"), (
      "host_hits", "expert_host_hits"), ("misses", "expert_misses"), ("repins", "repins"))}
  hits = c["pin_hits"] + c["host_hits"]
  requests = hits + c["misses"]
  return {**c, "policy": "engine", "hits": hits, "requests": requests,
          "hit_rate": hits / requests if requests else 0.0, "bytes_read": c["misses"] * chunk,
          "expert_bytes": chunk, "slots_per_layer": slots, "host_bytes": host_bytes}


@register("lfru")
class LFRU(Policy):
  """The engine's pin rule as a cache: decayed-use heat (decay per step), a free slot first,
  else the coldest resident (lowest slot on ties) is replaced only when the candidate's heat
  beats it by the hysteresis (`should_repin`); never a member of the union being served."""

  def __init__(self, capacity, stream, layers):
    super().__init__(capacity, stream, layers)
    self.heat = Heat()
    self.slots = PinSlots(0, int(capacity))

  def __contains__(self, key):
    return key in self.slots

  def __len__(self):
    return len(self.slots.slot_of)

  def access(self, keys, q):
    self.heat.use(0, keys)
    return [k in self.slots for k in keys]

  def admit(self, keys, q, protect, prefetch=False):
    evicted = []
    union = {k for k in protect} if protect else set()
    for k, slot, _ in lfru_admissions(self.slots, self.heat, union, keys):
      old = self.slots.expert_in[slot]
      if old is not None:
        evicted.append(old)
      self.slots.assign(k, slot)
    return evicted

  def end_step(self, step):
    self.heat.decay()
