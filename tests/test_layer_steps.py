"""Resident steps: each decoder layer two jitted halves (`forward.layer_step`: attention, then
MLP) that layers with the same half share, or the same steps inlined into one program for a
shallow model (`forward.entry_points`). Both give the bits of the one forward pass in one jit,
and a deep stack compiles one program per distinct half."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.formats.synthetic import DENSE_LAYERS, synthetic_config
from glmjax.model import forward, kvcache, weights
from glmjax.model.config import Config

DEPTH = 10  # total layers: past two per distinct layer (3 here), so the executor steps them
PROMPT = 13  # tokens of the prefill chunk (odd: a width no other test compiles)


@functools.cache
def _model():
  cfg = Config.from_dict(synthetic_config("tiny", moe_layers=DEPTH - DENSE_LAYERS, mtp=False))
  # committed to the device, as the executor's weights are: a jit compiles once per mix of
  # committed and uncommitted arguments (the embedding's output feeds the first layer)
  return cfg, jax.device_put(weights.init(cfg, seed=3, with_mtp=False), jax.local_devices()[0])


def _whole(cfg, w, tokens):
  """The reference: the one forward pass (pure pieces) in one jit over every layer, with no
  layer step anywhere: prefill logits at the last token, then two greedy decode steps."""
  def step(w, cache, tokens, absorbed):  # the head at the last token only, as prefill_fn's
    _, x, cache = forward.forward(w, tokens, cfg, cache, absorbed)
    return forward.logits_of(w, x[:, -1:], cfg), cache
  # absorbed: by cost as prefill_fn's, then True as decode_fn's
  run = jax.jit(step, static_argnums=3)
  cache = kvcache.init_cache(cfg, 1, 64)
  logits, cache = run(w, cache, tokens, None)
  cache = kvcache.KVCache(cache.layers, cache.pages, cache.length + tokens.shape[1])
  out = [np.asarray(logits[0, -1])]
  for _ in range(2):
    tok = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
    logits, cache = run(w, cache, tok, True)
    cache = kvcache.KVCache(cache.layers, cache.pages, cache.length + 1)
    out.append(np.asarray(logits[0, -1]))
  return out


def _entry(cfg, w, tokens, fns):
  """The same through the resident entry points `fns` (`prefill`, then `decode`)."""
  cache = kvcache.init_cache(cfg, 1, 64)
  step = fns["prefill"](w, cache, tokens, jnp.int32(tokens.shape[1]), cfg=cfg)
  out, logits = [np.asarray(step.logits[0])], step.logits[:, None]
  cache = step.cache
  for _ in range(2):
    tok = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
    step = fns["decode"](w, cache, tok, cfg=cfg)
    cache, logits = step.cache, step.logits
    out.append(np.asarray(logits[0, -1]))
  return out


def test_layer_steps_and_one_program_give_the_whole_jits_bits():
  cfg, w = _model()
  tokens = jnp.asarray(np.random.default_rng(0).integers(5, cfg.vocab_size, (1, PROMPT)),
                       jnp.int32)
  want = _whole(cfg, w, tokens)
  for fns in (forward.LAYER_STEPS, forward.ONE_PROGRAM):
    for got, ref in zip(_entry(cfg, w, tokens, fns), want):
      np.testing.assert_array_equal(got, ref)


def test_a_deep_stack_compiles_one_program_per_distinct_half():
  cfg, w = _model()
  assert forward.distinct_layers(w) == 3 and len(w.layers) == DEPTH
  # dense + full, MoE + full, MoE + shared: two attention halves (full and shared indexer; the
  # dense layer's is a full one) and two MLP halves (dense, MoE)
  assert {lw.attn.indexer is None for lw in w.layers} == {True, False}
  assert forward.entry_points(w) is forward.LAYER_STEPS
  before = forward.attention_step._cache_size(), forward.mlp_step._cache_size()
  cache = kvcache.init_cache(cfg, 1, 64)
  tokens = jnp.zeros((1, PROMPT + 2), jnp.int32)  # a width of its own
  forward.prefill_fn(w, cache, tokens, jnp.int32(PROMPT), cfg=cfg)
  assert forward.attention_step._cache_size() - before[0] == 2
  assert forward.mlp_step._cache_size() - before[1] == 2


def test_the_executor_keeps_a_shallow_model_in_one_program():
  """The rule against its statement: one program up to two layers per distinct layer."""
  for layers in (4, 6, 7, 10, 24):
    cfg = Config.from_dict(synthetic_config("tiny", moe_layers=layers - DENSE_LAYERS, mtp=False))
    w = weights.abstract(cfg, jnp.float32, with_mtp=False)
    w = weights.map_infos(lambda i: jax.ShapeDtypeStruct(i.shape, i.dtype), w)
    kinds = forward.distinct_layers(w)
    want = forward.ONE_PROGRAM if layers <= 2 * kinds else forward.LAYER_STEPS
    assert forward.entry_points(w) is want, layers
  assert forward.entry_points(_model()[1]) is forward.LAYER_STEPS


def test_a_deep_stores_fused_step_runs_layer_by_layer_with_the_layer_paths_bits(tmp_path):
  """A fully cached store as deep as `_model`'s: its fused step runs each layer as two jitted
  halves (`attention_step`, `fused_mlp`: a program per distinct half) and gives the bits of
  the engine's layer steps, whose attention is the same `attention_step` (a dense layer's
  program a full MoE layer's) before the MLP head's own step."""
  import glmjax
  from glmjax.formats import synthetic
  from glmjax.model.forward import _mlp_head_step, attention_step
  from glmjax.offload.fused import fused_mlp
  path = str(tmp_path / "deep")
  synthetic.make_synthetic_store(path, geometry="tiny", moe_layers=DEPTH - DENSE_LAYERS,
                                 experts=8, mtp=False, progress=False)
  prompt = list(range(5, 5 + PROMPT))
  runs = {}
  programs = lambda: np.array([attention_step._cache_size(), fused_mlp._cache_size(),
                               _mlp_head_step._cache_size()])
  for fused in (False, True):  # the layer steps first: their programs are counted alone
    with glmjax.load(path, progress=False, prefetch=False, device_cache_gb=0,
                     host_cache_gb=1.0) as m:
      eng = m.engine
      eng.fused_step.enabled = fused
      eng.warm_host()
      assert eng.tiers.all_cached(eng.moe_layers) and not eng.fused_step.one_program
      before = programs()
      out = m.generate(prompt, 6, stop_ids=[]).tokens
      logits = m.score([prompt])
      runs[fused] = (out, logits, eng.telemetry().get("fused_steps", 0), programs() - before)
  assert runs[True][2] > 0 and runs[False][2] == 0
  assert runs[True][0] == runs[False][0]
  np.testing.assert_array_equal(runs[True][1], runs[False][1])
  # (prefill, decode, score) x two attention kinds (full, shared indexer), not three layer kinds
  attention, _, head = runs[False][3]
  assert 0 < attention <= 2 * 3 and 0 < head <= 2 * 3, runs[False][3]
  assert 0 < runs[True][3][:2].sum() <= 4 * 3  # distinct halves x (prefill, decode, score)


def test_compile_unit_chooses_and_a_bad_one_is_refused():
  import pytest
  import glmjax
  from glmjax.errors import InputError
  _, w = _model()
  assert forward.entry_points(w, "step") is forward.ONE_PROGRAM
  assert forward.entry_points(w, "layer") is forward.LAYER_STEPS
  with glmjax.load(progress=False, compile_unit="layer") as m:
    assert m.executor.fns is forward.LAYER_STEPS
  with pytest.raises(InputError, match="compile_unit must be 'auto', 'layer' or 'step'"):
    glmjax.load(progress=False, compile_unit="layers")
