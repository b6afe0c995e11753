"""The OpenAI wire format: request checks and response bodies, free of any web framework.

Every bad input becomes an `ApiError` (HTTP status + OpenAI's error object), never an
exception the server would turn into a 500.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable

MAX_LOGPROBS = 20  # alternatives per position (vLLM's default --max-logprobs)
MAX_CHOICES = 16  # prompts × n in one request: each choice takes a batch row
MAX_SEED = 2 ** 63  # the PRNG key is an int64
MAX_TOP_K = 256  # glmjax.decoding.sampling.PRESELECT: larger ks compile a sampler each
MAX_REPETITION_PENALTY = 10.0
# Logits are divided by the penalty in float32: near 1e-38 it underflows and the distribution
# turns to NaN (found by scripts/fuzz_server.py: NaN logprobs, a 500). Far above that point.
MIN_REPETITION_PENALTY = 1e-6
MAX_STOPS = 4  # OpenAI's limit on `stop`

# The bounds of the numeric fields: the checks below and the published schema
# (glmjax.serving.openapi) both read these tables, so the two cannot drift apart.
# Numbers: (low, high, low excluded); sampling bounds as OpenAI documents them.
NUMBER_BOUNDS = {"temperature": (0.0, 2.0, False), "top_p": (0.0, 1.0, True),
                 "min_p": (0.0, 1.0, False),
                 "repetition_penalty": (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, False),
                 "presence_penalty": (-2.0, 2.0, False), "frequency_penalty": (-2.0, 2.0, False)}
# Integers: [low, high]. top_k -1 is vLLM's spelling of off.
INT_BOUNDS = {"seed": (0, MAX_SEED - 1), "top_k": (-1, MAX_TOP_K), "n": (1, MAX_CHOICES),
              "logprobs": (0, MAX_LOGPROBS), "top_logprobs": (0, MAX_LOGPROBS)}


class ApiError(Exception):
  """A client error: `status` and the body `{"error": {message, type, param, code}}`."""

  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None, kind: str = "invalid_request_error",
               headers: dict | None = None):
    super().__init__(message)
    self.status = status
    self.headers = headers  # e.g. {"connection": "close"} after a body that never came
    self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}


def integral(v) -> int | None:
  """`v` as an int if it is a JSON integer, else None. JSON (and JSON Schema) make no
  difference between 2 and 2.0, and clients in languages without an int type send either."""
  if isinstance(v, bool):
    return None
  if isinstance(v, int):
    return v
  if isinstance(v, float) and v.is_integer():
    return int(v)
  return None


def _number(body: dict, name: str, default: float) -> float:
  lo, hi, lo_open = NUMBER_BOUNDS[name]
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise ApiError(400, f"{name} must be a number, got {type(v).__name__}", name, "invalid_type")
  if v < lo or v > hi or (lo_open and v == lo):
    side = "(" if lo_open else "["
    raise ApiError(400, f"{name} must be in {side}{lo}, {hi}], got {v}", name, "invalid_value")
  return float(v)


def _int(body: dict, name: str, default: int | None, lo: int = -2 ** 63,
         hi: int = 2 ** 63 - 1) -> int | None:
  v = body.get(name, default)
  if v is None:
    return default
  if integral(v) is None:
    raise ApiError(400, f"{name} must be an integer, got {type(v).__name__}", name,
                   "invalid_type")
  v = integral(v)
  if not lo <= v <= hi:
    raise ApiError(400, f"{name} must be in [{lo}, {hi}], got {v}", name, "invalid_value")
  return v


def _bool(body: dict, name: str) -> bool:
  v = body.get(name, False)
  if v is None:
    return False
  if not isinstance(v, bool):
    raise ApiError(400, f"{name} must be a boolean, got {type(v).__name__}", name,
                   "invalid_type")
  return v


def _stops(body: dict) -> list[str]:
  v = body.get("stop")
  if v is None:
    return []
  if isinstance(v, str):
    v = [v]
  if (not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or
      len(v) > MAX_STOPS):
    raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} of "
                   "them",
                   "stop", "invalid_type")
  return v


def sampling(body: dict, n_prompt: int, context: int, default_max: int,
             defaults: dict | None = None, own_stops: list[str] | None = None) -> dict:
  """The checked sampling settings of a request (`glmjax.decoding.generation.new_request`
  keywords) for a prompt of `n_prompt` tokens in a `context`-token window; unset temperature
  and top_p take `defaults` (the model's generation_config; OpenAI's 1.0 without).
  `own_stops`: the server's stop strings, after the client's."""
  defaults = defaults or {}
  if n_prompt >= context:
    raise ApiError(400, f"the prompt is {n_prompt} tokens; this model's context is {context} "
                   "tokens and must hold at least one generated token", "messages"
                   if "messages" in body else "prompt", "context_length_exceeded")
  room = context - n_prompt
  given = {}  # max_tokens wins over max_completion_tokens; both, when given, are checked
  for name in ("max_completion_tokens", "max_tokens"):
    v = _int(body, name, None)
    if v is None:
      continue
    if v < (0 if echo(body) else 1):  # echo with 0 new tokens scores the prompt only
      raise ApiError(400, f"{name} must be ≥ 1 (≥ 0 with echo), got {v}", name,
                     "invalid_value")
    if v > room:
      raise ApiError(400, f"{name} ({v}) + the prompt ({n_prompt} tokens) exceed the context "
                     f"of {context} tokens", name, "context_length_exceeded")
    given[name] = v
  max_tokens = given.get("max_tokens", given.get("max_completion_tokens",
                                                 min(default_max, room)))
  seed = _int(body, "seed", 0, *INT_BOUNDS["seed"])
  return dict(max_new_tokens=max_tokens, logprobs=logprobs(body),
              temperature=_number(body, "temperature", defaults.get("temperature", 1.0)),
              top_p=_number(body, "top_p", defaults.get("top_p", 1.0)),
              seed=seed, stop=_stops(body) + list(own_stops or ()),
              top_k=_top_k(body), min_p=_number(body, "min_p", 0.0),
              repetition_penalty=_number(body, "repetition_penalty", 1.0),
              presence_penalty=_number(body, "presence_penalty", 0.0),
              frequency_penalty=_number(body, "frequency_penalty", 0.0))


def _top_k(body: dict) -> int:
  """`top_k`: 0 or -1 (vLLM's spelling) is off. Values up to the sampler's pre-selection run in
  the one compiled sampler; a larger k would compile a sampler of its own for each value."""
  k = _int(body, "top_k", 0, *INT_BOUNDS["top_k"])
  return 0 if k == -1 else k


def stream_flag(body: dict) -> bool:
  return _bool(body, "stream")


def include_usage(body: dict) -> bool:
  """`stream_options.include_usage`: a last chunk with no choices and the usage."""
  opts = body.get("stream_options")
  if opts is None:
    return False
  if not isinstance(opts, dict):
    raise ApiError(400, "stream_options must be an object", "stream_options", "invalid_type")
  return _bool(opts, "include_usage")


def echo(body: dict) -> bool:
  """Completions' `echo`: the prompt (and its logprobs) come first in the choice."""
  return "messages" not in body and _bool(body, "echo")


def logprobs(body: dict) -> int | None:
  """Alternatives to report per token, or None when no logprobs are asked for. Completions:
  `logprobs` an int ≤ 20; chat: `logprobs: true` with `top_logprobs` ≤ 20."""
  if "messages" in body:
    if not _bool(body, "logprobs"):
      if body.get("top_logprobs") is not None:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs",
                       "invalid_value")
      return None
    return _int(body, "top_logprobs", 0, *INT_BOUNDS["top_logprobs"])
  return _int(body, "logprobs", None, *INT_BOUNDS["logprobs"])


