"""scripts/bench_vs_transformers.py as a user runs it: a subprocess with default flags."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_vs_transformers.py")
N = 16


def test_bench_vs_transformers_defaults(tmp_path):
  out = tmp_path / "bench.json"
  # Another working directory: the script finds its model and package on its own.
  r = subprocess.run([sys.executable, SCRIPT, f"--max_new_tokens={N}", "--runs=1",
                      f"--json={out}"], cwd=tmp_path, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stderr
  report = json.loads(out.read_text())
  assert json.loads(r.stdout) == report  # printed and written alike
  for key in ("model", "prompt_tokens", "max_new_tokens", "timed", "glmjax", "transformers",
              "speedup_glmjax_over_transformers", "agreement", "versions", "machine"):
    assert key in report, key
  for side in ("glmjax", "transformers"):
    s = report[side]
    for key in ("warmup_s", "load_s", "wall_s", "ttft_s", "decode_s", "tok_s", "decode_tok_s"):
      assert s[key] > 0, (side, key, s[key])
    assert len(s["runs"]) == 1 and all(run["new_tokens"] == N for run in s["runs"])
    assert len(s["tokens"]) == N and s["deterministic"]
  for key in ("tok_s", "decode_tok_s", "ttft_s"):
    assert report["speedup_glmjax_over_transformers"][key] > 0
  # The two implementations agree to float32 rounding (tests/test_parity.py,
  # test_embedded.py), so every greedy token of the embedded model matches.
  assert report["agreement"] == {"equal": N, "compared": N, "fraction": 1.0,
                                 "first_divergence": None}


def test_bench_vs_transformers_without_transformers(tmp_path):
  """Without the test extras the script names them and exits 1, before loading anything."""
  code = ("import runpy, sys; sys.modules['transformers'] = None; "
          f"sys.argv = [{SCRIPT!r}]; runpy.run_path({SCRIPT!r}, run_name='__main__')")
  r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 1, (r.stdout, r.stderr)
  assert "needs transformers and torch" in r.stderr and "[test]" in r.stderr
  assert r.stdout == ""
