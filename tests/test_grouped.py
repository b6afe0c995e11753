"""Grouped expert compute in the engine: placement, padding, in-place installs, promotion."""

import threading

import jax.numpy as jnp
import numpy as np
import pytest

import glmjax
from glmjax.offload import tiers
from glmjax.offload.expert_io import DEMAND, PILOT, ExpertReader

GB = 1 << 30
PROMPT17 = [5 + (7 * i) % 80 for i in range(17)]



def _tiered(eng, layer, m, x, ids):
  """One layer step of `x` `[T, D]` routed to `ids` through the engine's tiers: its terms."""
  from glmjax.model.forward import Routed
  (terms,) = eng.provider.tiered(layer, m, [Routed(x[None], x, ids)])
  return terms

def chunk_bytes(path):
  import json, os
  m = json.load(open(os.path.join(path, "manifest.json")))
  return m["experts"]["main"]["layout"]["nbytes"]


def test_host_and_device_placement_bitwise_equal_on_cpu(embedded_store):
  """On a CPU-only machine every placement runs the same CPU kernel."""
  chunk = chunk_bytes(embedded_store)
  kw = dict(progress=False, device_cache_gb=4 * 4 * chunk / GB, host_cache_gb=16 * chunk / GB,
            prefetch=False)
  toks = [PROMPT17]
  results = {}
  for mode in ("device", "host", "auto"):
    with glmjax.load(embedded_store, expert_compute=mode, **kw) as m:
      m.score(toks)  # fills the free pin slots
      before = m.engine.telemetry()
      logits = m.score(toks)
      after = m.engine.telemetry()
      d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
      assert d["experts_on_device"] + d["experts_on_host"] == d["experts_used"] > 0
      assert d["experts_on_device"] >= d["expert_pin_hits"] > 0
      assert d.get("h2d_bytes", 0) == 0  # the CPU is the device: nothing crosses a bus
      results[mode] = (logits, d)
  np.testing.assert_array_equal(results["host"][0], results["device"][0])
  np.testing.assert_array_equal(results["auto"][0], results["device"][0])
  # device mode counts host-held experts as run on the device; host mode on the host.
  assert results["device"][1]["experts_on_host"] == 0
  assert results["host"][1]["experts_on_host"] > 0


def test_accelerator_placement_paths_run_on_a_cpu(embedded_store):
  """The engine's accelerator-only paths, run on this CPU by telling the engine it has an
  accelerator (the device kernel is then the CPU kernel, so every placement still gives the
  same bits): `device` uploads host-held experts into a transient pool (gather_slot,
  as_device_pool; h2d_bytes counted), `host` runs them where they are, and `auto` measures
  both rates and picks per step. These paths raised on their first use before (gather_slot)."""
  chunk = chunk_bytes(embedded_store)
  # 4 pins per layer and half the experts in the host cache: the second score hits both
  kw = dict(progress=False, device_cache_gb=4 * 4 * chunk / GB, host_cache_gb=64 * chunk / GB,
            prefetch=False)
  toks = [PROMPT17]
  with glmjax.load(embedded_store, **kw) as m:
    m.score(toks)
    want = m.score(toks)
  for mode in ("device", "host", "auto"):
    with glmjax.load(embedded_store, expert_compute=mode, **kw) as m:
      eng = m.engine
      # as on a GPU or TPU machine
      eng.placement.on_cpu = eng.fused_step.enabled = eng.prefetcher.filling = False
      m.score(toks)  # misses fill the host cache and the free pin slots
      before = eng.telemetry()
      got = m.score(toks)
      d = {k: v - before.get(k, 0) for k, v in eng.telemetry().items()}
      np.testing.assert_array_equal(got, want, err_msg=mode)
      assert d["experts_on_device"] + d["experts_on_host"] == d["experts_used"] > 0, mode
      assert d["expert_host_hits"] > 0, mode  # the host-held path ran
      if mode == "device":
        assert d["experts_on_host"] == 0 and d["h2d_bytes"] == (
            d["expert_host_hits"] + d["expert_misses"]) * chunk
      if mode == "host":
        assert d["h2d_bytes"] == 0 and d["experts_on_host"] > 0
      if mode == "auto":  # the first host-held step uploads, the next runs on the host
        assert eng.placement.rates["h2d"] > 0 and eng.placement.rates["host"] > 0


