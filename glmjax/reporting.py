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
