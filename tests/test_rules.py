"""The prefetch rules are written once (glmjax.offload.rules): the offload engine and the replay
simulator reach each of them through the same function, and agree on its outcome (the tier
rules' test is tests/test_replay.py::test_the_engine_and_its_simulator_share_the_tier_rules)."""

import collections
import concurrent.futures as cf
import importlib
import json
import os

import jax.numpy as jnp
import numpy as np

import glmjax
from glmjax.offload import prefetch, rules
from glmjax.offload.expert_io import PILOT
from glmjax.replay import Trace, simulate

GB = 1 << 30
# the module (the package exports the function `simulate` under the same name)
SIM = importlib.import_module("glmjax.replay.simulate")


def test_the_prefetcher_and_its_simulator_share_landing_and_expiry(embedded_store, monkeypatch):
  """With the cache full, a prediction of two experts of a layer lands nowhere (`land_free`),
  the layer's next step takes the one it uses (`PrefetchLedger.take`, useful) and drops the
  other (`PrefetchLedger.expire`, wasted): in the engine and in the simulator (land="free"),
  through the same functions, with the same outcomes."""
  assert prefetch.land_free is SIM.land_free is rules.land_free
  assert prefetch.PrefetchLedger is SIM.PrefetchLedger is rules.PrefetchLedger
  seen = []  # (who, rule, outcome in expert ids)
  land_free, take, expire = rules.land_free, rules.PrefetchLedger.take, rules.PrefetchLedger.expire

  def expert(key):  # the engine's keys are (layer, expert), the simulator's j·E + expert
    return key[1] if isinstance(key, tuple) else key % 4

  def spy_land(keys, room, store):
    held = land_free(keys, room, store)
    if held:
      seen.append(("land_free", sorted(expert(k) for k in held)))
    return held

  def spy_take(self, key, outcome):
    seen.append(("take", expert(key), outcome))
    return take(self, key, outcome)

  def spy_expire(self, layer, outcome=lambda handle: "wasted"):
    gone = expire(self, layer, outcome)
    if gone:
      seen.append(("expire", sorted(expert(k) for k, _ in gone)))
    return gone

  for module in (prefetch, SIM):
    monkeypatch.setattr(module, "land_free", spy_land)
  monkeypatch.setattr(rules.PrefetchLedger, "take", spy_take)
  monkeypatch.setattr(rules.PrefetchLedger, "expire", spy_expire)

  # The engine: layer L's host cache full with experts 0 and 1; 2 and 3 predicted; the step
  # uses 0, 1, 2 and 4 (its lookups land what has room: nothing). The host cache gives every
  # main layer an equal share: two chunks each.
  with open(os.path.join(embedded_store, "manifest.json")) as f:
    manifest = json.load(f)
  chunk = manifest["experts"]["main"]["layout"]["nbytes"]
  with glmjax.load(embedded_store, progress=False, device_cache_gb=0,
                   host_cache_gb=2 * chunk * len(manifest["moe_layers"]) / GB) as m:
    eng = m.engine
    layer = eng.moe_layers[0]
    for x in (0, 1):
      eng.tiers.put_host((layer, x), eng.store.read_chunk(layer, x))
    eng.tiers.slabs.flush()
    eng.prefetcher.pilot_k = eng.prefetcher.couple_k = 0  # the step predicts nothing more
    eng.hint(layer, [2, 3], PILOT)
    cf.wait([eng.prefetcher.inflight[(layer, g)][0] for g in (2, 3)])
    k = m.config.num_experts_per_tok
    ids = jnp.asarray([[2, 0, 1, *range(4, 4 + k - 3)]] * 4, jnp.int32)[:, :k]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, m.config.hidden_size)),
                    jnp.float32)
    from glmjax.model.forward import Routed
    list(eng.provider.tiered(layer, eng.dense.layers[layer].mlp, [Routed(x[None], x, ids)]))
  engine_seen = list(seen)
  seen.clear()

  # The simulator: layer 1 holds two experts, 0 and 1 (step 0); step 1's pilot predicts 2 and
  # 3 for layer 1, whose request uses 0 and 2.
  ids = np.asarray([[[0, 1], [0, 1]], [[0, 1], [0, 2]]])
  pilot = np.full((2, 2, 2), -1)
  pilot[1, 1] = [2, 3]
  t = Trace.from_ids(ids, n_experts=4, pilot=pilot, expert_bytes=10)
  r = simulate(t, "lru", per_layer=2, prefetch=("pilot",), pilot_k=2, land="free")
  assert engine_seen == seen == [("land_free", [2, 3]), ("take", 2, "useful"),
                                     ("expire", [3])]
  assert (r["prefetch_issued"], r["prefetch_useful"], r["prefetch_wasted"]) == (2, 1, 1)