def choices_per_prompt(body: dict, n_prompts: int) -> int:
  """`n`: choices per prompt, each its own batch row; prompts × n at most MAX_CHOICES."""
  n = _int(body, "n", 1, *INT_BOUNDS["n"])
  if n * n_prompts > MAX_CHOICES:
    raise ApiError(400, f"{n_prompts} prompts × n={n} exceed {MAX_CHOICES} choices in one "
                   "request", "n", "invalid_value")
  return n


def check_model(body: dict, served: str) -> None:
  name = body.get("model")
  if not isinstance(name, str):
    raise ApiError(400, "model must be a string naming the served model", "model",
                   "invalid_type")
  if name != served:
    raise ApiError(404, f"the model {name!r} does not exist; this server serves {served!r}",
                   "model", "model_not_found")


def token_ids(p) -> list[int] | None:
  """`p` as a list of token ids (ints, or integral floats), or None if it is not one; the
  vocabulary's range is glmjax.api.Model.check_tokens' to check."""
  if not isinstance(p, list) or not p:
    return None
  ids = [integral(t) for t in p]
  return None if None in ids else ids


def prompts(body: dict) -> list:
  """A completion's prompts, each text or a list of token ids: `prompt` is a string, a
  token-id list, or a list of either (a batch: one choice per prompt, in order)."""
  p = body.get("prompt")
  if (isinstance(p, str) and p) or token_ids(p):
    return [p if isinstance(p, str) else token_ids(p)]
  if isinstance(p, list) and p and len(p) <= MAX_CHOICES:
    out = [q if isinstance(q, str) and q else token_ids(q) for q in p]
    if all(out):
      return out
  raise ApiError(400, "prompt must be a non-empty string, a list of token ids, or a list of at "
                 f"most {MAX_CHOICES} of either", "prompt", "invalid_type")


