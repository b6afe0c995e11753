"""What a script that runs a model does first, before anything allocates (`start()`).

- Huge pages for XLA's host allocations: `_hugepages.reexec()` (the process re-executes itself
  once with glibc's tunable).
- A larger young generation for Python's cycle collector: tracing and lowering a JAX program
  allocate millions of short-lived objects, and at CPython's default thresholds (700, 10, 10)
  the collector takes about a tenth of a warm script's CPU, its full collections walking every
  object of JAX, transformers and numba (DESIGN.md §4). Full collections still come (after at
  least 20 × 20 × 20,000 net allocations of container objects), so a long-lived server frees its
  cyclic garbage.
"""

from __future__ import annotations

import gc

import _hugepages

GC_THRESHOLDS = (20_000, 20, 20)


def start() -> None:
  """Re-executes this process for huge pages (once), then sets the collector's thresholds."""
  _hugepages.reexec()
  gc.set_threshold(*GC_THRESHOLDS)