def test_host_and_auto_agree_with_device_under_the_pallas_kernel(embedded_store):
  """README's accelerator claim, checked on this CPU with the Pallas kernel (interpreted) as
  the device kernel: `host` (the CPU kernel for host-held experts) and `auto` give logits
  within 1e-5 relative of `device`, which runs Pallas over the pin pool and over uploads."""
  chunk = chunk_bytes(embedded_store)
  kw = dict(progress=False, device_cache_gb=4 * 4 * chunk / GB, host_cache_gb=64 * chunk / GB,
            prefetch=False, moe_kernel="pallas")
  logits, h2d = {}, {}
  for mode in ("device", "host", "auto"):
    with glmjax.load(embedded_store, expert_compute=mode, **kw) as m:
      eng = m.engine
      eng.placement.on_cpu = eng.fused_step.enabled = eng.prefetcher.filling = False  # as on a GPU
      assert eng.kernel == "pallas"
      m.score([PROMPT17])
      logits[mode] = m.score([PROMPT17])
      h2d[mode] = eng.telemetry()["h2d_bytes"]
  scale = np.abs(logits["device"]).max()
  for mode in ("host", "auto"):
    assert np.abs(logits[mode] - logits["device"]).max() <= 1e-5 * scale, mode
  assert h2d["device"] > 0 and h2d["host"] == 0
  assert not np.array_equal(logits["host"], logits["device"])  # two kernels really ran


def test_padding_never_routes(embedded_store):
  """A 17-token prompt (prefilled padded to 32) reads and counts exactly the experts of its
  17 real tokens scored alone (no padding)."""
  kw = dict(progress=False, device_cache_gb=0, host_cache_gb=0, prefetch=False)
  with glmjax.load(embedded_store, **kw) as m:
    m.engine.heat.h.clear()  # the shared store's usage.json holds earlier tests' history
    r = m.generate(PROMPT17, 1, stop_ids=[])  # one token: the prefill alone
    heat_gen = dict(m.engine.heat.h)
  with glmjax.load(embedded_store, **kw) as m:
    m.engine.heat.h.clear()
    before = m.engine.telemetry()
    m.score([PROMPT17])
    after = m.engine.telemetry()
    heat_score = dict(m.engine.heat.h)
  for key in ("experts_used", "expert_misses", "expert_bytes_read"):
    assert r.stats[key] == after[key] - before.get(key, 0), key
  assert set(heat_gen) == set(heat_score)  # usage statistics see the real tokens only


COUNTERS = ("expert_pin_hits", "expert_host_hits", "expert_misses", "experts_used",
            "expert_bytes_read", "repins", "experts_on_device", "experts_on_host")


