"""The embedded-model training script's pieces, in process on a tiny config."""

import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.model.forward import forward
from glmjax.model.moe import route
from glmjax.model.mtp import mtp_logits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def te():
  spec = importlib.util.spec_from_file_location(
      "train_embedded", os.path.join(ROOT, "scripts", "train_embedded.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="module")
def cfg(te):
  return te.make_config("tiny", vocab_size=64, eos_id=6)


def _loss(te, *args):
  """te.loss_fn in one jit (op by op, its first call compiled every primitive: ~5x slower)."""
  return jax.jit(te.loss_fn, static_argnums=tuple(range(2, 7)))(*args)


def _tokens(seed, batch, length, vocab=64):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, length)), jnp.int32)


GAMMA = 1e-3  # the bias balancer's step in the training steps below


@pytest.fixture(scope="module")
def steps(te, cfg):
  """(optimizer, dense step, sparse step), compiled once for the tests that train."""
  w = te.init_params(cfg, seed=0)
  opt = te.make_optimizer(w, 1e-2, 0.1)
  return (opt, te.make_step(cfg, opt, False, 2.0, 0.3, 1.0, GAMMA),
          te.make_step(cfg, opt, True, 2.0, 0.3, 1.0, GAMMA))


def test_loss_falls(te, cfg, steps):
  # A learnable stream: each sequence counts up by a random stride modulo the vocabulary.
  rng = np.random.default_rng(0)
  base = rng.integers(0, 64, (4, 1))
  stride = rng.integers(1, 4, (4, 1))
  toks = jnp.asarray((base + stride * np.arange(34)) % 64, jnp.int32)
  opt, dense, sparse = steps
  w = te.init_params(cfg, seed=0)
  state = opt.init(w)
  losses = []
  for i in range(16):
    w, state, m = (dense if i < 8 else sparse)(w, state, toks)
    losses.append(float(m["ce"]))
    assert np.isfinite(float(m["loss"]))
  assert losses[-1] < losses[0] - 1.0, losses
  assert float(m["index_kl"]) >= 0.0


def test_training_forward_matches_inference_forward(te, cfg):
  """With dense attention and no capacity drops, the training loss is the real model's loss."""
  cfg = dataclasses.replace(cfg, index_topk=64)  # no DSA selection on either side
  w = te.init_params(cfg, seed=1, std=0.1)
  w = te.update_bias(w, [jnp.linspace(0, 0.25, cfg.n_routed_experts)] * 3, 0.05)
  toks = _tokens(2, 2, 26)
  _, (m, loads) = _loss(te, w, toks, cfg, False, 100.0, 0.3, 1.0)
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


def test_bias_update_moves_load_toward_balance(te, cfg):
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((512, cfg.hidden_size)) + 1.0, jnp.float32)
  skew = np.linspace(-2.0, 2.0, cfg.n_routed_experts)[:, None] / cfg.hidden_size
  router = jnp.asarray(0.1 * rng.standard_normal((cfg.n_routed_experts, cfg.hidden_size)) + skew,
                       jnp.float32)  # the high-index experts win most tokens

  def load_cv(bias):
    ids, _ = route(x, router, bias, cfg)
    load = np.bincount(np.asarray(ids).ravel(), minlength=cfg.n_routed_experts) / ids.size
    return float(np.std(load) / np.mean(load)), jnp.asarray(load, jnp.float32)

  w = te.init_params(cfg, seed=0)
  for m in te.moe_blocks(w):
    m.router = router
  before, load = load_cv(te.moe_blocks(w)[0].bias)
  # Direction: under-loaded experts' bias goes up by γ, over-loaded ones' down by γ.
  w2 = te.update_bias(w, [load] * 3, 0.01)
  delta = np.asarray(te.moe_blocks(w2)[0].bias - te.moe_blocks(w)[0].bias)
  mean = float(np.mean(np.asarray(load)))
  np.testing.assert_allclose(delta[np.asarray(load) < mean], 0.01, rtol=1e-5)
  np.testing.assert_allclose(delta[np.asarray(load) > mean], -0.01, rtol=1e-5)
  for _ in range(100):
    _, load = load_cv(te.moe_blocks(w)[0].bias)
    w = te.update_bias(w, [load] * 3, 0.02)
  after, _ = load_cv(te.moe_blocks(w)[0].bias)
  assert before > 0.5 and after < 0.5 * before, (before, after)


def test_bias_is_not_trained_by_gradient(te, cfg, steps):
  """Neither the gradient nor weight decay moves the correction bias: a step changes it by
  exactly the balancer's ±γ (or 0), where Adam's update alone would be ~1e-2."""
  opt, _, sparse = steps
  w = te.init_params(cfg, seed=0)
  state = opt.init(w)
  before = [np.asarray(m.bias) for m in te.moe_blocks(w)]
  w, state, _ = sparse(w, state, _tokens(4, 4, 34))
  for b, m in zip(before, te.moe_blocks(w)):
    delta = (np.asarray(m.bias) - b) / GAMMA
    np.testing.assert_allclose(delta, np.round(delta), atol=1e-3)
    assert set(np.round(delta).astype(int).tolist()) <= {-1, 0, 1}


def test_capacity_drops_are_counted(te, cfg):
  w = te.init_params(cfg, seed=0)
  toks = _tokens(5, 2, 34)
  _, (m, _) = _loss(te, w, toks, cfg, False, 0.25, 0.3, 1.0)
  assert float(m["dropped"]) > 0.5  # capacity 0.25 × the mean load cannot hold the pairs


def test_eval_windows_score_each_position_once():
  from glmjax.formats.corpus import windows
  for n, ctx, stride in ((10, 4, 2), (3, 4, 2), (1000, 256, 128), (700, 256, 512)):
    seen = []
    for s, e, first in windows(n, ctx, stride):
      assert e - s <= ctx and s <= first < e
      seen.extend(range(first, e))
    assert seen == list(range(n))
