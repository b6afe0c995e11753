"""The OpenAI wire format: request checks and response bodies, free of any web framework.

Every bad input becomes an `ApiError` (HTTP status + OpenAI's error object), never an
exception the server would turn into a 500.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

# Sampling bounds as OpenAI documents them.
_TEMPERATURE = (0.0, 2.0)


class ApiError(Exception):
  """A client error: `status` and the body `{"error": {message, type, param, code}}`."""

  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status = status
    self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _number(body: dict, name: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise ApiError(400, f"{name} must be a number, got {type(v).__name__}", name, "invalid_type")
  if v < lo or v > hi or (lo_open and v == lo):
    side = "(" if lo_open else "["
    raise ApiError(400, f"{name} must be in {side}{lo}, {hi}], got {v}", name, "invalid_value")
  return float(v)


def _int(body: dict, name: str, default: int | None) -> int | None:
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, int):
    raise ApiError(400, f"{name} must be an integer, got {type(v).__name__}", name,
                   "invalid_type")
  return v


def _stops(body: dict) -> list[str]:
  v = body.get("stop")
  if v is None:
    return []
  if isinstance(v, str):
    v = [v]
  if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > 4:
    raise ApiError(400, "stop must be a non-empty string or a list of at most 4 of them",
                   "stop", "invalid_type")
  return v


def sampling(body: dict, n_prompt: int, context: int, default_max: int,
             defaults: dict | None = None) -> dict:
  """The checked sampling settings of a request (`glmjax.decoding.generation.new_request`
  keywords) for a prompt of `n_prompt` tokens in a `context`-token window; unset temperature
  and top_p take `defaults` (the model's generation_config; OpenAI's 1.0 without)."""
  defaults = defaults or {}
  if n_prompt >= context:
    raise ApiError(400, f"the prompt is {n_prompt} tokens; this model's context is {context} "
                   "tokens and must hold at least one generated token", "messages"
                   if "messages" in body else "prompt", "context_length_exceeded")
  room = context - n_prompt
  max_tokens = _int(body, "max_completion_tokens", None)
  max_tokens = _int(body, "max_tokens", max_tokens)
  if max_tokens is None:
    max_tokens = min(default_max, room)
  if max_tokens < 1:
    raise ApiError(400, f"max_tokens must be ≥ 1, got {max_tokens}", "max_tokens",
                   "invalid_value")
  if max_tokens > room:
    raise ApiError(400, f"max_tokens ({max_tokens}) + the prompt ({n_prompt} tokens) exceed "
                   f"the context of {context} tokens", "max_tokens", "context_length_exceeded")
  n = _int(body, "n", 1)
  if n != 1:
    raise ApiError(400, f"only n=1 is supported, got {n}", "n", "invalid_value")
  seed = _int(body, "seed", 0)
  return dict(max_new_tokens=max_tokens,
              temperature=_number(body, "temperature", defaults.get("temperature", 1.0),
                                  *_TEMPERATURE),
              top_p=_number(body, "top_p", defaults.get("top_p", 1.0), 0.0, 1.0, lo_open=True),
              seed=seed, stop=_stops(body))


def stream_flag(body: dict) -> bool:
  v = body.get("stream", False)
  if v is None:
    return False
  if not isinstance(v, bool):
    raise ApiError(400, f"stream must be a boolean, got {type(v).__name__}", "stream",
                   "invalid_type")
  return v


def check_model(body: dict, served: str) -> None:
  name = body.get("model")
  if not isinstance(name, str):
    raise ApiError(400, "model must be a string naming the served model", "model",
                   "invalid_type")
  if name != served:
    raise ApiError(404, f"the model {name!r} does not exist; this server serves {served!r}",
                   "model", "model_not_found")


def messages(body: dict) -> list[dict]:
  """The chat messages as the chat template takes them: role and text content."""
  msgs = body.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise ApiError(400, "messages must be a non-empty list", "messages", "invalid_type")
  out = []
  for i, m in enumerate(msgs):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise ApiError(400, f"messages[{i}] must be an object with a string role",
                     f"messages[{i}]", "invalid_type")
    if m["role"] not in ("system", "user", "assistant"):
      raise ApiError(400, f"messages[{i}].role {m['role']!r} is not supported (system, user, "
                     "assistant)", f"messages[{i}].role", "invalid_value")
    content = m.get("content")
    if isinstance(content, list):  # text parts only
      if not all(isinstance(p, dict) and p.get("type") == "text" and
                 isinstance(p.get("text"), str) for p in content):
        raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                       f"messages[{i}].content", "invalid_type")
      content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
      raise ApiError(400, f"messages[{i}].content must be a string", f"messages[{i}].content",
                     "invalid_type")
    out.append({"role": m["role"], "content": content})
  return out


def prompt(body: dict):
  """A completion prompt: text, or a list of token ids."""
  p = body.get("prompt")
  if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
    p = p[0]
  if isinstance(p, str) and p:
    return p
  if (isinstance(p, list) and p and
      all(isinstance(t, int) and not isinstance(t, bool) for t in p)):
    return p
  raise ApiError(400, "prompt must be a non-empty string or a list of token ids", "prompt",
                 "invalid_type")


# --- responses ---------------------------------------------------------------------------------

def _usage(s: dict) -> dict:
  return {"prompt_tokens": s["prompt_tokens"], "completion_tokens": s["completion_tokens"],
          "total_tokens": s["prompt_tokens"] + s["completion_tokens"]}


def telemetry(s: dict) -> dict:
  """The `glmjax` field: timings, throughput and the request's share of the expert reads."""
  keep = ("ttft_s", "latency_s", "decode_tok_s", "expert_pin_hits", "expert_host_hits",
          "expert_misses", "expert_bytes_read")
  return {k: s[k] for k in keep if k in s}


class Reply:
  """Builds one request's response bodies (whole, or as stream chunks)."""

  def __init__(self, kind: str, model: str):
    self.chat = kind == "chat"
    self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
    self.created = int(time.time())
    self.model = model

  def _base(self, obj: str) -> dict:
    return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

  def whole(self, s: dict) -> dict:
    if self.chat:
      choice = {"index": 0, "message": {"role": "assistant", "content": s["text"]},
                "finish_reason": s["finish_reason"], "logprobs": None}
      body = self._base("chat.completion")
    else:
      choice = {"index": 0, "text": s["text"], "finish_reason": s["finish_reason"],
                "logprobs": None}
      body = self._base("text_completion")
    return {**body, "choices": [choice], "usage": _usage(s), "glmjax": telemetry(s)}

  def chunk(self, piece: str | None, first: bool = False, summary: dict | None = None) -> dict:
    """A stream chunk with text `piece`; the last one (with `summary`) carries the finish
    reason, usage and telemetry."""
    reason = summary["finish_reason"] if summary else None
    if self.chat:
      delta: dict[str, Any] = {"role": "assistant"} if first else {}
      if piece:
        delta["content"] = piece
      choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
      body = self._base("chat.completion.chunk")
    else:
      choice = {"index": 0, "text": piece or "", "finish_reason": reason, "logprobs": None}
      body = self._base("text_completion")
    body["choices"] = [choice]
    if summary:
      body["usage"] = _usage(summary)
      body["glmjax"] = telemetry(summary)
    return body
