"""glmjax.cli: Options as absl flags and back (fast: no model is loaded)."""

import dataclasses
import typing

from absl import flags
import pytest

from glmjax import cli
from glmjax.errors import InputError
from glmjax.options import Options

FIELDS = {f.name: f for f in dataclasses.fields(Options)}


def parsed(*argv, **define) -> flags.FlagValues:
  fv = flags.FlagValues()
  cli.define_load_flags(fv, **define)
  fv(["script", *argv])
  return fv


def test_every_option_is_a_flag_with_its_docstring_help():
  fv = parsed()
  doc = " ".join(Options.__doc__.split())
  kinds, hints = {bool: "bool", int: "int", float: "float"}, typing.get_type_hints(Options)
  for name, field in FIELDS.items():
    flag = fv[name]  # an enum's help starts with its choices: <auto|float32|...>: ...
    assert flag.default == field.default and flag.help.endswith(cli.field_help()[name])
    if name in cli.EXTRA_HELP:  # only fields the docstring does not describe
      assert f"    {name}: " not in Options.__doc__, f"{name}: drop it from cli.EXTRA_HELP"
    else:
      assert f"{name}: {cli.field_help()[name]}" in doc, name
    kind = kinds.get(cli.base_type(hints[name]), "string")
    assert flag.flag_type() == ("string enum" if name in cli.CHOICES else kind), name
  assert cli.load_options(fv) == {}  # all defaults: nothing to pass


def test_flags_round_trip_to_load_kwargs():
  fv = parsed("--host_cache_gb=2", "--nocold", "--dtype=float32")
  kwargs = cli.load_options(fv)
  assert kwargs == {"dtype": "float32", "host_cache_gb": 2.0}
  opts = Options(**kwargs)
  assert (opts.dtype, opts.host_cache_gb, opts.cold, opts.device_cache_gb) == ("float32", 2.0,
                                                                                False, None)
  # The Options of the kwargs are those of every flag's value.
  assert opts == Options(**{n: fv[n].value for n in FIELDS})
  assert cli.load_options(fv, exclude=("dtype",)) == {"host_cache_gb": 2.0}


def test_a_script_overrides_defaults_and_declares_a_subset():
  define = dict(only=("cold", "host_cache_gb", "prefill_chunk"),
                defaults={"cold": True, "prefill_chunk": 128}, notes={"cold": "Here: each run."})
  fv = parsed(**define)
  assert sorted(fv) == ["cold", "host_cache_gb", "prefill_chunk"]
  assert fv["cold"].help.endswith("Here: each run.")
  assert cli.load_options(fv) == {"cold": True, "prefill_chunk": 128}
  assert cli.load_options(parsed("--nocold", "--prefill_chunk=0", **define)) == {
      "prefill_chunk": 0}  # --nocold is Options' default again
  assert sorted(parsed(exclude=("cold", "dtype"))) == sorted(set(FIELDS) - {"cold", "dtype"})
  with pytest.raises(ValueError, match="not Options fields: colder"):
    parsed(defaults={"colder": True})


def test_choices_and_bounds_are_options_own():
  for name, choices in cli.CHOICES.items():
    for c in choices:
      Options(**{name: c})
    with pytest.raises(InputError):
      Options(**{name: "bogus"})
    with pytest.raises(flags.IllegalFlagValueError):
      parsed(f"--{name}=bogus")
  for name, (lower, upper) in cli.BOUNDS.items():
    below = lower - 1 if FIELDS[name].type.startswith("int") else lower - 0.5
    with pytest.raises(flags.IllegalFlagValueError):
      parsed(f"--{name}={below}")
    if upper is not None:
      with pytest.raises(InputError):
        Options(**{name: upper + 1})


def test_model_flag_and_the_store_alias():
  fv = flags.FlagValues()
  cli.define_model_flag(cli.STORE_KINDS, flag_values=fv, store_alias=True)
  fv(["script", "--store=/tmp/s"])
  assert fv.model == "/tmp/s" and fv["model"].help.startswith("The model to load: an expert store")


def test_the_flags_belong_to_the_script_that_declares_them():
  """glmjax.cli disclaims its flags, so a script's --help (its key flags) lists them."""
  fv = flags.FlagValues()
  cli.define_load_flags(fv, only=("cold",))
  cli.define_model_flag(cli.MODEL_KINDS, flag_values=fv)
  assert {f.name for f in fv.get_key_flags_for_module(__name__)} == {"cold", "model"}
