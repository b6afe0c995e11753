"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the same
scheduler, template and reply reader as the OpenAI routes: an Anthropic body becomes a
glmjax.serving.chat.ChatRequest, and the reply's reasoning, text and tool calls become
`thinking`, `text` and `tool_use` content blocks. Errors take Anthropic's shape
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from glmjax.decoding import glm_format
from glmjax.errors import GlmjaxError
from glmjax.serving import chat, fields, protocol
from glmjax.serving.protocol import ApiError

# anthropic-version: a date; the API answers in the shape of 2023-06-01, which later versions
# (the SDK sends its own release's date) keep for every field served here.
_VERSION = re.compile(r"20\d\d-\d\d-\d\d")
OLDEST_VERSION = "2023-01-01"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "request_too_large", 431: "request_too_large",
                415: "invalid_request_error", 429: "rate_limit_error", 499: "api_error"}


@dataclasses.dataclass
class Served:
  """What the route needs of the app (glmjax.serving.app.create_app builds it)."""
  name: str
  tok: Any
  guard: Any
  check_tokens: Callable  # ids -> checked ids (a GlmjaxError when too long)
  sampling: Callable  # (body, n_prompt, default_max, own_stops) -> settings
  grammar: Callable  # GrammarSpec -> its checked JSON for the settings (a 400 if refused)
  submit: Callable  # async (choices) -> jobs
  next_event: Callable  # async (queue, request) -> event or None
  failure: Callable  # job error -> ApiError


def error(e: ApiError) -> JSONResponse:
  """An ApiError in Anthropic's error shape."""
  kind = _ERROR_TYPES.get(e.status, "api_error" if e.status < 503 else "overloaded_error")
  return JSONResponse({"type": "error", "error": {"type": kind, "message": str(e)}},
                      status_code=e.status, headers=e.headers)


def _bad(message: str, param: str | None = None) -> ApiError:
  return ApiError(400, message, param, "invalid_value")


# --- the request -------------------------------------------------------------------------------

def _text_blocks(content, where: str) -> str:
  if isinstance(content, str):
    return content
  if not isinstance(content, list):
    raise _bad(f"{where} must be a string or a list of text blocks", where)
  out = []
  for j, b in enumerate(content):
    if not (isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)):
      raise _bad(f"{where}[{j}] must be a text block", f"{where}[{j}]")
    fields.check(b, {"type", "text"}, fields.ANTHROPIC_BLOCK_IGNORED, f"{where}[{j}].")
    out.append(b["text"])
  return "".join(out)


def _turn(m: dict, where: str) -> list[dict]:
  """One Anthropic message as chat messages: a user turn's tool results become tool messages
  (before its text); an assistant turn's thinking, text and tool uses one assistant message."""
  role, content = m["role"], m.get("content")
  if isinstance(content, str):
    return [{"role": role, "content": content}]
  if not isinstance(content, list):
    raise _bad(f"{where}.content must be a string or a list of blocks", where + ".content")
  results, texts, reasoning, calls = [], [], [], []
  for j, b in enumerate(content):
    at = f"{where}.content[{j}]"
    kind = b.get("type") if isinstance(b, dict) else None
    kind = kind if isinstance(kind, str) else None  # a list or object would not hash (a 500)
    allowed = {("user", "text"): {"text"}, ("assistant", "text"): {"text"},
               ("user", "tool_result"): {"tool_use_id", "content", "is_error"},
               ("assistant", "tool_use"): {"id", "name", "input"},
               ("assistant", "thinking"): {"thinking", "signature"}}.get((role, kind))
    if allowed is None:
      raise _bad(f"{at}: a {role} turn takes no {kind!r} block", at)
    fields.check(b, allowed | {"type"}, fields.ANTHROPIC_BLOCK_IGNORED, at + ".")
    if kind == "text":
      texts.append(_text_blocks([b], at))
    elif kind == "thinking":
      reasoning.append(str(b.get("thinking", "")))
    elif kind == "tool_result":
      if not isinstance(b.get("tool_use_id"), str):
        raise _bad(f"{at}.tool_use_id must be a string", at + ".tool_use_id")
      text = _text_blocks(b.get("content", ""), at + ".content")
      results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                      "content": ("Error: " + text) if b.get("is_error") else text})
    else:
      if not isinstance(b.get("name"), str) or not isinstance(b.get("input"), dict):
        raise _bad(f"{at} needs a name and an input object", at)
      calls.append({"id": b.get("id"), "type": "function",
                    "function": {"name": b["name"], "arguments": b["input"]}})
  out = results
  if role == "user" and (texts or not results):
    out = out + [{"role": "user", "content": "".join(texts)}]
  elif role == "assistant":
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
      msg["reasoning_content"] = "".join(reasoning)
    if calls:
      msg["tool_calls"] = calls
    out = [msg]
  return out


