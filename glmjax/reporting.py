"""Benchmark reports: one JSON document, printed and optionally written to a file."""

from __future__ import annotations

import json
import os


def persistent_compile_cache(path: str | None = None) -> str | None:
  """Turns on JAX's persistent compilation cache for a script (not for library users: it is a
  process-wide setting): compiled steps are reused by the next run instead of recompiled
  (~2.5 s per shape on the embedded model). `path` defaults to $GLMJAX_CACHE or
  ~/.cache/glmjax/xla; an unwritable location leaves the cache off. Returns the directory."""
  import jax
  path = path or os.environ.get("GLMJAX_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "glmjax", "xla")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  return path


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


def bench_store(path: str | None, prefix: str) -> str:
  """`path`, or a fresh store converted from the embedded model when `path` is None."""
  import subprocess
  import sys
  import tempfile
  from glmjax.formats import embedded
  if path is not None:
    return path
  import atexit
  import shutil
  tmp = tempfile.mkdtemp(prefix=prefix)
  atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # a benchmark leaves no store behind
  path = os.path.join(tmp, "store")
  script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                        "convert.py")
  subprocess.run([sys.executable, script, f"--src={embedded.ensure()}", f"--dst={path}"],
                 check=True, capture_output=True)
  return path


def store_geometry(path: str) -> dict:
  """Chunk bytes, MoE layers, experts per layer and total expert bytes of a store."""
  with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
    m = json.load(f)
  chunk = m["experts"]["main"]["layout"]["nbytes"]
  layers, experts = len(m["moe_layers"]), m["source_config"]["n_routed_experts"]
  return {"chunk_bytes": chunk, "moe_layers": layers, "experts": experts,
          "expert_bytes_total": chunk * layers * experts}


def disk_read_gbs(path: str, workers: int, group: str = "main", clock=None) -> dict:
  """Read bandwidth of a store's disk as the engine reads it: every expert chunk of `group`,
  dropped from the page cache, then read whole and checked (`ExpertStore.read_chunk`) on
  `workers` threads at once. GB/s is 1e9 bytes per second of `clock` (time.perf_counter)."""
  import concurrent.futures
  import time
  from glmjax.formats.store import ExpertStore
  from glmjax.offload.expert_io import drop_page_cache
  clock = clock or time.perf_counter
  store = ExpertStore(path)
  g = store.manifest["experts"][group]
  keys = [(layer, e) for layer in g["layers"] for e in range(store.groups[group][0].shape[1])]
  drop_page_cache(os.path.join(path, g["path"]))
  t0 = clock()
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    nbytes = sum(b.nbytes for b in pool.map(lambda k: store.read_chunk(*k), keys))
  seconds = clock() - t0
  return {"disk_gbs": nbytes / seconds / 1e9 if seconds > 0 else float("inf"),
          "bytes": nbytes, "seconds": seconds, "chunks": len(keys), "workers": workers}
