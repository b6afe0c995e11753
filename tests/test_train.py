"""The embedded-model trainer (glmjax.train), in process on a tiny config, and the script."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.errors import InputError
from glmjax.model.attention import Taps
from glmjax.model.config import Runtime
from glmjax.model.forward import Drive, forward
from glmjax.model.moe import route
from glmjax.model.mtp import mtp_logits
from glmjax.train import objective, optim, presets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cfg():
  return presets.make_config("tiny", vocab_size=64, eos_id=6)


def _loss(*args):
  """objective.loss_fn in one jit (op by op, its first call compiled every primitive: ~5x
  slower)."""
  return jax.jit(objective.loss_fn, static_argnums=tuple(range(2, 7)))(*args)


def _tokens(seed, batch, length, vocab=64):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, length)), jnp.int32)


GAMMA = 1e-3  # the bias balancer's step in the training steps below


@pytest.fixture(scope="module")
def steps(cfg):
  """(optimizer, dense step, sparse step), compiled once for the tests that train."""
  w = presets.init_params(cfg, seed=0)
  opt = optim.make_optimizer(w, 1e-2, 0.1)
  return (opt, optim.make_step(cfg, opt, False, 2.0, 0.3, 1.0, GAMMA),
          optim.make_step(cfg, opt, True, 2.0, 0.3, 1.0, GAMMA))


def test_loss_falls(cfg, steps):
  # A learnable stream: each sequence counts up by a random stride modulo the vocabulary.
  rng = np.random.default_rng(0)
  base = rng.integers(0, 64, (4, 1))
  stride = rng.integers(1, 4, (4, 1))
  toks = jnp.asarray((base + stride * np.arange(34)) % 64, jnp.int32)
  opt, dense, sparse = steps
  w = presets.init_params(cfg, seed=0)
  state = opt.init(w)
  losses = []
  for i in range(16):
    w, state, m = (dense if i < 8 else sparse)(w, state, toks)
    losses.append(float(m["ce"]))
    assert np.isfinite(float(m["loss"]))
  assert losses[-1] < losses[0] - 1.0, losses
  assert float(m["index_kl"]) >= 0.0


def test_training_forward_matches_inference_forward(cfg):
  """With dense attention and no capacity drops, the training loss is the real model's loss."""
  cfg = dataclasses.replace(cfg, index_topk=64)  # no DSA selection on either side
  w = presets.init_params(cfg, seed=1, std=0.1)
  w = optim.update_bias(w, [jnp.linspace(0, 0.25, cfg.n_routed_experts)] * 3, 0.05)
  toks = _tokens(2, 2, 26)
  _, (m, loads) = _loss(w, toks, cfg, False, 100.0, 0.3, 1.0)
  logits, h, _ = jax.jit(forward, static_argnums=2)(w, toks[:, :24], cfg)
  ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:25, None], -1))
  ml, _ = jax.jit(mtp_logits, static_argnums=3)(w, h, toks[:, 1:25], cfg)
  mce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(ml), toks[:, 2:26, None], -1))
  # No pair dropped: one would be >= 1 / (48 tokens x top-k); 1 - mean(keep) rounds in the jit
  assert abs(float(m["dropped"])) < 1e-6
  np.testing.assert_allclose(float(m["ce"]), float(ce), rtol=1e-5)
  np.testing.assert_allclose(float(m["mtp_ce"]), float(mce), rtol=1e-5)
  assert loads.shape == (3, cfg.n_routed_experts)  # 2 MoE layers + the MTP layer
  np.testing.assert_allclose(np.asarray(loads).sum(-1), 1.0, rtol=1e-5)


