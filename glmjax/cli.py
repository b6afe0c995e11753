"""Script flags from one declaration: `glmjax.options.Options` as absl flags, and back.

A script that loads a model declares its load options here, never by hand (tests/
test_architecture.py checks it): each `Options` field becomes a flag of the same name, its type
from the field's annotation, its help from the field's entry under "Attributes:" in `Options`'
docstring, its default `Options`' unless the script overrides it.

  from glmjax import cli
  cli.define_model_flag(cli.STORE_KINDS)   # --model, saying which kinds of model it takes
  cli.define_load_flags(only=("host_cache_gb", "cold"), defaults={"cold": True})
  ...
  glmjax.load(FLAGS.model, **cli.load_options(), progress=False)
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
import weakref

from absl import flags

from glmjax.options import DTYPES, MAX_PREFILL_CHUNK, Options

# The flags below belong to the script that asks for them: its --help lists them.
flags.disclaim_key_flags()

# The values each string option takes (Options.__post_init__ checks the same sets; a test keeps
# the two in step): these become DEFINE_enum, other strings DEFINE_string.
CHOICES = {
    "dtype": DTYPES,
    "moe_kernel": ("auto", "cpu", "pallas", "xla"),
    "expert_compute": ("auto", "device", "host"),
    "attention": ("sparse", "dense"),
    "kv_dtype": ("auto", "float32", "bfloat16"),
    "index_dtype": ("auto", "float32", "bfloat16", "float8"),
    "compile_unit": ("auto", "layer", "step"),
}
# (lower, upper) bounds absl checks as it parses (Options checks again at load).
BOUNDS = {"max_context": (1, None), "io_workers": (1, None), "expert_budget": (1, None),
          "prefill_chunk": (0, MAX_PREFILL_CHUNK), "pilot_k": (0, None), "couple_k": (0, None),
          "route_keep": (0, None), "route_rank": (0, None), "device_cache_gb": (0, None),
          "host_cache_gb": (0, None), "io_timeout_s": (0, None)}
# Help of the fields Options' docstring does not describe (a test fails once it does).
EXTRA_HELP: dict[str, str] = {}  # help for any field the docstring does not describe

# The kinds of model most scripts take, for define_model_flag.
MODEL_KINDS = "an HF checkpoint or expert store directory; default: the embedded model"
STORE_KINDS = "an expert store; default: the embedded model, converted to a temporary one"

_DECLARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # FlagValues -> names


def field_help() -> dict[str, str]:
  """Each `Options` field's entry under "Attributes:" in its docstring, on one line."""
  doc = inspect.cleandoc(Options.__doc__).split("Attributes:", 1)[1]
  fields = {f.name for f in dataclasses.fields(Options)}
  out, name = {}, None
  for line in doc.splitlines():
    m = re.match(r"  (\w+): (.*)", line)
    if m and m.group(1) in fields:
      name = m.group(1)
      out[name] = m.group(2).strip()
    elif name is not None and line.strip():
      out[name] += " " + line.strip()
  return {**EXTRA_HELP, **out}


def base_type(annotation) -> type:
  """bool, int, float or str: the annotation with `| None` taken off."""
  if isinstance(annotation, types.UnionType):
    (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
  return annotation


def define_load_flags(flag_values: flags.FlagValues = flags.FLAGS, only=None, exclude=(),
                      defaults: dict | None = None, notes: dict | None = None) -> tuple[str, ...]:
  """Declares a flag for each `Options` field (those named in `only`, default all, less
  `exclude`). `defaults` overrides Options' default where the script's differs; `notes` adds the
  script's own words to a flag's help. Returns the names declared."""
  fields = {f.name: f for f in dataclasses.fields(Options)}
  defaults, notes = defaults or {}, notes or {}
  names = tuple(n for n in (fields if only is None else only) if n not in exclude)
  unknown = sorted((set(names) | set(exclude) | set(defaults) | set(notes)) - set(fields))
  if unknown:
    raise ValueError(f"not Options fields: {', '.join(unknown)}")
  hints, helps = typing.get_type_hints(Options), field_help()
  for name in names:
    default = defaults.get(name, fields[name].default)
    text = helps[name] + (f" {notes[name]}" if name in notes else "")
    kind, kw = base_type(hints[name]), dict(flag_values=flag_values)
    if kind is bool:
      flags.DEFINE_bool(name, default, text, **kw)
    elif name in CHOICES:
      flags.DEFINE_enum(name, default, CHOICES[name], text, **kw)
    elif kind is str:
      flags.DEFINE_string(name, default, text, **kw)
    elif kind in (int, float):
      lower, upper = BOUNDS.get(name, (None, None))
      define = flags.DEFINE_integer if kind is int else flags.DEFINE_float
      define(name, default, text, lower_bound=lower, upper_bound=upper, **kw)
    else:
      raise TypeError(f"Options.{name}: no flag type for {hints[name]}")
  _DECLARED.setdefault(flag_values, []).extend(names)
  return names


def load_options(flag_values: flags.FlagValues = flags.FLAGS, exclude=()) -> dict:
  """`glmjax.load` keyword arguments from the flags `define_load_flags` declared in
  `flag_values` (less `exclude`): those whose value is not Options' default, so an unset flag
  whose default is None stays out and the Options built from the result are those of the flags.
  """
  defaults = {f.name: f.default for f in dataclasses.fields(Options)}
  return {n: flag_values[n].value for n in _DECLARED.get(flag_values, ())
          if n not in exclude and flag_values[n].value != defaults[n]}


def define_model_flag(help_kinds: str, flag_values: flags.FlagValues = flags.FLAGS,
                      store_alias: bool = False) -> None:
  """Declares --model, what the script loads; `help_kinds` says which kinds of model it takes
  (an HF checkpoint directory, an expert store) and what it loads without one. `store_alias`
  keeps the older --store working (deprecated) in the scripts that had it."""
  flags.DEFINE_string("model", None, f"The model to load: {help_kinds}.", flag_values=flag_values)
  if store_alias:
    flags.DEFINE_alias("store", "model", flag_values=flag_values)