def test_fused_step_equals_the_layer_steps(embedded_store, tmp_path, device_fraction=0.3):
  """The fused step (one jit over the CPU tiers, bookkeeping after) gives bitwise the logits
  and tokens, and exactly the tier counters, of the layer-by-layer path. Forcing an attempt at
  every step also exercises void attempts (a miss): they re-run through the tiers exactly. The
  budgets hold a pin tier and a host cache of every expert, so both tiers serve fused steps.
  With the host tier warmed first, every expert is held, so each fused step returns before its
  bookkeeping, which the engine's next call folds: counters, heat and pins equal the layer
  path's."""
  import os, shutil
  from glmjax.bench.reporting import store_geometry
  total = store_geometry(embedded_store)["expert_bytes_total"]  # the main layers' experts
  runs = {}
  for mode in ("layers", "fused", "forced", "warm_layers", "warm_fused"):
    store = tmp_path / mode
    shutil.copytree(embedded_store, store)  # its own usage history: the same pins for each
    for name in ("usage.json", "couple.npy"):
      if os.path.exists(store / name):
        os.remove(store / name)
    with glmjax.load(str(store), progress=False, prefetch=False,
                     device_cache_gb=device_fraction * total / GB,
                     host_cache_gb=2 * total / GB) as m:
      eng = m.engine
      eng.fused_step.enabled = mode not in ("layers", "warm_layers")
      if mode.startswith("warm"):
        eng.warm_host()
        assert eng.tiers.all_cached(eng.moe_layers)
      if mode == "forced":
        forward = eng.forward

        def always(*a, **k):
          eng.fused_step.ready = True
          return forward(*a, **k)
        eng.forward = always
      deferred = []
      if mode == "warm_fused":  # records each step that returned before its bookkeeping
        fold = eng.fused_step.fold_deferred

        def spy():
          deferred.append(eng.fused_step.pending is not None)
          fold()
        eng.fused_step.fold_deferred = spy
      before = eng.telemetry()
      out = [m.generate(PROMPT17, 8, stop_ids=[]) for _ in range(2)]
      logits = m.score([PROMPT17, PROMPT17[::-1]])
      after = eng.telemetry()
      runs[mode] = (out, logits, {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS},
                    after.get("fused_steps", 0), after.get("fused_void", 0),
                    dict(eng.heat.h), {l: list(d.expert_in) for l, d in eng.device.items()},
                    sum(deferred))
  with glmjax.load(embedded_store, progress=False, device_cache_gb=2 * total / GB) as m:
    resident = m.score([PROMPT17, PROMPT17[::-1]])  # one jit, like a fused step
  layers = runs["layers"]
  assert layers[3] == 0 and runs["warm_layers"][3] == 0
  for mode in ("fused", "forced", "warm_layers", "warm_fused"):
    out, logits, counts, steps, void = runs[mode][:5]
    assert [r.tokens for r in out] == [r.tokens for r in layers[0]], mode
    np.testing.assert_array_equal(logits, layers[1], err_msg=mode)
    if mode == "warm_fused":  # the 34-token score ran as one jit: the resident path's bits too
      np.testing.assert_array_equal(logits, resident)
    if mode != "warm_layers":
      assert steps > 0, mode
    base = runs["warm_layers" if mode.startswith("warm") else "layers"]
    assert counts == base[2], mode
    assert counts["experts_used"] == layers[2]["experts_used"]
  assert runs["forced"][4] > 0  # the cold start's misses made attempts void
  warm = runs["warm_fused"]
  assert warm[4] == 0 and warm[2]["expert_misses"] == 0
  assert warm[7] >= warm[3] - 2  # every fused step but the last of each call was deferred
  assert warm[5] == runs["warm_layers"][5]  # heat: the same uses and decays, in order
  assert warm[6] == runs["warm_layers"][6]  # the same pins in the same slots


def test_a_host_cache_that_holds_everything_is_filled(embedded_store, tmp_path):
  """With room for every expert (and prefetch on, the default), the engine reads the experts
  no step has used in the background (FILL priority) until the tiers hold them all; steps
  are then fused. A smaller host cache is never filled. Reads are waited for, never timed."""
  import concurrent.futures as cf
  import shutil
  from glmjax.bench.reporting import store_geometry
  total = store_geometry(embedded_store)["expert_bytes_total"]
  for frac, filled in ((1.0, True), (0.5, False)):
    store = tmp_path / str(frac)
    shutil.copytree(embedded_store, store)
    with glmjax.load(str(store), progress=False, device_cache_gb=0,
                     host_cache_gb=frac * total / GB) as m:
      eng = m.engine
      ref = m.generate(PROMPT17, 4, stop_ids=[]).tokens
      for _ in range(20):  # each call queues what the reader has room for, then lands it
        cf.wait([f for f, _ in eng.prefetcher.inflight.values()])
        r = m.generate(PROMPT17, 4, stop_ids=[])
        assert r.tokens == ref
        if eng.tiers.all_cached(eng.moe_layers):
          break
      assert eng.tiers.all_cached(eng.moe_layers) == filled
      used = {k for k in eng.heat.h}
      stats = eng.telemetry()
      if filled:
        # Each expert was read once: the ones steps used, and the rest by the fill.
        n = len(eng.moe_layers) * m.config.n_routed_experts
        assert stats["expert_bytes_read"] <= n * chunk_bytes(embedded_store)
        assert len(eng.host) == n > len([k for k in used if k[0] in eng.moe_layers])
        before = eng.telemetry()
        m.generate(PROMPT17, 4, stop_ids=[])
        d = {k: v - before.get(k, 0) for k, v in eng.telemetry().items()}
        assert d["fused_steps"] >= 3 and d.get("expert_misses", 0) == 0


