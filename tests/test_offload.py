"""The offload engine: bitwise determinism across budgets, accounting, cache rules, faults, memory."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import glmjax
from glmjax.errors import InputError
from glmjax.offload.expert_io import ExpertIOError
from glmjax.offload.rules import REPIN_MARGIN, REPIN_RATIO, HostCache, should_repin
from hf_reference import make_hf, tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1 << 30
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def convert(src, dst):
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "convert.py"), f"--src={src}",
                      f"--dst={dst}", ], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def store(tmp_path_factory):
  base = tmp_path_factory.mktemp("offload")
  make_hf(str(base / "hf"), seed=31, std=0.05, n_routed_experts=16, num_experts_per_tok=4,
          hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, index_topk=6,
          n_group=2, topk_group=2, indexer_types=["full", "shared", "full", "shared"])
  convert(str(base / "hf"), str(base / "store"))
  m = json.load(open(base / "store" / "manifest.json"))
  chunk = m["experts"]["main"]["layout"]["nbytes"]
  return str(base / "store"), chunk, len(m["moe_layers"])


def budgets(chunk, layers):
  """(device_cache_gb, host_cache_gb) from nothing cached up to everything resident."""
  slot = layers * chunk / GB  # one device slot in every MoE layer
  return [(0, 0), (2 * slot, 0), (0, 5 * chunk / GB), (3 * slot, 6 * chunk / GB), (0, 1.0),
          (16 * slot, 0)]


@pytest.fixture(scope="module")
def reference(store):
  path, _, _ = store
  model = glmjax.load(path, progress=False)  # automatic budgets: all resident here
  assert model.engine.all_resident
  return model.score(tokens(1, 2, 13)), model.generate(PROMPT, 10, stop_ids=[]).tokens


def test_bitwise_deterministic_across_budgets(store, reference):
  path, chunk, layers = store
  ref_logits, ref_tokens = reference
  seen = set()
  for dev, host in budgets(chunk, layers):
    model = glmjax.load(path, progress=False, device_cache_gb=dev, host_cache_gb=host)
    seen.add((model.engine.slots, model.engine.host.budget, model.engine.all_resident))
    np.testing.assert_array_equal(model.score(tokens(1, 2, 13)), ref_logits)
    assert model.generate(PROMPT, 10, stop_ids=[]).tokens == ref_tokens
  assert len(seen) == 6  # the budgets really exercised different tier configurations


def test_io_timing_does_not_change_results(store, reference):
  """Reads that complete slowly and out of order give the same bits."""
  path, _, _ = store
  model = glmjax.load(path, progress=False, device_cache_gb=0, host_cache_gb=0, io_workers=3)
  read = model.engine.reader.read_fn
  rng = np.random.default_rng(0)

  def jittery(layer, expert):
    time.sleep(float(rng.random()) * 0.003)
    return read(layer, expert)

  model.engine.reader.read_fn = jittery
  np.testing.assert_array_equal(model.score(tokens(1, 2, 13)), reference[0])


def test_accounting(store):
  path, chunk, layers = store
  model = glmjax.load(path, progress=False, device_cache_gb=2 * layers * chunk / GB,
                      host_cache_gb=4 * chunk / GB, prefetch=False)
  s = model.generate(PROMPT, 8, stop_ids=[]).stats
  used = s["experts_used"]
  assert used > 0 and s["expert_pin_hits"] + s["expert_host_hits"] + s["expert_misses"] == used
  assert s["expert_bytes_read"] == s["expert_misses"] * chunk
  per_layer = sum(v for k, v in s.items() if k.startswith("misses_layer_"))
  assert per_layer == s["expert_misses"]
  assert s["io_service_s"] > 0 and s["io_wait_s"] >= 0 and s["decode_tok_s"] > 0


def test_host_cache_everything_second_run_reads_nothing(store):
  path, _, _ = store
  # Prefetch off: a hint of the first run landing during the second would count there.
  model = glmjax.load(path, progress=False, device_cache_gb=0, host_cache_gb=1.0, prefetch=False)
  first = model.generate(PROMPT, 8, stop_ids=[]).stats
  second = model.generate(PROMPT, 8, stop_ids=[]).stats
  assert first["expert_misses"] > 0
  assert second["expert_misses"] == 0 and second["expert_bytes_read"] == 0
  assert second["expert_host_hits"] == second["experts_used"]


def test_zero_budget_reads_every_expert_it_uses(store):
  path, chunk, _ = store
  model = glmjax.load(path, progress=False, device_cache_gb=0, host_cache_gb=0)
  for _ in range(2):
    s = model.generate(PROMPT, 6, stop_ids=[]).stats
    assert s["expert_misses"] == s["experts_used"] and s["expert_bytes_read"] == s["experts_used"] * chunk


def test_lru_order():
  c = HostCache(3 * 10)
  for k in "abc":
    c.put(k, 10)
  assert c.keys() == ["a", "b", "c"]
  assert c.touch("a")  # a becomes most recent
  assert c.put("d", 10) == ["b"]  # evicts the least recent: b
  assert c.keys() == ["c", "a", "d"] and "b" not in c and c.used == 30
  assert c.put("e", 10, protect={"c"}) == ["a"]  # the protected least recent one stays
  assert c.put("huge", 31) == []  # larger than the budget: not cached, nothing evicted
  assert c.keys() == ["c", "d", "e"] and "huge" not in c
  assert not HostCache(0).touch("x")


def test_lfru_hysteresis():
  # Needs more than 25% + 4 uses over the incumbent to swap.
  assert not should_repin(10.0 * REPIN_RATIO + REPIN_MARGIN, 10.0)
  assert should_repin(10.0 * REPIN_RATIO + REPIN_MARGIN + 0.01, 10.0)
  assert not should_repin(4.0, 0.0) and should_repin(4.5, 0.0)


def test_lfru_repins_a_hot_expert(store):
  """A device tier of 1 slot holding an expert the prompt does not use: a hot one replaces it."""
  path, chunk, layers = store
  # Prefetch off: a landed prefetch may take the free slot first, which timing decides.
  model = glmjax.load(path, progress=False, device_cache_gb=layers * chunk / GB, host_cache_gb=0,
                      prefetch=False)
  eng = model.engine
  layer = eng.moe_layers[0]
  model.generate(PROMPT, 8, stop_ids=[])
  # Pin an expert this prompt never uses: the hot ones must replace it.
  cold = min(range(16), key=lambda e: (eng.heat[(layer, e)], e))
  eng.device[layer].install(cold, eng.store.read(layer, cold), 0)
  eng.heat.h[(layer, cold)] = 0.0
  s = model.generate(PROMPT, 24, stop_ids=[]).stats
  assert s.get("repins", 0) >= 1 and eng.device[layer].expert_in[0] != cold
  pinned = eng.device[layer].expert_in[0]
  # Whatever sits in the slot is never beaten by the hysteresis rule by a colder expert.
  for e in range(16):
    if e != pinned:
      assert not should_repin(eng.heat[(layer, e)], eng.heat[(layer, pinned)])


def test_failed_read_names_layer_and_expert(store):
  path, _, _ = store
  model = glmjax.load(path, progress=False, device_cache_gb=0, host_cache_gb=0)
  read = model.engine.reader.read_fn

  def faulty(layer, expert):
    if expert == 3 or expert == 7:
      raise OSError(5, "Input/output error")
    return read(layer, expert)

  model.engine.reader.read_fn = faulty
  with pytest.raises(ExpertIOError, match=r"layer \d+ expert (3|7) failed.*Input/output error"):
    model.score(tokens(1, 2, 13))
  model.engine.reader.read_fn = read  # the engine keeps working after a failed request
  assert model.score(tokens(1, 1, 5)).shape == (1, 5, 96)


def test_stalled_read_times_out(store):
  import threading
  path, _, _ = store
  model = glmjax.load(path, progress=False, device_cache_gb=0, host_cache_gb=0, io_timeout_s=0.5)
  never = threading.Event()
  model.engine.reader.read_fn = lambda layer, expert: never.wait() and None
  t0 = time.perf_counter()
  try:
    with pytest.raises(ExpertIOError,
                       match=r"layer \d+ expert \d+ did not complete within 0.5 s"):
      model.score(tokens(1, 1, 5))
    assert time.perf_counter() - t0 < 10
  finally:  # the stalled reads return, so the engine's threads end with the model
    never.set()
    model.close()


def test_budget_refusals(store):
  path, chunk, layers = store
  with pytest.raises(InputError, match="holds no expert"):
    glmjax.load(path, progress=False, device_cache_gb=chunk / GB)
  with pytest.raises(InputError, match=r"does not fit(.|\n)*host expert cache +1000000\.000 GB"):
    glmjax.load(path, progress=False, device_cache_gb=0, host_cache_gb=1e6)
  with pytest.raises(InputError, match="≥ 0"):
    glmjax.load(path, progress=False, host_cache_gb=-1)


# Peak RSS growth of one engine per budget, measured after a warm-up engine has compiled every
# step shape at that budget (compilation peaks would otherwise dominate), by resetting the peak
# (VmHWM) through /proc/self/clear_refs. One process measures the budgets in the order given,
# each warm-up and measured engine closed and freed before the next, and the C heap's free
# memory handed back to the system (malloc_trim) before each measurement: memory an earlier run
# left in the allocator would otherwise be reused unseen (on a loaded machine the 1 GB budget's
# growth read 46-66 MB; trimmed, 117-120 MB in four runs, the 8 MB budget's 34-36 MB).
# ru_maxrss is no use here: it survives exec, so a child of the large pytest process reports
# the parent's peak.
_RSS_SCRIPT = """
import ctypes, gc, sys, glmjax, numpy as np
def status(key):
  return [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key)][0]
