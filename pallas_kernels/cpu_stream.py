"""A streaming read with the CPU kernel's own 16-lane vector ops (``pallas_kernels.cpu``):
the memory roof for a numba kernel that reads its weights once (scripts/bench_experts.py's
DRAM row)."""

from __future__ import annotations

import numba
import numpy as np

from pallas_kernels import cpu

# pylint: disable-next=protected-access
_vld, _vadd, _vzero, _vhsum = cpu._vld, cpu._vadd, cpu._vzero, cpu._vhsum


@numba.njit
def _stream_part(a, lo, hi):
  # Four independent accumulators: the adds of one do not wait for another's.
  s0 = _vzero()
  s1 = _vzero()
  s2 = _vzero()
  s3 = _vzero()
  for j in range(lo, hi, 64):
    s0 = _vadd(s0, _vld(a, j))
    s1 = _vadd(s1, _vld(a, j + 16))
    s2 = _vadd(s2, _vld(a, j + 32))
    s3 = _vadd(s3, _vld(a, j + 48))
  return _vhsum(_vadd(_vadd(s0, s1), _vadd(s2, s3)))


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
