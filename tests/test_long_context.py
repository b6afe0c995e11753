"""Long context: sparse DSA attention against the masked dense reference, chunked prefill, the
paged KV cache and its limits, memory at GLM-5's dims, and the server's KV budget.

The reference for sparse attention is the masked dense path (`attention="dense"`): every key
scored, the indexer's top-k applied as a mask. Both run the same projections; they differ in
summation order only (1e-7 relative at these sizes), so their logits must agree within 1e-6 of
max |logit| and their selections exactly.
"""

import concurrent.futures
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glmjax
from glmjax.errors import InputError
from glmjax.model import attention, kvcache, weights
from glmjax.model.config import Runtime
from glmjax.model.forward import (Chunk, attention_half, attention_step, entry_points, mlp_half,
                                  mlp_step)
from hf_reference import hf_logits, make_hf, rel_err, tiny_config, tokens

K = 8  # index_topk of the test model: sequences on both sides of it
RT = {impl: Runtime(impl=impl) for impl in ("sparse", "dense")}  # the attention's
CFG = tiny_config(num_hidden_layers=3, indexer_types=["full", "shared", "full"], index_topk=K,
                  index_n_heads=4, n_routed_experts=4)
TOL = 1e-6
# Chunked against one-piece prefill: attention over the cache's pages against the fresh keys,
# so more summations change order than sparse against dense; 12 token seeds gave 0.78-1.98e-6
# of max |logit| (2026-12-05).
CHUNK_TOL = 5e-6
# One attention block without a cache, jitted: run eagerly it compiles every primitive per shape
_attention = jax.jit(attention.attention, static_argnames=("start", "cfg", "runtime"))


@pytest.fixture(scope="module")
def w():
  return weights.init(CFG, seed=3, std=0.3)


def _toks(seed, b, s):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, (b, s)), jnp.int32)


@pytest.mark.parametrize("s", [5, K, K + 1, 40])
def test_sparse_equals_dense_without_a_cache(w, s):
  toks = _toks(s, 2, s)
  score = entry_points(w)["score"]  # as the executor runs it
  run = lambda impl: np.asarray(score(w, toks, jnp.int32(0), cfg=CFG, runtime=RT[impl]))
  assert rel_err(run("sparse"), run("dense")) <= TOL
  # The selections themselves, layer 0 (full) on the embedded tokens: identical, ordered.
  x = w.embed[toks].astype(jnp.float32)
  sel = [_attention(w.layers[0].attn, x, 0, CFG, runtime=RT[i])[2]
         for i in ("sparse", "dense")]
  if s <= K:
    assert sel == [None, None]  # a query sees no more than K keys: dense, nothing selected
  else:
    np.testing.assert_array_equal(np.asarray(sel[0]), np.asarray(sel[1]))
    assert (np.asarray(sel[0])[:, -1] >= 0).sum(-1).min() == K  # the last queries are sparse


def test_sparse_equals_dense_through_the_cache(w):
  """A 6-token prefill, then 40 decode steps crossing index_topk: every step's logits."""
  toks = _toks(1, 1, 46)

  fns = entry_points(w)  # as the executor runs them

  def run(impl):
    cache = kvcache.init_cache(CFG, 1, 64)
    logits, _, cache, _ = fns["prefill"](w, cache, toks[:, :6], jnp.int32(6), cfg=CFG,
                                         runtime=RT[impl])
    out = [np.asarray(logits[0])]
    for t in range(6, 46):
      logits, _, cache, _ = fns["decode"](w, cache, toks[:, t:t + 1], cfg=CFG, runtime=RT[impl])
      out.append(np.asarray(logits[0, 0]))
    return np.stack(out)
  assert rel_err(run("sparse"), run("dense")) <= TOL


def _random_pool(cache, seed):
  """`cache` with every pool entry random (a filled cache without a prefill)."""
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 3 * len(cache.layers)))
  fill = lambda a: None if a is None else jax.random.normal(next(keys), a.shape, a.dtype)
  layers = [kvcache.LayerCache(fill(l.latent), fill(l.k_rope), fill(l.index_k))
            for l in cache.layers]
  return dataclasses.replace(cache, layers=layers)