def test_bias_update_moves_load_toward_balance(cfg):
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((512, cfg.hidden_size)) + 1.0, jnp.float32)
  skew = np.linspace(-2.0, 2.0, cfg.n_routed_experts)[:, None] / cfg.hidden_size
  router = jnp.asarray(0.1 * rng.standard_normal((cfg.n_routed_experts, cfg.hidden_size)) + skew,
                       jnp.float32)  # the high-index experts win most tokens

  def load_cv(bias):
    ids, _ = route(x, router, bias, cfg)
    load = np.bincount(np.asarray(ids).ravel(), minlength=cfg.n_routed_experts) / ids.size
    return float(np.std(load) / np.mean(load)), jnp.asarray(load, jnp.float32)

  w = presets.init_params(cfg, seed=0)
  for m in optim.moe_modules(w):
    m.router = router
  before, load = load_cv(optim.moe_modules(w)[0].bias)
  # Direction: under-loaded experts' bias goes up by γ, over-loaded ones' down by γ.
  w2 = optim.update_bias(w, [load] * 3, 0.01)
  delta = np.asarray(optim.moe_modules(w2)[0].bias - optim.moe_modules(w)[0].bias)
  mean = float(np.mean(np.asarray(load)))
  np.testing.assert_allclose(delta[np.asarray(load) < mean], 0.01, rtol=1e-5)
  np.testing.assert_allclose(delta[np.asarray(load) > mean], -0.01, rtol=1e-5)
  for _ in range(100):
    _, load = load_cv(optim.moe_modules(w)[0].bias)
    w = optim.update_bias(w, [load] * 3, 0.02)
  after, _ = load_cv(optim.moe_modules(w)[0].bias)
  assert before > 0.5 and after < 0.5 * before, (before, after)


def test_bias_is_not_trained_by_gradient(cfg, steps):
  """Neither the gradient nor weight decay moves the correction bias: a step changes it by
  exactly the balancer's ±γ (or 0), where Adam's update alone would be ~1e-2."""
  opt, _, sparse = steps
  w = presets.init_params(cfg, seed=0)
  state = opt.init(w)
  before = [np.asarray(m.bias) for m in optim.moe_modules(w)]
  w, state, _ = sparse(w, state, _tokens(4, 4, 34))
  for b, m in zip(before, optim.moe_modules(w)):
    delta = (np.asarray(m.bias) - b) / GAMMA
    np.testing.assert_allclose(delta, np.round(delta), atol=1e-3)
    assert set(np.round(delta).astype(int).tolist()) <= {-1, 0, 1}


def test_capacity_drops_are_counted(cfg):
  w = presets.init_params(cfg, seed=0)
  toks = _tokens(5, 2, 34)
  _, (m, _) = _loss(w, toks, cfg, False, 0.25, 0.3, 1.0)
  assert float(m["dropped"]) > 0.5  # capacity 0.25 × the mean load cannot hold the pairs


def test_eval_windows_score_each_position_once():
  from glmjax.formats.corpus import windows
  for n, ctx, stride in ((10, 4, 2), (3, 4, 2), (1000, 256, 128), (700, 256, 512)):
    seen = []
    for s, e, first in windows(n, ctx, stride):
      assert e - s <= ctx and s <= first < e
      seen.extend(range(first, e))
    assert seen == list(range(n))


def _is_indexer(path) -> bool:
  return any(getattr(k, "name", None) == "indexer" for k in path)


def test_indexer_learns_from_its_kl_only(cfg):
  """The indexer's inputs and the KL's target carry no gradient: the next-token and MTP losses
  move nothing of the indexer, and the KL moves nothing but the indexer."""
  w = presets.init_params(cfg, seed=0, std=0.1)
  toks = _tokens(7, 2, 34)

  def metric(name):
    def f(w):
      _, (m, _) = objective.loss_fn(w, toks, cfg, True, 2.0, 0.3, 1.0)
      return m[name] if name == "index_kl" else m["ce"] + 0.3 * m["mtp_ce"]
    return jax.jit(jax.grad(f))(w)

  for name, moved in (("index_kl", _is_indexer), ("ce", lambda p: not _is_indexer(p))):
    norms = jax.tree_util.tree_map_with_path(
        lambda p, g: (moved(p), float(jnp.max(jnp.abs(g)))), metric(name))
    flat = jax.tree_util.tree_leaves(norms, is_leaf=lambda x: isinstance(x, tuple))
    assert all(g == 0.0 for m, g in flat if not m), (name, norms)
    assert max(g for m, g in flat if m) > 0.0, (name, norms)


