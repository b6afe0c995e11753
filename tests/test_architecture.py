"""The wings' boundaries, read from the source: serving/ uses only public names of the other
wings, and pallas_kernels/ imports nothing from glmjax."""

import ast
import glob
import os

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