toks = np.random.default_rng(0).integers(3, 90, size=(1, 64)).astype(np.int32)
def engine(host_gb):
  return glmjax.load(sys.argv[1], progress=False, device_cache_gb=0, host_cache_gb=host_gb,
                     prefetch=False)
for host_gb in [float(b) for b in sys.argv[2:]]:
  with engine(host_gb) as warm:  # closed: its threads joined, its tiers freed before `start`
    for _ in range(2):
      warm.score(toks)
  del warm
  gc.collect()
  ctypes.CDLL("libc.so.6").malloc_trim(0)
  start = status("VmRSS")
  open("/proc/self/clear_refs", "w").write("5")
  m = engine(host_gb)
  for _ in range(3):
    m.score(toks)
  print("RSS", status("VmHWM") - start, m.engine.host.used)
  m.close()
  del m
  gc.collect()
"""


def _peak_rss(path, *host_gb):
  """[(peak RSS growth of a measured engine in bytes, bytes its host cache holds)] per budget."""
  r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, path, *map(str, host_gb)],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  rows = [l.split()[1:] for l in r.stdout.splitlines() if l.startswith("RSS ")]
  return [(int(growth), int(cached)) for growth, cached in rows]


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
  """A store whose experts (≈90 MB) dwarf RSS noise (±15 MB run to run)."""
  import ml_dtypes
  from glmjax.formats import checkpoint
  from glmjax.model import weights
  from glmjax.model.config import Config
  base = tmp_path_factory.mktemp("big")
  cfg = Config.from_dict({
      "model_type": "glm_moe_dsa", "vocab_size": 96, "hidden_size": 384, "intermediate_size": 256,
      "moe_intermediate_size": 384, "num_hidden_layers": 7, "num_attention_heads": 2,
      "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
      "v_head_dim": 16, "n_routed_experts": 64, "num_experts_per_tok": 8,
      "first_k_dense_replace": 1, "index_topk": 64, "index_head_dim": 16, "index_n_heads": 2})
  checkpoint.save_hf(weights.init(cfg, seed=1, with_mtp=False), cfg, str(base / "hf"),
                     dtype=ml_dtypes.bfloat16)
  convert(str(base / "hf"), str(base / "store"))
  m = json.load(open(base / "store" / "manifest.json"))
  total = m["experts"]["main"]["layout"]["nbytes"] * 64 * len(m["moe_layers"])
  return str(base / "store"), total, m["experts"]["main"]["layout"]["nbytes"]


def test_peak_rss_within_budget(big_store):
  path, total, chunk = big_store
  budget = 8 << 20
  # Stated margin (glmjax/offload/budget.py): the transient working set of one step, 2 × min(E, rows·K)
  # chunks (its union of experts as bytes, stacked, and as a device pool: ≈ 30 MB at 64 rows),
  # plus 32 MB for dequantization temporaries, the engine's dense weights and allocator slack.
  # Observed growth at an 8 MB budget: 34–36 MB (the heap trimmed first; 36–54 MB before).
  margin = 2 * 64 * chunk + (32 << 20)
  (capped, capped_cached), (everything, cached) = _peak_rss(path, budget / GB, 1.0)
  print(f"peak RSS growth: {capped / 2**20:.1f} MB at an 8 MB budget (bound "
        f"{(budget + margin) / 2**20:.1f}), {everything / 2**20:.1f} MB caching {cached / 2**20:.1f} MB")
  assert capped_cached <= budget
  assert capped <= budget + margin, capped
  # The measurement can fail: caching every expert the run touched (most of the store) raises
  # the peak by about their bytes.
  assert cached > total / 2 and everything >= 0.8 * cached, (everything, cached)


def _router_config(experts: int, top_k: int):
  """A one-layer config whose only purpose is routing (D = 16)."""
  from glmjax.model.config import Config
  return Config.from_dict({
      "model_type": "glm_moe_dsa", "vocab_size": 8, "hidden_size": 16, "intermediate_size": 8,
      "moe_intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
      "q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
      "v_head_dim": 4, "n_routed_experts": experts, "num_experts_per_tok": top_k})


def test_cache_aware_routing_matches_definition():
  """Chosen experts: true top-J, then resident ones among the top-M in rank order, then the
  best-ranked others (a loop reference over biased scores)."""
  import jax.numpy as jnp
  from glmjax.model.moe import route_cache_aware
  cfg = _router_config(32, 6)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((20, 16)).astype(np.float32)
  router = rng.standard_normal((32, 16)).astype(np.float32)
  bias = 0.1 * rng.standard_normal(32).astype(np.float32)
  resident = rng.random(32) < 0.3
  ids, w, stats = route_cache_aware(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), cfg,
                                    jnp.asarray(resident), 2, 12)
  choice = 1 / (1 + np.exp(-(x.astype(np.float64) @ router.T))) + bias
  swaps = 0
  for t in range(20):
    order = list(np.argsort(-choice[t], kind="stable"))
    top_m = order[:12]
    want = top_m[:2] + [e for e in top_m[2:] if resident[e]]
    want += [e for e in top_m[2:] if e not in want]
    want = want[:6]
    assert list(np.asarray(ids[t])) == want
    swaps += len(set(want) - set(order[:6]))
  stats = np.asarray(stats).sum(axis=0)
  assert float(stats[0]) == swaps > 0
  assert 0 < float(stats[1]) <= 20 and float(stats[2]) >= 0


def test_cache_aware_routing_opt_in(store):
  path, chunk, layers = store
  # Prefetch off: miss counts then depend on routing and the LRU alone, never on read timing.
  # A host cache holding 24 of 64 experts: each layer keeps some resident across tokens.
  kw = dict(progress=False, device_cache_gb=0, host_cache_gb=24 * chunk / GB, prefetch=False)
  plain = glmjax.load(path, **kw).generate(PROMPT, 10, stop_ids=[])
  aware = glmjax.load(path, cache_route=True, **kw).generate(PROMPT, 10, stop_ids=[])
  assert "route_swap_rate" not in plain.stats  # off by default
  s = aware.stats
  assert 0 < s["route_swap_rate"] <= 0.5  # at most K - keep = 2 of 4 slots swap
  assert 0 < s["route_overlap"] <= 1 and s["route_kl"] >= 0
  assert s["expert_misses"] <= plain.stats["expert_misses"]


def test_capped_routing_matches_definition():
  """expert_budget's routing: keep the experts most real tokens chose (ties: summed sigmoid
  score), then each token's top-k by biased score among them (a loop reference)."""
  import jax.numpy as jnp
  from glmjax.model.moe import route_capped
  cfg = _router_config(16, 4)
  rng = np.random.default_rng(1)
  x = rng.standard_normal((7, 16)).astype(np.float32)
  router = rng.standard_normal((16, 16)).astype(np.float32)
  bias = 0.1 * rng.standard_normal(16).astype(np.float32)
  valid = np.array([True] * 5 + [False] * 2)  # two padding rows must not vote
  for budget in (4, 6, 9, 16):
    ids, w, stats = route_capped(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), cfg,
                                 jnp.asarray(valid), budget)
    s = 1 / (1 + np.exp(-(x.astype(np.float64) @ router.T)))
    choice = s + bias
    top = np.argsort(-choice, axis=1, kind="stable")[:, :4]
    count = np.zeros(16)
    for t in range(7):
      if valid[t]:
        count[top[t]] += 1
    mass = s[valid].sum(axis=0)
    kept = sorted(range(16), key=lambda e: (-count[e], -mass[e]))[:budget]
    for t in range(7):
      want = [e for e in np.argsort(-choice[t], kind="stable") if e in kept][:4]
      assert list(np.asarray(ids[t])) == want, (budget, t)
    swaps = sum(len(set(np.asarray(ids[t])) - set(top[t])) for t in range(7))
    assert float(np.asarray(stats)[:, 0].sum()) == swaps
    assert (budget < 16) or swaps == 0


def test_expert_budget_below_top_k_is_refused(store):
  path, _, _ = store
  with pytest.raises(InputError, match="expert_budget"):
    glmjax.load(path, progress=False, expert_budget=2)
