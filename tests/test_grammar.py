"""The grammar's token masks (glmjax.decoding.grammar) on the embedded model's tokenizer, and
the sampler under a mask (glmjax.decoding.sampling): no model runs here.

The reference for a mask is llguidance's own matcher fed one token at a time: a token is
allowed exactly when a copy of the matcher consumes it. Random walks over the masks must end in
output that the schema (jsonschema) or GLM's call parser (glm_format) accepts."""

from __future__ import annotations

import json

import jax
import jsonschema
import numpy as np
import pytest

from glmjax.decoding import glm_format, grammar, sampling, text
from glmjax.decoding.grammar import Constraint, GrammarError, GrammarSpec
from glmjax.errors import InputError

V = 4096  # the embedded model's vocabulary
SCHEMA = {"type": "object",
          "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 1, "maximum": 9},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                         "note": {"type": "string", "maxLength": 5}},
          "required": ["color", "n", "note"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
  return text.Tokenizer.from_dir(text.__file__.rsplit("/", 2)[0] + "/embedded_model")


@pytest.fixture(scope="module")
def stops(tok):
  return {tok.endoftext_id}


def _walk(c: Constraint, stops, seed: int, check_every: int = 0, budget: int = 120):
  """Tokens picked uniformly among those the mask allows until a stop token; with
  `check_every`, the mask is compared with the matcher's own verdict on every 
  `check_every`-th step. Returns the tokens (the stop left out)."""
  rng = np.random.default_rng(seed)
  out = []
  for step in range(budget):
    allowed = c.mask()
    if check_every and step % check_every == 0:
      _check_mask(c, allowed, stops, rng)
    t = int(rng.choice(np.nonzero(allowed)[0]))
    if t in stops:
      return out
    out.append(t)
    c.observe(t)
    assert c.failed is None
  raise AssertionError(f"no stop within {budget} tokens: a bounded schema must complete")


def _check_mask(c: Constraint, allowed: np.ndarray, stops, rng) -> None:
  """Each allowed token (up to 200 drawn) is consumed by a copy of the matcher, and a stop
  token is allowed exactly when the output is complete. (The mask may forbid a token the
  matcher would take: where the grammar forces text, llguidance allows only its canonical
  tokens, e.g. `":` and not `"` after a key.)"""
  ok = [t for t in np.nonzero(allowed)[0] if t not in stops]
  for t in rng.permutation(ok)[:200]:
    assert c.matcher.deep_copy().try_consume_tokens([int(t)]) == 1, t
  assert all(allowed[s] == c.matcher.is_accepting() for s in stops)


@pytest.mark.parametrize("seed", range(4))
def test_json_masks_match_the_matcher_and_every_walk_is_valid(tok, stops, seed):
  c = Constraint(GrammarSpec("json", SCHEMA), tok, V, stops)
  out = _walk(c, stops, seed, check_every=3)
  jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)


def test_json_object_takes_any_object_and_nothing_else(tok, stops):
  c = Constraint(GrammarSpec("json", {"type": "object"}), tok, V, stops)
  first = {tok.decode([int(t)]) for t in np.nonzero(c.mask())[0]}
  assert first == {"{", "{}"}
  for seed in range(4):  # a walk may open nested values; it ends in one JSON object
    c = Constraint(GrammarSpec("json", {"type": "object"}), tok, V, stops)
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < 300:
      allowed = c.mask()
      if c.matcher.is_accepting():  # stop at the first chance: unbounded values may go on
        break
      t = int(rng.choice(np.nonzero(allowed)[0]))
      out.append(t)
      c.observe(t)
    if c.matcher.is_accepting():
      assert isinstance(json.loads(tok.decode(out)), dict)


@pytest.mark.parametrize("seed", range(4))
def test_forced_call_arguments_follow_each_property_schema(tok, stops, seed):
  c = Constraint(GrammarSpec("tool_args", SCHEMA, field="tools"), tok, V, stops)
  out = _walk(c, stops, seed, check_every=4, budget=200)
  reply = tok.decode(out)
  assert reply.endswith(glm_format.CALL_END)
  call = glm_format.parse_call("f" + reply[:-len(glm_format.CALL_END)],
                               {"f": {"color", "note"}})  # the string-typed ones, as written
  assert call is not None, reply
  jsonschema.validate(call.arguments, SCHEMA)


def test_a_required_call_chooses_among_the_functions(tok, stops):
  functions = {"get_weather": {"type": "object", "properties": {"days": {
      "type": "integer", "minimum": 1, "maximum": 3}}, "required": ["days"]}, "ping": {}}
  names = set()
  for seed in range(8):
    c = Constraint(GrammarSpec("tool_call", functions, field="tools"), tok, V, stops)
    reply = tok.decode(_walk(c, stops, seed, budget=200))
    call = glm_format.parse_call(reply[:-len(glm_format.CALL_END)])
    assert call is not None and call.name in functions, reply
    jsonschema.validate(call.arguments, functions[call.name] or {"type": "object"})
    names.add(call.name)
  assert names == set(functions)


def test_with_reasoning_the_grammar_starts_after_think(tok, stops):
  c = Constraint(GrammarSpec("json", SCHEMA, after_think=True), tok, V, stops)
  for t in tok.encode("Let me see."):
    assert c.mask() is None  # the reasoning is free text
    c.observe(t)
  c.observe(tok.end_think_id)
  assert [tok.decode([int(t)]) for t in np.nonzero(c.mask())[0]] == ["{"]


@pytest.mark.parametrize("schema, field", [
    ({"type": "string", "pattern": "(a"}, "response_format"),
    ({"type": "string", "pattern": "^(a+)+$"}, "response_format.pattern"),
    ({"type": "object", "properties": {"x": {"type": "string", "pattern": "(\\w*)*z"}}},
     "response_format.properties.x.pattern"),
    ({"type": "string", "pattern": "(a)\\1"}, "response_format.pattern"),
    ({"type": "nonsense"}, "response_format"),
])
def test_a_schema_the_grammar_cannot_take_is_an_input_error_naming_its_field(
    tok, stops, schema, field):
  with pytest.raises(GrammarError) as e:
    grammar.validate(GrammarSpec("json", schema), tok, V, stops)
  assert isinstance(e.value, InputError) and e.value.field == field


def test_a_bounded_pattern_is_accepted(tok, stops):
  grammar.validate(GrammarSpec("json", {"type": "string", "pattern": "^[a-z]{1,4}(-[0-9]+)?$"}),
                   tok, V, stops)


# --- the sampler under a mask ----------------------------------------------------------------

@pytest.mark.parametrize("params", [
    sampling.SamplingParams(temperature=0.0),
    sampling.SamplingParams(temperature=1.0),
    sampling.SamplingParams(temperature=2.0, top_k=5),
    sampling.SamplingParams(temperature=1.0, top_p=0.5),
    sampling.SamplingParams(temperature=1.0, min_p=0.3, repetition_penalty=1.3),
])
def test_the_sampler_never_picks_a_token_the_mask_forbids(params):
  logits = jax.random.normal(jax.random.PRNGKey(0), (V,)) * 4
  allowed = np.zeros(V, bool)
  allowed[[3, 77, 1000, 4095]] = True  # the argmax is elsewhere: each filter must see the mask
  assert not allowed[int(np.argmax(logits))]
  picker = sampling.TokenPicker(params, V, seen=[77], seed=1)
  bits = np.packbits(allowed, bitorder="little")  # as the grammar hands it over
  picks = {picker.pick(logits, bits) for _ in range(30)}
  assert picks <= {3, 77, 1000, 4095}
  logp = picker.logprobs(logits, bits)
  assert np.all(np.isneginf(logp[~allowed]))


def test_a_masked_and_a_free_pick_share_one_compiled_sampler():
  logits = jax.random.normal(jax.random.PRNGKey(1), (V,))
  picker = sampling.TokenPicker(sampling.SamplingParams(temperature=0.7), V, seed=2)
  picker.pick(logits)
  size = sampling._sample_jit._cache_size()
  picker.pick(logits, np.packbits(np.arange(V) % 2 == 0, bitorder="little"))
  assert sampling._sample_jit._cache_size() == size
