"""MTP speculative decoding and the prefetch queue."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glmjax
from glmjax.formats import checkpoint
from glmjax.runtime.clock import CompileClock
from glmjax.decoding import speculative
from glmjax.model import weights
from hf_reference import rel_err, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]
GB = 1 << 30


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
  """A checkpoint whose MTP layer is random: acceptance near chance, many rejections."""
  path = str(tmp_path_factory.mktemp("mtp"))
  cfg = tiny_config(num_hidden_layers=3, n_routed_experts=8, index_n_heads=8, index_topk=6,
                    num_nextn_predict_layers=1)
  checkpoint.save_hf(weights.init(cfg, seed=1, std=0.3), cfg, path)
  return path


@pytest.fixture(scope="module")
def random_store(random_mtp, tmp_path_factory):
  dst = str(tmp_path_factory.mktemp("mtpstore") / "s")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "convert.py"),
                      f"--src={random_mtp}", f"--dst={dst}"],
                     capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
  return dst


@pytest.mark.parametrize("draft", [1, 2, 3, 4, "auto"])
def test_greedy_equivalence_random_mtp(random_mtp, draft):
  model = glmjax.load(random_mtp, progress=False)
  plain = model.generate(PROMPT, 24, stop_ids=[])
  spec = model.generate(PROMPT, 24, stop_ids=[], draft=draft)
  assert spec.tokens == plain.tokens
  s = spec.stats
  assert s["draft_proposed"] >= s["draft_accepted"] >= 0
  # The prefill yields the first token; each verify forward its accepted drafts plus one more.
  assert 1 + s["draft_accepted"] + s["verify_forwards"] == len(spec.tokens)


def test_speculative_rate_leaves_out_compilation(random_mtp):
  """Shapes first met mid-run compile inside the rounds; the rate excludes that time exactly
  as measured, and the clock does measure a compile that happens while it is open."""
  with CompileClock() as clock:
    jax.jit(lambda x: x * 3 + 1)(jnp.ones(7))  # a new function: traced and compiled here
  assert clock.seconds > 0
  model = glmjax.load(random_mtp, progress=False)
  # 24 tokens: the cache size of test_greedy_equivalence_random_mtp, whose steps it reuses
  s = model.generate(PROMPT, 24, stop_ids=[], draft=3).stats
  steps = s["new_tokens"] - 1
  assert s["decode_tok_s"] == pytest.approx(steps / (s["decode_s"] - s["decode_compile_s"]))
  assert s["compile_s"] >= 0 and s["decode_compile_s"] >= 0


def test_greedy_equivalence_embedded():
  model = glmjax.load(progress=False)
  prompt = model.tokenizer.encode("def parse_args(argv):\n    ") if model.tokenizer else PROMPT
  plain = model.generate(prompt, 32, stop_ids=[])
  # The narrowest and widest verify passes (2 and 5 positions); every draft count is also
  # checked on the random-MTP model (test_greedy_equivalence_random_mtp).
  for draft in (1, 4):
    assert model.generate(prompt, 32, stop_ids=[], draft=draft).tokens == plain.tokens


def test_greedy_equivalence_offloaded(random_store):
  model = glmjax.load(random_store, progress=False, device_cache_gb=0, host_cache_gb=2e-5)
  plain = model.generate(PROMPT, 16, stop_ids=[])
  spec = model.generate(PROMPT, 16, stop_ids=[], draft=3)
  assert spec.tokens == plain.tokens and spec.stats["draft_proposed"] > 0


def test_rollback_matches_fresh_forward(random_mtp):
  """After every round (rejections included), the verify logits at the round's first position
  equal a fresh teacher-forced forward over the accepted sequence."""
  model = glmjax.load(random_mtp, progress=False)
  rounds = []
  out = model.generate(PROMPT, 24, stop_ids=[], draft=3, on_round=rounds.append)
  seq = PROMPT + out.tokens
  full = model.score(np.asarray([seq]))[0]
  assert any(r["accepted"] < len(r["tokens"]) - 1 for r in rounds)  # rejections happened
  for r in rounds:
    p = r["position"]
    assert r["tokens"][0] == seq[p]
    assert rel_err(r["logits"][0], full[p]) <= 1e-4


@pytest.mark.parametrize("kw", [
    dict(temperature=0.0, repetition_penalty=1.5),
    dict(temperature=0.0, repetition_penalty=1.3, top_k=5, top_p=0.9, min_p=0.05),
    dict(temperature=1e-4, repetition_penalty=1.5),
    dict(temperature=1e-4, repetition_penalty=1.2, top_k=3, top_p=0.8, min_p=0.1),
], ids=["greedy-penalty", "greedy-all", "sampled-penalty", "sampled-all"])
def test_drafts_honour_every_sampling_option(kw):
  """draft=k gives draft=0's tokens under a repetition penalty and every filter. At
  temperature 1e-4 sampling is an argmax in all but name, but it runs the sampling path:
  acceptance by p(d) and resampling, with the penalty applied to p."""
  model = glmjax.load(progress=False)
  plain = model.generate("def parse(text):", 40, stop_ids=[], **kw).tokens
  for draft in (1, 3):
    assert model.generate("def parse(text):", 40, stop_ids=[], draft=draft, **kw).tokens == plain


def test_accept_keeps_the_distribution():
  """Point-mass drafts with the rejection rule emit exactly p (chi-square, 8k draws)."""
  # numpy logits: 24k calls of `accept` itself, without a JAX dispatch per slice
  logits = np.asarray([2.0, 1.0, 0.5, 0.0, -1.0, 1.5], np.float32)
  p = np.asarray(jax_softmax(logits))
  rng = np.random.default_rng(0)

  class Picker:  # the plain distribution p; the bonus token is never needed here
    greedy = False
    probs = staticmethod(lambda lg: jax_softmax(lg))
    pick = staticmethod(lambda lg: -1)

  for draft in (0, 3, 4):
    counts = np.zeros(6)
    for _ in range(8000):
      a, nxt = speculative.accept(logits[None].repeat(2, 0), [draft], Picker, rng)
      counts[draft if a == 1 else nxt] += 1
    chi2 = float(((counts - 8000 * p) ** 2 / (8000 * p)).sum())
    assert chi2 < 20.5  # 5 degrees of freedom, p ≈ 0.001


def jax_softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max())
  return e / e.sum()


def test_sampling_distribution_end_to_end(random_mtp):
  """Second-token frequencies over seeds: speculative vs plain sampling (chi-square)."""
  model = glmjax.load(random_mtp, progress=False)
  # A strong repetition penalty: the draft's acceptance must see it (and the history as it
  # stands at that position), or the second token's distribution shifts.
  kw = dict(temperature=1.5, repetition_penalty=3.0, top_k=40, top_p=0.98, stop_ids=[])
  n = 300
  plain = [model.generate(PROMPT, 2, seed=s, **kw).tokens[1] for s in range(n)]
  spec = [model.generate(PROMPT, 2, seed=s, draft=1, **kw).tokens[1] for s in range(n)]
  a = np.bincount(plain, minlength=64).astype(float)
  b = np.bincount(spec, minlength=64).astype(float)
  keep = (a + b) >= 10  # pool rare tokens
  a = np.append(a[keep], a[~keep].sum())
  b = np.append(b[keep], b[~keep].sum())
  expected = (a + b) / 2
  mask = expected > 0
  chi2 = float((((a - expected) ** 2 + (b - expected) ** 2)[mask] / expected[mask]).sum())
  dof = int(mask.sum()) - 1
  assert chi2 < dof + 4 * np.sqrt(2 * dof) + 10, (chi2, dof)


def test_draft_controller_follows_throughput():
  # k=0 is fastest per token: the controller stays there; probes are a small share of rounds.
  ctrl = speculative.DraftController(k_max=3)
  picks = []
  for _ in range(100):
    k = ctrl.choose()
    picks.append(k)
    ctrl.update(k, tokens=1 + 0.1 * k, seconds=1.0 + k)
  assert ctrl.best == 0 and picks.count(0) >= 80
  # High acceptance and cheap drafts: it climbs to 3 drafts.
  ctrl = speculative.DraftController(k_max=3)
  for _ in range(100):
    k = ctrl.choose()
    ctrl.update(k, tokens=1 + 0.9 * k, seconds=1.0 + 0.1 * k)
  assert ctrl.best == 3
  # A drifting cost (the cache warming up) does not fool the paired probes: every round gets
  # cheaper over time, but a candidate is always compared with the incumbent side by side.
  ctrl = speculative.DraftController(k_max=3)
  for i in range(100):
    k = ctrl.choose()
    ctrl.update(k, tokens=1 + 0.1 * k, seconds=(1.0 + k) * (1 + 5.0 / (1 + i)))
  assert ctrl.best == 0


def test_bad_draft_argument(random_mtp, tmp_path):
  model = glmjax.load(random_mtp, progress=False)
  with pytest.raises(glmjax.InputError, match="draft"):
    model.generate(PROMPT, 4, draft=-1)


def _budget(store, chunks):
  m = json.load(open(os.path.join(store, "manifest.json")))
  return chunks * m["experts"]["main"]["layout"]["nbytes"] / GB


def test_prefetch_changes_no_output_and_counters_add_up(random_store):
  host = _budget(random_store, 6)
  on = glmjax.load(random_store, progress=False, device_cache_gb=0, host_cache_gb=host)
  off = glmjax.load(random_store, progress=False, device_cache_gb=0, host_cache_gb=host,
                    prefetch=False)
  a = on.generate(PROMPT, 16, stop_ids=[])  # fresh engines: counters start at zero
  b = off.generate(PROMPT, 16, stop_ids=[])
  assert a.tokens == b.tokens
  s = {k: a.stats.get(k, 0.0) for k in (
      "prefetch_issued", "prefetch_useful", "prefetch_late", "prefetch_wasted",
      "prefetch_unused", "prefetch_inflight", "prefetch_failed")}
  assert s["prefetch_issued"] > 0 and "prefetch_issued" not in b.stats
  # Every issued prefetch is exactly one of: used from cache, waited for, evicted unused,
  # still cached unused, still loading, or failed.
  assert s["prefetch_issued"] == sum(v for k, v in s.items() if k != "prefetch_issued")
  assert s["prefetch_useful"] > 0
  assert a.stats["expert_host_hits"] >= b.stats["expert_host_hits"]  # prefetch only adds hits
  assert 0 <= a.stats["pilot_precision"] <= 1 and 0 < a.stats["pilot_recall"] <= 1
  toks = np.asarray([PROMPT + [20, 21, 22]])
  np.testing.assert_array_equal(on.score(toks), off.score(toks))


def test_pilot_recall_matches_independent_routing(random_store):
  """The engine's pilot recall over one teacher-forced forward equals a recomputation with
  the pure model functions: layer L+1's router on layer L's post-attention residual (on a
  dense layer's output when L is dense), against L+1's actual routing (same int4 experts,
  resident, through glmjax.model.moe.moe)."""
  import dataclasses
  import jax
  from glmjax.model import attention as att
  from glmjax.model.layers import rms_norm, swiglu
  from glmjax.model.forward import moe_block
  from glmjax.model.moe import route
  from glmjax.formats.store import ExpertStore
  from glmjax.model.weights import MoE
  model = glmjax.load(random_store, progress=False, device_cache_gb=0,
                      host_cache_gb=_budget(random_store, 4), pilot_k=3, couple_k=0)
  toks = np.asarray([PROMPT + [30, 31, 32, 33]])
  before = model.engine.telemetry()
  model.score(toks)
  after = model.engine.telemetry()
  hits = after["pilot_hits"] - before.get("pilot_hits", 0)
  actual = after["pilot_actual"] - before.get("pilot_actual", 0)

  cfg, store = model.config, ExpertStore(random_store)
  layers = [dataclasses.replace(l, mlp=dataclasses.replace(
      l.mlp, experts=jax.tree_util.tree_map(jnp.asarray, store.read_layer(i))))
            if isinstance(l.mlp, MoE) else l for i, l in enumerate(model.weights.layers)]
  x = model.weights.embed[jnp.asarray(toks)]
  sel, pred, want_hits, want_actual = None, None, 0, 0

  # Each step jitted: run eagerly, every primitive compiles on its own at every shape
  @jax.jit
  def pilot(x, norm, router, bias):  # a router's top 3 on x
    hn = rms_norm(x, norm, cfg.rms_norm_eps)[0]
    return jax.lax.top_k(jax.nn.sigmoid(hn @ router.T) + bias, 3)[1]

  @jax.jit
  def block(lw, x, sel):  # (post-attention residual, output, selection, routed ids or None)
    a, _, sel = att.attention(lw.attn, rms_norm(x, lw.attn_norm, cfg.rms_norm_eps), 0, cfg,
                              selection=sel)
    x = x + a
    hm = rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps)
    if not isinstance(lw.mlp, MoE):
      return x, x + swiglu(hm, lw.mlp.gate_up, lw.mlp.down), sel, None
    return x, x + moe_block(lw.mlp, hm, cfg), sel, route(hm[0], lw.mlp.router, lw.mlp.bias,
                                                        cfg)[0]

  def predict(i, x):  # layer i+1's router on x, when layer i+1 is a MoE layer
    nxt = layers[i + 1] if i + 1 < len(layers) else None
    if nxt is None or not isinstance(nxt.mlp, MoE):
      return None
    return set(np.unique(np.asarray(pilot(x, nxt.mlp_norm, nxt.mlp.router, nxt.mlp.bias))
                         ).tolist())

  for i, lw in enumerate(layers):
    resid, x, sel, ids = block(lw, x, sel)
    if ids is None:
      pred = predict(i, x)  # from the dense layer's output
      continue
    union = set(np.unique(np.asarray(ids)).tolist())
    if pred is not None:
      want_hits += len(pred & union)
      want_actual += len(union)
    pred = predict(i, resid)  # from the post-attention residual
  assert want_actual > 0 and (hits, actual) == (want_hits, want_actual)


def test_generate_script_draft_auto():
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py"),
                      "--draft=auto", "--max_new_tokens=24", "--temperature=0"],
                     capture_output=True, text=True, timeout=300, env=os.environ.copy())
  assert r.returncode == 0, r.stderr
  assert "tok/s" in r.stdout and "accept" in r.stdout
