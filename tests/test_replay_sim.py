"""Replay: the trace format on disk and the cache simulator, against reference loops written
here (per request, O(capacity) scans, no shared code with glmjax.replay)."""

import itertools
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from glmjax.errors import CheckpointError, InputError
from glmjax.offload import rules
from glmjax.replay import Trace, TraceWriter, simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEVER = float("inf")


# --- references --------------------------------------------------------------------------

def requests(ids, steps, per_token=False):
  """[(layer, sorted expert ids)] in the engine's order: steps, then layers."""
  n, l, _ = ids.shape
  by_step = {}
  for i in range(n):
    by_step.setdefault(i if per_token else int(steps[i]), []).append(i)
  return [(j, sorted({int(e) for i in by_step[s] for e in ids[i, j]}))
          for s in sorted(by_step) for j in range(l)]


def reference(reqs, n_layers, cap, per_layer, policy):
  """Misses of a demand cache, written as plainly as possible."""
  keysets = [{(j, e) for e in u} for j, u in reqs]

  def next_use(key, q):
    """The requests naming `key` after q, then never: Belady keeps the soonest, comparing
    later uses on ties (needed with unions: see test_belady_breaks_ties_by_later_uses)."""
    return tuple(r for r in range(q + 1, len(reqs)) if key in keysets[r]) + (NEVER,)

  caches = [[] for _ in range(n_layers if per_layer else 1)]
  counts = {}
  for ks in keysets:
    for k in ks:
      counts[k] = counts.get(k, 0) + 1
  fixed = []
  for ci in range(len(caches)):
    mine = sorted((k for k in counts if not per_layer or k[0] == ci),
                  key=lambda k: (-counts[k], k))
    fixed.append(set(mine[:cap]))
  last, freq, clock, misses = {}, {}, 0, 0
  for q, (j, u) in enumerate(reqs):
    ci = j if per_layer else 0
    c, keys = caches[ci], [(j, e) for e in u]
    missed = []
    for k in keys:
      clock += 1
      freq[k] = freq.get(k, 0) + 1
      if k in c:
        last[k] = clock
      else:
        missed.append(k)
        if policy == "lfu":
          last[k] = clock
    misses += len(missed)
    if policy == "static":
      c.extend(k for k in missed if k in fixed[ci])
    elif policy == "belady":
      for k in sorted(missed, key=lambda k: next_use(k, q)):
        nk = next_use(k, q)
        if nk[0] == NEVER:
          break
        if len(c) < cap:
          c.append(k)
          continue
        others = [r for r in c if r not in keys]
        if not others:
          break
        far = max(others, key=lambda r: next_use(r, q))
        if next_use(far, q) <= nk:
          break
        c.remove(far)
        c.append(k)
    else:
      for k in missed:
        if len(c) >= cap:
          others = [r for r in c if r not in keys]
          if not others:
            continue
          if policy == "lru":
            victim = min(others, key=lambda r: last[r])
          else:
            victim = min(others, key=lambda r: (freq[r], last[r]))
          c.remove(victim)
        c.append(k)
        if policy == "lru":  # HostCache: misses go in after every hit was touched
          clock += 1
          last[k] = clock
  return misses


def optimum(reqs, cap):
  """Fewest misses of any cache obeying the demand rules (one shared cache): after a request
  the cache may hold any subset of (before ∪ union) of size ≤ cap that keeps the union's
  residents. Exhaustive over states; tiny inputs only."""
  best = {frozenset(): 0}
  for j, u in reqs:
    keys = {(j, e) for e in u}
    nxt = {}
    for s, m in best.items():
      m += len(keys - s)
      keep, free = s & keys, list((s | keys) - (s & keys))
      for r in range(0, cap - len(keep) + 1):
        for extra in itertools.combinations(free, r):
          t = keep | frozenset(extra)
          if m < nxt.get(t, NEVER):
            nxt[t] = m
    best = nxt
  return min(best.values())


