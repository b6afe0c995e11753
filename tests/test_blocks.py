"""Block-by-block checks against the transformers modules: norm, RoPE, MLA, indexer, router, MoE.

Each block gets the same random inputs on both sides and the weights of one loaded checkpoint,
so a failure points at the block. Tolerances as in test_parity (float32, different summation
orders, ~1e-6 observed; 1e-4 relative allowed).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

import glmjax
from glmjax.model import attention, kvcache, layers, moe, weights
from glmjax.model.forward import moe_block
from hf_reference import make_hf, rel_err

TOL = 1e-4
B, S = 2, 11
# The blocks under test, jitted: run eagerly they compile every primitive at every shape
_attention = jax.jit(attention.attention, static_argnames=("start", "cfg", "absorbed"))
_moe_block = jax.jit(moe_block, static_argnames=("cfg",))
_expert_outputs = jax.jit(moe.expert_outputs)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("blocks"))
  ref = make_hf(path, seed=7, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                index_topk=4, indexer_types=["full", "shared", "full", "shared"])
  ref.config._attn_implementation = "eager"
  return ref, glmjax.load(path, progress=False)


def _x(seed, *shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _t(a):
  return torch.as_tensor(np.asarray(a))


def _causal_mask():
  return torch.full((S, S), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, S, S)


def _rope(ref):
  pos = torch.arange(S)[None]
  return ref.model.rotary_emb(torch.zeros(1, S, 1), pos)


def test_rms_norm(pair):
  ref, model = pair
  mod = ref.model.layers[1].input_layernorm
  x = _x(0, B, S, model.config.hidden_size) * 3
  want = mod(_t(x)).detach().numpy()
  got = layers.rms_norm(jnp.asarray(x), model.weights.layers[1].attn_norm, model.config.rms_norm_eps)
  assert rel_err(got, want) <= 1e-6


def test_rope_interleaved(pair):
  ref, model = pair
  r = model.config.qk_rope_head_dim
  q, k = _x(1, B, 3, S, r), _x(2, B, 1, S, r)
  cos, sin = _rope(ref)
  want_q, want_k = hf.apply_rotary_pos_emb_interleave(_t(q), _t(k), cos, sin)
  c, s = layers.rope_angles(jnp.arange(S), r, model.config.rope_theta)  # [S, R/2]
  assert rel_err(layers.rope_interleaved(jnp.asarray(q), c, s), want_q.numpy()) <= 1e-6
  assert rel_err(layers.rope_interleaved(jnp.asarray(k), c, s), want_k.numpy()) <= 1e-6


@pytest.mark.parametrize("absorbed", [False, True, None])  # None: the cheaper form
@pytest.mark.parametrize("layer", [0, 1])  # a full-indexer layer and a shared one
def test_mla_attention(pair, absorbed, layer):
  ref, model = pair
  cfg = model.config
  x = _x(3, B, S, cfg.hidden_size)
  mod0 = ref.model.layers[0].self_attn
  with torch.no_grad():
    _, _, topk = mod0(_t(x), _rope(ref), _causal_mask())  # the selection shared layers reuse
    want, _, _ = ref.model.layers[layer].self_attn(_t(x), _rope(ref), _causal_mask(),
                                                    prev_topk_indices=topk)
  sel = None
  if layer == 1:
    _, _, sel = _attention(model.weights.layers[0].attn, jnp.asarray(x), 0, cfg)
    assert sel is not None  # index_topk < S, so layer 0 selects
  got, _, _ = _attention(model.weights.layers[layer].attn, jnp.asarray(x), 0, cfg,
                         selection=sel, absorbed=absorbed)
  assert rel_err(got, want.numpy()) <= TOL


@pytest.mark.parametrize("queries,slots", [(1, 512), (4, 512), (16, 16), (64, 64), (64, 4096)])
def test_the_attention_form_picked_is_the_one_xla_counts_cheaper(pair, queries, slots):
  """`absorbing_pays` against XLA's own flop count of both dense forms, compiled at these
  shapes (a float kv_b, so both forms are plain einsums XLA can count)."""
  cfg = pair[1].config
  h, n, r, c, v = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                   cfg.kv_lora_rank, cfg.v_head_dim)
  page = 16
  pools = [jnp.zeros((slots // page + 1, page, w), jnp.float32) for w in (c, r)]
  pages = jnp.arange(1, slots // page + 1, dtype=jnp.int32)[None]
  kv_b = jnp.asarray(_x(5, h * (n + v), c))
  q_nope, q_rope = jnp.asarray(_x(6, 1, queries, h, n)), jnp.asarray(_x(7, 1, queries, h, r))
  mask = jnp.ones((1, queries, slots), bool)

  def flops(absorbed):
    def run(latent, k_rope, pages, kv_b, q_nope, q_rope, mask):
      view = attention.KeyView(latent, k_rope, None, pages)
      score, lat = attention.dense_scores(view, q_nope, q_rope, attention.KvB(kv_b, h, n), 1.0,
                                          absorbed)
      return attention.dense_output(score, mask, lat, attention.KvB(kv_b, h, n), absorbed)
    args = (*pools, pages, kv_b, q_nope, q_rope, mask)
    return jax.jit(run).lower(*args).compile().cost_analysis()["flops"]

  cheaper = flops(True) <= flops(False)
  assert attention.absorbing_pays(queries, slots, cfg) == cheaper


@functools.partial(jax.jit, static_argnames=("cfg",))  # one compile, not one per primitive
def _selections(w, xj, cfg):
  """Layer `w`'s indexer selections for `xj`: the dense one and the blocked one."""
  c, s = layers.rope_angles(jnp.arange(S), cfg.qk_rope_head_dim, cfg.rope_theta)
  c, s = c[None], s[None]
  q_lat = layers.rms_norm(layers.linear(xj, w.q_a), w.q_a_norm, layers.LATENT_NORM_EPS)
  index_k = attention.indexer_keys(w.indexer, xj, cfg, c, s)  # [B, S, I]
  q, wts = attention.indexer_queries(w.indexer, xj, q_lat, cfg, c, s)
  visible = jnp.arange(S)[None, None] <= jnp.arange(S)[None, :, None]
  dense = attention.select_dense(q, wts, index_k, visible, cfg.index_topk)
  # The blocked selection (the sparse path's) reads the keys as pages of 4 positions, in
  # blocks of one page: the running top-k merges three blocks for the last queries.
  pool, pages = kvcache.as_pool(index_k, 4)
  view = attention.KeyView(None, None, pool, pages)
  slots = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  return dense, attention.select_blocked(view, q, wts, slots, cfg.index_topk, 1)


