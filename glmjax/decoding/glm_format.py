"""GLM-5's output and tool layout: reasoning in `<think>…</think>`, tool calls as
`<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>…</tool_call>`.

`OutputSplitter` turns generated text, piece by piece as it streams, into reasoning, answer
text and complete tool calls; a call is only ever handed out whole (its `</tool_call>` seen), so
a call cut off by the token budget is never reported as a malformed call: its text goes back to
the answer. The same splitter parses a whole reply (one piece), so a stream joins to the whole
response by construction. `render_tools`/`render_tool_call` write the layout the model reads,
for chats without a template file of their own (the embedded model).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Mapping, Sequence

THINK_END = "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)


@dataclasses.dataclass
class ToolCall:
  """One parsed call: the function's name and its arguments (a JSON object)."""
  name: str
  arguments: dict
  id: str = dataclasses.field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

  def arguments_json(self) -> str:
    return json.dumps(self.arguments, ensure_ascii=False)


@dataclasses.dataclass
class Delta:
  """What a piece of output adds: reasoning text, answer text, finished tool calls."""
  reasoning: str = ""
  content: str = ""
  calls: list = dataclasses.field(default_factory=list)

  def __bool__(self) -> bool:
    return bool(self.reasoning or self.content or self.calls)


def _string_params(tools: Sequence[Mapping] | None) -> dict[str, set]:
  """Per function name, its parameters whose schema type is "string": their values are kept
  as written (a string "42" stays a string), all others are read as JSON when they parse."""
  out: dict[str, set] = {}
  for t in tools or ():
    fn = t.get("function", t) if isinstance(t, Mapping) else {}
    props = (fn.get("parameters") or fn.get("input_schema") or {}).get("properties") or {}
    out[fn.get("name")] = {k for k, v in props.items()
                           if isinstance(v, Mapping) and v.get("type") == "string"}
  return out


def parse_call(body: str, string_params: Mapping[str, set] | None = None) -> ToolCall | None:
  """The call inside `<tool_call>…</tool_call>` (`body`, markers excluded), or None when it is
  not one (no name, stray text between pairs, a key twice)."""
  head, sep, rest = body.partition(KEY_START)
  name = head.strip()
  if not name or any(c.isspace() or c in "<>" for c in name):
    return None
  strings = (string_params or {}).get(name, set())
  arguments: dict[str, Any] = {}
  pos, rest = 0, sep + rest
  while pos < len(rest):
    m = _PAIR.match(rest, pos)
    if m is None:
      return None if rest[pos:].strip() else ToolCall(name, arguments)
    key, value = m.group(1).strip(), m.group(2)
    if not key or key in arguments:
      return None
    arguments[key] = value if key in strings else _json_or_text(value)
    pos = m.end()
  return ToolCall(name, arguments)


def _json_or_text(value: str):
  try:
    return json.loads(value)
  except ValueError:
    return value


def _marker_tail(text: str, marker: str) -> int:
  """Length of the longest end of `text` that begins `marker` (held back: it may complete)."""
  for n in range(min(len(marker) - 1, len(text)), 0, -1):
    if marker.startswith(text[-n:]):
      return n
  return 0