def test_a_long_step_is_fused_only_when_every_expert_is_held(embedded_store):
  """A void fused attempt costs a whole forward: after a step that missed nothing, only steps
  of at most FUSED_GUESS_TOKENS tokens are tried fused on a partial cache."""
  from glmjax.offload.fused import FUSED_GUESS_TOKENS
  with glmjax.load(embedded_store, progress=False, device_cache_gb=0,
                   host_cache_gb=8 * chunk_bytes(embedded_store) / GB, prefetch=False) as m:
    eng = m.engine
    for n, tried in ((FUSED_GUESS_TOKENS + 1, False), (FUSED_GUESS_TOKENS, True)):
      eng.fused_step.ready = True
      before = eng.telemetry()
      m.score([PROMPT17[:n]])
      after = eng.telemetry()
      attempts = sum(after.get(k, 0) - before.get(k, 0) for k in ("fused_steps", "fused_void"))
      assert attempts == int(tried), n


def test_short_cache_less_scores_are_bitwise_across_paths(embedded_store):
  """Regression: a cache-less score of 2–17 tokens ran with a constant start inside the one-jit
  paths (all resident, fused), where XLA specialised the softmax on the constant causal mask,
  and differed from the layer steps by up to 1.3e-5; 1 and 24+ tokens agreed. Every path now
  takes its start as a run-time value."""
  from glmjax.bench.reporting import store_geometry
  total = store_geometry(embedded_store)["expert_bytes_total"]
  prompts = [[PROMPT17[:n], PROMPT17[:n][::-1]] for n in (2, 5, 9, 17)] + [[PROMPT17[:3]]]
  with glmjax.load(embedded_store, progress=False, device_cache_gb=2 * total / GB) as res:
    want = [res.score(p) for p in prompts]
  with glmjax.load(embedded_store, progress=False, device_cache_gb=0, host_cache_gb=0,
                   prefetch=False) as m:
    for p, w in zip(prompts, want):
      np.testing.assert_array_equal(m.score(p), w, err_msg=str(len(p[0])))