def _tools(body: dict) -> list | None:
  ts = body.get("tools")
  if ts is None:
    return None
  if not isinstance(ts, list):
    raise _bad("tools must be a list", "tools")
  out = []
  for j, t in enumerate(ts):
    at = f"tools[{j}]"
    if not isinstance(t, dict):
      raise _bad(f"{at} must be an object", at)
    fields.check(t, {"name", "description", "input_schema", "type"},
                 fields.ANTHROPIC_BLOCK_IGNORED, at + ".")
    if t.get("type") not in (None, "custom"):  # the server tools (web search, …) are Anthropic's
      raise _bad(f"{at}.type {t['type']!r}: only custom tools are served", at + ".type")
    fn = {k: v for k, v in (("name", t.get("name")), ("description", t.get("description")),
                            ("parameters", t.get("input_schema"))) if v is not None}
    out.append({"type": "function", "function": chat.function(fn, at)})
  return out


def _choice(body: dict, offered: list | None) -> tuple[str, str | None, bool]:
  c = body.get("tool_choice")
  if c is None:
    return "auto", None, True
  if not isinstance(c, dict) or c.get("type") not in ("auto", "any", "tool", "none"):
    raise _bad("tool_choice must be {type: auto | any | tool | none}", "tool_choice")
  fields.check(c, {"type", "name", "disable_parallel_tool_use"}, (), "tool_choice.")
  parallel = not c.get("disable_parallel_tool_use", False)
  if c["type"] == "tool":
    named = chat.tool_choice({"tool_choice": {"type": "function", "function": {
        "name": c.get("name")}}}, offered)[1]
    return "named", named, parallel
  if c["type"] == "any" and not offered:
    raise _bad("tool_choice any needs tools", "tool_choice")
  return {"auto": "auto", "any": "required", "none": "none"}[c["type"]], None, parallel


def _thinking(body: dict) -> bool:
  t = body.get("thinking")
  if t is None:
    return False
  if not isinstance(t, dict) or t.get("type") not in ("enabled", "disabled"):
    raise _bad("thinking must be {type: enabled | disabled}", "thinking")
  # budget_tokens is accepted and bounds nothing beyond max_tokens (README: Serving).
  fields.check(t, {"type", "budget_tokens"}, (), "thinking.")
  return t["type"] == "enabled"


def request(body: dict, supported: set) -> chat.ChatRequest:
  """The chat request of an Anthropic body (its fields checked against `supported`)."""
  fields.check(body, supported, fields.ANTHROPIC_IGNORED)
  msgs = body.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise _bad("messages must be a non-empty list", "messages")
  out = []
  if body.get("system") is not None:
    out.append({"role": "system", "content": _text_blocks(body["system"], "system")})
  for i, m in enumerate(msgs):
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
      raise _bad(f"{where} must be {{role: user | assistant, content}}", where)
    fields.check(m, {"role", "content"}, (), where + ".")
    out += _turn(m, where)
  offered = _tools(body)
  choice, named, parallel = _choice(body, offered)
  return chat.ChatRequest(out, offered, choice, named, parallel, _thinking(body))


def _settings(body: dict, served: Served, n_prompt: int, req: chat.ChatRequest) -> dict:
  """Anthropic's sampling fields as the OpenAI checks read them."""
  if protocol.integral(body.get("max_tokens")) is None:
    raise _bad("max_tokens is required: an integer", "max_tokens")
  stops = body.get("stop_sequences")
  if stops is not None and not (isinstance(stops, list) and
                                len(stops) <= fields.MAX_STOP_SEQUENCES and
                                all(isinstance(s, str) and s for s in stops)):
    raise _bad(f"stop_sequences must be a list of at most {fields.MAX_STOP_SEQUENCES} non-empty "
               "strings", "stop_sequences")
  temperature = body.get("temperature")
  if temperature is not None and not (isinstance(temperature, (int, float)) and
                                      not isinstance(temperature, bool) and
                                      0 <= temperature <= 1):
    raise _bad("temperature must be a number in [0, 1]", "temperature")
  openai = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "messages")
            if k in body}
  settings = served.sampling(openai, n_prompt, protocol.integral(body["max_tokens"]),
                             list(stops or []) + req.stops)
  if req.grammar is not None:  # a forced tool use: its input follows the tool's input_schema
    settings["grammar"] = served.grammar(req.grammar)
  return settings


# --- the reply -----------------------------------------------------------------------------------

