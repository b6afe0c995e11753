"""The one command for a machine with a GPU (CI has none; the CPU suite runs the kernels in
interpret mode). Writes one JSON report, in about 12 minutes on one H200 (8 without step 8):

  python scripts/check_gpu.py --out=$OUT/gpu_check.json

1. compiled Pallas kernels against the float64 loop reference;
2. the expert placement comparison (expert_compute device / host / auto: tok/s and logits);
3. kernel GB/s and fraction of HBM at GLM-5 decode shapes (bench_kernels.py, P5) over the
   default tiling and --variants, the fastest per row count as `tuning_candidates`;
4. model-level Pallas against XLA (the store tests' pallas cases);
5. bench_decode.py: cold decode of a 2-MoE-layer GLM-5-geometry store against its limit;
6. bench_experts.py at GLM-5 expert dims: the Pallas decode matvec and grouped T = 16 / 128 /
   1024 beside the host's numba kernel and DRAM bandwidth;
7. quantized dense weights: the compiled Pallas dense kernel against the float64 loop, and
   bench_dense.py's matvec table at GLM-5's dims (`dense_pallas_faster`: Pallas against XLA);
8. bench_depth.py at --depth_layers MoE layers (24; 0 skips it): cold decode and prefill of a
   GLM-5-geometry store at depth against their physical limit.

Each check records its own failure instead of stopping the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "gpu_check.json", "JSON report path.")
flags.DEFINE_integer("repeats", 50, "Benchmark repeats.")
flags.DEFINE_list("variants", ["fma:32:32:128", "fma:64:64:256", "fma:128:128:256:8",
                               "dot:64:64:256", "dot:128:128:512:8:3"],
                  "Candidate Pallas tilings timed beside the default "
                  "(mode:block_n:block_n_down:block_k[:num_warps[:num_stages]]).")
flags.DEFINE_integer("decode_experts", 16, "Experts per MoE layer of the synthetic store.")
flags.DEFINE_integer("depth_layers", 24, "MoE layers of bench_depth.py's store (0: skip it).",
                     lower_bound=0)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = 1e-5  # as in tests/test_kernels.py: f32 accumulation vs a float64 reference


def kernel_checks() -> list[dict]:
  import numpy as np
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from pallas_kernels import ops
  from pallas_kernels import tuning
  from test_kernels import _loop_reference, _make_problem  # the suite's own reference
  configs = {
      "fma": tuning.BlockConfig(mode="fma", block_n=32, block_n_down=32, block_k=128),
      "dot": tuning.BlockConfig(mode="dot", block_n=32, block_n_down=32, block_k=128),
      "dot-tf32x3": tuning.BlockConfig(mode="dot", precision="tf32x3"),
      "default": None,
  }
  rows = []
  for name, config in configs.items():
    for r, bits in ((1, 4), (4, 4), (5, 4), (16, 8)):
      row = {"config": name, "rows": r, "bits": bits}
      try:
        x, pool, ids, w = _make_problem(r, r, 8, 12, 320, 192, 64, bits)
        ref = _loop_reference(x, pool, ids, w)
        out = np.asarray(ops.grouped_moe(x, pool, ids, w, backend="pallas",
                                                    config=config))
        err = float(np.abs(out - ref).max() / np.abs(ref).max())
        tol = RTOL * (3 if name == "dot-tf32x3" else 1)
        row.update(rel_err=err, ok=err < tol)
      except Exception as e:  # report, keep going
        row.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
      rows.append(row)
  return rows


def dense_kernel_checks() -> list[dict]:
  """The compiled Pallas dense kernel (`ops.dense_matmul`) against the suite's float64 loop."""
  import jax.numpy as jnp
  import numpy as np
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from pallas_kernels import ops
  from test_dense_pallas import DOT, FMA, dequantized, matrix, reference, rel_err
  rows = []
  for name, config in (("default", None), ("fma", FMA), ("dot", DOT)):
    for bits, group, r in ((4, 64, 1), (4, 64, 4), (8, 64, 3), (4, 32, 16)):
      row = {"config": name, "bits": bits, "group": group, "rows": r}
      try:
        q = matrix(bits, group)
        x = np.random.default_rng(r).standard_normal((r, q.in_features)).astype(np.float32)
        got = ops.dense_matmul(jnp.asarray(x), q, backend="pallas", config=config)
        err = rel_err(got, reference(x, dequantized(q)))
        row.update(rel_err=err, ok=err < RTOL)
      except Exception as e:  # report, keep going
        row.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
      rows.append(row)
  return rows


