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