def test_expert_terms_do_not_depend_on_the_batch(embedded_store):
  """A sequence's expert terms are bitwise equal scored alone or beside another sequence."""
  with glmjax.load(embedded_store, progress=False, device_cache_gb=0, host_cache_gb=0,
                   prefetch=False) as m:
    eng = m.engine
    layer = eng.moe_layers[0]
    lw = eng.dense.layers[layer]
    rng = np.random.default_rng(0)
    d, e, k = m.config.hidden_size, m.config.n_routed_experts, m.config.num_experts_per_tok
    a = jnp.asarray(rng.standard_normal((5, d)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((9, d)), jnp.float32)
    ids_a = jnp.asarray(rng.permuted(np.tile(np.arange(e), (5, 1)), axis=1)[:, :k], jnp.int32)
    ids_b = jnp.asarray(rng.permuted(np.tile(np.arange(e), (9, 1)), axis=1)[:, :k], jnp.int32)
    alone = _tiered(eng, layer, lw.mlp, a, ids_a)
    ab = jnp.concatenate([a, b])
    both = _tiered(eng, layer, lw.mlp, ab, jnp.concatenate([ids_a, ids_b]))
    np.testing.assert_array_equal(np.asarray(both)[:5], np.asarray(alone))
    assert np.abs(np.asarray(alone)).min(axis=-1).max() > 0  # every (token, rank) computed


def test_install_writes_in_place(embedded_store):
  """Installing one expert donates the pool: the same buffer, no copy of the layer pool."""
  from glmjax.formats.store import ExpertStore
  store = ExpertStore(embedded_store)
  layer = store.layers[0]
  layout = store.layout(layer)
  dev = tiers.DevicePool(layer, 4, tiers.empty_pool(layout, 4))
  before = dev.pool.gate_up.packed.unsafe_buffer_pointer()
  w = store.read(layer, 3)
  dev.install(3, w, 2)
  assert dev.pool.gate_up.packed.unsafe_buffer_pointer() == before
  np.testing.assert_array_equal(np.asarray(dev.pool.gate_up.packed[2]), w.gate_up.packed)
  assert dev.slot_of == {3: 2}


def test_gather_slot_returns_the_expert_a_slot_holds(embedded_store):
  """`gather_slot` (uploads of host-cached experts under device placement, and admissions of a
  slab's expert into a pin pool on another device) returns one slot's weights, every field
  equal to the store's. It raised TypeError on every call since it was written: only an
  accelerator or a multi-device mesh reaches it."""
  from glmjax.formats.store import ExpertStore
  store = ExpertStore(embedded_store)
  layer = store.layers[0]
  dev = tiers.DevicePool(layer, 4, tiers.empty_pool(store.layout(layer), 4))
  w = store.read(layer, 3)
  dev.install(3, w, 1)
  got = tiers.gather_slot(dev.pool, 1)
  for have, want in zip(got, w):
    assert (have.bits, have.group_size, have.in_features) == (want.bits, want.group_size,
                                                               want.in_features)
    np.testing.assert_array_equal(have.packed, want.packed)
    np.testing.assert_array_equal(np.asarray(have.scales).view(np.uint16),
                                  np.asarray(want.scales).view(np.uint16))


def test_promoted_hint_is_read_before_queued_hints():
  """With the only worker busy, hints h1..h3 queue; a demand for h3 promotes it ahead."""
  release, order = threading.Event(), []

  def read(layer, expert):
    if expert == 0:
      release.wait(10)
    order.append(expert)
    return np.zeros(1, np.uint8)

  reader = ExpertReader(read, workers=1, timeout_s=10)
  try:
    blocker = reader.submit(0, 0, DEMAND)
    hints = {e: reader.submit(0, e, PILOT) for e in (1, 2, 3)}
    assert reader.promote(hints[3]) and not reader.promote(blocker)
    release.set()
    for fut in (blocker, *hints.values()):
      reader.wait(fut, 0, 0)
  finally:
    reader.close()
  assert order == [0, 3, 1, 2]


def test_drain_waits_for_every_read_and_its_accounting():
  """`drain` returns only once no read is queued or running (a blocked read keeps it waiting,
  and it names how many are left); after it, every future is done and its time counted."""
  from glmjax.offload.expert_io import ExpertIOError
  release = threading.Event()

  def read(layer, expert):
    release.wait(10)
    return np.zeros(1, np.uint8)

  reader = ExpertReader(read, workers=1, timeout_s=10)
  try:
    futs = [reader.submit(0, 0, DEMAND), reader.submit(0, 1, PILOT), reader.submit(0, 2, PILOT)]
    reader.promote(futs[2])  # a promoted hint is one read, not two
    with pytest.raises(ExpertIOError, match="3 reads did not finish within 0.0 s"):
      reader.drain(timeout_s=0.0)
    release.set()
    reader.drain()
    assert all(f.done() for f in futs) and reader.service_s > 0
    reader.drain(timeout_s=0.0)  # idle: returns at once
  finally:
    reader.close()
  reader.drain(timeout_s=0.0)  # closed: nothing left to wait for


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32), (4, 20)])
def test_xla_custom_call_is_bitwise_the_cpu_kernel(bits, group):
  """The in-jit custom call (zero-copy operands) gives pool_terms' bits, inactive pairs 0."""
  import jax
  from glmjax.formats.quantize import quantize_expert
  from glmjax.model import quant
  from pallas_kernels import cpu, cpu_ffi
  rng = np.random.default_rng(bits + group)
  d, inter, s, t, k = 100, 72, 5, 7, 3
  experts = [quantize_expert(rng.standard_normal((inter, d)), rng.standard_normal((inter, d)),
                             rng.standard_normal((d, inter)), bits, group) for _ in range(s)]
  pool = quant.stack_experts(experts)
  gu, dn = pool.gate_up, pool.down
  x = rng.standard_normal((t, d)).astype(np.float32)
  ids = rng.integers(0, s, (t, k)).astype(np.int32)
  active = rng.random((t, k)) < 0.6
  kw = dict(bits=bits, group_size=group, hidden=d, intermediate=inter)
  want = cpu.pool_terms(x, gu.packed, gu.scales, dn.packed, dn.scales, ids, active, **kw)
  fn = jax.jit(lambda x, ids, act: cpu_ffi.pool_terms_xla(
      x, jnp.asarray(gu.packed), jnp.asarray(gu.scales), jnp.asarray(dn.packed),
      jnp.asarray(dn.scales), ids, act, **kw))
  got = np.asarray(fn(x, ids, active))
  np.testing.assert_array_equal(got, want)
  assert (got[~active] == 0).all() and np.abs(got[active]).min(axis=-1).max() > 0


