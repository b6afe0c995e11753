"""Text in, text out through the model: prompts, stop strings, chat sessions reusing the cache."""


import pytest

import glmjax
from glmjax.formats import checkpoint
from glmjax.decoding import text
from glmjax.model import weights
from hf_reference import tiny_config
from text_fixtures import GLM_LIKE_TEMPLATE, make_tokenizer_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  """A random model whose vocabulary is a tiny trained BPE with GLM's special tokens."""
  path = tmp_path_factory.mktemp("textmodel")
  tok = make_tokenizer_dir(path, chat_template=GLM_LIKE_TEMPLATE)
  cfg = tiny_config(vocab_size=tok.vocab_size, index_n_heads=4, index_topk=8,
                    eos_token_id=tok.endoftext_id, max_position_embeddings=512)
  checkpoint.save_hf(weights.init(cfg, seed=3, std=0.5), cfg, str(path))
  return glmjax.load(str(path), progress=False)


def test_text_in_text_out(model):
  r = model.generate("def add(a, b):", 24, stop_ids=[])
  assert r.text == model.tokenizer.decode(r.tokens)
  pieces = []
  r2 = model.generate("def add(a, b):", 24, stop_ids=[], on_text=pieces.append)
  assert "".join(pieces) == r2.text == r.text
  # Text prompts encode exactly as token-id prompts do.
  ids = model.tokenizer.encode("def add(a, b):")
  assert model.generate(ids, 24, stop_ids=[]).tokens == r.tokens


def test_stop_string(model):
  free = model.generate("The quick brown", 40, stop_ids=[])
  assert len(free.text) > 6
  stop = free.text[3:6]
  r = model.generate("The quick brown", 40, stop_ids=[], stop=[stop])
  assert r.stop_reason == "stop_string"
  assert r.text == free.text[:free.text.index(stop)]


def test_default_stop_ids_include_tokenizer_turn_tokens(model):
  stops = model.default_stop_ids()
  tok = model.tokenizer
  assert {tok.endoftext_id, tok.user_id} <= stops


def test_chat_reuses_cache_and_matches_a_fresh_prefill(model):
  chat = model.chat(system="Be brief.")
  first = chat.send("Hello there", max_new_tokens=12, stop_ids=[])
  second = chat.send("And again?", max_new_tokens=12, stop_ids=[])
  assert second.stats["reused_tokens"] > 0
  # The same conversation prefilled from scratch gives the same greedy reply.
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
          {"role": "assistant", "content": first.text}, {"role": "user", "content": "And again?"}]
  ids = text.encode_chat(msgs, model.tokenizer, add_generation_prompt=True, enable_thinking=False)
  fresh = model.generate(ids, 12, stop_ids=[])
  assert second.tokens == fresh.tokens
  assert ids[:int(second.stats["reused_tokens"])] == chat.tokens[:int(second.stats["reused_tokens"])]


def test_prompt_without_tokenizer_is_refused(tmp_path):
  cfg = tiny_config(vocab_size=32, num_hidden_layers=1)
  checkpoint.save_hf(weights.init(cfg, seed=0), cfg, str(tmp_path))
  m = glmjax.load(str(tmp_path), progress=False)
  with pytest.raises(glmjax.InputError, match="no tokenizer"):
    m.generate("hello", 4)