def test_batched_decode_with_rows_at_their_own_lengths(w):
  """Rows at 3, 9 and 30 cached positions decode in one step, sparse as dense, and each row
  as it would alone."""
  lengths = np.asarray([3, 9, 30], np.int32)
  toks = _toks(2, 3, 1)

  def run(impl, rows=slice(None)):  # a fresh cache each time: decode donates it
    base = _random_pool(kvcache.init_cache(CFG, 3, 40), 0)
    cache = dataclasses.replace(base, pages=base.pages[rows],
                                length=jnp.asarray(lengths[rows]))
    return np.asarray(entry_points(w)["decode"](
        w, cache, toks[rows], cfg=CFG, runtime=RT[impl],
        n_valid=jnp.ones(len(lengths[rows]), jnp.int32)).logits[:, 0])
  both = run("sparse")
  assert rel_err(both, run("dense")) <= TOL
  for r in range(3):
    assert rel_err(run("sparse", slice(r, r + 1))[0], both[r]) <= TOL


@pytest.mark.parametrize("page,block", [(2, 1), (4, 1), (4, 3), (64, 1)])
def test_blocked_selection_breaks_ties_like_one_top_k(page, block):
  """Integer-valued queries and keys make index scores exact and ties common (a third of all
  scores are 0): the running top-k over key blocks picks the same keys in the same order as
  one top-k over every key, ties to the earliest slot."""
  rng = np.random.default_rng(page * 10 + block)
  b, s, g, i, t = 2, 7, 3, 4, 37
  q = jnp.asarray(rng.integers(-1, 2, (b, s, g, i)), jnp.float32)
  wts = jnp.asarray(rng.integers(0, 2, (b, s, g)), jnp.float32)
  keys = jnp.asarray(rng.integers(-1, 2, (b, t, i)), jnp.float32)
  slots = jnp.asarray(np.sort(rng.integers(0, t, (b, s)), axis=1), jnp.int32)
  visible = jnp.arange(t)[None, None] <= slots[:, :, None]
  want = np.asarray(attention.select_dense(q, wts, keys, visible, K))
  pool, pages = kvcache.as_pool(keys, page)
  view = attention.KeyView(None, None, pool, pages)
  got = np.asarray(attention.select_blocked(view, q, wts, slots, K, block))
  np.testing.assert_array_equal(got, want)
  scores = np.asarray(attention.index_scores(q, wts, keys))
  assert (scores == 0).mean() > 0.3  # the case is tie-heavy


def test_tied_indexer_keeps_the_earliest_keys(w):
  """An indexer whose scores are all 0 (weights_proj zeroed): every key ties and both paths
  keep the K earliest visible keys."""
  ix = dataclasses.replace(w.layers[0].attn.indexer,
                           weights_proj=jnp.zeros_like(w.layers[0].attn.indexer.weights_proj))
  w0 = dataclasses.replace(w, layers=[dataclasses.replace(
      w.layers[0], attn=dataclasses.replace(w.layers[0].attn, indexer=ix)), *w.layers[1:]])
  toks = _toks(4, 1, 30)
  score = entry_points(w0)["score"]
  run = lambda impl: np.asarray(score(w0, toks, jnp.int32(0), cfg=CFG, runtime=RT[impl]))
  assert rel_err(run("sparse"), run("dense")) <= TOL
  x = w0.embed[toks].astype(jnp.float32)
  _, _, sel = _attention(w0.layers[0].attn, x, 0, CFG)
  np.testing.assert_array_equal(np.asarray(sel)[0, -1], np.arange(K))


@pytest.fixture(scope="module")
def hf_long(tmp_path_factory):
  """A transformers model with index_topk 8, prompts of 30 tokens: DSA selects."""
  path = str(tmp_path_factory.mktemp("hf_long"))
  ref = make_hf(path, seed=11, index_topk=K, indexer_types=["full", "shared", "full", "shared"])
  return ref, path


