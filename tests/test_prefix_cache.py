"""The prefix cache: its bookkeeping against a plain reference, and decoding with it equal to
decoding without it (greedy tokens identical, logprobs within 1e-4), eviction included."""

from __future__ import annotations

import numpy as np
import openai
import pytest

import glmjax
from glmjax.decoding.generation import new_request
from glmjax.decoding.prefix import PrefixCache
from glmjax.serving.batch import BatchDecoder

PS = 4  # a small page for the bookkeeping tests


def test_keys_name_whole_prefixes():
  cache = PrefixCache(PS)
  a = np.arange(12)
  b = a.copy()
  b[1] = 99  # differs in the first page only
  ka, kb = cache.keys(a, 12), cache.keys(b, 12)
  assert len(ka) == 3 and len(cache.keys(a, 11)) == 2
  assert all(x != y for x, y in zip(ka, kb))  # a later page's key depends on every earlier token
  assert cache.keys(a, 8) == ka[:2]


def test_lookup_insert_release_evict_follow_the_rules():
  cache = PrefixCache(PS)
  ids = np.arange(10)
  assert cache.lookup(ids, 9) == []
  cache.insert(ids, [5, 6, 7], 10)  # pages 5, 6 are full (positions 0..7); 7 is partial
  assert cache.cached_pages == 2
  assert cache.release([5, 6, 7]) == [7]  # the partial page goes back; 5 and 6 stay cached
  assert list(cache.idle) == [5, 6]
  assert cache.lookup(ids, 9) == [5, 6] and not cache.idle  # in use again
  assert cache.lookup(np.r_[ids[:4], 50, 51, 52, 53], 8) == [5]  # shares the first page only
  assert cache.release([5]) == [] and cache.release([5, 6]) == []
  assert list(cache.idle) == [5, 6]
  assert cache.lookup(ids, 7) == [5]  # a limit inside page 6: page 5 only
  assert cache.release([5]) == []
  assert list(cache.idle) == [6, 5]  # 5 used last
  assert cache.evict(1) == [6] and cache.cached_pages == 1
  assert cache.lookup(ids, 9) == [5]  # the prefix's first page is still there
  assert cache.clear() == [] and cache.release([5]) == [5]  # forgotten while in use: freed


@pytest.fixture(scope="module")
def model():
  m = glmjax.load(progress=False, max_context=1024)
  yield m
  m.close()


def _prompts(model) -> tuple[np.ndarray, list[np.ndarray]]:
  from glmjax.formats import corpus
  text = corpus.read(corpus.HELD_OUT_SMALL[0])
  ids = np.asarray(model.tokenizer.encode(text), np.int32)
  shared = ids[:540]  # two full pages of 256 and 28 more tokens
  tails = [ids[600:640], ids[700:760], ids[800:810]]
  return shared, [np.concatenate([shared, t]) for t in tails]


def _run(batch: BatchDecoder, model, prompts, n_new=6):
  """Each prompt through the batch one after another: (tokens, logprobs, cached tokens)."""
  out = []
  for p in prompts:
    req = new_request(model, p, n_new, logprobs=1)
    done = batch.admit(p, req, tag=object())
    while not done:
      done = bool(batch.step())
    out.append((list(req.out), [sc.logprob for _, sc in req.scores], req.cached_tokens))
  return out


def test_decoding_with_the_cache_equals_decoding_without(model):
  _, prompts = _prompts(model)
  plain = _run(BatchDecoder(model, 2, kv_cache_gb=0.05), model, prompts)
  batch = BatchDecoder(model, 2, kv_cache_gb=0.05, prefix_cache=True)
  cached = _run(batch, model, prompts)
  assert [c for _, _, c in plain] == [0, 0, 0]
  assert [c for _, _, c in cached] == [0, 512, 512]  # the shared prefix's two full pages
  for (t0, lp0, _), (t1, lp1, _) in zip(plain, cached):
    assert t0 == t1
    np.testing.assert_allclose(lp1, lp0, atol=1e-4)
  assert batch.pool.prefix.hits_tokens == 1024
  # a page-aligned prompt shares every full page but the one holding its last token
  p = prompts[0][:768]
  assert _run(batch, model, [p])[0][2] == 512


def test_eviction_under_a_small_budget_keeps_results(model):
  _, prompts = _prompts(model)
  layout = model.kv_layout()
  gb = 4 * layout.page_bytes() / 2 ** 30  # 4 pages: one request of 3, and one more
  batch = BatchDecoder(model, 1, kv_cache_gb=gb, prefix_cache=True)
  other = np.asarray(model.tokenizer.encode("x = 1\n" * 300), np.int32)[:600]
  assert len(other) == 600  # 3 pages with its new tokens: it must evict a cached page
  out = _run(batch, model, [prompts[0], other, prompts[1]])
  assert out[2][2] == 0  # the first prompt's pages were evicted for the second
  plain = _run(BatchDecoder(model, 1, kv_cache_gb=gb), model, [prompts[1]])
  assert out[2][0] == plain[0][0]
  assert batch.pool.available == batch.pool.n_pages - 1  # every page free or cached


def test_the_server_reports_cached_tokens(model):
  from glmjax.serving.app import create_app
  from tests.test_serve import serving
  _, prompts = _prompts(model)
  app = create_app(model, max_batch=2, max_queue=4, kv_cache_gb=0.05,  # prefix cache: default
                   warm_prefill=False)
  with serving(app) as port:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    got = [client.completions.create(model=app.state.model_name, prompt=p.tolist(),
                                     max_tokens=4, temperature=0) for p in prompts[:2]]
    assert [g.usage.prompt_tokens_details.cached_tokens for g in got] == [0, 512]
  assert got[1].choices[0].text == model.generate(prompts[1], 4).text


def test_generate_with_the_prefix_cache_option(model):
  _, prompts = _prompts(model)
  with glmjax.load(progress=False, max_context=1024, prefix_cache=True) as cached:
    got = [cached.generate(p, 6) for p in prompts[:2]]
    assert [g.stats["cached_tokens"] for g in got] == [0, 512]
    assert got[1].stats["prompt_tokens"] == len(prompts[1])
    assert [g.tokens for g in got] == [model.generate(p, 6).tokens for p in prompts[:2]]
  assert model.kv.prefix is None  # off by default