# --- responses ---------------------------------------------------------------------------------

def usage(summaries: list[dict]) -> dict:
  """Token counts of a request's choices: each prompt counted once, however many choices."""
  prompt = sum(s["prompt_tokens"] for s in summaries if s["first_of_prompt"])
  completion = sum(s["completion_tokens"] for s in summaries)
  out = {"prompt_tokens": prompt, "completion_tokens": completion,
         "total_tokens": prompt + completion}
  cached = sum(s.get("cached_tokens", 0) for s in summaries if s["first_of_prompt"])
  out["prompt_tokens_details"] = {"cached_tokens": cached}
  if any("reasoning_tokens" in s for s in summaries):  # chat replies
    out["completion_tokens_details"] = {
        "reasoning_tokens": sum(s.get("reasoning_tokens", 0) for s in summaries)}
  return out


def telemetry(s: dict) -> dict:
  """The `glmjax` field: timings, throughput and the request's share of the expert reads."""
  keep = ("ttft_s", "latency_s", "decode_tok_s", "expert_pin_hits", "expert_host_hits",
          "expert_misses", "expert_bytes_read")
  return {k: s[k] for k in keep if k in s}


class Reply:
  """Builds one request's response bodies (whole, or as stream chunks). `token_text` maps a
  token id to its text (for logprobs)."""

  def __init__(self, kind: str, model: str, token_text: Callable[[int], str] | None = None):
    self.chat = kind == "chat"
    self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
    self.created = int(time.time())
    self.model = model
    self.token_text = token_text or str

  def _base(self, obj: str) -> dict:
    return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

  def _choice(self, s: dict) -> dict:
    if self.chat:  # the message as glmjax.serving.chat.ChoiceReply read it
      return {"index": s["index"], "message": s["message"],
              "finish_reason": s["finish_reason"], "logprobs": self._chat_logprobs(s)}
    return {"index": s["index"], "text": s.get("echo_text", "") + s["text"],
            "finish_reason": s["finish_reason"], "logprobs": self._completion_logprobs(s)}

  def whole(self, summaries: list[dict]) -> dict:
    """The response of a finished request, its choices in `index` order."""
    summaries = sorted(summaries, key=lambda s: s["index"])
    body = self._base("chat.completion" if self.chat else "text_completion")
    return {**body, "choices": [self._choice(s) for s in summaries], "usage": usage(summaries),
            "glmjax": telemetry(summaries[0]) if len(summaries) == 1 else
            [telemetry(s) for s in summaries]}

  def chunk(self, piece: str | dict | None, index: int = 0, first: bool = False,
            summary: dict | None = None, logprobs: dict | None = None) -> dict:
    """A stream chunk of choice `index` with text `piece` (chat: the delta's fields, as
    glmjax.serving.chat.ChoiceReply gives them) and the `logprobs` of its tokens; its last one
    (with `summary`) carries the finish reason and telemetry."""
    reason = summary["finish_reason"] if summary else None
    if self.chat:
      delta: dict[str, Any] = {"role": "assistant"} if first else {}
      delta.update(piece or {})
      choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
      body = self._base("chat.completion.chunk")
    else:
      choice = {"index": index, "text": piece or "", "finish_reason": reason,
                "logprobs": logprobs}
      body = self._base("text_completion")
    body["choices"] = [choice]
    if summary:  # the choice's own usage (include_usage adds the whole request's at the end)
      body["usage"] = usage([summary])
      body["glmjax"] = telemetry(summary)
    return body

  def usage_chunk(self, summaries: list[dict]) -> dict:
    """`stream_options.include_usage`'s last chunk: no choices, the whole request's usage."""
    body = self._base("chat.completion.chunk" if self.chat else "text_completion")
    return {**body, "choices": [], "usage": usage(summaries)}

  # --- logprobs --------------------------------------------------------------------------
  def _top(self, score) -> dict:
    return {self.token_text(t): lp for t, lp in zip(score.top_ids, score.top_logprobs)}

  def _completion_logprobs(self, s: dict) -> dict | None:
    """Legacy completions' logprobs: tokens, token_logprobs, top_logprobs (dicts) and
    text_offset; with echo the prompt's tokens come first, the first one's logprob null."""
    if s["logprobs"] is None:
      return None
    scored = list(s["prompt_scores"]) if s["echo"] else []
    return self.logprobs(scored + s["scores"], 0 if s["echo"] else len(s["prompt_text"]))[0]

  def logprobs(self, scored: list, offset: int = 0) -> tuple[dict, int]:
    """The logprobs object of `scored` (token, TokenLogprob | None) pairs in the request's kind
    (completions: text offsets from `offset`), and the offset after them."""
    if self.chat:
      return self._chat_entries(scored), offset
    tokens = [self.token_text(t) for t, _ in scored]
    offsets = []
    for text in tokens:
      offsets.append(offset)
      offset += len(text)
    return {"tokens": tokens,
            "token_logprobs": [None if sc is None else sc.logprob for _, sc in scored],
            "top_logprobs": [None if sc is None else self._top(sc) for _, sc in scored],
            "text_offset": offsets}, offset

  def _chat_logprobs(self, s: dict) -> dict | None:
    """Chat's logprobs: one entry per content token (the stop token is not content)."""
    if s["logprobs"] is None:
      return None
    return self._chat_entries(s["scores"][:len(s["tokens"])])

  def _chat_entries(self, scored: list) -> dict:
    def entry(t: int, lp: float) -> dict:
      text = self.token_text(t)
      return {"token": text, "logprob": lp, "bytes": list(text.encode())}
    return {"content": [{**entry(t, sc.logprob), "top_logprobs": [
        entry(i, lp) for i, lp in zip(sc.top_ids, sc.top_logprobs)]} for t, sc in scored],
            "refusal": None}