def test_chunked_prefill_matches_transformers_and_one_piece(hf_long):
  """Chunks of 5 tokens (smaller than index_topk) through the cache: logits as transformers'
  and as one-piece prefill, greedy tokens equal."""
  ref, path = hf_long
  chunked = glmjax.load(path, progress=False, prefill_chunk=5)
  whole = glmjax.load(path, progress=False, prefill_chunk=0)
  toks = tokens(5, 2, 30)
  want = hf_logits(ref, toks)
  got = chunked.score(toks)  # 30 > 5: through the cache, six chunks
  assert rel_err(got, want) <= 1e-4
  assert rel_err(got, whole.score(toks)) <= CHUNK_TOL
  prompt = toks[0, :23].tolist()
  a, b = chunked.generate(prompt, 7, stop_ids=[]), whole.generate(prompt, 7, stop_ids=[])
  assert a.tokens == b.tokens and a.stats["prefill_chunks"] == 5 == 5 * b.stats["prefill_chunks"]
  full = np.asarray([prompt + a.tokens])
  np.testing.assert_array_equal(a.tokens, hf_logits(ref, full)[0, 22:-1].argmax(-1))


def test_score_targets_give_log_probabilities(hf_long):
  _, path = hf_long
  model = glmjax.load(path, progress=False, prefill_chunk=5)
  toks = tokens(6, 1, 23)
  targets = np.roll(toks, -1, axis=1)
  logits = model.score(toks).astype(np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
                         ) - logits.max(-1, keepdims=True)
  want = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(model.score(toks, targets=targets), want, atol=2e-5)


def test_engine_prefills_layer_major_bitwise_across_budgets(embedded_store):
  """A 300-token prompt in 128-token chunks: the same tokens and bitwise the same log-probs at
  every budget and with one-piece prefill's expert bytes (each expert read once per layer)."""
  ids = np.random.default_rng(7).integers(10, 4000, (1, 300))
  runs = {}
  for name, budget, chunk in (("resident", dict(device_cache_gb=1.0), 128),
                              ("host", dict(device_cache_gb=0, host_cache_gb=0.002), 128),
                              ("none", dict(device_cache_gb=0, host_cache_gb=0), 128),
                              ("none", dict(device_cache_gb=0, host_cache_gb=0), 0)):
    with glmjax.load(embedded_store, progress=False, prefill_chunk=chunk, **budget) as m:
      r = m.generate(ids[0].tolist(), 4, stop_ids=[])
      lp = m.score(ids, targets=np.roll(ids, -1, 1)) if chunk else None
      runs[name, chunk] = (r.tokens, lp, r.stats.get("prefill_expert_bytes", 0.0))
  base = runs["resident", 128]
  for (name, chunk), (toks, lp, read) in runs.items():
    assert toks == base[0], (name, chunk)
    if lp is not None:
      np.testing.assert_array_equal(lp, base[1])
  assert runs["none", 128][2] == runs["none", 0][2] > 0


def test_long_context_steps_stay_small_at_glm5_dims():
  """One decode step and one 2048-token prefill chunk at GLM-5's dims (one dense and one MoE
  layer of int4 experts) over a 131,072-token cache, each layer half's step lowered and compiled but
  never run: the compiled temporaries stay under 4 GB (a dense score array alone would be
  68 GB)."""
  from glmjax.formats.store import ExpertLayout
  from glmjax.formats.synthetic import synthetic_config
  from glmjax.model.config import Config
  from glmjax.model.quant import ExpertPool
  cfg = Config.from_dict(synthetic_config("glm5", moe_layers=1, experts=8, mtp=False))
  tree = weights.abstract(cfg, jnp.float32, with_mtp=False)
  sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  w = jax.tree_util.tree_map(sds, tree, is_leaf=weights.is_info)
  layout = ExpertLayout.make(cfg.hidden_size, cfg.moe_intermediate_size, 4, 64)
  one = layout.unpack(np.zeros((1, layout.nbytes), np.uint8))
  pool = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((8, *a.shape[1:]), a.dtype),
                                ExpertPool(one.gate_up, one.down))
  w.layers[1] = dataclasses.replace(w.layers[1], mlp=dataclasses.replace(w.layers[1].mlp,
                                                                         experts=pool))
  cache = jax.eval_shape(lambda: kvcache.init_cache(cfg, 1, 131072))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  cpu = Runtime(kernel="cpu")
  for name, width, n_valid, absorbed in (("decode", 1, None, True), ("prefill", 2048, i32(), None)):
    x = jax.ShapeDtypeStruct((1, width, cfg.hidden_size), jnp.float32)
    chunk = Chunk(x, cache.length, n_valid, None, cache.pages)
    assert all(lw.attn.indexer is not None for lw in w.layers)  # one attention half for both
    steps = [(attention_step, (attention_half(w.layers[0]), chunk, cache.layers[0]),
              {"absorbed": absorbed})]
    steps += [(mlp_step, (mlp_half(lw), chunk, None), {}) for lw in w.layers]
    for fn, args, kw in steps:  # each half's step (`layer_step`)
      lowered = fn.lower(*args, cfg=cfg, runtime=cpu, **kw)
      temp = lowered.compile().memory_analysis().temp_size_in_bytes
      assert temp < 4e9, (name, fn.__name__, temp)