def _pins_full_no_host(store, read_log):
  """A model whose engine has two pin slots per layer, both taken, and no host cache; its
  reads are logged to `read_log` as (layer, expert)."""
  m = glmjax.load(store, progress=False, device_cache_gb=2 * 4 * chunk_bytes(store) / GB,
                  host_cache_gb=0)
  eng = m.engine
  assert eng.prefetch and eng.host.budget == 0 and eng.slots > 0
  for layer in eng.moe_layers:
    dev = eng.device[layer]
    for e in range(m.config.n_routed_experts):
      slot = dev.free_slot()
      if slot is None:
        break
      if e not in dev:
        dev.install(e, eng.store.read(layer, e), slot)
  read = eng.reader.read_fn

  def logged(layer, expert):
    read_log.append((layer, expert))
    return read(layer, expert)
  eng.reader.read_fn = logged
  return m


def _step_inputs(m, want):
  """Hidden states for 6 tokens and routes in which every token chooses expert `want`."""
  rng = np.random.default_rng(1)
  d, e, k = m.config.hidden_size, m.config.n_routed_experts, m.config.num_experts_per_tok
  x = jnp.asarray(rng.standard_normal((6, d)), jnp.float32)
  others = [o for o in range(e) if o != want]
  ids = np.stack([[want, *rng.permutation(others)[:k - 1]] for _ in range(6)]).astype(np.int32)
  return x, jnp.asarray(ids)


def _hinted_step(m, layer, want):
  """Hints `want` of `layer`, waits for the read, then runs one layer step that uses it:
  (terms, telemetry before the step, telemetry after)."""
  import concurrent.futures as cf
  eng = m.engine
  x, ids = _step_inputs(m, want)
  eng.hint(layer, [want], PILOT)
  cf.wait([eng.prefetcher.inflight[(layer, want)][0]])
  before = eng.telemetry()
  terms = _tiered(eng, layer, eng.dense.layers[layer].mlp, x, ids)
  return terms, before, eng.telemetry()


def test_a_prefetch_no_tier_can_hold_serves_its_step(embedded_store):
  """With the pin pool full and no host cache a landed prefetch has nowhere to go. It used to
  be dropped and the step read the expert again; the step now takes the read it has. The
  terms are bitwise those of a run without prefetch, and the expert is read once."""
  with glmjax.load(embedded_store, progress=False, device_cache_gb=0, host_cache_gb=0,
                   prefetch=False) as plain:
    reads = []
    with _pins_full_no_host(embedded_store, reads) as m:
      eng = m.engine
      layer = eng.moe_layers[0]
      want = next(e for e in range(m.config.n_routed_experts) if e not in eng.device[layer])
      terms, before, after = _hinted_step(m, layer, want)
      assert reads.count((layer, want)) == 1, reads
      assert after.get("prefetch_wasted", 0) == before.get("prefetch_wasted", 0)
      assert after["prefetch_useful"] == before.get("prefetch_useful", 0) + 1
      x, ids = _step_inputs(m, want)
      ref = _tiered(plain.engine, layer, plain.engine.dense.layers[layer].mlp, x, ids)
      np.testing.assert_array_equal(np.asarray(terms), np.asarray(ref))


def test_a_failed_prefetch_is_read_again_by_its_step(embedded_store):
  """A prefetch that failed is not an error: the step that needs the expert reads it again."""
  reads = []
  with _pins_full_no_host(embedded_store, reads) as m:
    eng = m.engine
    layer = eng.moe_layers[0]
    want = next(e for e in range(m.config.n_routed_experts) if e not in eng.device[layer])
    logged = eng.reader.read_fn

    def fail_once(l, e):
      if (l, e) == (layer, want) and (l, e) not in reads:
        reads.append((l, e))
        raise OSError("transient")
      return logged(l, e)
    eng.reader.read_fn = fail_once
    terms, before, after = _hinted_step(m, layer, want)
    assert reads.count((layer, want)) == 2  # the failed hint, then the step's own read
    assert after["prefetch_failed"] == before.get("prefetch_failed", 0) + 1
    assert np.abs(np.asarray(terms)).min(axis=-1).max() > 0


