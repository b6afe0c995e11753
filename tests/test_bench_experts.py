"""scripts/bench_experts.py as a user runs it, at small dims: every backend it times computes
the same expert outputs as the numba kernel, and the report has every section."""

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_experts.py")
SMALL = ["--hidden=320", "--intermediate=128", "--experts=4", "--top_k=2", "--tokens=1,5",
         "--repeats=1", "--dram_gib=0.01", "--wait_idle_s=0"]
TOL = 1e-5  # float32 accumulation in different orders


def _run(tmp_path, *extra):
  out = tmp_path / "bench_experts.json"
  r = subprocess.run([sys.executable, SCRIPT, *SMALL, *extra, f"--out={out}"], cwd=tmp_path,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(out.read_text())


def test_bench_experts_small_with_interpreted_pallas(tmp_path):
  report = _run(tmp_path, "--pallas=interpret")
  assert report["shapes"] == dict(D=320, I=128, group_size=64, bits=4, experts=4, top_k=2)
  for name in ("jax_jit_sum", "numpy_sum", "numba_vector_stream"):
    assert report["dram_read"][name]["gb_per_s"] > 0
  dec = report["decode"]
  assert dec["numba_vs_xla_max_rel_err"] < TOL
  for name in ("numba_expert_ffn", "xla_per_pair", "xla_dequant_einsum"):
    assert dec[name]["gb_per_s"] > 0
  assert [g["tokens"] for g in report["grouped"]] == [1, 5]
  assert all(g["pairs"] == 2 * g["tokens"] and g["gflop_per_s"] > 0 for g in report["grouped"])
  score = report["score_128"]
  assert score["numba_vs_xla_max_rel_err"] < TOL
  assert score["speedup_numba_over_per_pair"] > 0  # the per-pair path ran
  pallas = report["pallas"]
  assert pallas["interpret"] is True
  assert pallas["decode"]["max_rel_err_vs_numba"] < TOL and pallas["decode"]["gb_per_s"] > 0
  assert [g["tokens"] for g in pallas["grouped"]] == [1, 5]
  for g in pallas["grouped"]:
    assert "error" not in g, g
    assert g["max_rel_err_vs_numba"] < TOL and np.isfinite(g["gflop_per_s"])


def test_bench_experts_without_accelerator_says_pallas_not_measured(tmp_path):
  report = _run(tmp_path, "--skip_per_pair")
  assert report["machine"]["jax_backend"] == "cpu"
  assert report["pallas"].startswith("not measured: no accelerator")
  assert report["score_128"]["xla_per_pair"] == "skipped (--skip_per_pair)"


def test_check_gpu_experts_step_reads_the_pallas_rows(tmp_path, monkeypatch):
  """check_gpu.py's bench_experts step (run on GPU machines only) at small dims, interpreted:
  it passes on agreeing kernels and reports a failure for a disagreeing one."""
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  import check_gpu  # pylint: disable=import-outside-toplevel
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(["check_gpu"])
  small = tuple(a for a in SMALL if not a.startswith(("--repeats", "--wait_idle_s")))
  result = check_gpu.experts_check(str(tmp_path), (*small, "--pallas=interpret"))
  assert result["ok"], result
  assert result["report"]["pallas"]["decode"]["max_rel_err_vs_numba"] < TOL
  monkeypatch.setattr(check_gpu, "RTOL", 0.0)  # no two summation orders agree to 0
  assert not check_gpu.experts_agree(result["report"])
  assert not check_gpu.experts_agree({**result["report"], "pallas": "not measured"})
