"""Routing traces from the model: the in-jit recording, live traces of generate, the replay
script, and the engine policy of the simulator against the live engine."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorstore as ts

import glmjax
from glmjax.offload import rules, tiers
from glmjax.replay import Trace, engine_model, simulate
from glmjax.bench.reporting import store_geometry

GB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [5 + (11 * i) % 80 for i in range(13)]


def test_recorded_routing_matches_transformers(tmp_path):
  """Ids and weights of every MoE layer equal the HF router's top-k (captured by hooks on
  transformers' gates); the pilot equals the next layer's router applied, in float64, to this
  layer's post-attention residual as transformers computes it."""
  import torch
  from hf_reference import make_hf, tokens
  hf = make_hf(str(tmp_path / "hf"), seed=3)
  model = glmjax.load(str(tmp_path / "hf"), progress=False)
  toks = tokens(5, 2, 12)
  rec = model.record_routing(toks)
  layers = model.moe_layers
  got, resid = {}, {}
  hooks = []
  for i in layers:
    layer = hf.model.layers[i]
    hooks.append(layer.mlp.gate.register_forward_hook(
        lambda mod, inp, out, i=i: got.__setitem__(i, (out[2].numpy(), out[1].numpy()))))
    hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(
        lambda mod, inp, i=i: resid.__setitem__(i, inp[0].double().numpy())))
  with torch.no_grad():
    hf(torch.as_tensor(toks))
  for h in hooks:
    h.remove()
  k = model.config.num_experts_per_tok
  for j, i in enumerate(layers):
    ids, w = got[i]
    np.testing.assert_array_equal(rec["ids"][j], ids.reshape(-1, k))
    np.testing.assert_allclose(rec["weights"][j], w.reshape(-1, k), rtol=1e-5, atol=1e-6)
    if j + 1 < len(layers):  # the pilot of layer i predicts layer i + 1
      nxt = hf.model.layers[i + 1]
      x = resid[i].reshape(-1, resid[i].shape[-1])
      var = np.mean(x * x, axis=-1, keepdims=True)
      f64 = lambda t: t.detach().double().numpy()
      h = x / np.sqrt(var + model.config.rms_norm_eps) * f64(nxt.post_attention_layernorm.weight)
      s = 1 / (1 + np.exp(-(h @ f64(nxt.mlp.gate.weight).T)))
      choice = s + f64(nxt.mlp.gate.e_score_correction_bias)
      want = np.argsort(-choice, axis=-1, kind="stable")[:, :rec["pilot"].shape[-1]]
      np.testing.assert_array_equal(rec["pilot"][j], want)
    else:
      assert (rec["pilot"][j] == -1).all()


def _fresh_store(src, dst):
  shutil.copytree(src, dst)
  for name in ("usage.json", "couple.npy"):
    if os.path.exists(os.path.join(dst, name)):
      os.remove(os.path.join(dst, name))
  return str(dst)


@pytest.mark.parametrize("device_fraction,host_fraction", [(0.3, 0.25), (0.0, 0.5), (0.5, 0.1)])
def test_simulator_reproduces_the_live_engine(embedded_store, tmp_path, device_fraction,
                                              host_fraction):
  """A live trace replayed under policy="engine" gives the live run's pin hits, host hits and
  misses counter for counter, for a cold run and for a second run starting from the state the
  first one left (pins swapped, host LRU filled, heat decayed)."""
  total = store_geometry(embedded_store)["expert_bytes_total"]
  path = _fresh_store(embedded_store, tmp_path / "store")
  with glmjax.load(path, progress=False, prefetch=False, device_cache_gb=device_fraction * total / GB,
                   host_cache_gb=host_fraction * total / GB) as m:
    for run in range(2):
      out = str(tmp_path / f"trace{run}")
      r = m.generate(PROMPT[run:], 12, stop_ids=[], trace=out)
      trace = Trace.open(out)
      assert trace.n_positions == len(PROMPT[run:]) + len(r.tokens) - 1  # the last is never fed
      sim = simulate(trace, "engine")
      live = (r.stats["expert_pin_hits"], r.stats["expert_host_hits"], r.stats["expert_misses"])
      assert (sim["pin_hits"], sim["host_hits"], sim["misses"]) == live, run
      assert sim["misses"] > 0 and (sim["pin_hits"] > 0 or device_fraction == 0)
  # The simulated bound holds: no demand policy at the same total capacity misses less than
  # Belady (per-layer capacity as the engine's host budget spreads it).
  cap = max(1, int(host_fraction * 32))
  assert simulate(trace, "belady", per_layer=cap)["misses"] <= simulate(trace, "lru",
                                                                        per_layer=cap)["misses"]