def random_trace(seed, n=120, l=2, e=8, k=2, zipf=0.0, group=3):
  rng = np.random.default_rng(seed)
  p = 1.0 / np.arange(1, e + 1) ** zipf
  g = rng.gumbel(size=(n, l, e)) + np.log(p / p.sum())
  ids = np.argsort(-g, axis=-1)[..., :k]  # k distinct ids per row, skewed by zipf
  steps = np.sort(rng.integers(0, n // group + 1, n))  # several positions per step
  return Trace.from_ids(ids, n_experts=e, steps=steps, expert_bytes=10)


# --- the simulator against the references ------------------------------------------------

@pytest.mark.parametrize("policy", ["lru", "lfu", "static", "belady"])
def test_policies_match_reference(policy):
  for seed in range(4):
    t = random_trace(seed, zipf=0.8 * (seed % 2))
    for per_token in (False, True):
      reqs = requests(t.ids, t.steps, per_token)
      for per_layer, cap in [(True, 1), (True, 2), (True, 5), (False, 3), (False, 7)]:
        kw = {"per_layer": cap} if per_layer else {"total": cap}
        r = simulate(t, policy, per_token=per_token, **kw)
        want = reference(reqs, t.n_layers, cap, per_layer, policy)
        assert r["misses"] == want, (seed, per_token, per_layer, cap)
        assert r["requests"] == sum(len(u) for _, u in reqs)
        assert r["hits"] == r["requests"] - want
        assert r["bytes_read"] == 10 * want


def test_lru_matches_the_engine_host_cache():
  from glmjax.offload.rules import HostCache
  t = random_trace(11, n=200, e=10, k=3)
  for cap in (2, 4, 6):
    host, misses = HostCache(cap), 0  # one byte per expert: the budget counts slots
    for j, u in requests(t.ids, t.steps):
      keys = [(j, e) for e in u]
      missed = [k for k in keys if not host.touch(k)]
      misses += len(missed)
      for k in missed:
        host.put(k, 1, protect=set(keys))
    assert simulate(t, "lru", total=cap)["misses"] == misses


def _lru_per_layer_holds(reqs, n_layers, cap):
  """Reference: a separate LRU of `cap` experts per layer, admitting a request's misses in
  union order without evicting a member of the union; yields its contents after each request."""
  held = [[] for _ in range(n_layers)]  # least recently used first
  for j, u in reqs:
    lru = held[j]
    for e in u:
      if e in lru:
        lru.remove(e)
        lru.append(e)
    for e in u:
      if e in lru:
        continue
      if len(lru) >= cap:
        old = [x for x in lru if x not in u]
        if not old:
          continue
        lru.remove(old[0])
      if cap:
        lru.append(e)
    yield j, set(lru)


def test_the_host_cache_holds_what_an_lru_per_layer_holds():
  """The engine's host rule with a share per layer (`layer_quotas`) keeps, after every
  request, at least the experts a separate LRU per layer of that room keeps, at 1, 2 and 4
  slots per layer over more layers than slots, so it hits at least as often; slots that do not
  divide evenly go to the first layers, which then keep more. The rule it replaced (one LRU
  over every layer, no quotas) hits less on the same decode-like traces."""
  from glmjax.offload.rules import HostCache, layer_quotas
  l, mb = 12, 1 << 20
  worse = 0
  for seed in range(3):
    t = random_trace(seed, n=240, l=l, e=16, k=4, group=1)
    reqs = requests(t.ids, t.steps)
    tb = Trace.from_ids(t.ids, n_experts=16, steps=t.steps, expert_bytes=mb)
    for cap in (1, 2, 4):
      for spare in (0, 5):  # whole slots beyond cap per layer, for the first `spare` layers
        budget = cap * l + spare  # one byte per expert: the budget counts slots
        host = HostCache(budget, layer_quotas(budget, range(l), 1, 16)[0])
        for (j, u), (_, want) in zip(reqs, _lru_per_layer_holds(reqs, l, cap)):
          keys = [(j, e) for e in u]
          missed = [k for k in keys if not host.touch(k)]
          for k in missed:
            host.put(k, 1, protect=set(keys))
          held = {e for (jj, e) in host.keys() if jj == j}
          assert want <= held and len(held) <= cap + (j < spare), (seed, cap, spare, j)
        # the engine policy of the simulator runs the same rule, from budgets in GiB
        eng = simulate(tb, "engine", device_cache_gb=0, host_cache_gb=budget * mb / (1 << 30))
        per_layer = simulate(tb, "lru", per_layer=cap)
        assert eng["host_hits"] >= per_layer["hits"] > 0, (seed, cap, spare)
      worse += simulate(tb, "lru", total=cap * l)["hits"] < per_layer["hits"]
  assert worse >= 6  # one LRU over every layer: the cyclic pattern defeats it


def test_belady_is_the_optimum_on_tiny_traces():
  for seed in range(6):
    t = random_trace(seed, n=14, l=1 + seed % 2, e=4, k=2, group=2)
    reqs = requests(t.ids, t.steps)
    for cap in (1, 2, 3):
      assert simulate(t, "belady", total=cap)["misses"] == optimum(reqs, cap), (seed, cap)


def test_belady_breaks_ties_by_later_uses():
  # Experts 2 and 3 are both next needed at step 1; only 3 is needed again (step 2). With one
  # slot, keeping 2 costs a miss at step 2 that keeping 3 avoids, and at step 1 the resident
  # 2 is part of the union, so it cannot be swapped for 3 then.
  t = Trace.from_ids(np.array([[[2, 3]], [[2, 3]], [[0, 3]]]), n_experts=4)
  assert simulate(t, "belady", per_layer=1)["misses"] == 4
  assert simulate(t, "static", per_layer=1)["misses"] == 4
  assert simulate(t, "lru", per_layer=1)["misses"] == 5


def test_cyclic_scan():
  c, n = 4, 200
  ids = (np.arange(n) % (c + 1)).reshape(n, 1, 1)  # c+1 experts, one at a time
  t = Trace.from_ids(ids, n_experts=c + 1)
  assert simulate(t, "lru", per_layer=c)["misses"] == n
  b = simulate(t, "belady", per_layer=c)["misses"]
  assert b == reference(requests(ids, t.steps), 1, c, True, "belady")
  assert abs(b - n / (c + 1)) <= c + 1  # one miss per cycle after the cold start


@pytest.mark.parametrize("zipf", [0.0, 1.2])
def test_belady_bounds_every_demand_policy(zipf):
  for seed in range(3):
    t = random_trace(100 + seed, n=400, l=3, e=16, k=4, zipf=zipf)
    for kw in [{"per_layer": 2}, {"per_layer": 6}, {"per_layer": 12}, {"total": 20}]:
      b = simulate(t, "belady", **kw)["misses"]
      others = {p: simulate(t, p, **kw)["misses"] for p in ("lru", "lfu", "static")}
      assert all(b <= m for m in others.values()), (seed, kw, b, others)
      assert b < max(others.values())  # not vacuous


def test_step_unions():
  t = random_trace(3, n=50, l=3, e=8, k=3)
  got = t.step_unions()
  want = requests(t.ids, t.steps)
  assert len(got) * 3 == len(want)
  assert [u.tolist() for step in got for u in step] == [u for _, u in want]
  assert len(t.step_unions(per_token=True)) == 50


# --- prefetch ----------------------------------------------------------------------------

def tiny(layer0, layer1, pilot1, e=4, **kw):
  """One position per step, two layers, K = len of each row; pilot rows of layer 1."""
  ids = np.stack([np.asarray(layer0), np.asarray(layer1)], 1)
  if ids.ndim == 2:
    ids = ids[..., None]
  p = np.asarray(pilot1).reshape(len(ids), -1)
  pilot = np.stack([np.full_like(p, -1), p], 1)
  return Trace.from_ids(ids, n_experts=e, pilot=pilot, expert_bytes=10, **kw)


def test_perfect_pilot_turns_layer1_misses_into_hits():
  t = tiny([0, 2, 0], [1, 3, 1], [1, 3, 1])
  base = simulate(t, "lru", per_layer=2)
  assert (base["misses"], base["layer_misses"]) == (4, [2, 2])
  r = simulate(t, "lru", per_layer=2, prefetch=("pilot",), pilot_k=1)
  # Steps 0 and 1 prefetch 1 and 3; step 2 finds 1 resident and issues nothing.
  assert r["layer_misses"] == [2, 0] and r["hits"] == 4
  assert (r["prefetch_issued"], r["prefetch_useful"], r["prefetch_wasted"]) == (2, 2, 0)
  assert (r["reads"], r["bytes_read"]) == (4, 40)
  assert simulate(t, "lfu", per_layer=2, prefetch=("pilot",), pilot_k=1)["misses"] == 2


def test_prefetch_wasted():
  # Layer 1 holds one expert. Step 0's prefetch (2) is evicted by the demand miss of 1;
  # step 1's (3) is used; step 2's (0) is never requested.
  t = tiny([0, 0, 0], [1, 3, 3], [2, 3, 0])
  r = simulate(t, "lru", per_layer=1, prefetch=("pilot",), pilot_k=1)
  assert (r["prefetch_issued"], r["prefetch_useful"], r["prefetch_wasted"]) == (3, 1, 2)
  # Layer 1: 1 misses, 3 hits (prefetched), 3 misses again (step 2's prefetch evicted it).
  assert r["layer_misses"] == [1, 2]
  assert r["reads"] == 3 + 3


def test_prefetch_landing_into_free_room_never_evicts():
  """land="free" (the engine's rule): a prefetch enters only a free slot; with the cache full
  it is held for its layer's next request. Layer 1 holds one expert; pilots 2, 3, 0.
  evict: step 0's 2 lands, request 1 evicts it; step 1's 3 evicts 1 and is hit; step 2's 0
  evicts 3, whose request then misses again: 6 reads.
  free: step 0's 2 lands in the empty slot, request 1 evicts it; step 1's 3 finds the slot
  full and is held, request 3 misses and takes it (no second read); step 2's 0 is held and
  wasted, and request 3 hits the expert the guess would have evicted: 5 reads."""
  t = tiny([0, 0, 0], [1, 3, 3], [2, 3, 0])
  kw = dict(per_layer=1, prefetch=("pilot",), pilot_k=1)
  evict = simulate(t, "lru", **kw)  # the default
  free = simulate(t, "lru", land="free", **kw)
  assert evict == simulate(t, "lru", land="evict", **kw)
  assert (evict["reads"], free["reads"]) == (6, 5)
  assert evict["layer_misses"] == free["layer_misses"] == [1, 2]
  for r in (evict, free):
    assert (r["prefetch_issued"], r["prefetch_useful"], r["prefetch_wasted"]) == (3, 1, 2)
  # With room for everything, free and evict land alike.
  roomy = dict(per_layer=4, prefetch=("pilot",), pilot_k=1)
  assert {**simulate(t, "lru", land="free", **roomy), "land": "evict"} == simulate(
      t, "lru", **roomy)
  with pytest.raises(InputError, match="land"):
    simulate(t, "lru", land="drop", **kw)


def test_a_prefetch_with_no_room_serves_the_next_request():
  """As in the engine: with no room to land, a prefetched read is held for layer 1's next
  request, whose miss takes it instead of reading again; one that request does not use is
  wasted."""
  t = tiny([0, 0], [1, 2], [1, 3])
  r = simulate(t, "lru", per_layer=0, prefetch=("pilot",), pilot_k=1)
  # Every request misses. Reads: layer 0's two, the two prefetches, and step 1's expert 2
  # (step 0's expert 1 came with its prefetch).
  assert (r["misses"], r["reads"]) == (4, 5)
  assert (r["prefetch_issued"], r["prefetch_useful"], r["prefetch_wasted"]) == (2, 1, 1)
  late = simulate(t, "lru", per_layer=0, prefetch=("pilot",), pilot_k=1, io_per_layer=0)
  assert (late["reads"], late["prefetch_late"], late["prefetch_useful"]) == (5, 1, 0)


def test_prefetch_late_beyond_io_budget():
  t = tiny([[0, 1]], [[2, 3]], [[2, 3]])
  r = simulate(t, "lru", per_layer=4, prefetch=("pilot",), pilot_k=2, io_per_layer=10)
  # Expert 2 arrives in time, 3 (the second 10-byte read) late: a miss without a second read.
  assert (r["hits"], r["misses"], r["reads"]) == (1, 3, 4)
  assert (r["prefetch_late"], r["prefetch_useful"], r["prefetch_wasted"]) == (1, 1, 0)
  r = simulate(t, "lru", per_layer=4, prefetch=("pilot",), pilot_k=2, io_per_layer=20)
  assert (r["hits"], r["prefetch_late"]) == (2, 0)


def test_mass_prefetch():
  t = tiny([[0]], [[3]], [[3, 2, 1, 0]])
  t.pilot_scores[0, 1] = [2.0, 1.0, 0.0, -5.0]  # softmax ≈ .665 .245 .090 .001
  for mass, issued in [(0.5, 1), (0.8, 2), (0.95, 3), (1.0, 4)]:
    r = simulate(t, "lru", per_layer=4, prefetch=("mass",), mass=mass)
    assert r["prefetch_issued"] == issued, mass
    assert r["prefetch_useful"] == 1 and r["prefetch_wasted"] == issued - 1


def test_couple_prefetch_learns_online():
  """Layer 0 cycles through experts 0, 2, 4, 6 and layer 1 always follows with the next id:
  four pairs, each seen once a cycle, 40 cycles. A pair predicts once it has been seen
  COUPLE_MIN times and stands out from chance, and is then always right; one slot a layer, so
  without prefetch layer 1 misses every step."""
  l0 = [0, 2, 4, 6] * 40
  t = tiny(l0, [e + 1 for e in l0], [0] * 160, e=8)
  r = simulate(t, "lru", per_layer=1, prefetch=("couple",), couple_k=1)
  issued = r["prefetch_issued"]
  assert 0 < issued <= 4 * (40 - rules.COUPLE_MIN)
  assert (r["prefetch_useful"], r["prefetch_wasted"]) == (issued, 0)
  assert r["layer_misses"] == [160, 160 - issued]
  assert simulate(t, "lru", per_layer=1)["layer_misses"] == [160, 160]


def test_verify_prefetch_fetches_the_pilot_union_of_verify_passes():
  """Step 0 is a prefill, steps 1 and 2 verify passes of a token and one draft. Under "verify"
  only the verify passes prefetch, each the union of its positions' pilot top-1."""
  steps = np.array([0, 0, 1, 1, 2, 2])
  t = tiny([0, 0, 0, 0, 0, 0], [1, 2, 1, 3, 2, 3], [1, 2, 1, 3, 2, 3], steps=steps,
           live={"verify": [{"step": 1, "drafts": 1, "accepted": 1},
                            {"step": 2, "drafts": 1, "accepted": 0}]})
  r = simulate(t, "lru", per_layer=3, prefetch=("verify",), pilot_k=1)
  # The prefill misses 1 and 2; step 1 wants {1, 3} and fetches 3; step 2 finds {2, 3} held.
  assert (r["prefetch_issued"], r["prefetch_useful"]) == (1, 1)
  assert r["layer_misses"] == [1, 2]
  assert simulate(t, "lru", per_layer=3)["layer_misses"] == [1, 3]
  # Where every step is a verify pass, "verify" is "pilot"; where none carries drafts, nothing.
  every = dict(t.live, verify=[{"step": s, "drafts": 1, "accepted": 0} for s in range(3)])
  t_all = tiny([0] * 6, [1, 2, 1, 3, 2, 3], [1, 2, 1, 3, 2, 3], steps=steps, live=every)
  strip = lambda r: {k: v for k, v in r.items() if k != "prefetch"}
  assert strip(simulate(t_all, "lru", per_layer=2, prefetch=("verify",), pilot_k=1)) == strip(
      simulate(t_all, "lru", per_layer=2, prefetch=("pilot",), pilot_k=1))
  none = {"verify": [{"step": s, "drafts": 0, "accepted": 0} for s in range(3)]}
  t_none = tiny([0] * 6, [1, 2, 1, 3, 2, 3], [1, 2, 1, 3, 2, 3], steps=steps, live=none)
  assert strip(simulate(t_none, "lru", per_layer=2, prefetch=("verify",), pilot_k=1)) == strip(
      simulate(t_none, "lru", per_layer=2))
  with pytest.raises(InputError, match="live speculative trace"):
    simulate(tiny([0], [1], [1]), "lru", per_layer=2, prefetch=("verify",))


def test_a_registered_policy_plugs_in():
  from glmjax.replay import POLICIES, Policy, register

  @register("test_fifo")
  class Fifo(Policy):  # first in, first out; counts its own evictions
    def __init__(self, capacity, stream, layers):
      super().__init__(capacity, stream, layers)
      self.q, self.evictions, self.steps = [], 0, 0

    def __contains__(self, key):
      return key in self.q

    def __len__(self):
      return len(self.q)

    def access(self, keys, q):
      return [k in self.q for k in keys]

    def admit(self, keys, q, protect, prefetch=False):
      out = []
      for k in keys:
        if len(self.q) >= self.capacity:
          v = next((v for v in self.q if v not in protect), None)
          if v is None:
            continue
          self.q.remove(v)
          out.append(v)
        self.q.append(k)
      self.evictions += len(out)
      return out

    def end_step(self, step):
      self.steps += 1

    def stats(self):
      return {"evictions": self.evictions, "seen_steps": self.steps}

  try:
    t = Trace.from_ids((np.arange(12) % 3).reshape(6, 2, 1), n_experts=3)  # 0 1 / 2 0 / 1 2
    r = simulate(t, "test_fifo", per_layer=1)
    assert (r["misses"], r["evictions"], r["seen_steps"]) == (12, 10, 12)  # 2 caches × 6
    r = simulate(t, "test_fifo", total=6)
    assert (r["misses"], r["evictions"], r["seen_steps"]) == (6, 0, 6)
  finally:
    del POLICIES["test_fifo"]


# --- bad calls ---------------------------------------------------------------------------

def test_bad_calls(tmp_path):
  t = random_trace(0)
  with pytest.raises(InputError, match="exactly one"):
    simulate(t, "lru", per_layer=2, total=4)
  with pytest.raises(InputError, match="exactly one"):
    simulate(t, "lru")
  with pytest.raises(InputError, match="unknown policy"):
    simulate(t, "fifo", per_layer=2)
  with pytest.raises(InputError, match="takes no prefetch"):
    simulate(t, "belady", per_layer=2, prefetch=("couple",))
  with pytest.raises(InputError, match="pilot"):
    simulate(t, "lru", per_layer=2, prefetch=("pilot",))  # recorded without pilot
  with pytest.raises(InputError):
    Trace.from_ids(np.array([[[0, 9]]]), n_experts=4)
  with pytest.raises(CheckpointError, match="missing"):
    Trace.open(str(tmp_path / "missing"))


# --- the format on disk ------------------------------------------------------------------

def full_trace(n=37, l=3, k=4, e=16, m=6, p=5, seed=0):
  rng = np.random.default_rng(seed)
  ids = np.argsort(rng.random((n, l, e)), -1)
  pilot = ids[..., :p].copy()
  pilot[:, 0] = -1
  return Trace.from_ids(
      ids[..., :k], n_experts=e, weights=rng.random((n, l, k)), tokens=rng.integers(0, 999, n),
      steps=np.arange(n) // 2, seq_starts=[0, n // 3, n], scores=rng.random((n, l, m)),
      score_ids=ids[..., :m], pilot=pilot, pilot_scores=rng.random((n, l, p)),
      expert_bytes=12345, moe_layers=[1, 2, 3], config={"n_routed_experts": e},
      options={"pilot": True}, live={"mtp_draft": [3, 4], "heat": [0.5, 1.5]})


ARRAYS = ["ids", "weights", "tokens", "steps", "seq_starts", "scores", "score_ids", "pilot",
          "pilot_scores"]


def plain_read(path):
  import tensorstore as ts
  return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}
                 ).result().read().result()


