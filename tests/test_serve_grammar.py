"""Structured output under a grammar, through the `openai` SDK: `response_format` json_schema
(`chat.completions.parse` with a pydantic model) and json_object, forced tool calls whose
arguments follow the tool's schema, a schema the grammar refuses, and JSON after reasoning.

The embedded model's weights are random: whatever it writes is a sample at temperature 1.0,
so only the grammar can make every reply valid. Each request asks for n=10 choices (choice j
samples with seed + j), so two requests cover 20 seeds; the schemas are bounded (an enum, a
bounded integer, a short string), so every reply completes within max_tokens."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

import glmjax
from glmjax.decoding import generation
from glmjax.errors import InputError
from glmjax.serving.app import create_app
from tests.test_serve import serving

ASK = [{"role": "user", "content": "Pick a color."}]
N = 10  # choices per request: seeds s .. s + 9
MAX_TOKENS = 48  # the longest reply these schemas allow is ~40 tokens of the embedded vocabulary
# The embedded vocabulary spells GLM's call markers in plain text, ~7 tokens each: three
# argument pairs and the close take ~110 tokens at most.
CALL_TOKENS = 128


class Pick(BaseModel):
  color: Literal["red", "green", "blue"]
  n: int = Field(ge=1, le=9)
  note: str = Field(max_length=4, pattern="^[a-z]*$")


WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "note": {"type": "string", "maxLength": 4}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def server():
  model = glmjax.load(progress=False, max_context=512)
  app = create_app(model, max_batch=N, max_queue=N, warm_prefill=False)
  with serving(app) as port:
    base = f"http://127.0.0.1:{port}"
    yield dict(model=model, tok=model.tokenizer, name=app.state.model_name,
               client=openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0))
  model.close()


def _ask(server, **kw):
  return {"model": server["name"], "messages": ASK, "max_tokens": MAX_TOKENS,
          "temperature": 1.0, "n": N, **kw}


@pytest.mark.parametrize("seed", [0, N])
def test_every_parsed_reply_is_valid_over_20_seeds(server, seed):
  r = server["client"].chat.completions.parse(response_format=Pick, seed=seed,
                                               **_ask(server))
  assert len(r.choices) == N
  for c in r.choices:
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(c.message.parsed, Pick), c.message.content


@pytest.mark.parametrize("seed", [0, N])
def test_every_streamed_reply_is_valid_over_20_seeds(server, seed):
  fmt = openai.lib._pydantic.to_strict_json_schema(Pick)
  stream = server["client"].chat.completions.create(
      stream=True, seed=seed, response_format={"type": "json_schema", "json_schema": {
          "name": "Pick", "schema": fmt, "strict": True}}, **_ask(server))
  texts, reasons = {}, {}
  for chunk in stream:
    for c in chunk.choices:
      texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
      reasons[c.index] = c.finish_reason or reasons.get(c.index)
  assert sorted(texts) == list(range(N)) and set(reasons.values()) == {"stop"}
  for reply in texts.values():
    Pick.model_validate_json(reply)


def test_json_object_replies_are_objects(server):
  r = server["client"].chat.completions.create(
      response_format={"type": "json_object"}, seed=3,
      **{**_ask(server), "n": 4, "max_tokens": 8})
  for c in r.choices:  # a budget cut may end an open object; a finished one is an object
    if c.finish_reason == "stop":
      assert isinstance(json.loads(c.message.content), dict)
    else:
      assert c.message.content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_arguments_validate_over_20_seeds(server, stream):
  forced = {"type": "function", "function": {"name": "get_weather"}}
  for seed in (0, N):
    kw = _ask(server, tools=TOOLS, tool_choice=forced, seed=seed, max_tokens=CALL_TOKENS)
    if not stream:
      r = server["client"].chat.completions.create(**kw)
      calls = {c.index: (c.finish_reason, c.message.tool_calls[0].function.arguments)
               for c in r.choices}
    else:
      calls = {}
      for chunk in server["client"].chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
          reason, args = calls.get(c.index, (None, ""))
          for t in c.delta.tool_calls or []:
            args += t.function.arguments or ""
          calls[c.index] = (c.finish_reason or reason, args)
    assert len(calls) == N
    for reason, args in calls.values():
      assert reason == "tool_calls"
      jsonschema.validate(json.loads(args), WEATHER)


def test_a_required_call_with_strict_tools_is_constrained(server):
  strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
  r = server["client"].chat.completions.create(
      **_ask(server, tools=strict, tool_choice="required", seed=5, max_tokens=CALL_TOKENS))
  for c in r.choices:
    assert c.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), WEATHER)
  with pytest.raises(openai.BadRequestError) as e:  # strict, but the call is not forced
    server["client"].chat.completions.create(**_ask(server, tools=strict, max_tokens=2))
  assert e.value.body["param"] == "tools[0].function.strict"


@pytest.mark.parametrize("schema, param", [
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}},
     "response_format.json_schema.schema.properties.a.pattern"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(a"}}},
     "response_format.json_schema.schema"),
    ({"type": "nonsense"}, "response_format.json_schema.schema"),
])
def test_a_schema_the_grammar_refuses_is_a_400_naming_it(server, schema, param):
  with pytest.raises(openai.BadRequestError) as e:
    server["client"].chat.completions.create(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        **{**_ask(server), "n": 1, "max_tokens": 2})
  assert e.value.body["param"] == param


def test_a_forced_call_whose_schema_the_grammar_refuses_is_a_400_naming_it(server):
  bad = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(\\w+)*$"}}}
  tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": bad}}]
  with pytest.raises(openai.BadRequestError) as e:
    server["client"].chat.completions.create(**_ask(
        server, tools=tools, tool_choice={"type": "function", "function": {"name": "f"}},
        n=1, max_tokens=2))
  assert e.value.body["param"] == "tools[1].function.parameters.properties.x.pattern"


def test_with_reasoning_the_json_starts_after_think(server, monkeypatch):
  """The model is made to write `Hm.</think>` first (a scripted start), then samples freely
  under the grammar: the reasoning is free text, the answer valid JSON."""
  tok = server["tok"]
  opening = tok.encode("Hm.") + [tok.end_think_id]
  sample = generation.Request.pick

  def pick(self, logits):
    return opening[len(self.out)] if len(self.out) < len(opening) else sample(self, logits)
  monkeypatch.setattr(generation.Request, "pick", pick)
  r = server["client"].chat.completions.parse(
      response_format=Pick, seed=7, extra_body={"chat_template_kwargs": {"enable_thinking": True}},
      **{**_ask(server), "n": 3, "max_tokens": MAX_TOKENS + len(opening)})
  for c in r.choices:
    assert c.message.model_extra["reasoning_content"] == "Hm."
    assert isinstance(c.message.parsed, Pick), c.message.content


def test_model_generate_takes_a_json_schema(server):
  """The Python API: `Model.generate(json_schema=...)` samples under the same grammar; a schema
  it cannot take is an InputError naming the field."""
  schema = openai.lib._pydantic.to_strict_json_schema(Pick)  # additionalProperties: false
  model = server["model"]
  for seed in range(3):
    r = model.generate("Pick a color.", MAX_TOKENS, temperature=1.0, seed=seed,
                       json_schema=schema)
    assert r.stop_reason == "stop_token", r.text
    Pick.model_validate_json(r.text)
  with pytest.raises(InputError) as e:
    model.generate("x", 2, json_schema={"type": "string", "pattern": "(a*)*"})
  assert e.value.field == "json_schema.pattern"