def test_the_engine_and_its_simulator_share_the_tier_rules(embedded_store, tmp_path,
                                                           monkeypatch):
  """A live run and its trace replayed under policy="engine" call the one `TierRules.lookup`
  and `lfru_admissions`, with the same arguments and the same outcomes, step by step."""
  assert engine_model.TierRules is rules.TierRules and issubclass(tiers.Tiers, rules.TierRules)
  for rule in ("lookup", "fold", "settle", "admit"):  # the engine stores; it restates no rule
    assert rule not in vars(tiers.Tiers)
  calls = {"lookup": [], "admit": []}
  lookup, admissions = rules.TierRules.lookup, rules.lfru_admissions

  def spy_lookup(self, layer, union):
    out = lookup(self, layer, union)
    if union:  # a precompile step's all-padding rows route nothing
      calls["lookup"].append((layer, list(union), out))
    return out

  def spy_admissions(pins, heat, union, candidates):
    for admitted in admissions(pins, heat, union, candidates):  # lazily: each is assigned first
      calls["admit"].append((pins.layer, admitted))
      yield admitted

  monkeypatch.setattr(rules.TierRules, "lookup", spy_lookup)
  monkeypatch.setattr(rules, "lfru_admissions", spy_admissions)
  total = store_geometry(embedded_store)["expert_bytes_total"]
  path = _fresh_store(embedded_store, tmp_path / "store")
  with glmjax.load(path, progress=False, prefetch=False, device_cache_gb=0.3 * total / GB,
                   host_cache_gb=0.2 * total / GB) as m:
    out = str(tmp_path / "trace")
    m.generate(PROMPT, 10, stop_ids=[], trace=out)
  live = {k: list(v) for k, v in calls.items()}
  for v in calls.values():
    v.clear()
  sim = simulate(Trace.open(out), "engine")
  assert live["lookup"] and live["admit"]  # both tiers were exercised, pins swapped
  assert calls == live
  assert sim["misses"] == sum(len(o[2]) for _, _, o in live["lookup"])


def test_live_trace_of_a_resident_model_matches_teacher_forced_routing(tmp_path):
  """generate(trace=) on the embedded model records the prompt and each fed token; their ids
  agree with a teacher-forced recording of the same tokens (decode and score attention round
  differently, so near-ties may differ: ≥ 99% of ids equal)."""
  model = glmjax.load(progress=False)
  out = str(tmp_path / "live")
  r = model.generate(PROMPT, 16, stop_ids=[], trace=out)
  trace = Trace.open(out)
  fed = PROMPT + r.tokens[:-1]
  np.testing.assert_array_equal(trace.tokens, fed)
  assert list(np.unique(trace.steps)) == list(range(len(r.tokens)))  # prefill, then 1 per step
  ref = model.record_routing(np.asarray([fed]))["ids"].swapaxes(0, 1)  # [N, L, K]
  assert np.mean(trace.ids == ref) >= 0.99
  with pytest.raises(glmjax.InputError, match="already exists"):
    model.generate(PROMPT, 2, trace=out)
  assert trace.live == {}  # nothing offloaded: no tier state


def test_replay_script_with_default_flags(tmp_path):
  """replay.py on the embedded model and its held-out corpus: a trace with no padding rows,
  readable by plain tensorstore, whose rows equal the model's own recording of those tokens."""
  out = str(tmp_path / "trace")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "replay.py"), f"--out={out}",
                      "--max_tokens=2048"], capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr
  ids = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{out}/ids"}}
                ).result().read().result()
  manifest = json.load(open(os.path.join(out, "trace.json")))
  model = glmjax.load(progress=False)
  assert ids.shape == (2048, len(model.moe_layers), model.config.num_experts_per_tok)
  assert manifest["moe_layers"] == model.moe_layers
  trace = Trace.open(out)
  first = trace.tokens[:256]  # the first row: batch 4 × seq 256 by default
  ref = model.record_routing(first[None])
  np.testing.assert_array_equal(ids[:256], ref["ids"].swapaxes(0, 1))
  assert trace.pilot.shape[-1] == 16 and trace.scores.shape[-1] == 32  # min(64, E = 32)
  again = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "replay.py"),
                          f"--out={out}"], capture_output=True, text=True, timeout=600)
  assert again.returncode == 1 and "already exists" in again.stderr


@pytest.mark.parametrize("offloaded", [False, True])
def test_speculative_runs_are_traced(embedded_store, tmp_path, offloaded):
  """With draft, every verify pass is a step holding its token and all its drafts; the live
  notes account for every proposed and accepted draft."""
  if offloaded:
    total = store_geometry(embedded_store)["expert_bytes_total"]
    model = glmjax.load(_fresh_store(embedded_store, tmp_path / "store"), progress=False,
                        device_cache_gb=0, host_cache_gb=0.5 * total / GB, prefetch=False)
  else:
    model = glmjax.load(progress=False)
  out = str(tmp_path / "spec")
  r = model.generate(PROMPT, 12, stop_ids=[], draft=2, trace=out)
  trace = Trace.open(out)
  verify = trace.live["verify"]
  assert len(verify) == r.stats["verify_forwards"]
  assert sum(v["drafts"] for v in verify) == r.stats["draft_proposed"]
  assert sum(v["accepted"] for v in verify) == r.stats["draft_accepted"]
  sizes = np.bincount(trace.steps)
  assert sizes[0] == len(PROMPT)  # the prefill's real positions only
  assert [int(s) for s in sizes[1:]] == [1 + v["drafts"] for v in verify]
  assert [v["step"] for v in verify] == list(range(1, len(verify) + 1))
  # Accepted tokens are the generated ones: each verify step starts with the token it verifies.
  firsts = trace.tokens[np.searchsorted(trace.steps, np.arange(1, len(verify) + 1))]
  assert set(int(t) for t in firsts) <= set(r.tokens)
  model.close()