def test_indexer_selection(pair):
  ref, model = pair
  cfg = model.config
  x = _x(4, B, S, cfg.hidden_size)
  att = ref.model.layers[0].self_attn
  cos, sin = _rope(ref)
  with torch.no_grad():
    q_resid = att.q_a_layernorm(att.q_a_proj(_t(x)))
    want = att.indexer(_t(x), q_resid, (cos, sin), _causal_mask()[:, 0], None).numpy()
  dense, blocked = map(np.asarray, _selections(model.weights.layers[0].attn, jnp.asarray(x), cfg))
  np.testing.assert_array_equal(blocked, dense)  # the same keys in the same order
  for b in range(B):
    for q_ in range(S):
      ref_set = {int(t) for t in want[b, q_] if t <= q_}  # masked picks are never attended
      assert ref_set == {int(t) for t in dense[b, q_] if t >= 0}, (b, q_)
  # Queries with more visible keys than index_topk really are sparse.
  assert (dense[:, -1] >= 0).sum(-1).max() == cfg.index_topk


def test_router_group_limited(pair):
  ref, model = pair
  cfg = model.config
  x = _x(5, 40, cfg.hidden_size)
  gate = ref.model.layers[1].mlp.gate
  with torch.no_grad():
    _, w_ref, i_ref = gate(_t(x))
  mw = model.weights.layers[1].mlp
  ids, w = moe.route(jnp.asarray(x), mw.router, mw.bias, cfg)
  ids, w = np.asarray(ids), np.asarray(w)
  for t in range(len(x)):  # same experts with the same weights (HF returns them unsorted)
    ref_map = dict(zip(i_ref[t].tolist(), w_ref[t].tolist()))
    assert set(ids[t].tolist()) == set(ref_map)
    np.testing.assert_allclose([ref_map[e] for e in ids[t]], w[t], rtol=1e-6)
  # Group limiting is active: every token's experts come from at most topk_group groups.
  groups = ids // (cfg.n_routed_experts // cfg.n_group)
  assert max(len(set(g)) for g in groups.tolist()) <= cfg.topk_group


