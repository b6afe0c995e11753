"""Benchmark reports: one JSON document, printed and optionally written to a file."""

from __future__ import annotations

import json
import os

# The checkout's scripts/, beside the package (the README installs it editable, from the clone).
SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "scripts")
MAX_KEPT = 128  # read buffers the disk probe keeps for reuse (2.6 GB of GLM-5 experts)


def write_report(report: dict | list, path: str | None = None) -> str:
  """Prints `report` as JSON and, with `path`, writes it there atomically. Returns the text."""
  text = json.dumps(report, indent=1)
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
    os.replace(tmp, path)
  print(text)
  return text


def run_script(name: str, *flags: str, what: str) -> None:
  """Runs scripts/`name` with `flags` in a fresh interpreter. Its absence or failure is an
  InputError that says `what` failed, with the end of the script's stderr."""
  import subprocess
  import sys
  from glmjax.errors import InputError
  path = os.path.join(SCRIPTS, name)
  if not os.path.exists(path):
    raise InputError(f"{what} needs {path}, which is missing: run from a clone of glmjax "
                     "installed with pip install -e .")
  r = subprocess.run([sys.executable, path, *flags], capture_output=True, text=True)
  if r.returncode != 0:
    raise InputError(f"{what} failed: {r.stderr.strip()[-2000:]}")


def bench_store(path: str | None, prefix: str) -> str:
  """`path`, or a fresh store converted from the embedded model when `path` is None."""
  import tempfile
  from glmjax.formats import embedded
  if path is not None:
    return path
  import atexit
  import shutil
  tmp = tempfile.mkdtemp(prefix=prefix)
  atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # a benchmark leaves no store behind
  path = os.path.join(tmp, "store")
  run_script("convert.py", f"--src={embedded.ensure()}", f"--dst={path}",
             what="converting the embedded model to a store for the benchmark")
  return path


def store_geometry(path: str) -> dict:
  """Chunk bytes, MoE layers, experts per layer and total expert bytes of a store."""
  with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
    m = json.load(f)
  chunk = m["experts"]["main"]["layout"]["nbytes"]
  layers, experts = len(m["moe_layers"]), m["source_config"]["n_routed_experts"]
  return {"chunk_bytes": chunk, "moe_layers": layers, "experts": experts,
          "expert_bytes_total": chunk * layers * experts}


def disk_read_gbs(path: str, workers: int, group: str = "main", clock=None,
                  batch: int | None = None, passes: int = 1) -> dict:
  """Read bandwidth of a store's disk as the engine reads it: every expert chunk of `group`,
  dropped from the page cache, then read whole and checked (`ExpertStore.read_chunk`: O_DIRECT
  for chunks of `DIRECT_MIN_BYTES` or more, the page cache below) on `workers` threads. GB/s
  is 1e9 bytes per second of `clock` (time.perf_counter).

  Reads land in reused buffers, as the engine's do (glmjax.formats.read_buffers).

  The one disk probe of the benchmarks. Without `batch`, all chunks are in flight at once, one
  pass (bench_decode's I/O limit). With `batch`, they are read `batch` at a time, as a decode
  step dispatches its misses, over `passes` passes (the page cache dropped before each), and
  `disk_gbs` is the median batch's rate (the cost model's disk figure), beside
  `median_batch_s` and `per_chunk_us`."""
  import concurrent.futures
  import time
  from glmjax.formats.store import DIRECT_MIN_BYTES, ExpertStore
  from glmjax.offload.expert_io import drop_page_cache
  clock = clock or time.perf_counter
  store = ExpertStore(path)
  g = store.manifest["experts"][group]
  keys = [(layer, e) for layer in g["layers"] for e in range(store.groups[group][0].shape[1])]
  chunks = os.path.join(path, g["path"])
  if batch is not None and batch < 1:
    from glmjax.errors import InputError
    raise InputError(f"disk_read_gbs: batch must be ≥ 1, got {batch}")
  size = max(1, batch or len(keys))
  # buffers reused as the engine's are: fresh ones would time the kernel's page faults too
  store.buffers.keep_bytes = min(size, MAX_KEPT) * store.read_nbytes(g["layers"][0])
  times, nbytes = [], []
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    for _ in range(passes if batch else 1):
      drop_page_cache(chunks)
      for lo in range(0, len(keys), size):
        t0 = clock()
        nbytes.append(sum(b.nbytes for b in pool.map(lambda k: store.read_chunk(*k),
                                                     keys[lo:lo + size])))
        times.append(clock() - t0)
  seconds = sum(times)
  out = {"disk_gbs": sum(nbytes) / seconds / 1e9 if seconds > 0 else float("inf"),
         "bytes": sum(nbytes), "seconds": seconds, "chunks": len(keys), "workers": workers,
         "buffers_reused": store.buffers.reused}
  if batch:
    i = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]  # the median batch
    chunk = store.groups[group][1].nbytes
    out.update({"disk_gbs": nbytes[i] / times[i] / 1e9, "batch": batch, "passes": passes,
                "batches": len(times), "median_batch_s": times[i],
                "per_chunk_us": times[i] / min(batch, len(keys)) * 1e6,
                "method": ("O_DIRECT" if chunk >= DIRECT_MIN_BYTES and hasattr(os, "O_DIRECT")
                           else "page cache dropped (posix_fadvise DONTNEED), then read")})
  return out


def disk_best_gbs(path: str, workers=(1, 2, 4, 8), batch: int = 128) -> dict:
  """The disk's rate as the engine's read path can get it: `disk_read_gbs`'s median `batch`-chunk
  batch over every chunk of `path` at each thread count of `workers`, the best of them, with
  every count's rate (`by_workers`). A limit taken at the engine's own thread count would be
  that setting's, not the disk's (DESIGN.md §26)."""
  probes = [disk_read_gbs(path, w, batch=batch) for w in workers]
  best = max(probes, key=lambda p: p["disk_gbs"])
  return {**best, "by_workers": {p["workers"]: p["disk_gbs"] for p in probes}}
