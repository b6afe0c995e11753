"""Benchmark reports: one JSON document, printed and optionally written to a file."""

from __future__ import annotations

import json
import os


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
  path = os.path.join(tempfile.mkdtemp(prefix=prefix), "store")
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
