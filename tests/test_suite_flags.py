"""The suite compiles with `conftest.SUITE_XLA_FLAGS` (LLVM level 1, one codegen piece) to save
time; users compile with XLA's defaults. This checks that the two give the same bits on the
model's steps, so what the suite proves holds for what users run: the embedded model's
scores, greedy and speculative generation, and the offload engine's layer steps on the
converted store, computed here under the suite's flags and in a process with no XLA flags.
"""

import os
import subprocess
import sys

import numpy as np

from conftest import ROOT, SUITE_XLA_FLAGS

_OUTPUTS = r"""
import numpy as np
import glmjax


def outputs(store):
  toks = (np.arange(80, dtype=np.int32).reshape(2, 40) * 7 + 3) % 1000
  out = {}
  with glmjax.load(progress=False) as m:
    out["score"] = m.score(toks)
    out["greedy"] = np.asarray(m.generate(list(range(3, 60)), 8, stop_ids=[],
                                          temperature=0.0).tokens)
    out["draft"] = np.asarray(m.generate(list(range(3, 30)), 6, stop_ids=[], temperature=0.0,
                                         draft=2).tokens)
  with glmjax.load(store, progress=False, device_cache_gb=0, host_cache_gb=0) as s:
    out["engine"] = s.score(toks)
  return out
"""


def test_suite_flags_change_no_bit(embedded_store, tmp_path):
  assert SUITE_XLA_FLAGS in os.environ["XLA_FLAGS"]  # this process compiles with them
  namespace = {}
  exec(_OUTPUTS, namespace)  # pylint: disable=exec-used
  here = namespace["outputs"](embedded_store)
  path = str(tmp_path / "default.npz")
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             XLA_FLAGS="", JAX_PLATFORMS="cpu")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # compiled anew, by the default flags
  script = _OUTPUTS + f"\nnp.savez({path!r}, **outputs({embedded_store!r}))\n"
  r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  default = np.load(path)
  assert set(default.files) == set(here)
  for key, value in here.items():
    assert np.array_equal(default[key], value), key
