"""The wings' boundaries, read from the source: serving/ uses only public names of the other
wings, pallas_kernels/ imports nothing from glmjax, only glmjax/model/kernels.py picks kernels,
scripts declare their load flags through glmjax.cli, the model's public functions take few
parameters, and every entry into the offload engine folds a deferred step first."""

import ast
import dataclasses
import glob
import os

from glmjax.options import Options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules(folder: str) -> dict[str, ast.Module]:
  return {path: ast.parse(open(path, encoding="utf-8").read(), path)
          for path in sorted(glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True))}


def _private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(tree: ast.Module) -> list[str]:
  """Private names a module takes from elsewhere: imported (`from x import _y`, `import _x`)
  or read as an attribute of anything but `self`, `cls` or a class the module defines."""
  own = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)} | {"self", "cls"}
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom):
      found += [f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names
                if _private(a.name) or _private((node.module or "").split(".")[-1])]
    elif isinstance(node, ast.Import):
      found += [f"line {node.lineno}: import {a.name}" for a in node.names
                if any(_private(p) for p in a.name.split("."))]
    elif isinstance(node, ast.Attribute) and _private(node.attr):
      base = node.value
      if not (isinstance(base, ast.Name) and base.id in own):
        found.append(f"line {node.lineno}: {ast.unparse(node)}")
  return found


def test_serving_uses_only_public_names():
  bad = {os.path.relpath(p, ROOT): uses for p, t in _modules("glmjax/serving").items()
         if (uses := private_uses(t))}
  assert not bad, bad


def test_the_check_sees_private_uses():
  """The checker itself: each form of private use is caught, the allowed ones are not."""
  tree = ast.parse("from glmjax.api import _bucket\nimport glmjax._x\nclass Own:\n  _n = 1\n"
                   "def f(self, model):\n  model._tokens(1)\n  self._a\n  Own._n\n"
                   "  model.__class__\n")
  assert [u.split(":")[0] for u in private_uses(tree)] == ["line 1", "line 2", "line 6"]


def test_pallas_kernels_import_nothing_from_glmjax():
  for path, tree in _modules("pallas_kernels").items():
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      assert not any(n == "glmjax" or n.startswith("glmjax.") for n in names), (path, names)


OPTION_FIELDS = {f.name for f in dataclasses.fields(Options)}


def hand_declared_load_flags(tree: ast.Module) -> list[str]:
  """Flags a script declares by hand (`flags.DEFINE_*("name", ...)`) that glmjax.cli declares:
  `model` and the deprecated `store` in any script, and `Options` fields in a script that
  calls `glmjax.load` (or a `load` imported from glmjax)."""
  loads_from = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.module or "").split(".")[0] == "glmjax" for a in n.names if a.name == "load"}
  loads = any(isinstance(n, ast.Call) and (
      (isinstance(n.func, ast.Attribute) and n.func.attr == "load"
       and isinstance(n.func.value, ast.Name) and n.func.value.id == "glmjax")
      or (isinstance(n.func, ast.Name) and n.func.id in loads_from)) for n in ast.walk(tree))
  banned = {"model", "store"} | (OPTION_FIELDS if loads else set())
  found = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call):
      continue
    func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    if not func.startswith("DEFINE_"):
      continue
    name = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"),
                                               None)
    if isinstance(name, ast.Constant) and name.value in banned:
      found.append(f"line {node.lineno}: {func}({name.value!r})")
  return found


def test_scripts_declare_load_flags_through_the_helper():
  """Every script that loads a model takes --model and its load options from glmjax.cli (one
  declaration: Options' fields, types, defaults and docstring), never by hand."""
  bad = {os.path.relpath(p, ROOT): found for p, t in _modules("scripts").items()
         if (found := hand_declared_load_flags(t))}
  assert not bad, bad


def test_the_check_sees_hand_declared_load_flags():
  loads = "import glmjax\nglmjax.load(None)\n"
  found = lambda src: [f.split(": ")[1] for f in hand_declared_load_flags(ast.parse(src))]
  assert found(loads + 'flags.DEFINE_enum("dtype", "auto", ["auto"], "x")\n'
               'flags.DEFINE_string(name="store", default=None, help="x")\n'
               'DEFINE_integer("tokens", 1, "x")\n') == ["DEFINE_enum('dtype')",
                                                          "DEFINE_string('store')"]
  assert found("from glmjax import load as L\nL()\nflags.DEFINE_bool('cold', True, 'x')\n") == [
      "DEFINE_bool('cold')"]
  # a script that loads nothing may name a flag like an option (simulate.py's --prefetch)
  assert found("flags.DEFINE_list('prefetch', [], 'x')\nflags.DEFINE_string('model', None, "
               "'x')\n") == ["DEFINE_string('model')"]


MODEL_NAMES = {"model", "m", "float_model"}  # what the library and scripts call a loaded Model


def mode_reads(tree: ast.Module) -> list[str]:
  """Reads that branch on how a model runs: `.offloaded` or `.runner` of anything, and
  `.engine` of a model (a name in MODEL_NAMES, or any `<x>.model`)."""
  found = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute) or node.attr not in ("offloaded", "runner", "engine"):
      continue
    base = node.value
    of_model = ((isinstance(base, ast.Name) and base.id in MODEL_NAMES)
                or (isinstance(base, ast.Attribute) and base.attr == "model"))
    if node.attr != "engine" or of_model:
      found.append(f"line {node.lineno}: {ast.unparse(node)}")
  return found


def test_only_the_executors_know_how_a_model_runs():
  """Decoding, serving, the studies and the scripts go through `model.executor`
  (glmjax.runtime); nothing outside the executors asks whether a model is offloaded."""
  trees = {**_modules("glmjax"), **_modules("scripts")}
  runtime = os.path.join(ROOT, "glmjax", "runtime")
  bad = {os.path.relpath(p, ROOT): reads for p, t in trees.items()
         if not p.startswith(runtime) and (reads := mode_reads(t))}
  assert not bad, bad


