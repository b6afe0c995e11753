"""The server's OpenAPI 3.1 document (`GET /openapi.json`), built from the tables the checks
read: the field allowlists (glmjax.serving.fields) and the bounds (glmjax.serving.protocol), so
the published bounds are the enforced ones (tests/test_openapi_fuzz.py compares them).

What a body schema says is what the server refuses whatever else the body holds: a request
outside it is always a 4xx. Rules that depend on other fields (the prompt and max_tokens
against the context, a tool message's tool_call_id, a forced tool among the tools) are the
server's to check and not written here, so a body inside the schema may still get a 400.
Unknown fields are refused unless null (a null field asks for nothing: SDKs send unset
fields as null), hence `additionalProperties: {"type": "null"}` rather than `false`.
"""

from __future__ import annotations

from glmjax.serving import chat, fields, protocol

JSON = "application/json"
NULL = {"type": "null"}
ANY: dict = {}
ERROR_STATUSES = ("400", "401", "403", "404", "408", "413", "415", "429", "431", "499", "500",
                  "503")


def nullable(schema: dict) -> dict:
  return {"anyOf": [schema, NULL]}


def closed(props: dict, required: tuple = (), ignored: tuple = ()) -> dict:
  """An object of `props` (and `ignored` fields of any value); any other field only null."""
  props = {**props, **{k: ANY for k in ignored}}
  out = {"type": "object", "properties": props, "additionalProperties": NULL}
  if required:
    out["required"] = list(required)
  return out


def number(name: str) -> dict:
  lo, hi, lo_open = protocol.NUMBER_BOUNDS[name]
  low = {"exclusiveMinimum": lo} if lo_open else {"minimum": lo}
  return nullable({"type": "number", **low, "maximum": hi})


def integer(name: str) -> dict:
  lo, hi = protocol.INT_BOUNDS[name]
  return nullable({"type": "integer", "minimum": lo, "maximum": hi})


def max_tokens(context: int, least: int) -> dict:
  """The prompt takes at least one position, so at most context - 1 new tokens."""
  return {"type": "integer", "minimum": least, "maximum": context - 1}


def _sampling(context: int, least_tokens: int) -> dict:
  stop = {"type": "string", "minLength": 1}
  props = {k: number(k) for k in protocol.NUMBER_BOUNDS}
  props.update({k: integer(k) for k in ("seed", "top_k", "n")})
  props.update(
      max_tokens=nullable(max_tokens(context, least_tokens)),
      stop=nullable({"anyOf": [stop, {"type": "array", "items": stop,
                                      "maxItems": protocol.MAX_STOPS}]}),
      stream=nullable({"type": "boolean"}),
      stream_options=nullable(closed({"include_usage": nullable({"type": "boolean"})},
                                     ignored=fields.STREAM_OPTIONS_IGNORED)))
  assert set(props) == fields.SAMPLING, set(props) ^ fields.SAMPLING
  return props


def _chat_messages() -> dict:
  """A message per role: what each role may carry (any other field only null)."""
  part = closed({"type": {"enum": ["text"]}, "text": {"type": "string"}}, ("type", "text"),
                fields.PART_IGNORED)
  text = {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}
  ign = fields.MESSAGE_IGNORED
  return {"anyOf": [
      closed({"role": {"enum": ["system", "developer", "user"]}, "content": text},
             ("role", "content"), ign),
      closed({"role": {"enum": ["assistant"]}, "content": nullable(text),
              "tool_calls": nullable({"type": "array"}),
              "reasoning_content": nullable({"type": "string"})}, ("role",), ign),
      closed({"role": {"enum": ["tool"]}, "content": text,
              "tool_call_id": {"type": "string"}}, ("role", "content", "tool_call_id"), ign)]}


