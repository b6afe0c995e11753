"""Text in and out: the tokenizer, streaming detokenization, chat rendering and stop strings.

The tokenizer is HF `tokenizer.json` run by the `tokenizers` library; `tokenizer_config.json`
(chat template, named special tokens) and `generation_config.json` are read when present. Chat
rendering follows transformers' `apply_chat_template` (same Jinja environment and variables) so a
model's own template gives the prompt it was trained on; without one a GLM-5 layout is built in.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
import threading
import time
import uuid
from typing import Any, Iterable, Mapping, Sequence

import tokenizers

from glmjax.decoding import glm_format
from glmjax.errors import InputError

GLM_SPECIAL_TOKENS = (
    "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|endoftext|>", "<think>", "</think>",
)
# Tokens after which GLM chat models hand the turn back; all of them end generation.
_TURN_END_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")
# Named special-token attributes transformers hands to chat templates.
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")
_REPLACEMENT = "\ufffd"


class TokenizerError(InputError, ValueError):
  """A tokenizer directory or file that is missing or unreadable, or a bad chat/stop input."""


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise TokenizerError(f"{path}: cannot read JSON ({e})") from e
  if not isinstance(data, dict):
    raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
  return data


def _token_text(v) -> str | None:
  """A special token as stored in tokenizer_config.json: a string or an AddedToken dict."""
  if isinstance(v, dict):
    v = v.get("content")
  return v if isinstance(v, str) else None


class Tokenizer:
  """A `tokenizers.Tokenizer` plus the config files around it."""

  def __init__(self, tok: tokenizers.Tokenizer, config: Mapping[str, Any] | None = None,
               generation_config: Mapping[str, Any] | None = None,
               chat_template: str | None = None):
    self._tok = tok
    self.config = dict(config or {})
    self.generation_config = dict(generation_config or {})
    self.chat_template = chat_template
    self._plain: tokenizers.Tokenizer | None = None

  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
    """Loads `tokenizer.json` (required) and the optional config files from directory `path`."""
    path = os.fspath(path)
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
      raise TokenizerError(f"{tok_file}: missing; a tokenizer directory needs tokenizer.json")
    try:
      tok = tokenizers.Tokenizer.from_file(tok_file)
    except Exception as e:  # the Rust side raises plain Exception subclasses
      raise TokenizerError(f"{tok_file}: cannot load ({e})") from e
    cfg_file = os.path.join(path, "tokenizer_config.json")
    config = _read_json(cfg_file) if os.path.isfile(cfg_file) else {}
    gen_file = os.path.join(path, "generation_config.json")
    gen = _read_json(gen_file) if os.path.isfile(gen_file) else {}
    return cls(tok, config, gen, _chat_template(path, config, cfg_file))

  # --- ids and text ------------------------------------------------------------------------
  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def to_json(self) -> str:
    """The tokenizer as `tokenizer.json` text (what llguidance builds its view from)."""
    return self._tok.to_str()

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; special-token strings in it map to their ids, none are added."""
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_plain(self, text: str) -> list[int]:
    """Token ids of `text` read as plain text: a special token's spelling in it is encoded as
    the characters it is made of, never as the control id (user text is text)."""
    if self._plain is None:  # a copy of the tokenizer that splits special tokens
      self._plain = tokenizers.Tokenizer.from_str(self._tok.to_str())
      self._plain.encode_special_tokens = True
    return self._plain.encode(text, add_special_tokens=False).ids

  @property
  def added_tokens(self) -> list[str]:
    """Every added token's text (the strings `encode` maps to their own ids)."""
    return [t.content for t in self._tok.get_added_tokens_decoder().values()]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """Text of `ids`; special tokens are kept unless `skip_special_tokens`."""
    return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def token_id(self, token: str) -> int | None:
    """Id of the vocabulary entry `token` (exact string), or None."""
    return self._tok.token_to_id(token)

  # --- GLM special tokens ------------------------------------------------------------------
  gmask_id = property(lambda self: self.token_id("[gMASK]"))
  sop_id = property(lambda self: self.token_id("<sop>"))
  system_id = property(lambda self: self.token_id("<|system|>"))
  user_id = property(lambda self: self.token_id("<|user|>"))
  assistant_id = property(lambda self: self.token_id("<|assistant|>"))
  observation_id = property(lambda self: self.token_id("<|observation|>"))
  endoftext_id = property(lambda self: self.token_id("<|endoftext|>"))
  think_id = property(lambda self: self.token_id("<think>"))
  end_think_id = property(lambda self: self.token_id("</think>"))

  @property
  def special_tokens_map(self) -> dict[str, str]:
    """Named special tokens from tokenizer_config.json (bos_token, eos_token, ...)."""
    out = {}
    for name in _NAMED_SPECIALS:
      text = _token_text(self.config.get(name))
      if text is not None:
        out[name] = text
    return out

  def stop_ids(self, eos_token_id: int | Sequence[int] | None = None) -> set[int]:
    """Ids that end generation: `eos_token_id` (int or list; by default generation_config's,
    else the config's eos_token) plus <|endoftext|>, <|user|> and <|observation|> if in vocab."""
    if eos_token_id is None:
      eos_token_id = self.generation_config.get("eos_token_id")
    if eos_token_id is None:
      eos = _token_text(self.config.get("eos_token"))
      eos_token_id = self.token_id(eos) if eos else None
    ids = set()
    for i in ([] if eos_token_id is None else
              [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id):
      if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
        raise TokenizerError(f"eos_token_id {i!r} is not a token id in [0, {self.vocab_size})")
      ids.add(i)
    for t in _TURN_END_TOKENS:
      i = self.token_id(t)
      if i is not None:
        ids.add(i)
    return ids


def _chat_template(path: str, config: Mapping[str, Any], cfg_file: str) -> str | None:
  """The default chat template; a chat_template.jinja file wins over the config, as in HF."""
  jinja_file = os.path.join(path, "chat_template.jinja")
  if os.path.isfile(jinja_file):
    with open(jinja_file, encoding="utf-8") as f:
      return f.read()
  t = config.get("chat_template")
  if isinstance(t, list):  # older configs: [{"name": ..., "template": ...}, ...]
    named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
    t = named.get("default")
  if t is not None and not isinstance(t, str):
    raise TokenizerError(f"{cfg_file}: chat_template must be a string")
  return t


# --- streaming detokenization ----------------------------------------------------------------

class StreamDecoder:
  """Turns a stream of token ids into text without ever emitting half a character.

  Byte-level BPE splits multi-byte UTF-8 characters across tokens; decoding such a prefix ends in
  U+FFFD. Text is therefore held back while it ends in U+FFFD. Each step decodes only a short
  window (the last emitted tokens as context, plus the new ones), so decoders that treat the start
  of a sequence specially still produce the same text as decoding everything at once.
  """

  def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
    self._tokenizer = tokenizer
    self._skip = skip_special_tokens
    self._ids: list[int] = []
    self._start = 0  # window start: context tokens whose text was already emitted
    self._mark = 0   # end of the emitted part of the window

  def _decode(self, ids) -> str:
    return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

  def _pending(self) -> tuple[str, str]:
    done = self._decode(self._ids[self._start:self._mark])
    return done, self._decode(self._ids[self._start:])

  def feed(self, token_ids: int | Iterable[int]) -> str:
    """Adds one id (or several) and returns the newly completed text, possibly ''."""
    self._ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
    done, text = self._pending()
    if len(text) <= len(done) or text.endswith(_REPLACEMENT):
      return ""
    self._start, self._mark = self._mark, len(self._ids)
    return text[len(done):]

  def flush(self) -> str:
    """Returns whatever is still held back (an incomplete character decodes as U+FFFD)."""
    done, text = self._pending()
    self._start = self._mark = len(self._ids)
    return text[len(done):]


# --- stop strings ----------------------------------------------------------------------------

class StopMatcher:
  """Finds user stop strings in streamed text, even when one arrives split across chunks.

  `feed` returns (text safe to show, stopped). Text that could be the start of a stop string is
  held back until it is known not to be; after a stop, everything from the stop string on is
  dropped. `matched` names the stop string that fired.
  """

  def __init__(self, stops: Iterable[str]):
    self.stops = tuple(stops)
    if any(not isinstance(s, str) or not s for s in self.stops):
      raise TokenizerError(f"stop strings must be non-empty strings, got {self.stops!r}")
    self._held = ""
    self.matched: str | None = None

  @property
  def stopped(self) -> bool:
    return self.matched is not None

  def feed(self, text: str) -> tuple[str, bool]:
    if self.stopped:
      return "", True
    buf = self._held + text
    hits = [(buf.find(s), s) for s in self.stops if s in buf]
    if hits:
      cut, self.matched = min(hits)
      self._held = ""
      return buf[:cut], True
    keep = 0
    for s in self.stops:
      for n in range(min(len(s) - 1, len(buf)), keep, -1):
        if buf.endswith(s[:n]):
          keep = n
          break
    self._held = buf[len(buf) - keep:]
    return buf[:len(buf) - keep], False

  def flush(self) -> str:
    """Releases held text at the end of generation (nothing if a stop fired)."""
    out, self._held = ("" if self.stopped else self._held), ""
    return out


# --- chat ------------------------------------------------------------------------------------

# Bounds on rendering a chat template: a template (or messages that drive its loops) must not
# hold a server's worker for long or fill its memory. Checked at every call, attribute and
# item access the template makes and at every piece of output.
MAX_RENDER_S = 5.0
MAX_RENDER_CHARS = 64 << 20
_render_deadline = threading.local()


def _raise_exception(message):
  import jinja2
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _check_deadline() -> None:
  deadline = getattr(_render_deadline, "at", None)
  if deadline is not None and time.monotonic() > deadline:
    raise TokenizerError(f"the chat template took longer than {MAX_RENDER_S} s to render")


@functools.lru_cache(maxsize=16)
def _compile(template: str):
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with the render deadline checked at each call and lookup."""

    def call(self, context, obj, /, *args, **kwargs):
      _check_deadline()
      return super().call(context, obj, *args, **kwargs)

    def getattr(self, obj, attribute):
      _check_deadline()
      return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
      _check_deadline()
      return super().getitem(obj, argument)

  env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                           extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(template)


def _render(template: str, variables: dict) -> str:
  """`template` rendered within MAX_RENDER_S and MAX_RENDER_CHARS; a template's own error
  (raise_exception, an undefined name) is a TokenizerError naming it."""
  import jinja2
  _render_deadline.at = time.monotonic() + MAX_RENDER_S
  out, size = [], 0
  try:
    for piece in _compile(template).generate(**variables):
      size += len(piece)
      if size > MAX_RENDER_CHARS:
        raise TokenizerError(f"the chat template's output exceeds {MAX_RENDER_CHARS} characters")
      _check_deadline()
      out.append(piece)
  except jinja2.TemplateError as e:
    raise TokenizerError(f"the chat template refused these messages: {e}") from None
  finally:
    _render_deadline.at = None
  return "".join(out)


def _split_think(m: dict) -> dict:
  """An assistant turn whose content still holds `…</think>answer` (a reply sent back as it
  came) gets its reasoning apart, as templates and the built-in layout expect it."""
  content = m.get("content")
  if (m.get("role") != "assistant" or not isinstance(content, str) or "</think>" not in content
      or "reasoning_content" in m):
    return m
  reasoning, _, answer = content.partition("</think>")
  reasoning = reasoning.split("<think>")[-1].strip("\n")
  return {**m, "content": answer.lstrip("\n"), "reasoning_content": reasoning,
          "thinking": reasoning}


def _normalise(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
  """Messages as transformers hands them to templates: None fields dropped, reasoning aliased."""
  if not messages:
    raise TokenizerError("messages: a chat needs at least one message")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping) or "role" not in m:
      raise TokenizerError(f"messages[{i}]: expected a dict with a 'role', got {m!r}")
    m = {k: v for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
    if reasoning is not None:
      m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    out.append(_split_think(m))
  return out


def _content_text(content, where: str) -> str:
  if isinstance(content, str):
    return content
  if isinstance(content, list):  # OpenAI-style parts; only text parts can go to a text model
    return "".join(p.get("text", "") for p in content
                   if isinstance(p, Mapping) and p.get("type") == "text")
  raise TokenizerError(f"{where}: content must be a string or a list of text parts")


_BUILTIN_ROLES = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>",
                  "tool": "<|observation|>", "observation": "<|observation|>"}


def _builtin_calls(m: dict, where: str) -> str:
  """An assistant turn's tool calls in GLM's layout (OpenAI's {"function": {name, arguments}}
  or a flat {name, arguments}; arguments a mapping or its JSON text)."""
  out = []
  for j, call in enumerate(m.get("tool_calls") or ()):
    fn = call.get("function", call) if isinstance(call, Mapping) else None
    args = fn.get("arguments", {}) if isinstance(fn, Mapping) else None
    if isinstance(args, str):
      try:
        args = json.loads(args)
      except ValueError:
        args = None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or \
        not isinstance(args, Mapping):
      raise TokenizerError(f"{where}.tool_calls[{j}]: needs a name and a JSON object of "
                           "arguments")
    out.append(glm_format.render_tool_call(fn["name"], args))
  return "".join(out)


def _builtin_chat(messages: list[dict], add_generation_prompt: bool, enable_thinking: bool,
                  tools: Sequence[Mapping[str, Any]] | None = None) -> str:
  parts = ["[gMASK]<sop>"]
  if tools:
    parts.append("<|system|>" + glm_format.render_tools(tools))
  previous = None
  for i, m in enumerate(messages):
    role, where = m["role"], f"messages[{i}]"
    tag = _BUILTIN_ROLES.get(role)
    if tag is None:
      raise TokenizerError(f"{where}: role {role!r} is not one of {sorted(_BUILTIN_ROLES)}")
    content = _content_text(m.get("content", ""), where)
    if role == "tool":  # consecutive results share one observation turn
      parts.append(("" if previous == "tool" else tag) +
                   f"<tool_response>{content}</tool_response>")
    elif role == "assistant":
      think = f"<think>{m['reasoning_content']}</think>" if "reasoning_content" in m else ""
      parts.append(tag + think + content + _builtin_calls(m, where))
    else:
      parts.append(tag + content)
    previous = role
  if add_generation_prompt:
    parts.append("<|assistant|>" + ("<think>" if enable_thinking else "<think></think>"))
  return "".join(parts)


def render_chat(messages: Sequence[Mapping[str, Any]], tokenizer: Tokenizer,
                add_generation_prompt: bool = True, enable_thinking: bool = False,
                tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs) -> str:
  """The prompt string for `messages` ([{"role": ..., "content": ...}, ...]).

  With a chat template (tokenizer_config.json or chat_template.jinja) this renders it as
  transformers' apply_chat_template(..., tokenize=False) does, with `enable_thinking` and any
  `template_kwargs` as template variables, within MAX_RENDER_S and MAX_RENDER_CHARS. Without one
  it builds the GLM-5 layout: `[gMASK]<sop><|user|>...<|assistant|><think></think>` (`<think>`
  when thinking is on), `tools` in a system turn and calls and results in GLM's tags.
  """
  messages = _normalise(messages)
  if tokenizer.chat_template is None:
    return _builtin_chat(messages, add_generation_prompt, enable_thinking, tools)
  if tools and "tools" not in tokenizer.chat_template:
    raise TokenizerError("this model's chat template does not render tools")
  variables = {**tokenizer.special_tokens_map, "enable_thinking": enable_thinking,
               **template_kwargs}
  return _render(tokenizer.chat_template, dict(
      messages=messages, tools=None if tools is None else list(tools), documents=None,
      add_generation_prompt=add_generation_prompt, **variables))


class _Masks:
  """Stands in for added-token spellings in the caller's strings while a template renders, so
  that afterwards only the template's own structure is read as control tokens. A mark is
  `[[nonce:i]]`, the nonce fresh per chat: text cannot forge one, and no template filter that
  trims or escapes JSON changes it. One pattern finds every nonce's marks (a pattern per nonce
  would churn `re`'s cache, and evict the specials' pattern, at every chat)."""

  MARK = re.compile(r"\[\[([0-9a-f]{32}):(\d+)\]\]")

  def __init__(self, tokenizer: Tokenizer):
    specials = sorted(set(tokenizer.added_tokens), key=len, reverse=True)
    self.pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
    self.nonce = uuid.uuid4().hex
    self.originals: list[str] = []

  def hide(self, x):
    """`x` (strings inside lists and dicts) with every added-token spelling marked."""
    if self.pattern is None:
      return x
    if isinstance(x, str):
      return self.pattern.sub(self._mark, x)
    if isinstance(x, Mapping):
      return {k: self.hide(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [self.hide(v) for v in x]
    return x

  def _mark(self, m: re.Match) -> str:
    self.originals.append(m.group())
    return f"[[{self.nonce}:{len(self.originals) - 1}]]"

  def _restore(self, m: re.Match) -> str:  # another nonce's mark is text, left as it is
    return self.originals[int(m.group(2))] if m.group(1) == self.nonce else m.group()

  def encode(self, rendered: str, tokenizer: Tokenizer) -> list[int]:
    """Ids of `rendered`: the added tokens it spells itself become their ids; the text between
    them, the marked spellings restored, is encoded as plain text."""
    ids, pos = [], 0
    for m in (self.pattern.finditer(rendered) if self.pattern is not None else ()):
      ids += self._plain(rendered[pos:m.start()], tokenizer)
      ids.append(tokenizer.token_id(m.group()))
      pos = m.end()
    return ids + self._plain(rendered[pos:], tokenizer)

  def _plain(self, text: str, tokenizer: Tokenizer) -> list[int]:
    text = self.MARK.sub(self._restore, text)
    return tokenizer.encode_plain(text) if text else []


def encode_chat(messages: Sequence[Mapping[str, Any]], tokenizer: Tokenizer,
                add_generation_prompt: bool = True, enable_thinking: bool = False,
                tools: Sequence[Mapping[str, Any]] | None = None, reply_prefix: str = "",
                **kwargs) -> list[int]:
  """Token ids of `render_chat(...)` + `reply_prefix` (the start of the reply, written by the
  caller): the template's role and control tokens become their single ids, while a special
  token spelled inside a message or a tool definition stays plain text (it cannot forge a
  turn)."""
  masks = _Masks(tokenizer)
  rendered = render_chat(masks.hide(_normalise(messages)), tokenizer, add_generation_prompt,
                         enable_thinking, tools=None if tools is None else masks.hide(tools),
                         **kwargs)
  return masks.encode(rendered + reply_prefix, tokenizer)


# --- training small tokenizers ---------------------------------------------------------------

def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike,
                        special_tokens: Sequence[str] = GLM_SPECIAL_TOKENS,
                        eos_token: str = "<|endoftext|>", pad_token: str = "<|endoftext|>",
                        chat_template: str | None = None,
                        generation_config: Mapping[str, Any] | None = None) -> Tokenizer:
  """Trains a byte-level BPE on `texts` and writes an HF-loadable tokenizer directory.

  Writes tokenizer.json, tokenizer_config.json (PreTrainedTokenizerFast, eos/pad tokens, optional
  chat_template) and generation_config.json (by default: sampling on, stop on the GLM turn-end
  tokens). `special_tokens` become added special tokens with the first ids.
  """
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers

  for name, tok in (("eos_token", eos_token), ("pad_token", pad_token)):
    if tok not in special_tokens:
      raise TokenizerError(f"{name} {tok!r} is not among special_tokens")
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + len(special_tokens):
    raise TokenizerError(f"vocab_size {vocab_size} cannot hold the {len(alphabet)} byte symbols "
                         f"and {len(special_tokens)} special tokens")
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                initial_alphabet=alphabet, show_progress=False)
  tok.train_from_iterator(texts, trainer)

  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token,
            "pad_token": pad_token, "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 20}
  if chat_template is not None:
    config["chat_template"] = chat_template
  if generation_config is None:
    stops = [tok.token_to_id(t) for t in _TURN_END_TOKENS if tok.token_to_id(t) is not None]
    generation_config = {"do_sample": True, "temperature": 1.0, "top_p": 0.95,
                         "eos_token_id": stops, "pad_token_id": tok.token_to_id(pad_token)}
  for name, data in (("tokenizer_config.json", config),
                     ("generation_config.json", dict(generation_config))):
    with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
      json.dump(data, f, ensure_ascii=False, indent=2)
  return Tokenizer.from_dir(out_dir)