# --- tokenizer routes (lm-eval's remote tokenizer probes these) ---------------------------------

def tokenizer_info(tok) -> dict:
  """GET /tokenizer_info: the named special tokens (eos_token always) and the chat template."""
  names = tok.special_tokens_map
  eos = names.get("eos_token") or "<|endoftext|>"
  out = {"eos_token": eos, "bos_token": names.get("bos_token"),
         "pad_token": names.get("pad_token"), "chat_template": tok.chat_template,
         "vocab_size": tok.vocab_size}
  return {k: v for k, v in out.items() if v is not None}


def tokenize(tok, body: dict) -> dict:
  """POST /tokenize {prompt, add_special_tokens}: {"tokens": [...]}. The model adds no special
  tokens to a completion prompt, so add_special_tokens changes nothing here."""
  text = body.get("prompt")
  if not isinstance(text, str):
    raise ApiError(400, "prompt must be a string", "prompt", "invalid_type")
  _bool(body, "add_special_tokens")
  return {"tokens": tok.encode(text)}


def detokenize(tok, body: dict, vocab_size: int) -> dict:
  """POST /detokenize {tokens}: {"prompt": text}."""
  ids = body.get("tokens")
  ids = [] if ids == [] else token_ids(ids)
  if ids is None or not all(0 <= t < vocab_size for t in ids):
    raise ApiError(400, f"tokens must be a list of token ids in [0, {vocab_size})", "tokens",
                   "invalid_type")
  return {"prompt": tok.decode(ids)}
