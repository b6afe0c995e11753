"""Decoding under a grammar: JSON output that follows a schema, and a forced tool call's
arguments in GLM's `<arg_key>`/`<arg_value>` layout, each value following its property's schema.

llguidance does the work: it compiles a grammar against the model's tokenizer and, per step,
yields the set of tokens that keep the output a valid prefix (a bitmask), lazily: no table of
vocabulary × grammar states is built up front, so a schema new to the server costs milliseconds.
Here a request's grammar is a `GrammarSpec` (plain JSON, so it travels in a request's settings
to follower processes), and a `Constraint` is one request's matcher: `bits()` before each pick,
`observe(tok)` after.

With reasoning on, the grammar starts after `</think>`: until that token is emitted the
constraint allows everything (the reasoning is free text).
"""

from __future__ import annotations

import dataclasses
import json
import re
import weakref
from typing import Any, Mapping

import numpy as np

from glmjax.errors import InputError

# Output JSON without free whitespace: flexible whitespace lets a sampled reply spend its whole
# budget on blanks and never close, and a bounded schema must always complete.
_JSON_OPTIONS = {"whitespace_flexible": False}
# A group repeated without bound that itself holds an unbounded quantifier, e.g. (a+)+ or
# (\w*){2,}: the shape behind catastrophic backtracking in the validators clients check replies
# with (llguidance itself does not backtrack).
_UNBOUNDED = r"(?:[*+]|\{\d*,\})"
_NESTED_QUANTIFIER = re.compile(r"\((?:[^()\\]|\\.)*" + _UNBOUNDED + r"(?:[^()\\]|\\.)*\)"
                                + _UNBOUNDED)
_MAX_PATTERN = 1000  # characters: patterns are for formats, not programs


class GrammarError(InputError, ValueError):
  """A schema or pattern the grammar cannot take; `field` names where it sits in the request."""

  def __init__(self, message: str, field: str = ""):
    super().__init__(message)
    self.field = field


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
  """What to constrain: `kind` "json" (the reply is one JSON value under `schema`),
  "tool_args" (the reply continues a named call: argument pairs under `schema`'s properties,
  then `</tool_call>`) or "tool_call" (a required call: `schema` maps each function's name to
  its parameters; the name, then its arguments). `after_think`: the grammar starts after the
  reasoning closes."""
  kind: str
  schema: Mapping[str, Any]
  after_think: bool = False
  field: str = "response_format"  # the request field a compile error names

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def of(cls, value) -> "GrammarSpec | None":
    if value is None or isinstance(value, GrammarSpec):
      return value
    return cls(**value)


# --- checks --------------------------------------------------------------------------------------

def check_patterns(schema, field: str) -> None:
  """Refuses a `pattern` (or `patternProperties` key) that could backtrack without bound."""
  stack = [(schema, field)]
  while stack:
    node, at = stack.pop()
    if isinstance(node, list):
      stack.extend((v, f"{at}[{i}]") for i, v in enumerate(node))
      continue
    if not isinstance(node, Mapping):
      continue
    for key, value in node.items():
      where = f"{at}.{key}"
      if key == "pattern" and isinstance(value, str):
        _check_pattern(value, where)
      elif key == "patternProperties" and isinstance(value, Mapping):
        for p in value:
          _check_pattern(p, where)
      stack.append((value, where))


def _check_pattern(p: str, where: str) -> None:
  if len(p) > _MAX_PATTERN:
    raise GrammarError(f"{where}: pattern longer than {_MAX_PATTERN} characters", where)
  if _NESTED_QUANTIFIER.search(p):
    raise GrammarError(f"{where}: pattern {p!r} nests an unbounded quantifier inside a "
                       "repeated group, which can backtrack without bound", where)
  if re.search(r"\\[1-9]|\(\?[=!<]", p):
    raise GrammarError(f"{where}: pattern {p!r} uses a backreference or lookaround", where)


# --- grammars ------------------------------------------------------------------------------------

def _json_schema(schema: Mapping) -> dict:
  return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **_JSON_OPTIONS}}


def _lark_literal(s: str) -> str:
  return json.dumps(s)  # a Lark string literal is a JSON string (escapes included)


def _string_value(prop: Mapping) -> str | None:
  """A string argument's raw text (GLM writes string values unquoted) as a Lark expression,
  or None when the property is not a plain string."""
  if prop.get("type") != "string":
    return None
  if "enum" in prop or "const" in prop:
    options = prop["enum"] if "enum" in prop else [prop["const"]]
    return "(" + " | ".join(_lark_literal(str(o)) for o in options) + ")"
  if "pattern" in prop:
    body = prop["pattern"].removeprefix("^").removesuffix("$")
    return "/" + body.replace("/", "\\/") + "/"
  lo, hi = int(prop.get("minLength", 0)), prop.get("maxLength")
  # No `<` inside: the value ends at `</arg_value>`, which must stay unambiguous.
  return f"/[^<]{{{lo},{'' if hi is None else int(hi)}}}/"