def test_save_reads_back_with_plain_tensorstore(tmp_path):
  t = full_trace()
  t.save(str(tmp_path / "tr"))
  for name in ARRAYS:
    got = plain_read(str(tmp_path / "tr" / name))
    assert got.dtype == getattr(t, name).dtype
    np.testing.assert_array_equal(got, getattr(t, name), err_msg=name)
  u = Trace.open(str(tmp_path / "tr"))
  for name in ARRAYS:
    np.testing.assert_array_equal(getattr(u, name), getattr(t, name), err_msg=name)
  assert u.manifest() == t.manifest()
  with open(tmp_path / "tr" / "trace.json") as f:
    assert json.load(f)["live"] == {"mtp_draft": [3, 4], "heat": [0.5, 1.5]}
  assert (u.n_positions, u.n_layers, u.top_k, u.n_experts) == (37, 3, 4, 16)
  assert sorted(os.listdir(tmp_path)) == ["tr"]  # no temporary left beside it
  with pytest.raises(InputError, match="already exists"):
    t.save(str(tmp_path / "tr"))


def test_trace_writer_appends_equal_the_concatenation(tmp_path):
  t = full_trace(n=23)
  m = t.manifest()
  path = str(tmp_path / "w")
  cuts = [0, 3, 4, 10, 18, 23]  # 5 appends, capacity 5 forces growth, 4-row chunks
  with TraceWriter(path, m, capacity=5, M=6, P=5, chunk_rows=4) as w:
    for a, b in zip(cuts[:-1], cuts[1:]):
      w.append(**{n: getattr(t, n)[a:b] for n in ARRAYS if n != "seq_starts"})
      if b in (10, 18):
        w.end_sequence()
    with pytest.raises(InputError, match="ids must be"):
      w.append(ids=t.ids[:2, :2], weights=t.weights[:2], tokens=t.tokens[:2],
               steps=t.steps[:2], scores=t.scores[:2], score_ids=t.score_ids[:2],
               pilot=t.pilot[:2], pilot_scores=t.pilot_scores[:2])
    assert not os.path.exists(path)  # only the temporary exists until close
  u = Trace.open(path)
  for name in ARRAYS[:-1]:
    if name != "seq_starts":
      np.testing.assert_array_equal(getattr(u, name), getattr(t, name), err_msg=name)
  np.testing.assert_array_equal(u.seq_starts, [0, 10, 18, 23])
  assert plain_read(os.path.join(path, "ids")).shape == (23, 3, 4)  # shrunk: no padding
  assert u.live == t.live and u.moe_layers == [1, 2, 3]


