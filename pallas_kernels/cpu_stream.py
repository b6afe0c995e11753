"""A streaming read with the CPU kernels' own 16-lane vector ops (``pallas_kernels.cpu_vec``):
the memory roof for a numba kernel that reads its weights once (scripts/bench_experts.py's
DRAM row)."""

from __future__ import annotations

import numba
import numpy as np

from pallas_kernels.cpu_vec import vadd, vhsum, vld, vzero


@numba.njit
def _stream_part(a, lo, hi):
  # Four independent accumulators: the adds of one do not wait for another's.
  s0 = vzero()
  s1 = vzero()
  s2 = vzero()
  s3 = vzero()
  for j in range(lo, hi, 64):
    s0 = vadd(s0, vld(a, j))
    s1 = vadd(s1, vld(a, j + 16))
    s2 = vadd(s2, vld(a, j + 32))
    s3 = vadd(s3, vld(a, j + 48))
  return vhsum(vadd(vadd(s0, s1), vadd(s2, s3)))


@numba.njit(parallel=True)
def stream_sum(a):
  """Sum of float32 `a` [N] read in 64 parallel parts of whole 64-element blocks (a tail of
  fewer than 64 × 64 elements is left out: only the read rate matters)."""
  parts = 64
  m = a.shape[0] // parts // 64 * 64
  acc = np.zeros(parts, np.float64)
  for p in numba.prange(parts):
    acc[p] = _stream_part(a, np.int64(p) * m, (np.int64(p) + 1) * m)
  return acc.sum()