def test_a_context_memory_cannot_hold_is_refused_before_allocating():
  model = glmjax.load(progress=False, max_context=1 << 20)
  model.kv.room = lambda: 10 << 20  # 10 MB left
  pages = model.kv.n_pages
  with pytest.raises(InputError, match=r"needs .* GB more .* only 0\.01 GB are available"):
    model.generate("def ", 500_000)
  assert model.kv.n_pages == pages  # nothing was allocated
  assert model.chat().max_context == 1 << 20  # a chat is not capped at 4096 either
  assert model.generate("def ", 4).tokens  # still usable


def test_pages_are_taken_as_needed_and_given_back():
  model = glmjax.load(progress=False)
  ps = model.kv.layout.page_size
  r = model.generate("def ", ps + 10, stop_ids=[])
  assert r.stats["kv_pages"] == 2 and r.stats["kv_bytes"] == 2 * model.kv.layout.page_bytes()
  assert model.kv.used_pages == 0
  chat = model.chat()
  chat.send("def f(x):", 8)
  first = len(chat.pages)
  chat.send("and now a much longer request " * 30, ps)
  assert len(chat.pages) > first and model.kv.used_pages == len(chat.pages)
  chat.close()
  assert model.kv.used_pages == 0


def test_server_kv_budget_refuses_what_never_fits_and_serves_the_rest():
  """A batch whose KV budget holds 2 pages: a request needing more gets a 400 naming the
  budget, while a concurrent one finishes; the pool is the budget, not max_position_embeddings
  per row."""
  from glmjax.serving.scheduler import Job, Scheduler
  import asyncio
  model = glmjax.load(progress=False)  # max_position_embeddings 1024
  layout = model.kv_layout()
  budget = 2 * layout.page_bytes() / 2**30
  sched = Scheduler(model, max_batch=2, max_queue=4, kv_cache_gb=budget, warm=False)
  try:
    assert sched.batch.pool.n_pages - 1 == 2
    loop = asyncio.new_event_loop()
    ok = Job(np.asarray(model.tokenizer.encode("def "), np.int32),
             dict(max_new_tokens=8, temperature=0.0), loop)
    big = Job(np.asarray(model.tokenizer.encode("def "), np.int32),
              dict(max_new_tokens=600, temperature=0.0), loop)
    sched.submit(ok)
    with pytest.raises(InputError, match="KV cache budget of 512 tokens"):
      sched.submit(big)
    events = []
    while not events or events[-1][0] not in ("done", "error"):
      events.append(loop.run_until_complete(asyncio.wait_for(ok.queue.get(), 60)))
    assert events[-1][0] == "done" and events[-1][1]["completion_tokens"] == 8
    assert sched.state()["kv"]["pages_free"] == 2
  finally:
    sched.close()