def test_interrupted_writer_leaves_nothing(tmp_path):
  t = full_trace(n=9)
  path = str(tmp_path / "w")
  with pytest.raises(RuntimeError):
    with TraceWriter(path, t.manifest(), capacity=100) as w:
      w.append(ids=t.ids, weights=t.weights, tokens=t.tokens, steps=t.steps)
      raise RuntimeError("killed")
  assert os.listdir(tmp_path) == []


def test_open_reports_damaged_traces(tmp_path):
  t = full_trace(n=9)
  for damage, match in [("manifest", "no trace.json"), ("array", "'weights'.*missing"),
                        ("shape", "ids.*does not match")]:
    path = tmp_path / damage
    t.save(str(path))
    if damage == "manifest":
      os.remove(path / "trace.json")
    elif damage == "array":
      shutil.rmtree(path / "weights")
    else:
      m = json.loads((path / "trace.json").read_text())
      m["top_k"] = 2
      (path / "trace.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=match):
      Trace.open(str(path))


# --- the script ----------------------------------------------------------------------------

def test_simulate_script(tmp_path):
  random_trace(5, n=200, l=2, e=8, k=2).save(str(tmp_path / "tr"))
  script = os.path.join(ROOT, "scripts", "simulate.py")
  r = subprocess.run([sys.executable, script, f"--trace={tmp_path / 'tr'}",
                      f"--out={tmp_path / 'out'}"], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  with open(tmp_path / "out" / "simulate.json") as f:
    records = json.load(f)["records"]
  got = {(x["policy"], x["capacity"]) for x in records}
  assert got == {(p, c) for p in ("lru", "lfu", "belady", "static") for c in (1, 2, 4, 8)}
  with open(tmp_path / "out" / "hit_rate.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  r = subprocess.run([sys.executable, script, f"--trace={tmp_path / 'nope'}",
                      f"--out={tmp_path / 'out2'}"], capture_output=True, text=True, timeout=120)
  assert r.returncode == 2
  assert "Traceback" not in r.stderr and r.stderr.strip().startswith("error:")
  assert len(r.stderr.strip().splitlines()) == 1
