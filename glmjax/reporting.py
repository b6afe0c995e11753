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


def write_report(report: dict, path: str | None = None) -> str:
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


def chunk_files(path: str, group: str = "main") -> list[str]:
  """The files holding a store's expert chunks of `group` (one per (layer, expert))."""
  with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
    root = os.path.join(path, json.load(f)["experts"][group]["path"])
  return sorted(os.path.join(d, n) for d, _, names in os.walk(os.path.join(root, "c"))
                for n in names)


def disk_read_gbs(files: list[str], workers: int, clock=None) -> dict:
  """Read bandwidth of the disk under `files`: each dropped from the page cache, then read
  whole on `workers` threads at once (the engine's chunk size and I/O concurrency). GB/s is
  1e9 bytes per second of `clock` (default time.perf_counter)."""
  import concurrent.futures
  import time
  clock = clock or time.perf_counter
  for name in files:
    fd = os.open(name, os.O_RDONLY)
    try:
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)

  def read(name):
    fd = os.open(name, os.O_RDONLY)
    try:
      buf = bytearray(os.fstat(fd).st_size)
      view, done = memoryview(buf), 0
      while done < len(buf):
        n = os.readv(fd, [view[done:]])
        if n == 0:
          break
        done += n
      return done
    finally:
      os.close(fd)

  t0 = clock()
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    nbytes = sum(pool.map(read, files))
  seconds = clock() - t0
  return {"disk_gbs": nbytes / seconds / 1e9 if seconds > 0 else float("inf"),
          "bytes": nbytes, "seconds": seconds, "files": len(files), "workers": workers}