@pytest.mark.parametrize("tokens", [3, 40])  # gather path (T·K ≤ 64) and tiled path
def test_moe_block(pair, tokens):
  ref, model = pair
  x = _x(6, 1, tokens, model.config.hidden_size)
  with torch.no_grad():
    want = ref.model.layers[2].mlp(_t(x)).numpy()
  got = _moe_block(model.weights.layers[2].mlp, jnp.asarray(x), model.config)
  assert rel_err(got, want) <= TOL


def test_combine_is_rank_ordered():
  """combine() adds expert outputs in rank order: reversing the ranks changes the FP result
  only through summation order, and equals an explicit ordered loop bitwise."""
  rng = np.random.default_rng(0)
  ys = jnp.asarray(rng.standard_normal((5, 8, 16)).astype(np.float32) * 1e3)
  w = jnp.asarray(rng.random((5, 8)).astype(np.float32))
  got = np.asarray(moe.combine(ys, w))
  acc = np.asarray(ys[:, 0] * w[:, 0, None])
  for k in range(1, 8):
    acc = acc + np.asarray(ys[:, k] * w[:, k, None])
  np.testing.assert_array_equal(got, acc)


@pytest.mark.parametrize("skew", ["uniform", "one_expert", "two_of_many"])
@pytest.mark.parametrize("tokens", [17, 100, 1024])
def test_float_expert_outputs_against_a_float64_loop(tokens, skew):
  """The tiled float path (pairs sorted by expert, padded to whole tiles) against a float64
  loop over pairs, with every expert's share from even to all pairs on one expert (the tile
  count bound) and unused experts."""
  rng = np.random.default_rng(tokens)
  e, k, d, f = 12, 3, 24, 10
  gu = rng.standard_normal((e, 2 * f, d)).astype(np.float32) * 0.3
  dn = rng.standard_normal((e, d, f)).astype(np.float32) * 0.3
  x = rng.standard_normal((tokens, d)).astype(np.float32)
  if skew == "uniform":
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)])
  elif skew == "one_expert":  # rank 0 always expert 5: one expert holds a third of the pairs
    ids = np.stack([[5, *rng.choice([i for i in range(e) if i != 5], k - 1, replace=False)]
                    for _ in range(tokens)])
  else:
    ids = np.stack([[0, 1, 2 + t % 2] for t in range(tokens)])  # 8 experts never chosen
  got = np.asarray(_expert_outputs(jnp.asarray(x), jnp.asarray(ids, jnp.int32),
                                   weights.Experts(gate_up=jnp.asarray(gu), down=jnp.asarray(dn))))
  want = np.zeros((tokens, k, d))
  for t in range(tokens):
    for r in range(k):
      h = gu[ids[t, r]].astype(np.float64) @ x[t].astype(np.float64)
      a = h[:f] / (1 + np.exp(-h[:f])) * h[f:]
      want[t, r] = dn[ids[t, r]].astype(np.float64) @ a
  assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("b,s", [(1, 1), (3, 1), (1, 6), (3, 5)])
def test_cache_writes_land_where_a_loop_puts_them(b, s):
  """`kvcache.write` (one loop over the rows' positions for all of a layer's pools) against
  numpy, position by position: each row at its own start, a row running past its table
  writing the null page, the other pages untouched."""
  ps, w, widths = 4, 3, (8, 2)
  rng = np.random.default_rng(b * 10 + s)
  pools = [rng.standard_normal((1 + b * w, ps, x)).astype(np.float32) for x in widths]
  news = [rng.standard_normal((b, s, x)).astype(np.float32) for x in widths]
  pages = (1 + rng.permutation(b * w)).reshape(b, w).astype(np.int32)
  starts = rng.integers(0, w * ps - s + 1, b).astype(np.int32)
  starts[-1] = w * ps - 1  # the last row's later positions fall past its table
  got = jax.jit(kvcache.write)(tuple(map(jnp.asarray, pools)), tuple(map(jnp.asarray, news)),
                               jnp.asarray(pages), jnp.asarray(starts))
  for pool, new, out in zip(pools, news, got):
    want = pool.copy()
    for r in range(b):
      for i in range(s):
        t = int(starts[r]) + i
        page = pages[r, t // ps] if t // ps < w else kvcache.NULL_PAGE
        want[page, t % ps] = new[r, i]
    real = np.arange(len(want)) != kvcache.NULL_PAGE  # the null page holds whatever lands last
    np.testing.assert_array_equal(np.asarray(out)[real], want[real])