def test_the_check_sees_mode_reads():
  tree = ast.parse("if model.offloaded:\n  r = m.runner\nx = self.model.engine.telemetry()\n"
                   "y = job.engine\nz = model.executor.telemetry()\n")
  assert [u.split(":")[0] for u in mode_reads(tree)] == ["line 1", "line 2", "line 3"]


# The one module of glmjax/model that picks kernels: it alone imports pallas_kernels and asks
# which platform this process computes on.
KERNEL_DISPATCH = "glmjax/model/kernels.py"


def kernel_choices(tree: ast.Module) -> list[str]:
  """Where a module imports pallas_kernels or asks for the platform (`jax.default_backend`,
  any `.platform`)."""
  found = []
  for node in ast.walk(tree):
    names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
             [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
    found += [f"line {node.lineno}: imports {n}" for n in names
              if n == "pallas_kernels" or n.startswith("pallas_kernels.")]
    if (isinstance(node, ast.Attribute) and node.attr in ("default_backend", "platform")
        or isinstance(node, ast.Name) and node.id == "default_backend"):
      found.append(f"line {node.lineno}: {ast.unparse(node)}")
  return found


def test_only_the_dispatch_module_chooses_kernels():
  """Model code knows no platform and no kernel module: glmjax/model/kernels.py picks the
  backend for every matmul and expert term, and the offload provider calls it too."""
  bad = {rel: uses for p, t in _modules("glmjax/model").items()
         if (rel := os.path.relpath(p, ROOT)) != KERNEL_DISPATCH and (uses := kernel_choices(t))}
  assert not bad, bad
  assert kernel_choices(_modules("glmjax/model")[os.path.join(ROOT, KERNEL_DISPATCH)])
  provider = _modules("glmjax/offload")[os.path.join(ROOT, "glmjax/offload/provider.py")]
  direct = [ast.unparse(n) for n in ast.walk(provider)
            if isinstance(n, ast.Attribute) and n.attr == "expert_ffn"]
  assert not direct and not kernel_choices(provider), (direct, kernel_choices(provider))


def test_the_check_sees_kernel_choices():
  tree = ast.parse("import pallas_kernels.cpu\nfrom pallas_kernels import ops\nimport jax\n"
                   "def f():\n  jax.default_backend()\n  jax.devices()[0].platform\n"
                   "  from jax import default_backend\n  default_backend()\n")
  assert sorted(int(u.split(":")[0][5:]) for u in kernel_choices(tree)) == [1, 2, 5, 6, 8]


MAX_PARAMS = 8  # a public function of glmjax/model/ takes at most this many parameters


def wide_functions(tree: ast.Module) -> list[str]:
  """Public functions and methods (at module or class level) with more than MAX_PARAMS
  parameters, `self` and `cls` not counted."""
  found = []
  scopes = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
  for body in scopes:
    for fn in body:
      if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or _private(fn.name):
        continue
      a = fn.args
      names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs
               + [p for p in (a.vararg, a.kwarg) if p is not None]]
      n = len([x for x in names if x not in ("self", "cls")])
      if n > MAX_PARAMS:
        found.append(f"{fn.name}: {n}")
  return found


def test_model_functions_take_few_parameters():
  """The forward pass's public functions take their static choices as one `Runtime` and a
  pass's driving as one `Drive` (glmjax.model), not as threaded keyword arguments."""
  bad = {os.path.relpath(p, ROOT): wide for p, t in _modules("glmjax/model").items()
         if (wide := wide_functions(t))}
  assert not bad, bad


def test_the_check_sees_wide_functions():
  tree = ast.parse("def f(a, b, c, d, e, f, g, h, i): pass\ndef g(a, b, c, d, e, f, g, *h): pass\n"
                   "def _h(a, b, c, d, e, f, g, h, i): pass\nclass C:\n"
                   "  def m(self, a, b, c, d, e, f, g, h, *, i=0): pass\n"
                   "  def n(self, a, b, c, d, e, f, g, h): pass\n")
  assert wide_functions(tree) == ["f: 9", "m: 9"]


# The engine's public names that read no tier state or counters (its configuration).
ENGINE_SETTINGS = {"prefetch", "kernel", "stage_s", "closed"}


def unfolded_entries(tree: ast.Module, cls: str = "OffloadEngine") -> list[str]:
  """Public methods and properties of `cls` that do not start by folding a deferred fused
  step (the `folded` decorator), its settings (ENGINE_SETTINGS) aside."""
  (engine,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
  return [fn.name for fn in engine.body
          if isinstance(fn, ast.FunctionDef) and not fn.name.startswith("_")
          and fn.name not in ENGINE_SETTINGS
          and "folded" not in {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}]


def test_every_engine_entry_folds_the_deferred_step_first():
  """A fused step returns before its bookkeeping when nothing can miss; every way into the
  engine folds it first, so no caller has a rule to remember (glmjax.offload.engine.folded)."""
  path = os.path.join(ROOT, "glmjax", "offload", "engine.py")
  assert unfolded_entries(ast.parse(open(path, encoding="utf-8").read())) == []


def test_the_check_sees_unfolded_entries():
  tree = ast.parse("class OffloadEngine:\n  @folded\n  def forward(self): pass\n"
                   "  @property\n  @folded\n  def heat(self): pass\n"
                   "  @property\n  def host(self): pass\n  def telemetry(self): pass\n"
                   "  def _routing(self): pass\n  @property\n  def kernel(self): pass\n")
  assert unfolded_entries(tree) == ["host", "telemetry"]