def test_only_the_reads_the_last_landing_held_expire():
  """`PrefetchLedger.expire` drops a layer's pending reads that the last landing held
  (`hold`), and no other: not a read issued since (it has not had its landing yet), not
  another layer's, not a key the landing held that was taken and read again since."""
  stats = collections.Counter()
  ledger = rules.PrefetchLedger(stats, layer_of=lambda key: key[0])
  for key in [(0, 1), (0, 2), (0, 3), (1, 1)]:
    ledger.issue(key, handle=key)
  ledger.hold(rules.land_free([(0, 1), (0, 2), (1, 1)], lambda key: False, None))
  ledger.issue((0, 4), handle=(0, 4))  # after the landing
  assert ledger.take((0, 2), "useful") == (0, 2)  # the step's miss takes it...
  ledger.issue((0, 2), handle="again")  # ...and a later read of it is a new one
  gone = ledger.expire(0)
  assert gone == [((0, 1), (0, 1))]
  assert set(ledger.pending) == {(0, 2), (0, 3), (0, 4), (1, 1)}
  assert (stats["prefetch_wasted"], stats["prefetch_useful"], stats["prefetch_issued"]) == (1, 1, 6)
  ledger.hold([(0, 3)])  # the next landing replaces the held set
  assert ledger.expire(1) == [] and [k for k, _ in ledger.expire(0)] == [(0, 3)]


def _couple_reference(table, union, k):
  """couple_top as loops in float64: a pair counts when seen COUPLE_MIN times and its count is
  COUPLE_LIFT times and COUPLE_SIGMA Poisson deviations above row total × column total / total;
  the next-layer experts by their counted pairs' sum, the k highest, ties by the lower id."""
  n = len(table)
  total = float(sum(map(sum, table)))
  if total == 0:
    return []
  scores = []
  for b in range(n):
    score = 0.0
    for a in union:
      expected = sum(table[a]) * sum(table[r][b] for r in range(n)) / total
      c = table[a][b]
      if (c >= rules.COUPLE_MIN and c >= rules.COUPLE_LIFT * expected
          and c - expected >= rules.COUPLE_SIGMA * expected ** 0.5):
        score += c
    if score > 0:
      scores.append((-score, b))
  return [b for _, b in sorted(scores)[:k]]


def test_couple_hints_only_associated_experts():
  """Counts learned from independent routing (top-8 of 16, as the depth stores route, and of
  256, GLM-5's) hint nothing, however many tokens; with 64 planted pairs (GLM-5's width, the
  partner follows half the times), only partners of the union's experts are hinted, and most
  are; and the rule equals its float64 loop reference on random tables."""
  rng = np.random.default_rng(0)
  for e, seen in ((16, (5, 100, 1000)), (256, (100, 1000, 2000))):
    table = np.zeros((e, e), np.int64)
    for n in range(1, seen[-1] + 1):
      rules.learn_couple(table, rng.choice(e, 8, replace=False), rng.choice(e, 8, replace=False))
      if n in seen:
        assert not any(rules.couple_top(table, rng.choice(e, 8, replace=False), 8)
                       for _ in range(40)), (e, n)
  partner = {e: (e * 37 + 11) % 256 for e in range(0, 256, 4)}
  table, hinted, wanted = np.zeros((256, 256), np.int64), 0, 0
  for n in range(3000):
    prev = rng.choice(256, 8, replace=False)
    if n >= 2000:
      hints = set(rules.couple_top(table, prev, 8))
      assert hints <= {partner[e] for e in prev if e in partner}
      hinted, wanted = hinted + len(hints), wanted + sum(e in partner for e in prev)
    forced = {partner[e] for e in prev if e in partner and rng.random() < 0.5}
    rest = [e for e in rng.permutation(256) if e not in forced][:8 - len(forced)]
    rules.learn_couple(table, prev, np.asarray(sorted(forced | set(rest))))
  assert hinted >= 0.9 * wanted > 0
  for _ in range(50):
    t = rng.integers(0, 60, (8, 8)) * (rng.random((8, 8)) < 0.3) + rng.integers(0, 3, (8, 8))
    u = rng.choice(8, int(rng.integers(1, 5)), replace=False)
    assert rules.couple_top(t, u, 3) == _couple_reference(t.tolist(), u.tolist(), 3)
  assert rules.couple_top(np.zeros((4, 4)), [0, 1], 2) == []