def dense_bench(workdir: str) -> dict:
  """bench_dense.py's matvec table on this accelerator; Pallas vs XLA per quantized format."""
  out = os.path.join(workdir, "bench_dense.json")
  report = _steps_report([["bench_dense.py", f"--json={out}", "--decode=false"]], out, 600)
  if report["ok"]:
    total = report["report"]["matvec_total_ms"]
    report["dense_pallas_faster"] = {f: total[f] < total[f"{f} xla"] for f in ("int8", "int4")
                                     if f"{f} xla" in total}  # accelerators only
  return report


def placement_checks(store: str | None = None) -> list[dict]:
  """Decode tok/s and logits per expert_compute placement (device / host / auto) on a store
  with a quarter of its experts pinned and the rest in the host cache. Device placement must be
  bitwise equal across budgets; host and auto within 1e-5 relative of device."""
  import numpy as np
  import glmjax
  from glmjax.bench.reporting import bench_store, store_geometry
  path = bench_store(store, "check_gpu.")
  total = store_geometry(path)["expert_bytes_total"]
  toks = np.random.default_rng(0).integers(3, 90, (1, 64)).astype(np.int32)
  rows, ref = [], None
  for mode, dev in (("device", 1.0), ("device", 0.25), ("host", 0.25), ("auto", 0.25)):
    row = {"expert_compute": mode, "device_frac": dev}
    try:
      with glmjax.load(path, progress=False, expert_compute=mode,
                       device_cache_gb=dev * total / 2**30,
                       host_cache_gb=total / 2**30) as m:
        logits = m.score(toks)
        m.generate([5, 6, 7, 8], 8, stop_ids=[])  # compile
        r = m.generate([5, 6, 7, 8], 48, stop_ids=[])
      ref = logits if ref is None else ref
      diff = float(np.abs(logits - ref).max() / np.abs(ref).max())
      row.update(decode_tok_s=r.stats["decode_tok_s"], rel_diff_vs_resident=diff,
                 bitwise=bool(np.array_equal(logits, ref)),
                 experts_on_host=r.stats.get("experts_on_host", 0.0),
                 h2d_bytes=r.stats.get("h2d_bytes", 0.0),
                 ok=(diff == 0.0) if mode == "device" else diff <= 1e-5)
    except Exception as e:  # report, keep going
      row.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
    rows.append(row)
  return rows


def tuning_candidates(bench: dict) -> dict:
  """Per row count: the fastest finite Pallas config of the benchmark, with its GB/s."""
  best: dict = {}
  for e in bench.get("results", []):
    if e.get("backend") != "pallas" or "median_s" not in e or not e.get("finite"):
      continue
    cur = best.get(str(e["rows"]))
    if cur is None or e["median_s"] < cur["median_s"]:
      best[str(e["rows"])] = {k: e.get(k) for k in ("config", "median_s", "gb_per_s",
                                                     "hbm_fraction", "max_rel_err_vs_xla")}
  return best


def _steps_report(steps: list, out: str, timeout: int) -> dict:
  """Runs the commands `steps` in order in a temporary folder (`{tmp}` in them), then reads the
  JSON report `out`; the first failure is reported instead."""
  import shutil
  import tempfile
  tmp = tempfile.mkdtemp(prefix="check_gpu.")  # stores stay out of the report folder
  try:
    for cmd in steps:
      cmd = [sys.executable, os.path.join(ROOT, "scripts", cmd[0])] + [
          a.format(tmp=tmp) for a in cmd[1:]]
      r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
      if r.returncode:
        return dict(ok=False, failed=os.path.basename(cmd[1]), stderr_tail=r.stderr[-3000:])
    return dict(ok=True, report=json.load(open(out)))
  except (subprocess.TimeoutExpired, OSError, ValueError) as e:  # report, keep going
    return dict(ok=False, error=f"{type(e).__name__}: {e}")
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def decode_check(workdir: str) -> dict:
  """bench_decode on a synthetic GLM-5-geometry store (2 MoE layers), read cold."""
  out = os.path.join(workdir, "bench_decode.json")
  return _steps_report([
      ["make_synthetic_store.py", "--geometry=glm5", "--moe_layers=2",
       f"--experts={FLAGS.decode_experts}", "--vocab_size=4096", "--dst={tmp}/glm5"],
      ["bench_decode.py", "--model={tmp}/glm5", "--cold", "--max_new_tokens=8",
       "--device_cache_gb=0.1", "--host_cache_gb=0.2", f"--json={out}"]], out, 240)