def test_a_prefetch_never_evicts_a_cached_expert(embedded_store):
  """With the host cache full, finished prefetches are held instead of landing by eviction:
  the cache keeps every expert it had. The layer's next step takes the one it uses (read once,
  bitwise the terms without prefetch) and drops the others as wasted, their bytes counted."""
  import concurrent.futures as cf
  chunk = chunk_bytes(embedded_store)
  with glmjax.load(embedded_store, progress=False, device_cache_gb=0,
                   host_cache_gb=0, prefetch=False) as plain, \
      glmjax.load(embedded_store, progress=False, device_cache_gb=0,
                  host_cache_gb=6 * chunk * len(plain.moe_layers) / GB) as m:
    eng = m.engine
    layer = eng.moe_layers[0]
    e = m.config.n_routed_experts
    for x in range(6):  # fill the layer's share of the host cache through the engine's inserts
      eng.tiers.put_host((layer, x), eng.store.read_chunk(layer, x))
    eng.tiers.slabs.flush()
    assert not eng.host.has_room((layer, 6), chunk)  # full: a landing would have to evict
    held = eng.host.keys()
    want, guesses = 6, [7, 8, 9]
    eng.hint(layer, [want, *guesses], PILOT)
    cf.wait([eng.prefetcher.inflight[(layer, g)][0] for g in [want, *guesses]])
    eng.prefetcher.land()
    assert eng.host.keys() == held  # nothing evicted, nothing landed
    assert {(layer, g) for g in [want, *guesses]} <= set(eng.prefetcher.inflight)
    eng.prefetcher.pilot_k = eng.prefetcher.couple_k = 0  # the step below hints nothing next
    reads = []
    read = eng.reader.read_fn
    eng.reader.read_fn = lambda l, x: reads.append((l, x)) or read(l, x)
    before = eng.telemetry()
    x, _ = _step_inputs(m, want)
    ids = jnp.asarray([[want, 0, 1, 2]] * 6, jnp.int32)  # the held read and cached experts
    terms = _tiered(eng, layer, eng.dense.layers[layer].mlp, x, ids)
    after = eng.telemetry()
    assert reads == []  # the held read served the step
    assert after["prefetch_useful"] - before.get("prefetch_useful", 0) == 1
    assert after["prefetch_wasted"] - before.get("prefetch_wasted", 0) == len(guesses)
    # the step dropped the unused ones
    assert not any(k[0] == layer for k in eng.prefetcher.inflight)
    read_now = after["expert_bytes_read"] - before.get("expert_bytes_read", 0)
    assert read_now == (1 + len(guesses)) * chunk  # the wasted guesses' bytes count too
    ref = _tiered(plain.engine, layer, plain.engine.dense.layers[layer].mlp, x, ids)
    np.testing.assert_array_equal(np.asarray(terms), np.asarray(ref))


def test_a_read_that_finishes_after_the_landing_is_not_expired(embedded_store):
  """A prefetch whose read finishes between a step's landing and its expiry has not had its
  chance to land: the expiry keeps it, and the next landing stores it (read once). Dropping it
  there made the tiers depend on read timing: a host fill's read dropped so was read again on
  demand (one suite run read 129 chunks of 128). The read is held back by an event, never a
  sleep."""
  import concurrent.futures as cf
  import threading
  with glmjax.load(embedded_store, progress=False, device_cache_gb=0,
                   host_cache_gb=8 * chunk_bytes(embedded_store) / GB, prefetch=False) as m:
    eng = m.engine
    pf = eng.prefetcher
    layer, guess = eng.moe_layers[0], 5
    gate = threading.Event()
    read = eng.reader.read_fn
    eng.reader.read_fn = lambda l, x: gate.wait() and read(l, x)
    before = eng.telemetry()
    eng.hint(layer, [guess], PILOT)
    fut = pf.inflight[(layer, guess)][0]
    pf.land()  # the read has not finished: nothing lands, nothing is held
    gate.set()
    cf.wait([fut])
    pf.expire(layer)  # the step's expiry comes after the read finished
    assert (layer, guess) in pf.inflight
    pf.land()
    assert (layer, guess) in eng.host.keys() and (layer, guess) not in pf.inflight
    after = eng.telemetry()
    assert after.get("prefetch_wasted", 0) == before.get("prefetch_wasted", 0)
    assert after["expert_bytes_read"] - before.get("expert_bytes_read", 0) == chunk_bytes(
        embedded_store)
