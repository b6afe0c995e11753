"""scripts/bench_vs_transformers.py as a user runs it: a subprocess with default flags; and
scripts/bench_depth.py on two tiny synthetic depths."""

import json
import os
import subprocess
import sys

import pytest

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
  # As `python scripts/bench_vs_transformers.py` runs it: argv and the script's folder on the path.
  code = ("import os, runpy, sys; sys.modules['transformers'] = None; "
          f"sys.argv = [{SCRIPT!r}]; sys.path.insert(0, os.path.dirname({SCRIPT!r})); "
          f"runpy.run_path({SCRIPT!r}, run_name='__main__')")
  r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 1, (r.stdout, r.stderr)
  assert "needs transformers and torch" in r.stderr and "[test]" in r.stderr
  assert r.stdout == ""


def test_bench_depth_tiny(tmp_path):
  """bench_depth at a tiny depth (stores made on the way): per depth and phase a positive
  limit (compute or Belady's I/O) and ratio, hit rates in [0, 1], and the engine serving exactly
  the requests the replays see in each phase (the prefill/decode split agrees)."""
  out = tmp_path / "depth.json"
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_depth.py"),
                      "--geometry=tiny", "--layers=2", "--warm_layers=2", "--max_new_tokens=3",
                      "--experts=8",
                      f"--stores={tmp_path / 'stores'}", f"--json={out}"],
                     cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  report = json.loads(out.read_text())
  assert [d["moe_layers"] for d in report["depths"]] == [2]
  assert report["disk"]["disk_gbs"] > 0 and os.path.getsize(report["png"]) > 0
  rates = report["disk"]["by_workers"]  # the disk's best rate over the thread counts
  assert sorted(rates) == ["1", "2", "4", "8"] and report["disk"]["disk_gbs"] == max(rates.values())
  assert all(w["misses"] == 0 for w in report["compute"]["warm_runs"].values())  # all resident
  for fit in report["compute"]["fit"].values():
    assert fit["intercept_s"] >= 0 and fit["slope_s_per_layer"] >= 0
    assert fit["intercept_s"] + fit["slope_s_per_layer"] > 0
  for d in report["depths"]:
    assert (d["prompt_tokens"], d["new_tokens"], d["decode_steps"]) == (4, 3, 2)
    assert d["peak_rss_mb"] > 0 and d["prefill_s"] > 0 and d["decode_s_per_token"] > 0
    assert d["ms_per_layer_token"] == pytest.approx(1e3 * d["decode_s_per_token"]
                                                    / d["moe_layers"])
    assert d["host_cache_gb"] * 2**30 < d["expert_bytes_total"]  # only part of it fits
    for phase in ("prefill", "decode"):
      lim = d[f"{phase}_limit"]
      assert lim["limit_s_per_token"] == max(lim["compute_s_per_token"], lim["io_s_per_token"])
      assert lim["limit_s_per_token"] > 0 and lim["io_s_per_token"] > 0
      assert d[f"{phase}_ratio"] == pytest.approx(lim["measured_s_per_token"]
                                                  / lim["limit_s_per_token"])
      assert d[f"{phase}_ratio"] > 0 and d[f"{phase}_bound"] in ("io", "compute")
      for rate in ("hit_rate", "host_hit_rate", "belady_hit_rate", "lru_layer_hit_rate",
                   "lru_global_hit_rate"):
        assert 0 <= d[f"{phase}_{rate}"] <= 1, (phase, rate)
      assert d[f"{phase}_belady_hit_rate"] >= d[f"{phase}_lru_global_hit_rate"]
      e = d["engine"][phase]
      served = e["expert_misses"] + e["expert_host_hits"] + e["expert_pin_hits"]
      assert served == d["replay"][f"belady_{phase}"]["requests"] > 0
    assert d["prefill_belady_hit_rate"] == 0  # one step from a cold start: compulsory misses
    assert d["engine"]["prefill"]["expert_bytes_read"] >= d["replay"]["belady_prefill"]["bytes"]


def test_bench_compile_at_glm5_dims_compiles_each_distinct_half_once(tmp_path):
  """bench_compile's abstract GLM-5 path at 1 dense + 3 MoE layers: the layer steps and the
  fused step each compile one program per distinct half layer (4: attention with a full and
  with a shared indexer, a dense and a MoE MLP), not one per layer, and time them along with
  the one program."""
  out = tmp_path / "compile.json"
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_compile.py"),
                      "--layers=", "--glm5_layers=4", "--prefill_tokens=8", "--capacity=64",
                      f"--json={out}"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  (row,) = json.loads(out.read_text())["glm5_dims"]
  assert row["layers"] == 4
  for phase in ("prefill", "decode"):
    assert row[f"{phase}_layer_programs"] == row[f"{phase}_fused_programs"] == 4
    for kind in ("layer_steps", "fused_layers", "one_program"):
      assert row[f"{phase}_{kind}_s"] > 0