def _chat_body(name: str, context: int, effort: bool) -> dict:
  message = _chat_messages()
  function = closed({"name": {"type": "string", "pattern": chat.NAME_PATTERN},
                     "description": {"type": "string"}, "parameters": {"type": "object"},
                     "strict": nullable({"type": "boolean"})}, ("name",))
  tool = closed({"type": {"enum": ["function"]}, "function": function}, ("type", "function"))
  named = {"type": "object", "required": ["type", "function"], "properties": {
      "type": {"enum": ["function"]}, "function": {
          "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}
  json_schema = closed({"name": ANY, "schema": {"type": "object"}, "strict": ANY,
                        "description": ANY})
  props = {
      "model": {"enum": [name]}, "messages": {"type": "array", "items": message, "minItems": 1},
      "max_completion_tokens": nullable(max_tokens(context, 1)),
      "logprobs": nullable({"type": "boolean"}), "top_logprobs": integer("top_logprobs"),
      "tools": nullable({"type": "array", "items": tool}),
      "tool_choice": nullable({"anyOf": [{"enum": list(chat.TOOL_CHOICES)}, named]}),
      "parallel_tool_calls": nullable({"type": "boolean"}),
      "chat_template_kwargs": nullable(closed(
          {k: {"type": "boolean"} for k in fields.TEMPLATE_KWARGS})),
      # only where the model's chat template reads it (glmjax.serving.chat.template_kwargs)
      "reasoning_effort": nullable({"enum": ["minimal", "low", "medium", "high"]}) if effort
                          else NULL,
      "response_format": nullable(closed({
          "type": {"enum": ["text", "json_object", "json_schema"]},
          "json_schema": nullable(json_schema)}, ("type",))),
      **_sampling(context, 1)}
  assert set(props) == fields.CHAT, set(props) ^ fields.CHAT
  return closed(props, ("model", "messages"), fields.OPENAI_IGNORED)


def _completion_body(name: str, context: int, vocab: int) -> dict:
  ids = {"type": "array", "minItems": 1, "maxItems": context - 1,
         "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}}
  text = {"type": "string", "minLength": 1}
  prompt = {"anyOf": [text, ids, {"type": "array", "minItems": 1,
                                  "maxItems": protocol.MAX_CHOICES,
                                  "items": {"anyOf": [text, ids]}}]}
  props = {"model": {"enum": [name]}, "prompt": prompt, "logprobs": integer("logprobs"),
           "echo": nullable({"type": "boolean"}), **_sampling(context, 0)}
  assert set(props) == fields.COMPLETION, set(props) ^ fields.COMPLETION
  return closed(props, ("model", "prompt"), fields.OPENAI_IGNORED)


def _anthropic_body(name: str, context: int, count_only: bool) -> dict:
  ign = fields.ANTHROPIC_BLOCK_IGNORED
  text_block = closed({"type": {"enum": ["text"]}, "text": _STR}, ("type", "text"), ign)
  texts = {"anyOf": [_STR, {"type": "array", "items": text_block}]}
  result = closed({"type": {"enum": ["tool_result"]}, "tool_use_id": _STR, "content": texts,
                   "is_error": ANY}, ("type", "tool_use_id"), ign)
  use = closed({"type": {"enum": ["tool_use"]}, "id": ANY, "name": _STR,
                "input": {"type": "object"}}, ("type", "name", "input"), ign)
  thinking = closed({"type": {"enum": ["thinking"]}, "thinking": ANY, "signature": ANY},
                    ("type",), ign)
  message = {"anyOf": [
      closed({"role": {"enum": ["user"]}, "content": {"anyOf": [_STR, {
          "type": "array", "items": {"anyOf": [text_block, result]}}]}}, ("role", "content")),
      closed({"role": {"enum": ["assistant"]}, "content": {"anyOf": [_STR, {
          "type": "array", "items": {"anyOf": [text_block, use, thinking]}}]}},
             ("role", "content"))]}
  content = texts
  tool = closed({"name": {"type": "string", "pattern": chat.NAME_PATTERN},
                 "description": nullable({"type": "string"}),
                 "input_schema": nullable({"type": "object"}),
                 "type": nullable({"enum": ["custom"]})}, ("name",),
                fields.ANTHROPIC_BLOCK_IGNORED)
  props = {
      "model": {"enum": [name]}, "messages": {"type": "array", "items": message, "minItems": 1},
      "system": nullable(content), "tools": nullable({"type": "array", "items": tool}),
      "tool_choice": nullable(closed({"type": {"enum": ["auto", "any", "tool", "none"]},
                                      "name": ANY, "disable_parallel_tool_use": ANY},
                                     ("type",))),
      "thinking": nullable(closed({"type": {"enum": ["enabled", "disabled"]},
                                   "budget_tokens": ANY}, ("type",)))}
  required = ("model", "messages")
  if not count_only:
    stop = {"type": "string", "minLength": 1}
    props.update(
        max_tokens=max_tokens(context, 1),
        stop_sequences=nullable({"type": "array", "items": stop,
                                 "maxItems": fields.MAX_STOP_SEQUENCES}),
        temperature=nullable({"type": "number", "minimum": 0, "maximum": 1}),
        top_p=number("top_p"), top_k=integer("top_k"), stream=nullable({"type": "boolean"}))
    required += ("max_tokens",)
  want = fields.ANTHROPIC_COUNT if count_only else fields.ANTHROPIC
  assert set(props) == want, set(props) ^ want
  return closed(props, required, fields.ANTHROPIC_IGNORED)


def _errors(anthropic: bool) -> dict:
  ref = {"$ref": "#/components/schemas/" + ("AnthropicError" if anthropic else "Error")}
  return {code: {"description": "an error", "content": {JSON: {"schema": ref}}}
          for code in ERROR_STATUSES}


def _ok(schema: dict, stream: bool = False) -> dict:
  content = {JSON: {"schema": schema}}
  if stream:  # `stream: true`: server-sent events, each `data:` a JSON text (or [DONE])
    content["text/event-stream"] = {"schema": _obj("data", data=_STR, event=_STR)}
  return {"200": {"description": "the answer", "content": content}}


def _post(summary: str, body: dict, reply: dict, stream: bool = False,
          anthropic: bool = False) -> dict:
  return {"post": {"summary": summary, "requestBody": {
      "required": True, "content": {JSON: {"schema": body}}},
      "responses": {**_ok(reply, stream), **_errors(anthropic)}}}


def _get(summary: str, reply: dict, public: bool = False) -> dict:
  op = {"summary": summary, "responses": {**_ok(reply), **_errors(False)}}
  if public:
    op["security"] = []
  return {"get": op}


def _health() -> dict:
  """/health: its own body in both cases, 503 once the scheduler has stopped."""
  body = _obj("status", "model", status={"enum": ["ok", "error"]}, compilations=_INT,
              warming=_INT)
  op = _get("liveness and counters", body, public=True)
  op["get"]["responses"]["503"] = {"description": "the scheduler has stopped",
                                   "content": {JSON: {"schema": body}}}
  return op


def _obj(*required: str, **props) -> dict:
  return {"type": "object", "required": list(required), "properties": props}


_STR, _INT = {"type": "string"}, {"type": "integer"}
_FINISH = {"enum": ["stop", "length", "tool_calls"]}
_USAGE = _obj("prompt_tokens", "completion_tokens", "total_tokens", prompt_tokens=_INT,
              completion_tokens=_INT, total_tokens=_INT)
_CHAT_REPLY = _obj("id", "object", "created", "model", "choices", "usage",
                   object={"const": "chat.completion"}, usage=_USAGE, choices={
                       "type": "array", "minItems": 1, "items": _obj(
                           "index", "message", "finish_reason", index=_INT,
                           finish_reason=_FINISH, message=_obj(
                               "role", "content", role={"const": "assistant"},
                               content=nullable(_STR)))})
_COMPLETION_REPLY = _obj("id", "object", "created", "model", "choices", "usage",
                         object={"const": "text_completion"}, usage=_USAGE, choices={
                             "type": "array", "minItems": 1, "items": _obj(
                                 "index", "text", "finish_reason", index=_INT, text=_STR,
                                 finish_reason=_FINISH)})
_MESSAGE_REPLY = _obj("id", "type", "role", "model", "content", "stop_reason", "usage",
                      type={"const": "message"}, role={"const": "assistant"},
                      content={"type": "array", "items": _obj("type", type=_STR)},
                      stop_reason={"enum": ["end_turn", "max_tokens", "stop_sequence",
                                            "tool_use"]})


def _components(keyed: bool) -> dict:
  out = {"schemas": {
      "Error": _obj("error", error=_obj("message", "type", "param", "code", message=_STR,
                                        type=_STR, param=nullable(_STR), code=nullable(_STR))),
      "AnthropicError": _obj("type", "error", type={"const": "error"},
                             error=_obj("type", "message", type=_STR, message=_STR))}}
  if keyed:
    out["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                              "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
  return out


def document(name: str, context: int, vocab: int, keyed: bool, default_max: dict,
             effort: bool = False) -> dict:
  """The OpenAPI document of a server serving `name` with a `context`-token window and a
  `vocab`-token vocabulary; `keyed`: routes but /health and /openapi.json need an API key;
  `effort`: the chat template reads `reasoning_effort`."""
  tokens = _obj("tokens", tokens={"type": "array", "items": _INT})
  doc = {
      "openapi": "3.1.0",
      "info": {"title": "glmjax", "version": "1",
               "description": "OpenAI- and Anthropic-compatible routes over one model. "
                              f"Unset max_tokens: chat {default_max['chat']}, completions "
                              f"{default_max['completion']} (at most what the context leaves)."},
      "paths": {
          "/v1/chat/completions": _post("chat completion", _chat_body(name, context, effort),
                                        _CHAT_REPLY, stream=True),
          "/v1/completions": _post("text completion", _completion_body(name, context, vocab),
                                   _COMPLETION_REPLY, stream=True),
          "/v1/messages": _post("Anthropic message", _anthropic_body(name, context, False),
                                _MESSAGE_REPLY, stream=True, anthropic=True),
          "/v1/messages/count_tokens": _post(
              "Anthropic token count", _anthropic_body(name, context, True),
              _obj("input_tokens", input_tokens=_INT), anthropic=True),
          "/v1/models": _get("the served model", _obj("object", "data", data={
              "type": "array", "items": _obj("id", id={"const": name})})),
          "/tokenizer_info": _get("the tokenizer's special tokens and chat template",
                                  _obj("eos_token", "vocab_size", vocab_size=_INT)),
          "/tokenize": _post("text to token ids", closed(
              {"prompt": _STR, "add_special_tokens": nullable({"type": "boolean"})},
              ("prompt",), fields.TOKENIZER_IGNORED), tokens),
          "/detokenize": _post("token ids to text", closed(
              {"tokens": {"type": "array", "items": {
                  "type": "integer", "minimum": 0, "maximum": vocab - 1}}},
              ("tokens",), fields.TOKENIZER_IGNORED), _obj("prompt", prompt=_STR)),
          "/health": _health(),
          "/openapi.json": _get("this document", {"type": "object"}, public=True),
      },
      "components": _components(keyed),
  }
  if keyed:
    doc["security"] = [{"bearer": []}, {"apiKey": []}]
  return doc