def test_automatic_kv_budget_at_glm5_geometry_is_not_max_context_per_row(monkeypatch):
  from glmjax.decoding import pages
  from glmjax.formats.synthetic import synthetic_config
  from glmjax.model.config import Config
  from glmjax.serving import batch
  cfg = Config.from_dict(synthetic_config("glm5", moe_layers=75, experts=256, mtp=True))
  model = type("M", (), {"kv_layout": lambda self: pages.KVLayout(cfg, "bfloat16", "bfloat16")})()
  monkeypatch.setattr(batch, "free_bytes", lambda: 64 << 30)
  full = 4 * model.kv_layout().pages_for(cfg.max_position_embeddings) * \
      model.kv_layout().page_bytes()
  got = batch.kv_budget(model, 4, cfg.max_position_embeddings, None)
  assert got == 16 << 30 and full > 100 * 2**30  # a quarter of what is free, not ~460 GB


def test_speculative_decoding_after_a_chunked_prompt(tmp_path):
  """A 40-token prompt in chunks of 8 (index_topk 6): the MTP layer absorbs it piece by piece
  into its own pages, and drafting gives the plain greedy tokens."""
  from glmjax.formats import checkpoint
  cfg = tiny_config(num_hidden_layers=3, n_routed_experts=8, index_n_heads=8, index_topk=6,
                    num_nextn_predict_layers=1)
  checkpoint.save_hf(weights.init(cfg, seed=1, std=0.3), cfg, str(tmp_path))
  model = glmjax.load(str(tmp_path), progress=False, prefill_chunk=8)
  prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 40).tolist()
  plain = model.generate(prompt, 12, stop_ids=[])
  spec = model.generate(prompt, 12, stop_ids=[], draft=2)
  assert spec.tokens == plain.tokens and spec.stats["draft_proposed"] > 0
  assert spec.stats["prefill_chunks"] == 5 and model.kv.mtp_layers is not None


def test_bench_context_script(tmp_path):
  """scripts/bench_context.py on the embedded model at small contexts, as a user runs it. Both
  contexts take two KV pages, so their steps share programs (200 and 300 compiled a second
  set: 31.9 against 20.3 CPU-s on a cold cache)."""
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out, png = tmp_path / "ctx.json", tmp_path / "ctx.png"
  r = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_context.py"),
                      "--contexts=300,400", "--steps=2", "--prefill_max=300", f"--json={out}",
                      f"--plot={png}"], capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr
  entries = json.loads(out.read_text())
  assert [e["context"] for e in entries] == [300, 400] and png.stat().st_size > 0
  for e in entries:
    assert e["decode_ms"] > 0 and e["dense"]["decode_ms"] > 0 and e["fill"] == "random"
    assert e["indexer_ms"] > 0 and e["kv_bytes_per_token"] > 0
  assert entries[0]["prefill_tok_s"] > 0 and "prefill_tok_s" not in entries[1]


def test_kv_dtype_kl_script(tmp_path):
  """scripts/kv_dtype_kl.py on one held-out file: a bfloat16 latent costs a small, positive KL;
  every narrower choice saves bytes."""
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "kl.json"
  r = subprocess.run([sys.executable, os.path.join(root, "scripts", "kv_dtype_kl.py"),
                      "--files=1", "--tokens=96", "--prefill_chunk=32",
                      "--choices=float32:bfloat16,bfloat16:bfloat16,bfloat16:float8",
                      f"--json={out}"],
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr
  rows = json.loads(out.read_text())["rows"]
  by = {(r["kv_dtype"], r["index_dtype"]): r for r in rows}
  # 96 tokens < index_topk: the indexer key's dtype cannot change which keys a query reads
  # here (only their order, so the sums' rounding)
  assert by["float32", "bfloat16"]["kl_mean"] < 1e-9
  assert by["bfloat16", "float8"]["kl_mean"] == pytest.approx(by["bfloat16", "bfloat16"]["kl_mean"],
                                                              rel=1e-2)
  assert 1e-7 < by["bfloat16", "bfloat16"]["kl_mean"] < 1e-2
  assert all(r["top1_agreement"] > 0.9 for r in rows)
  size = {k: r["bytes_per_position"] for k, r in by.items()}
  assert size["bfloat16", "float8"] < size["bfloat16", "bfloat16"] < size["float32", "bfloat16"]
