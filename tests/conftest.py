"""Suite-wide setup: a private model cache so the suite never touches ~/.cache."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_model_cache(tmp_path_factory):
  os.environ["GLMJAX_CACHE"] = str(tmp_path_factory.mktemp("glmjax_cache"))
  yield


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def convert_store(src: str, dst: str, *flags: str, timeout: float = 300):
  """Runs scripts/convert.py as a user would (default flags unless given); the CompletedProcess."""
  import subprocess
  import sys
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "convert.py"),
                         f"--src={src}", f"--dst={dst}", *flags],
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def embedded_store(tmp_path_factory):
  """The embedded model converted with the converter's default flags (what users run first)."""
  from glmjax.formats import embedded
  dst = str(tmp_path_factory.mktemp("embedded_store") / "store")
  r = convert_store(embedded.ensure(progress=False), dst)
  assert r.returncode == 0, r.stderr
  return dst