def depth_check(workdir: str) -> dict:
  """bench_depth.py at --depth_layers MoE layers, its stores made in a temporary folder."""
  out = os.path.join(workdir, "bench_depth.json")
  return _steps_report([["bench_depth.py", f"--layers={FLAGS.depth_layers}", "--stores={tmp}",
                         f"--json={out}"]], out, 600)


def experts_check(workdir: str, extra: tuple[str, ...] = ()) -> dict:
  """bench_experts at GLM-5 expert dims; the Pallas rows run because JAX has an accelerator."""
  out = os.path.join(workdir, "bench_experts.json")
  report = _steps_report([["bench_experts.py", f"--repeats={min(FLAGS.repeats, 10)}",
                           "--skip_per_pair", "--wait_idle_s=0", f"--out={out}", *extra]],
                         out, 300)
  report["ok"] = report["ok"] and experts_agree(report["report"])
  return report


def experts_agree(report: dict) -> bool:
  """bench_experts' Pallas rows ran, and each agrees with the numba kernel within RTOL."""
  pallas = report.get("pallas")
  return isinstance(pallas, dict) and pallas["decode"]["max_rel_err_vs_numba"] <= RTOL and all(
      "error" not in g and g["max_rel_err_vs_numba"] <= RTOL for g in pallas["grouped"])


def main(argv):
  del argv
  import jax
  report = {"devices": [str(d) for d in jax.devices()], "started": time.time()}
  report["kernels"] = kernel_checks()
  report["placement"] = placement_checks()
  here = os.path.dirname(os.path.abspath(FLAGS.out))
  bench = os.path.join(here, "bench_kernels.json")
  report["bench"] = _steps_report([["bench_kernels.py", "--rows=1,2,3,4", f"--out={bench}",
                                     f"--repeats={FLAGS.repeats}",
                                     f"--variants={','.join(FLAGS.variants)}"]], bench, 1800)
  if report["bench"]["ok"]:
    report["tuning_candidates"] = tuning_candidates(report["bench"]["report"])
  t = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x",
                      os.path.join(ROOT, "tests", "test_store.py"), "-k", "pallas"],
                     capture_output=True, text=True)
  report["model_level_pallas_vs_xla"] = {"returncode": t.returncode, "tail": t.stdout[-1500:]}
  report["decode"] = decode_check(here)
  report["experts"] = experts_check(here)
  report["dense_kernels"] = dense_kernel_checks()
  report["dense"] = dense_bench(here)
  report["depth"] = depth_check(here) if FLAGS.depth_layers else {"ok": None}
  report["elapsed_s"] = time.time() - report.pop("started")
  with open(FLAGS.out, "w") as f:
    json.dump(report, f, indent=1)
  print(json.dumps({"kernels_ok": all(k["ok"] for k in report["kernels"]),
                    "placement_ok": all(p["ok"] for p in report["placement"]),
                    "bench_ok": report["bench"]["ok"], "model_rc": t.returncode,
                    "decode_ok": report["decode"]["ok"],
                    "decode_ratio": report["decode"].get("report", {}).get("ratio"),
                    "experts_ok": report["experts"]["ok"],
                    "dense_kernels_ok": all(k["ok"] for k in report["dense_kernels"]),
                    "dense_pallas_faster": report["dense"].get("dense_pallas_faster"),
                    "depth_ok": report["depth"]["ok"]}))


if __name__ == "__main__":
  app.run(main)