def test_taps_without_selection_attend_every_causal_key(cfg):
  """`select=False` (the indexer's warm-up) is attention over every causal key: the model with
  an index_topk too large to select anything; with the selection on, the logits differ."""
  w = presets.init_params(cfg, seed=1, std=0.1)
  toks = _tokens(6, 2, 33)  # 32 positions, index_topk 8
  fn = jax.jit(objective.train_forward, static_argnums=(3, 4, 5))
  off, _, _ = fn(w, toks[:, :32], toks[:, 1:], cfg, False, 100.0)
  on, _, aux = fn(w, toks[:, :32], toks[:, 1:], cfg, True, 100.0)
  wide = dataclasses.replace(cfg, index_topk=64)
  want = np.asarray(jax.jit(forward, static_argnums=2)(w, toks[:, :32], wide)[0])
  scale = float(np.max(np.abs(want)))
  assert float(np.max(np.abs(np.asarray(off) - want))) <= 1e-5 * scale
  assert float(np.max(np.abs(np.asarray(on) - want))) > 1e-3 * scale
  assert len(aux["index"]) == 2  # the tiny config's two full indexer layers
  target, scores = aux["index"][0]
  np.testing.assert_allclose(np.asarray(target).sum(-1), 1.0, rtol=1e-5)
  assert not np.any(np.isfinite(np.asarray(scores))[:, 0, 1:])  # query 0 sees key 0 only


def test_taps_need_the_dense_reference(cfg):
  w = presets.init_params(cfg, seed=0)
  with pytest.raises(InputError, match="impl='dense'"):
    forward(w, _tokens(0, 1, 16), cfg, drive=Drive(runtime=Runtime(taps=Taps())))


def test_training_logits_equal_inference_logits_on_shipped_weights():
  """The training forward (dense attention with the DSA selection on, capacity experts that
  drop nothing, attention taps) gives the shipped model's inference logits (`Model.score`,
  attention="dense") and MTP logits on a held-out window, within 1e-5 of the largest |logit|."""
  import glmjax
  from glmjax.decoding.text import Tokenizer
  from glmjax.formats import corpus
  model = glmjax.load(progress=False, attention="dense")
  cfg, w = model.config, model.weights
  ids = Tokenizer.from_dir(model.path).encode(corpus.read("json/decoder.py"))
  s = 4 * cfg.index_topk  # past index_topk: the selection is active
  window = np.asarray([ids[:s + 1]], np.int32)
  capacity = cfg.n_routed_experts / cfg.num_experts_per_tok  # T slots per expert: no drops
  logits, mtp, aux = jax.jit(objective.train_forward, static_argnums=(3, 4, 5))(
      w, window[:, :s], window[:, 1:], cfg, True, capacity)
  assert float(jnp.max(aux["dropped"])) == 0.0
  want = model.score(window[:, :s])
  assert np.max(np.abs(np.asarray(logits) - want)) <= 1e-5 * np.max(np.abs(want))

  @jax.jit
  def inference_mtp(w, toks, next_toks):
    _, h, _ = forward(w, toks, cfg, drive=Drive(runtime=Runtime(impl="dense")))
    return mtp_logits(w, h, next_toks, cfg)[0]

  want_mtp = np.asarray(inference_mtp(w, window[:, :s], window[:, 1:]))
  assert np.max(np.abs(np.asarray(mtp) - want_mtp)) <= 1e-5 * np.max(np.abs(want_mtp))


def test_script_trains_exports_and_evaluates(tmp_path):
  """scripts/train_embedded.py end to end at toy size: tokenizer, stream, steps without and
  with the selection, checkpoint, export, and the quick held-out evaluation of the export. Two
  phases, the dense step in the first and the sparse ones in the second: two training steps
  compiled (16:2,64:1 compiled a third, 41.7 against 31.4 CPU-s on a cold cache)."""
  work, out = tmp_path / "run", tmp_path / "run" / "model"
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train_embedded.py"), f"--work_dir={work}",
         f"--out_dir={out}", "--size=tiny", "--vocab_size=384", "--train_files=4",
         "--phases=16:1,64:2", "--batch_tokens=64", "--dense_attn_steps=1", "--log_every=1",
         "--eval_quick", "--eval_stride=128"]
  res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  history = json.loads((work / "history.json").read_text())
  assert [h["step"] for h in history] == [1, 2, 3]
  assert [h["sparse"] for h in history] == [False, True, True]
  assert [h["seq"] for h in history] == [16, 64, 64]  # the phases
  assert all(np.isfinite(h["loss"]) for h in history)
  assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                     "tokenizer.json", "tokenizer_config.json"]
  ev = json.loads((work / "eval.json").read_text())
  assert np.isfinite(ev["stdlib_heldout"]["bits_per_byte"]), ev