class OutputSplitter:
  """Splits a reply's text into reasoning, answer and tool calls as it streams.

  `thinking`: the prompt opened `<think>`, so the reply starts as reasoning until `</think>`.
  `parse_tools`: `<tool_call>` blocks in the answer become calls (never inside reasoning).
  `tools`: the request's tool definitions, to read each argument by its schema's type.
  `prefix`: text the server already put at the start of the reply (a forced call's opening).
  """

  def __init__(self, thinking: bool = False, parse_tools: bool = False,
               tools: Sequence[Mapping] | None = None, prefix: str = ""):
    self.state = "reasoning" if thinking else "content"
    self.parse_tools = parse_tools
    self.strings = _string_params(tools)
    self._held = ""  # text not handed out yet: a possible marker's start, or an open call
    self._space = ""  # the answer's trailing whitespace, dropped if only calls follow
    self._after_think = False
    self.reasoning, self.content, self.calls = "", "", []
    self.calls_open = False  # a `<tool_call>` has been opened and not closed
    self._prefix = prefix

  def feed(self, piece: str) -> Delta:
    if self._prefix:
      piece, self._prefix = self._prefix + piece, ""
    out = Delta()
    buf = self._held + piece
    self._held = ""
    while buf:
      if self.state == "reasoning":
        i = buf.find(THINK_END)
        if i < 0:
          keep = _marker_tail(buf, THINK_END)
          out.reasoning += buf[:len(buf) - keep]
          self._held = buf[len(buf) - keep:]
          break
        out.reasoning += buf[:i]
        buf, self.state, self._after_think = buf[i + len(THINK_END):], "content", True
      elif self.state == "content":
        i = buf.find(CALL_START) if self.parse_tools else -1
        if i < 0:
          keep = _marker_tail(buf, CALL_START) if self.parse_tools else 0
          out.content += self._answer(buf[:len(buf) - keep])
          self._held = buf[len(buf) - keep:]
          break
        out.content += self._answer(buf[:i])
        buf, self.state, self.calls_open = buf[i + len(CALL_START):], "call", True
      else:  # inside a call: held whole until it closes
        i = buf.find(CALL_END)
        if i < 0:
          self._held = buf
          break
        call = parse_call(buf[:i], self.strings)
        if call is None:  # not a call after all: its text is part of the answer
          out.content += self._answer(CALL_START + buf[:i + len(CALL_END)])
        else:
          out.calls.append(call)
          self._space = ""  # whitespace between the answer and a call is layout
        buf, self.state, self.calls_open = buf[i + len(CALL_END):], "content", False
    return self._record(out)

  def _answer(self, text: str) -> str:
    """Answer text to hand out now: leading newlines after `</think>` dropped, and trailing
    whitespace (when calls may follow) held until more answer text comes."""
    if self._after_think:
      text = text.lstrip("\n")
      if not text:
        return ""
      self._after_think = False
    if not self.parse_tools:
      return text
    text = self._space + text
    body = text.rstrip()
    self._space = text[len(body):]
    return body

  def finish(self) -> Delta:
    """The rest at the end of the reply: held text goes where it was (an unclosed call, cut
    off by the budget or a stop, is answer text, never a call)."""
    out = Delta()
    held, self._held = self._held, ""
    if self.state == "reasoning":
      out.reasoning += held
    elif self.state == "call":
      out.content += self._answer(CALL_START + held)
      self.state, self.calls_open = "content", False
    else:
      out.content += self._answer(held)
    if not self.calls and self._space:
      out.content += self._space
    self._space = ""
    return self._record(out)

  def _record(self, out: Delta) -> Delta:
    self.reasoning += out.reasoning
    self.content += out.content
    self.calls += out.calls
    return out


def split_reasoning(text: str | None, thinking: bool) -> tuple[str | None, str | None]:
  """(reasoning, answer) of a whole reply; reasoning None when thinking was off."""
  if text is None:
    return None, None
  s = OutputSplitter(thinking=thinking)
  s.feed(text)
  s.finish()
  return (s.reasoning if thinking else None), s.content


# --- the layout the model reads (the built-in chat, no template file) --------------------------

def render_tools(tools: Sequence[Mapping]) -> str:
  """The system block that offers `tools` (OpenAI's [{"type": "function", "function": …}])."""
  lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
  return ("\n# Tools\n\nThese functions can be called to help with the request. Their "
          f"signatures, one JSON object per line:\n<tools>\n{lines}\n</tools>\n\nTo call one, "
          f"write {CALL_START}NAME{KEY_START}ARGUMENT{KEY_END}{VALUE_START}VALUE{VALUE_END}"
          f"{CALL_END}, one pair per argument, several calls one after another.")


def render_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
  """A call as the model writes it (string values as they are, others as JSON)."""
  pairs = "".join(f"{KEY_START}{k}{KEY_END}{VALUE_START}"
                  f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}{VALUE_END}"
                  for k, v in arguments.items())
  return f"{CALL_START}{name}{pairs}{CALL_END}"
