"""The importance-weighted scale search of `calibrated.quantize_weighted`, compiled by numba.

Its own module so that numba is imported only by conversions that use it, and the compiled
kernel is cached on disk. It replaced a numpy search that took ~9 s (unloaded) to ~110 s
(loaded machine) per GLM-5 gate_up matrix [4096, 6144]; times in docs/measurements/quantization.md.
"""

from __future__ import annotations

import numba
import numpy as np

from pallas_kernels import numba_cache

numba_cache.install()  # processes that compile at once keep numba's cache consistent


@numba.njit(nogil=True, parallel=True, cache=True)
def best_scales(wg, a, cands, qmin, qmax):
  """Per (row, group) of `wg [O, n, g]` float64, the candidate of `cands [C, O, n]` with least
  Σ_i a[group, i] (w_i − s·clamp(rint(w_i / s), qmin, qmax))² (`a [n, g]`); the first of equal
  errors wins (row 0: round-to-nearest's scale). Returns the scales `[O, n]`."""
  o, n, g = wg.shape
  best = np.empty((o, n), np.float64)
  for r in numba.prange(o):
    for j in range(n):
      least, pick = np.inf, 0.0
      for c in range(cands.shape[0]):
        sc = cands[c, r, j]
        err = 0.0
        for i in range(g):
          x = wg[r, j, i]
          q = 0.0 if sc == 0 else min(max(np.rint(x / sc), qmin), qmax)
          d = x - q * sc
          err += a[j, i] * d * d
        if err < least:
          least, pick = err, sc
      best[r, j] = pick
  return best
