"""bench_decode's limit arithmetic (fake timings and small traces) and the script itself."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from glmjax.errors import InputError
from glmjax.replay import Trace
from glmjax.replay.limit import belady_reads, capacity_experts, decode_limit
from glmjax.bench.reporting import disk_read_gbs, store_geometry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_limit_is_the_larger_of_compute_and_belady_reads():
  # 3 GB at 1.5 GB/s over 4 tokens: 0.5 s per token of reads against 0.25 s of compute.
  r = decode_limit(compute_s=1.0, io_bytes=3_000_000_000, disk_gbs=1.5, measured_s=10.0, tokens=4)
  assert r["compute_s_per_token"] == pytest.approx(0.25)
  assert r["io_s_per_token"] == pytest.approx(0.5)
  assert (r["limit_s_per_token"], r["bound"]) == (pytest.approx(0.5), "io")
  assert r["measured_s_per_token"] == pytest.approx(2.5)
  assert r["ratio"] == pytest.approx(5.0)
  # Reads that fit under compute leave a compute-bound limit.
  r = decode_limit(compute_s=4.0, io_bytes=3_000_000_000, disk_gbs=1.5, measured_s=6.0, tokens=4)
  assert (r["limit_s_per_token"], r["bound"], r["ratio"]) == (1.0, "compute", 1.5)
  with pytest.raises(InputError, match="tokens > 0"):
    decode_limit(compute_s=1.0, io_bytes=1, disk_gbs=1.0, measured_s=1.0, tokens=0)


def test_belady_reads_count_the_minimum_misses():
  # One layer, one position per step, a cache of 2, requests 0 1 2 0 1 2. MIN: 0, 1 and 2 miss
  # (2 evicts 1, whose next use is later than 0's); 0 hits; 1 misses (evicting 0, never used
  # again); 2 hits. Four misses.
  ids = np.array([0, 1, 2, 0, 1, 2])[:, None, None]
  t = Trace.from_ids(ids, n_experts=3, expert_bytes=1000)
  r = belady_reads(t, 2)
  assert (r["belady_misses"], r["belady_bytes"], r["requests"]) == (4, 4000, 6)
  assert belady_reads(t, 3)["belady_misses"] == 3  # only the cold misses


def test_capacity_counts_host_chunks_and_the_named_layers_slots():
  state = {"chunk_bytes": 100, "host_bytes": 1050, "slots": 3,
           "pins": {"1": [0, 1, 2], "2": [3, 4, 5], "4": [0, 1, 2]}}
  assert capacity_experts(state) == 10 + 9
  assert capacity_experts(state, layers=[1, 2]) == 10 + 6
  assert capacity_experts({"chunk_bytes": 100, "host_bytes": 99, "slots": 0, "pins": {}}) == 0


def test_disk_bandwidth_on_a_fake_clock(embedded_store):
  """Every main chunk read once, as the engine reads it; GB/s from the clock's seconds."""
  ticks = iter([10.0, 12.0])
  r = disk_read_gbs(embedded_store, workers=2, clock=lambda: next(ticks))
  geo = store_geometry(embedded_store)
  assert r["chunks"] == geo["moe_layers"] * geo["experts"]
  assert (r["bytes"], r["seconds"]) == (geo["expert_bytes_total"], 2.0)
  assert r["disk_gbs"] == pytest.approx(geo["expert_bytes_total"] / 2.0 / 1e9)


def test_bench_decode_script(tmp_path):
  """The script with default flags (a short request; no --model: it converts the embedded
  model, as bench_offload, bench_speculative and check_gpu do) reports a consistent limit and
  ratio."""
  out = tmp_path / "decode.json"
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_decode.py"),
                         "--max_new_tokens=4", f"--json={out}"],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  lim = r["limit"]
  assert r["new_tokens"] == 4 and r["same_tokens_as_resident"]
  assert lim["limit_s_per_token"] == max(lim["compute_s_per_token"], lim["io_s_per_token"])
  assert r["ratio"] == pytest.approx(r["measured_s_per_token"] / r["limit_s_per_token"])
  # the disk's best rate over the thread counts, not the engine's own count's
  assert sorted(r["disk"]["by_workers"], key=int) == ["1", "2", "4", "8"]
  assert r["disk_gbs"] == r["disk"]["disk_gbs"] == max(r["disk"]["by_workers"].values())
  assert r["belady"]["belady_misses"] <= r["engine"]["expert_misses"] + r["engine"][
      "prefetch_issued"]  # no policy reads less than MIN
  assert set(r["stages"]) >= {"attention", "route", "bookkeeping", "io_wait", "expert_compute",
                              "combine", "sampling"}
  assert os.path.getsize(r["png"]) > 0


def test_check_gpu_picks_the_fastest_finite_pallas_tiling():
  """check_gpu.py (run on GPU machines only) reads its tiling candidates off bench_kernels'
  report: per row count the fastest finite Pallas entry, never an XLA or failed one."""
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  import check_gpu
  bench = {"results": [
      {"rows": 1, "backend": "xla", "median_s": 1e-5, "finite": True},
      {"rows": 1, "backend": "pallas", "median_s": 3e-4, "finite": True, "config": {"b": 1}},
      {"rows": 1, "backend": "pallas", "median_s": 2e-4, "finite": True, "config": {"b": 2}},
      {"rows": 1, "backend": "pallas", "median_s": 1e-4, "finite": False, "config": {"b": 3}},
      {"rows": 2, "backend": "pallas", "error": "compile failed"},
      {"rows": 2, "backend": "pallas", "median_s": 5e-4, "finite": True, "config": {"b": 4}}]}
  best = check_gpu.tuning_candidates(bench)
  assert best["1"]["config"] == {"b": 2} and best["2"]["config"] == {"b": 4}
  assert set(best) == {"1", "2"}


def test_disk_bandwidth_in_decode_step_batches(embedded_store):
  """The cost model's use of the one disk probe: top_k chunks at a time, several passes, the
  median batch's rate; every chunk read once per pass."""
  geo = store_geometry(embedded_store)
  n = geo["moe_layers"] * geo["experts"]
  batch = 3
  batches = -(-n // batch)
  clock = iter(float(i) for i in range(4 * batches))  # every batch takes 1 s
  r = disk_read_gbs(embedded_store, workers=2, batch=batch, passes=2,
                    clock=lambda: next(clock))
  assert (r["batches"], r["chunks"], r["passes"]) == (2 * batches, n, 2)
  assert r["bytes"] == 2 * geo["expert_bytes_total"] and r["seconds"] == 2 * batches
  assert r["median_batch_s"] == 1.0
  assert r["disk_gbs"] == pytest.approx(min(batch, n) * geo["chunk_bytes"] / 1e9)
  assert r["per_chunk_us"] == pytest.approx(1e6 / batch)
  assert r["buffers_reused"] >= n  # read into reused buffers, as the engine reads


def test_a_missing_or_failing_script_names_itself(tmp_path):
  """bench_store and the studies run scripts of the checkout: one that is missing, or fails,
  is an InputError saying what failed, with the script's path or its last words."""
  from glmjax.bench.reporting import run_script
  from glmjax.errors import InputError
  with pytest.raises(InputError, match=r"converting a thing needs .*scripts/no_such\.py"):
    run_script("no_such.py", what="converting a thing")
  with pytest.raises(InputError, match="converting a thing failed: .*--src"):
    run_script("convert.py", f"--dst={tmp_path / 'store'}", what="converting a thing")