class Blocks:
  """A reply's content blocks as it streams: thinking, text, then tool uses; each piece of
  output becomes Anthropic stream events, and `content` the whole reply's blocks."""

  def __init__(self, req: chat.ChatRequest):
    self.reader = chat.ChoiceReply(req, None)
    self.content: list[dict] = []
    self.open: str | None = None  # the type of the block being streamed

  def _start(self, kind: str, block: dict) -> list[tuple[str, dict]]:
    events = self._stop()
    self.content.append(block)
    self.open = kind
    return events + [("content_block_start", {"index": len(self.content) - 1,
                                              "content_block": dict(block)})]

  def _stop(self) -> list[tuple[str, dict]]:
    if self.open is None:
      return []
    self.open = None
    return [("content_block_stop", {"index": len(self.content) - 1})]

  def events(self, d: glm_format.Delta) -> list[tuple[str, dict]]:
    out = []
    for kind, piece, field in (("thinking", d.reasoning, "thinking"),
                               ("text", d.content, "text")):
      if piece:
        if self.open != kind:
          out += self._start(kind, {"type": kind, field: "", **(
              {"signature": ""} if kind == "thinking" else {})})
        self.content[-1][field] += piece
        out.append(("content_block_delta", {"index": len(self.content) - 1, "delta": {
            "type": f"{kind}_delta", field: piece}}))
    for call in d.calls:
      block = {"type": "tool_use", "id": "toolu_" + call.id[5:], "name": call.name, "input": {}}
      out += self._start("tool_use", block)
      block["input"] = call.arguments
      out += [("content_block_delta", {"index": len(self.content) - 1, "delta": {
          "type": "input_json_delta", "partial_json": call.arguments_json()}})]
      out += self._stop()
    return out

  def feed(self, piece: str) -> list[tuple[str, dict]]:
    return self.events(self.reader.split.feed(piece))

  def finish(self, summary: dict, user_stops: list[str]) -> tuple[list, dict]:
    """The last events and the stop_reason/stop_sequence of the finished reply."""
    split = self.reader.split
    out = []
    if summary.get("stop_matched") == glm_format.CALL_END and split.calls_open:
      out += self.events(split.feed(glm_format.CALL_END))
    out += self.events(split.finish()) + self._stop()
    matched = summary.get("stop_matched")
    if split.calls and summary["finish_reason"] != "length":
      reason, sequence = "tool_use", None
    elif summary["finish_reason"] == "length":
      reason, sequence = "max_tokens", None
    elif matched in user_stops:
      reason, sequence = "stop_sequence", matched
    else:
      reason, sequence = "end_turn", None
    return out, {"stop_reason": reason, "stop_sequence": sequence}


def _sse(event: str, data: dict) -> str:
  return f"event: {event}\ndata: {json.dumps({'type': event, **data})}\n\n"


async def messages(request: Request, served: Served, count_only: bool = False):
  """POST /v1/messages (and /v1/messages/count_tokens with `count_only`)."""
  jobs = []
  try:
    served.guard.admit(request)
    version = request.headers.get("anthropic-version")
    if version is not None and not (_VERSION.fullmatch(version) and version >= OLDEST_VERSION):
      raise _bad(f"anthropic-version {version!r} is not a date from {OLDEST_VERSION} on")
    body = await served.guard.json_body(request)

    def plan():
      protocol.check_model(body, served.name)
      req = request_of(body, count_only)
      try:
        ids = served.check_tokens(req.encode(served.tok))
      except GlmjaxError as e:
        raise _bad(str(e), "messages") from None
      if count_only:
        return req, ids, None
      return req, ids, _settings(body, served, len(ids), req)
    req, ids, settings = await run_in_threadpool(plan)
    if count_only:
      return JSONResponse({"input_tokens": len(ids)})
    stream = protocol.stream_flag(body)
    jobs = await served.submit([dict(ids=ids, text="", index=0, first=True,
                                     settings=settings)])
  except ApiError as e:
    return error(e)
  user_stops = list(body.get("stop_sequences") or [])
  message = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
             "model": served.name}
  blocks = Blocks(req)
  if stream:
    return StreamingResponse(_stream(jobs[0], message, blocks, user_stops, len(ids), served),
                             media_type="text/event-stream")
  try:
    while True:
      event = await served.next_event(jobs[0].queue, request)
      if event is None:
        return error(ApiError(499, "the client went away"))
      kind, value, _ = event
      if kind == "error":
        return error(served.failure(value))
      if kind == "done":
        blocks.feed(value["text"])
        _, stop = blocks.finish(value, user_stops)
        return JSONResponse({**message, "content": blocks.content, **stop, "usage": {
            "input_tokens": len(ids), "output_tokens": value["completion_tokens"]}})
  finally:
    jobs[0].cancel()


def request_of(body: dict, count_only: bool) -> chat.ChatRequest:
  return request(body, fields.ANTHROPIC_COUNT if count_only else fields.ANTHROPIC)


async def _stream(job, message: dict, blocks: Blocks, user_stops: list, n_prompt: int,
                  served: Served):
  """The official event sequence: message_start, per block content_block_start / _delta /
  _stop, message_delta (stop reason, usage), message_stop; an error event on a failure."""
  try:
    yield _sse("message_start", {"message": {
        **message, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
    while True:
      kind, value, _ = await job.queue.get()
      if kind == "text" and value:
        for event, data in blocks.feed(value):
          yield _sse(event, data)
      elif kind == "done":
        last, stop = blocks.finish(value, user_stops)
        for event, data in last:
          yield _sse(event, data)
        yield _sse("message_delta", {"delta": stop, "usage": {
            "output_tokens": value["completion_tokens"]}})
        yield _sse("message_stop", {})
        return
      elif kind == "error":
        e = served.failure(value)
        yield _sse("error", {"error": {"type": "api_error", "message": str(e)}})
        return
  finally:
    job.cancel()
