"""A chat request as the model's template takes it (messages, tools, the tool choice, thinking)
and its reply as the OpenAI API gives it back (reasoning, answer, tool calls), free of any
web framework. The Anthropic route (glmjax.serving.anthropic) builds the same `ChatRequest`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from glmjax.decoding import glm_format, text
from glmjax.decoding.grammar import GrammarSpec
from glmjax.serving import fields
from glmjax.serving.protocol import ApiError

# OpenAI's rule for function names; it also keeps a forced call's name (which the server
# writes into the prompt itself) free of any control token's spelling.
NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"  # also the published schema's (glmjax.serving.openapi)
_NAME = re.compile(NAME_PATTERN)
TOOL_CHOICES = ("none", "auto", "required")


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
  return ApiError(400, message, param, code)


@dataclasses.dataclass
class ChatRequest:
  """What the template renders and how the reply is read.

  choice: "none" (tools offered, calls not parsed), "auto", "required" (the reply opens a
  call) or "named" (the reply opens a call of `named`). With `parallel` False the reply ends
  after its first call."""
  messages: list
  tools: list | None = None
  choice: str = "auto"
  named: str | None = None
  parallel: bool = True
  thinking: bool = False
  template_kwargs: dict = dataclasses.field(default_factory=dict)
  response_schema: dict | None = None  # response_format's JSON schema (json_object: any object)

  @property
  def grammar(self) -> GrammarSpec | None:
    """What decoding is constrained by: a forced call's arguments under its function's
    parameters (a required call: the name among the tools too), or the reply's JSON under
    `response_format`. A forced call closes the reasoning itself, so its grammar starts at
    once; a JSON reply's starts after `</think>`."""
    if self.tools and self.choice in ("named", "required"):
      params = {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools}
      if self.choice == "named":
        j = list(params).index(self.named)
        return GrammarSpec("tool_args", params[self.named],
                           field=f"tools[{j}].function.parameters")
      return GrammarSpec("tool_call", params, field="tools")
    if self.response_schema is not None:
      return GrammarSpec("json", self.response_schema, self.thinking,
                         "response_format.json_schema.schema")
    return None

  @property
  def parse_tools(self) -> bool:
    return bool(self.tools) and self.choice != "none"

  @property
  def reply_prefix(self) -> str:
    """The start of the reply the server writes for a forced call. It closes the reasoning
    first: a forced call cannot wait for the model to finish thinking."""
    if not self.tools or self.choice not in ("required", "named"):
      return ""
    close = glm_format.THINK_END if self.thinking else ""
    return close + glm_format.CALL_START + (self.named or "")

  @property
  def stops(self) -> list[str]:
    """Stop strings of the server's own: one call only ends the reply at its close."""
    single = self.choice == "named" or not self.parallel
    return [glm_format.CALL_END] if self.parse_tools and single else []

  def encode(self, tok) -> list[int]:
    return text.encode_chat(self.messages, tok, add_generation_prompt=True,
                            enable_thinking=self.thinking, tools=self.tools,
                            reply_prefix=self.reply_prefix, **self.template_kwargs)

  def splitter(self) -> glm_format.OutputSplitter:
    return glm_format.OutputSplitter(self.thinking, self.parse_tools, self.tools,
                                     self.reply_prefix)


# --- the OpenAI request --------------------------------------------------------------------------

def _text(content, where: str) -> str:
  """A message's text: a string, or text parts (each {type: text, text})."""
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    out = []
    for j, p in enumerate(content):
      if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
        raise _bad(f"{where}[{j}]: only text parts are supported", f"{where}[{j}]",
                   "invalid_type")
      fields.check(p, fields.CONTENT_PART, fields.PART_IGNORED, f"{where}[{j}].")
      out.append(p["text"])
    return "".join(out)
  raise _bad(f"{where} must be a string or a list of text parts", where, "invalid_type")


def _calls(calls, where: str) -> list[dict]:
  """An assistant turn's OpenAI tool calls, their arguments read into objects for the
  template."""
  if not isinstance(calls, list):
    raise _bad(f"{where} must be a list", where, "invalid_type")
  out = []
  for j, c in enumerate(calls):
    at = f"{where}[{j}]"
    fn = c.get("function") if isinstance(c, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and
            isinstance(fn.get("arguments"), str)):
      raise _bad(f"{at} must be {{id, type: function, function: {{name, arguments}}}}", at,
                 "invalid_type")
    try:
      args = json.loads(fn["arguments"])
    except ValueError:
      args = None
    if not isinstance(args, dict):
      raise _bad(f"{at}.function.arguments must be a JSON object", f"{at}.function.arguments")
    out.append({"id": c.get("id"), "type": "function",
                "function": {"name": fn["name"], "arguments": args}})
  return out


