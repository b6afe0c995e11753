"""Huge pages for XLA's host allocations (`_startup.start()`, a script's first call).

XLA:CPU allocates each executable's temporaries with malloc, and an engine layer step's are
tens of MB (73 MB for one attention step over 1024 tokens of the embedded model), above glibc's
mmap threshold: every call maps fresh pages and faults them in, 4 kB at a time. Scoring 1024
tokens layer by layer took 112k minor faults against 22k for the one-jit forward, and most of
the layer steps' extra time. glibc's `glibc.malloc.hugetlb=1` tunable makes malloc advise huge
pages on the memory it maps, which the kernel's default THP mode ("madvise") honours: the same
score then takes ~1.1k faults. Tunables are read only when a process starts, so a script that
wants them re-executes itself once with the tunable added to GLIBC_TUNABLES. Library users set
it before starting Python (README). GLMJAX_HUGEPAGES=0 turns this off.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"


def reexec() -> None:
  """Re-executes this process (same interpreter, same arguments) with the tunable, once."""
  if os.environ.get("GLMJAX_HUGEPAGES", "1") == "0":
    return
  if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
    return
  current = os.environ.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb" in current:  # already set (by us, before the exec, or by the user)
    return
  os.environ["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}" if current else TUNABLE
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(sys.executable, sys.orig_argv)
