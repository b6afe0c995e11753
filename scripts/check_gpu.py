"""The prepared device check: compiled Pallas kernels against the float64 loop reference, the
expert placement comparison (expert_compute device / host / auto: tok/s and logits), then the
kernel benchmark and model-level parity on a GPU. Writes one JSON report.

  python scripts/check_gpu.py --out=$OUT/gpu_check.json

Run it on a machine with an accelerator (CI has none; the CPU suite covers the kernels in
interpret mode). Each check records its own failure instead of stopping the run.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = 1e-5  # as in tests/test_kernels.py: f32 accumulation vs a float64 reference


def kernel_checks() -> list[dict]:
  import numpy as np
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  import pallas_kernels
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
        out = np.asarray(pallas_kernels.grouped_moe(x, pool, ids, w, backend="pallas",
                                                    config=config))
        err = float(np.abs(out - ref).max() / np.abs(ref).max())
        tol = RTOL * (3 if name == "dot-tf32x3" else 1)
        row.update(rel_err=err, ok=err < tol)
      except Exception as e:  # report, keep going
        row.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
      rows.append(row)
  return rows


def placement_checks(store: str | None = None) -> list[dict]:
  """Decode tok/s and logits per expert_compute placement (device / host / auto) on a store
  with a quarter of its experts pinned and the rest in the host cache. Device placement must be
  bitwise equal across budgets; host and auto within 1e-5 relative of device."""
  import numpy as np
  import glmjax
  from glmjax.reporting import bench_store, store_geometry
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


def main(argv):
  del argv
  import jax
  report = {"devices": [str(d) for d in jax.devices()], "started": time.time()}
  report["kernels"] = kernel_checks()
  report["placement"] = placement_checks()
  bench = os.path.join(os.path.dirname(FLAGS.out) or ".", "bench_kernels.json")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_kernels.py"),
                      "--rows=1,2,3,4", f"--repeats={FLAGS.repeats}", f"--out={bench}"],
                     capture_output=True, text=True)
  report["bench_returncode"] = r.returncode
  report["bench_stderr_tail"] = r.stderr[-3000:]
  if os.path.exists(bench):
    report["bench"] = json.load(open(bench))
  t = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x",
                      os.path.join(ROOT, "tests", "test_store.py"), "-k", "pallas"],
                     capture_output=True, text=True)
  report["model_level_pallas_vs_xla"] = {"returncode": t.returncode, "tail": t.stdout[-1500:]}
  report["elapsed_s"] = time.time() - report.pop("started")
  with open(FLAGS.out, "w") as f:
    json.dump(report, f, indent=1)
  ok = all(k["ok"] for k in report["kernels"])
  placement_ok = all(p["ok"] for p in report["placement"])
  print(json.dumps({"kernels_ok": ok, "placement_ok": placement_ok, "bench_rc": r.returncode,
                    "model_rc": t.returncode}))


if __name__ == "__main__":
  app.run(main)