def _args_rules(schema: Mapping, tag: str) -> tuple[str, list[str]]:
  """(the sequence of argument pairs, their rules) of one function's parameters: one
  `<arg_key>K</arg_key><arg_value>V</arg_value>` pair per property in the schema's order
  (optional ones may be left out). Only the declared properties are offered (as under
  additionalProperties: false); each non-string value is JSON under its property's schema."""
  from glmjax.decoding import glm_format as g
  if not isinstance(schema, Mapping):
    raise GrammarError("a function's parameters must be a JSON schema object", "tools")
  props = schema.get("properties") or {}
  required = set(schema.get("required") or ())
  rules, parts = [], []
  for i, (key, prop) in enumerate(props.items()):
    prop = prop if isinstance(prop, Mapping) else {}
    raw = _string_value(prop)
    value = raw if raw is not None else f"{tag}v{i}"
    if raw is None:
      rules.append(f"{tag}v{i}: %json {json.dumps(_json_schema(prop))}")
    head = _lark_literal(f"{g.KEY_START}{key}{g.KEY_END}{g.VALUE_START}")
    rules.append(f"{tag}p{i}: {head} {value} {_lark_literal(g.VALUE_END)}")
    parts.append(f"{tag}p{i}" if key in required else f"{tag}p{i}?")
  return " ".join(parts), rules


def tool_args_lark(schema: Mapping) -> str:
  """The Lark grammar of a named call's rest (its name already written): the arguments, then
  `</tool_call>`."""
  from glmjax.decoding import glm_format as g
  seq, rules = _args_rules(schema, "a")
  return "\n".join([f"start: {seq} {_lark_literal(g.CALL_END)}"] + rules) + "\n"


def tool_call_lark(functions: Mapping[str, Mapping]) -> str:
  """The Lark grammar of a required call's rest (after `<tool_call>`): one of the functions'
  names, its arguments, then `</tool_call>`."""
  from glmjax.decoding import glm_format as g
  alternatives, rules = [], []
  for j, (name, params) in enumerate(functions.items()):
    seq, own = _args_rules(params, f"f{j}")
    alternatives.append(f"{_lark_literal(name)} {seq}")
    rules += own
  start = "(" + " | ".join(alternatives) + ") " + _lark_literal(g.CALL_END)
  return "\n".join([f"start: {start}"] + rules) + "\n"


def grammar_text(spec: GrammarSpec) -> str:
  """The llguidance grammar of `spec`."""
  import llguidance
  if not isinstance(spec.schema, Mapping):
    raise GrammarError(f"{spec.field}: the schema must be a JSON object", spec.field)
  check_patterns(spec.schema, spec.field)
  if spec.kind == "json":
    return llguidance.LLMatcher.grammar_from_json_schema(_json_schema(spec.schema))
  if spec.kind == "tool_args":
    return llguidance.LLMatcher.grammar_from_lark(tool_args_lark(spec.schema))
  if spec.kind == "tool_call":
    return llguidance.LLMatcher.grammar_from_lark(tool_call_lark(spec.schema))
  raise GrammarError(f"unknown grammar kind {spec.kind!r}", spec.field)


# Tokenizer -> {(vocab size, stop ids): llguidance's view of it (its token byte strings)}: ~1 s
# to build for a large vocabulary, so once per model.
_LL_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer, vocab_size: int, stop_ids) -> Any:
  import llguidance
  key = (vocab_size, tuple(sorted(stop_ids)))
  cached = _LL_TOKENIZERS.setdefault(tokenizer, {})
  if key not in cached:
    cached[key] = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size,
                                         eos_token=list(key[1]))
  return cached[key]


# --- one request's matcher -----------------------------------------------------------------------

class Constraint:
  """One request's grammar state. `bits()`: the tokens allowed next, packed as the sampler
  takes them (uint8 `[ceil(V/8)]`, None while the reasoning is still open: everything is);
  `mask()`: the same as bool `[V]`; `observe(tok)`: the token joined the output."""

  def __init__(self, spec: GrammarSpec, tokenizer, vocab_size: int, stop_ids):
    import llguidance
    self.spec = spec
    self.vocab_size = vocab_size
    self.end_think = tokenizer.end_think_id if spec.after_think else None
    if spec.after_think and self.end_think is None:
      raise GrammarError(f"{spec.field}: with reasoning on, the grammar starts after </think>, "
                         "and this tokenizer has no </think> token", spec.field)
    self.active = not spec.after_think
    ll = ll_tokenizer(tokenizer, vocab_size, stop_ids)
    self.matcher = llguidance.LLMatcher(ll, grammar_text(spec), log_level=0)
    if self.matcher.is_error():
      raise GrammarError(f"{spec.field}: the grammar library refused the schema: "
                         f"{self.matcher.get_error()}", spec.field)

  def bits(self) -> np.ndarray | None:
    if not self.active or self.matcher.is_error():
      return None
    packed = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
    return packed[:(self.vocab_size + 7) // 8]

  def mask(self) -> np.ndarray | None:
    bits = self.bits()
    if bits is None:
      return None
    return np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)

  def observe(self, tok: int) -> None:
    if not self.active:
      self.active = tok == self.end_think
      return
    self.matcher.consume_token(int(tok))

  @property
  def failed(self) -> str | None:
    """Why the matcher stopped matching (only a token the mask forbade can do that)."""
    return self.matcher.get_error() if self.matcher.is_error() else None


def validate(spec: GrammarSpec, tokenizer, vocab_size: int, stop_ids) -> None:
  """Compiles `spec` once, raising GrammarError (a 400 through the server) if it cannot be."""
  Constraint(spec, tokenizer, vocab_size, stop_ids)