def messages(body: dict) -> list[dict]:
  """The chat messages as the template takes them: system, user, assistant (text, reasoning,
  tool calls) and tool results."""
  msgs = body.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise _bad("messages must be a non-empty list", "messages", "invalid_type")
  out = []
  for i, m in enumerate(msgs):
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise _bad(f"{where} must be an object with a string role", where, "invalid_type")
    fields.check(m, fields.CHAT_MESSAGE, fields.MESSAGE_IGNORED, where + ".")
    role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for it
    if role not in ("system", "user", "assistant", "tool"):
      raise _bad(f"{where}.role {role!r} is not supported (system or developer, user, "
                 "assistant, tool)", where + ".role")
    msg: dict[str, Any] = {"role": role}
    if m.get("tool_calls") is not None and (role != "assistant" or
                                            not isinstance(m["tool_calls"], list)):
      raise _bad(f"{where}.tool_calls must be a list, on an assistant message",
                 where + ".tool_calls")
    if role == "assistant" and m.get("tool_calls"):
      msg["tool_calls"] = _calls(m["tool_calls"], where + ".tool_calls")
      msg["content"] = "" if m.get("content") is None else _text(m["content"], where + ".content")
    else:
      msg["content"] = _text(m.get("content"), where + ".content")
    for key, allowed in (("tool_call_id", "tool"), ("reasoning_content", "assistant")):
      if m.get(key) is not None:
        if role != allowed or not isinstance(m[key], str):
          raise _bad(f"{where}.{key} must be a string, on a {allowed} message", f"{where}.{key}")
        msg[key] = m[key]
    if role == "tool" and "tool_call_id" not in msg:
      raise _bad(f"{where}: a tool message needs the tool_call_id it answers",
                 where + ".tool_call_id")
    out.append(msg)
  return out


def tools(body: dict) -> list[dict] | None:
  """`tools`: function definitions {type: function, function: {name, description?,
  parameters?, strict?}}; `strict` is kept for `_check_strict`, then dropped."""
  ts = body.get("tools")
  if ts is None:
    return None
  if not isinstance(ts, list):
    raise _bad("tools must be a list of function definitions", "tools", "invalid_type")
  out = []
  for j, t in enumerate(ts):
    at = f"tools[{j}]"
    fn = t.get("function") if isinstance(t, dict) else None
    if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)):
      raise _bad(f"{at} must be {{type: function, function: {{name, ...}}}}", at, "invalid_type")
    fields.check(t, {"type", "function"}, (), at + ".")
    fields.check(fn, {"name", "description", "parameters", "strict"}, (), at + ".function.")
    out.append({"type": "function", "function": function(fn, at + ".function")})
  names = [t["function"]["name"] for t in out]
  if len(set(names)) != len(names):
    raise _bad("tools: two functions share a name", "tools")
  return out


def function(fn: dict, at: str) -> dict:
  """One function's definition, checked: name, description, parameters (a JSON schema)."""
  if not isinstance(fn.get("name"), str) or not _NAME.fullmatch(fn["name"]):
    raise _bad(f"{at}.name must be 1-64 letters, digits, '_', '.' or '-'", at + ".name")
  if not isinstance(fn.get("description", ""), str):
    raise _bad(f"{at}.description must be a string", at + ".description", "invalid_type")
  if not isinstance(fn.get("parameters", {}), dict):
    raise _bad(f"{at}.parameters must be a JSON schema object", at + ".parameters",
               "invalid_type")
  if not isinstance(fn.get("strict", False), (bool, type(None))):
    raise _bad(f"{at}.strict must be a boolean", at + ".strict", "invalid_type")
  return {k: fn[k] for k in ("name", "description", "parameters", "strict") if k in fn}


def tool_choice(body: dict, offered: list | None) -> tuple[str, str | None]:
  """("none" | "auto" | "required" | "named", the named function)."""
  c = body.get("tool_choice")
  if c is None:
    return "auto", None
  if c in TOOL_CHOICES:
    if c == "required" and not offered:
      raise _bad("tool_choice required needs tools", "tool_choice")
    return c, None
  fn = c.get("function") if isinstance(c, dict) else None
  if not (isinstance(fn, dict) and c.get("type") == "function" and
          isinstance(fn.get("name"), str)):
    raise _bad("tool_choice must be none, auto, required or {type: function, function: "
               "{name}}", "tool_choice", "invalid_type")
  if fn["name"] not in [t["function"]["name"] for t in offered or ()]:
    raise _bad(f"tool_choice names {fn['name']!r}, which is not among tools", "tool_choice")
  return "named", fn["name"]


def template_kwargs(body: dict, tok) -> tuple[bool, dict]:
  """(enable_thinking, other template variables) from `chat_template_kwargs` (an allowlist)
  and `reasoning_effort` (only where the model's template reads it)."""
  kw = body.get("chat_template_kwargs")
  if kw is None:
    kw = {}
  if not isinstance(kw, dict):
    raise _bad("chat_template_kwargs must be an object", "chat_template_kwargs", "invalid_type")
  fields.check(kw, set(fields.TEMPLATE_KWARGS), (), "chat_template_kwargs.")
  thinking = kw.get("enable_thinking", False)
  if not isinstance(thinking, bool):
    raise _bad("chat_template_kwargs.enable_thinking must be a boolean",
               "chat_template_kwargs.enable_thinking", "invalid_type")
  extra = {}
  effort = body.get("reasoning_effort")
  if effort is not None:
    if not isinstance(effort, str) or effort not in ("minimal", "low", "medium", "high"):
      raise _bad("reasoning_effort must be minimal, low, medium or high", "reasoning_effort")
    if "reasoning_effort" not in (tok.chat_template or ""):
      raise _bad("reasoning_effort: this model's chat template has no such setting",
                 "reasoning_effort", "unsupported_value")
    extra["reasoning_effort"] = effort
  return thinking, extra


