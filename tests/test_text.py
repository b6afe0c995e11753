"""Tokenizer, streaming detokenization, chat rendering and stop strings (glmjax.decoding.text)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from glmjax.decoding import text  # noqa: E402
from text_fixtures import GLM_LIKE_TEMPLATE, make_tokenizer_dir  # noqa: E402

UNICODE_SAMPLES = [
    "Crème brûlée in Łódź, naïve Ångström.",
    "日本語と中文，한국어 — mixed scripts.",
    "Emoji 😀🎉🚀 and a family 👨‍👩‍👧 plus a parrot 🦜 never seen in training.",
    "line one\nline two\n\n\ttabbed   spaced\r\nwindows",
    "def f(x):\n    return {\"k\": [x, x ** 2]}  # code\n",
    "",
]

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 😀"}],
    [{"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What is a café?"},
        {"role": "assistant", "content": "Un café est une boisson."},
        {"role": "user", "content": "Et un thé?\nMerci."},
    ],
    [
        {"role": "user", "content": "Compute 3*7."},
        {"role": "assistant", "content": "21", "reasoning_content": "3*7 is 21."},
        {"role": "user", "content": "And 日本?"},
    ],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("tok_template")
  make_tokenizer_dir(d, chat_template=GLM_LIKE_TEMPLATE)
  return str(d)


@pytest.fixture(scope="module")
def tok(tok_dir):
  return text.Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory):
  d = tmp_path_factory.mktemp("tok_plain")
  return make_tokenizer_dir(d)


@pytest.mark.parametrize("s", UNICODE_SAMPLES)
def test_round_trip(tok, s):
  ids = tok.encode(s)
  assert all(isinstance(i, int) for i in ids)
  assert tok.decode(ids) == s


def test_special_tokens_are_single_ids(tok):
  for name in text.GLM_SPECIAL_TOKENS:
    i = tok.token_id(name)
    assert i is not None, name
    assert tok.encode(name) == [i]
  assert tok.gmask_id == tok.token_id("[gMASK]")
  assert tok.think_id == tok.token_id("<think>") != tok.end_think_id
  assert len({tok.gmask_id, tok.sop_id, tok.system_id, tok.user_id, tok.assistant_id,
              tok.observation_id, tok.endoftext_id, tok.think_id, tok.end_think_id}) == 9
  assert tok.token_id("<|not_a_token|>") is None


def _split_char_ids(tok, ch):
  """Ids of a character that byte-level BPE spreads over several tokens; asserts it does."""
  ids = tok.encode(ch)
  assert len(ids) >= 2 and any("\ufffd" in tok.decode([i]) for i in ids), (ch, ids)
  return ids


@pytest.mark.parametrize("s", UNICODE_SAMPLES[:4] + ["🦜🦜 鸚鵡 x🦜y"])
def test_stream_decoder_never_emits_half_characters(tok, s):
  _split_char_ids(tok, "🦜")  # the parrot is not in the training text: it stays in pieces
  ids = tok.encode(s)
  dec = text.StreamDecoder(tok)
  pieces = [dec.feed(i) for i in ids]
  pieces.append(dec.flush())
  assert not any("\ufffd" in p for p in pieces), pieces
  assert "".join(pieces) == tok.decode(ids) == s


def test_stream_decoder_holds_then_releases(tok):
  ids = _split_char_ids(tok, "🦜")
  dec = text.StreamDecoder(tok)
  assert [dec.feed(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
  assert dec.feed(ids[-1]) == "🦜"
  # A truncated character is only released by flush, as the replacement character.
  assert dec.feed(ids[:-1]) == ""
  assert dec.flush() == tok.decode(ids[:-1])


def test_stream_decoder_with_special_tokens(tok):
  ids = tok.encode("<|assistant|>hé🦜<|endoftext|>")
  dec = text.StreamDecoder(tok)
  out = "".join(dec.feed(i) for i in ids) + dec.flush()
  assert out == "<|assistant|>hé🦜<|endoftext|>"
  dec = text.StreamDecoder(tok, skip_special_tokens=True)
  out = "".join(dec.feed(i) for i in ids) + dec.flush()
  assert out == "hé🦜"


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(tok, tok_dir, conv, thinking):
  from transformers import PreTrainedTokenizerFast
  hf = PreTrainedTokenizerFast.from_pretrained(tok_dir)
  messages = CONVERSATIONS[conv]
  want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                enable_thinking=thinking)
  got = text.render_chat(messages, tok, add_generation_prompt=True, enable_thinking=thinking)
  assert got == want
  assert got.endswith("<|assistant|><think>" if thinking else "<|assistant|><think></think>")
  want_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                    enable_thinking=thinking)
  if isinstance(want_ids, dict) or hasattr(want_ids, "keys"):
    want_ids = want_ids["input_ids"]
  assert text.encode_chat(messages, tok, enable_thinking=thinking) == list(want_ids)


def test_chat_template_without_generation_prompt_and_errors(tok, tok_dir):
  from transformers import PreTrainedTokenizerFast
  hf = PreTrainedTokenizerFast.from_pretrained(tok_dir)
  messages = CONVERSATIONS[2]
  want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
  assert text.render_chat(messages, tok, add_generation_prompt=False) == want
  tool = [{"role": "tool", "content": {"temp": "21°C"}}]
  assert text.render_chat(tool, tok, add_generation_prompt=False) == (
      hf.apply_chat_template(tool, tokenize=False))
  # the template's own refusal comes back as a GlmjaxError that quotes it
  with pytest.raises(text.TokenizerError, match="refused these messages: unknown role narrator"):
    text.render_chat([{"role": "narrator", "content": "x"}], tok)
  with pytest.raises(ValueError, match="messages"):
    text.render_chat([], tok)


def test_chat_template_file_wins(tmp_path):
  make_tokenizer_dir(tmp_path, chat_template=GLM_LIKE_TEMPLATE)
  (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{% endfor %}")
  t = text.Tokenizer.from_dir(tmp_path)
  assert text.render_chat(CONVERSATIONS[0], t) == "<system><user>"


def test_builtin_glm_template(plain_tok):
  assert plain_tok.chat_template is None
  messages = CONVERSATIONS[2]
  want = ("[gMASK]<sop><|system|>Answer in French.<|user|>What is a café?"
          "<|assistant|>Un café est une boisson.<|user|>Et un thé?\nMerci.")
  assert text.render_chat(messages, plain_tok, add_generation_prompt=False) == want
  assert text.render_chat(messages, plain_tok) == want + "<|assistant|><think></think>"
  thinking = text.render_chat(messages, plain_tok, enable_thinking=True)
  assert thinking == want + "<|assistant|><think>"
  ids = text.encode_chat(CONVERSATIONS[1], plain_tok)
  t = plain_tok
  assert ids[:3] == [t.gmask_id, t.sop_id, t.user_id]
  assert ids[-3:] == [t.assistant_id, t.think_id, t.end_think_id]
  assert t.decode(ids[3:-3]) == "2+2?"
  with pytest.raises(ValueError, match="narrator"):
    text.render_chat([{"role": "narrator", "content": "x"}], plain_tok)


def test_stop_ids(tok, tok_dir):
  turn_end = {tok.endoftext_id, tok.user_id, tok.observation_id}
  assert tok.stop_ids() == turn_end  # generation_config.json lists exactly these
  assert tok.stop_ids(7) == turn_end | {7}
  assert tok.stop_ids([7, 8]) == turn_end | {7, 8}
  with open(os.path.join(tok_dir, "generation_config.json")) as f:
    assert set(json.load(f)["eos_token_id"]) == turn_end
  with pytest.raises(ValueError, match="eos_token_id"):
    tok.stop_ids([tok.vocab_size])


def test_stop_matcher_split_across_chunks():
  m = text.StopMatcher(["</answer>", "STOP"])
  out = []
  for chunk in ["The ans", "wer is 4", "2 </an", "swer", "> trailing"]:
    emitted, stopped = m.feed(chunk)
    out.append(emitted)
    if stopped:
      break
  assert "".join(out) == "The answer is 42 "
  assert m.stopped and m.matched == "</answer>"
  assert m.feed("more") == ("", True)
  assert m.flush() == ""


def test_stop_matcher_false_alarm_and_flush():
  m = text.StopMatcher(["<|end|>"])
  assert m.feed("a <|e") == ("a ", False)   # could be the stop string: held back
  assert m.feed("nd") == ("", False)
  assert m.feed("x") == ("<|endx", False)   # it was not
  assert m.feed(" <|") == (" ", False)
  assert m.flush() == "<|"
  assert not m.stopped
  m = text.StopMatcher(["bc", "abcd"])
  assert m.feed("xab") == ("x", False)
  assert m.feed("cd!") == ("", True)  # the earliest match wins, not the first-listed stop
  assert m.matched == "abcd"
  with pytest.raises(ValueError, match="stop strings"):
    text.StopMatcher([""])


def test_missing_tokenizer_json(tmp_path):
  with pytest.raises(ValueError, match="tokenizer.json"):
    text.Tokenizer.from_dir(tmp_path)
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(ValueError, match="tokenizer.json"):
    text.Tokenizer.from_dir(tmp_path)


def test_bad_config_json_named(tmp_path):
  make_tokenizer_dir(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
  with pytest.raises(ValueError, match="tokenizer_config.json"):
    text.Tokenizer.from_dir(tmp_path)