def _flag(body: dict, name: str, default: bool) -> bool:
  v = body.get(name)
  if v is None:
    return default
  if not isinstance(v, bool):
    raise _bad(f"{name} must be a boolean", name, "invalid_type")
  return v


def response_format(body: dict) -> dict | None:
  """The JSON schema `response_format` asks for: text (None), json_object (any object) or
  json_schema {name, schema, strict, description}."""
  rf = body.get("response_format")
  if rf is None:
    return None
  if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
    raise _bad("response_format must be {type: text | json_object | json_schema}",
               "response_format", "invalid_type")
  fields.check(rf, {"type", "json_schema"}, (), "response_format.")
  if rf["type"] == "text":
    return None
  if rf["type"] == "json_object":
    return {"type": "object"}
  js = rf.get("json_schema")
  if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
    raise _bad("response_format.json_schema must be {name, schema, strict}",
               "response_format.json_schema", "invalid_type")
  fields.check(js, {"name", "schema", "strict", "description"}, (), "response_format.json_schema.")
  return js.get("schema") or {}


def _check_strict(offered: list | None, choice: str) -> None:
  """`strict` tools are enforced by the grammar of a forced call; a call the model may or may
  not open (auto) is not constrained, so strict there would promise what is not kept."""
  for j, t in enumerate(offered or ()):
    if t["function"].get("strict") and choice not in ("named", "required"):
      raise _bad(f"tools[{j}].function.strict: a strict tool is enforced only when "
                 "tool_choice forces a call (required or a named function)",
                 f"tools[{j}].function.strict", "unsupported_value")


def request(body: dict, tok) -> ChatRequest:
  """The checked chat request of an OpenAI body."""
  offered = tools(body)
  choice, named = tool_choice(body, offered)
  _check_strict(offered, choice)
  thinking, extra = template_kwargs(body, tok)
  schema = response_format(body)
  if schema is not None and offered and choice in ("named", "required"):
    raise _bad("response_format cannot be combined with a forced tool call (the call's "
               "arguments follow the tool's schema)", "response_format")
  for t in offered or ():
    t["function"].pop("strict", None)  # the template renders the definition without it
  return ChatRequest(messages(body), offered, choice, named,
                     _flag(body, "parallel_tool_calls", True), thinking, extra, schema)


# --- the reply -----------------------------------------------------------------------------------

class ChoiceReply:
  """One choice's reply read as it streams: reasoning, answer and tool calls apart, in
  OpenAI's delta and message shapes."""

  def __init__(self, req: ChatRequest, end_think_id: int | None):
    self.req = req
    self.split = req.splitter()
    self.end_think_id = end_think_id

  def feed(self, piece: str) -> dict:
    return self._delta(self.split.feed(piece))

  def finish(self, summary: dict) -> dict:
    """The last delta; sets the summary's finish reason, message and reasoning tokens."""
    delta = glm_format.Delta()
    if summary.get("stop_matched") == glm_format.CALL_END and self.split.calls_open:
      delta = self.split.feed(glm_format.CALL_END)  # the server's own stop closed the call
    rest = self.split.finish()
    delta.reasoning += rest.reasoning
    delta.content += rest.content
    delta.calls += rest.calls
    if self.split.calls and summary["finish_reason"] != "length":
      summary["finish_reason"] = "tool_calls"
    summary["message"] = self.message()
    summary["reasoning_tokens"] = self._reasoning_tokens(summary["tokens"])
    return self._delta(delta)

  def _calls(self, calls: list, start: int) -> list[dict]:
    return [{"index": start + k, "id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments_json()}}
            for k, c in enumerate(calls)]

  def _delta(self, d: glm_format.Delta) -> dict:
    out: dict[str, Any] = {}
    if d.reasoning:
      out["reasoning_content"] = d.reasoning
    if d.content:
      out["content"] = d.content
    if d.calls:
      out["tool_calls"] = self._calls(d.calls, len(self.split.calls) - len(d.calls))
    return out

  def message(self) -> dict:
    s = self.split
    msg: dict[str, Any] = {"role": "assistant",
                           "content": s.content if s.content or not s.calls else None}
    if self.req.thinking:
      msg["reasoning_content"] = s.reasoning
    if s.calls:
      msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"}
                           for c in self._calls(s.calls, 0)]
    return msg

  def _reasoning_tokens(self, tokens: list[int]) -> int:
    """Tokens of the reply spent before `</think>` (0 when thinking is off or closed by the
    server for a forced call)."""
    if not self.req.thinking or self.req.reply_prefix:
      return 0
    if self.end_think_id is not None and self.end_think_id in tokens:
      return tokens.index(self.end_think_id) + 1
    return len(tokens) if not self.split.content and not self.split.calls else 0
