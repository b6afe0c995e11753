"""Calibrated int4/int8 quantizers that keep the store's format (issue 30, the quantizers).

Both write the same group-wise codes and bf16 scales as round-to-nearest (`quantize.quantize`,
the layout in `glmjax.model.quant`), so every kernel, tier and test reads them unchanged. What
they change is which scale a group gets and which code each weight gets:

- `quantize_weighted` (llama.cpp's imatrix idea): per (row, group), the scale among a fixed set
  of candidates that minimises the importance-weighted squared error Σ_k a_k (w_k − s·q_k)²,
  with a_k the mean squared activation of input channel k from calibration text. The
  candidates divide the group's largest magnitude by qmax + c for c in [−1, 1] (so the code
  qmin = −8, which `amax / 7` never uses, can be reached) and include round-to-nearest's own
  scale, so under the weighted error it is never worse than round-to-nearest.
- `quantize_gptq` (Frantar et al.): columns quantized in order, each one's rounding error
  pushed onto the columns not yet quantized through the inverse calibration Hessian
  H = XᵀX (+ dampening), in blocks of columns (the "lazy batch" update). Groups are static:
  every group's scale is fixed from the unmodified weights before any column moves, which is
  what keeps the format unchanged.

Host-side numpy in float64: conversion code, run once per weight.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from glmjax.formats.quantize import pack_int4
from glmjax.model.quant import QMAX, QMIN, QArray, check_bits_group

GRID = np.linspace(-1.0, 1.0, 21)  # c in s = amax / (qmax + c): the candidate scales


def _bf16(x: np.ndarray) -> np.ndarray:
  """Rounded to bfloat16 (the stored scale), back in float64."""
  return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _codes(w: np.ndarray, s: np.ndarray, bits: int) -> np.ndarray:
  """clamp(rint(w / s)) with s broadcast over a group; an all-zero group (s = 0) codes 0."""
  with np.errstate(divide="ignore", invalid="ignore"):
    q = np.where(s != 0, np.rint(w / np.where(s != 0, s, 1.0)), 0.0)
  return np.clip(q, QMIN[bits], QMAX[bits])


def _grouped(w: np.ndarray, g: int) -> np.ndarray:
  """`w [R, K]` zero-padded to whole groups: `[R, n_groups, g]` float64."""
  r, k = w.shape
  kp = -(-k // g) * g
  out = np.zeros((r, kp), np.float64)
  out[:, :k] = w
  return out.reshape(r, kp // g, g)


def candidate_scales(wg: np.ndarray, bits: int) -> np.ndarray:
  """The candidate scales of groups `wg [..., g]`: `[len(GRID), ...]` bf16-rounded, row 0
  round-to-nearest's `amax / qmax`."""
  amax = np.abs(wg).max(-1)
  divisors = QMAX[bits] + np.concatenate([[0.0], GRID[GRID != 0]])
  return _bf16(amax[None] / divisors.reshape((-1,) + (1,) * amax.ndim))


def _pack(q: np.ndarray, s: np.ndarray, bits: int, g: int, k: int) -> QArray:
  """Codes `[R, Kp]` and scales `[R, n_groups]` as the store's QArray."""
  if bits == 4:
    packed = pack_int4(q.astype(np.int8), g)
  else:
    packed = q.astype(np.int8)
  return QArray(packed=packed, scales=s.astype(ml_dtypes.bfloat16), bits=bits, group_size=g,
                in_features=k)


def quantize_weighted(w: np.ndarray, importance: np.ndarray, bits: int = 4,
                      group_size: int = 64) -> QArray:
  """`w [O, K]` quantized with, per (row, group), the candidate scale of least
  importance-weighted squared error (`importance [K]` ≥ 0: mean squared activations)."""
  check_bits_group(bits, group_size)
  w = np.asarray(w, np.float64)
  o, k = w.shape
  a = _grouped(np.asarray(importance, np.float64)[None], group_size)[0]  # [n_groups, g]
  wg = _grouped(w, group_size)  # [O, n_groups, g]
  cands = candidate_scales(wg, bits)  # [C, O, n_groups]
  from glmjax.formats.scale_search import best_scales  # numba: imported on first use
  s = best_scales(wg, a, np.ascontiguousarray(cands), float(QMIN[bits]), float(QMAX[bits]))
  q = _codes(wg, s[..., None], bits).reshape(o, -1)
  return _pack(q, s, bits, group_size, k)


def act_order(hessian: np.ndarray) -> np.ndarray:
  """GPTQ's "act-order": input channels by decreasing diag(H) (stable), the order in which
  the columns are quantized."""
  return np.argsort(-np.diag(np.asarray(hessian, np.float64)), kind="stable")


def quantize_gptq(w: np.ndarray, hessian: np.ndarray, bits: int = 4, group_size: int = 64,
                  damp: float = 0.01, block: int = 128, order: np.ndarray | None = None
                  ) -> QArray:
  """`w [O, K]` quantized column by column with GPTQ's error compensation under the
  calibration Hessian `hessian [K, K]` (XᵀX over calibration inputs), static groups (scales
  from the unmodified weights, importance = diag(H)), dampening `damp` × mean diag(H).
  Dead input channels (zero diagonal) get weight 0 and a unit diagonal, as GPTQ does.

  `order` (a permutation of the K columns, e.g. `act_order(H)`) is the order the columns are
  quantized in; each column keeps its own group's static scale, so the stored format (groups
  of consecutive input channels) is the same whatever the order."""
  check_bits_group(bits, group_size)
  w = np.array(w, np.float64)
  o, k = w.shape
  h = np.array(hessian, np.float64)
  dead = np.diag(h) == 0
  h[dead, dead] = 1.0
  w[:, dead] = 0.0
  scales = np.asarray(quantize_weighted(w, np.diag(h), bits, group_size).scales, np.float64)
  h[np.diag_indices(k)] += damp * np.mean(np.diag(h))
  perm = np.arange(k) if order is None else np.asarray(order)
  w, h = w[:, perm], h[np.ix_(perm, perm)]  # columns in quantization order
  col_scales = scales[:, perm // group_size]  # [O, K] each column's static group scale
  hinv = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: row j holds the update for column j
  q = np.zeros((o, k))
  for b0 in range(0, k, block):
    b1 = min(b0 + block, k)
    err = np.zeros((o, b1 - b0))
    for j in range(b0, b1):
      s = col_scales[:, j]
      q[:, j] = _codes(w[:, j], s, bits)
      e = (w[:, j] - q[:, j] * s) / hinv[j, j]
      w[:, j + 1:b1] -= np.outer(e, hinv[j, j + 1:b1])
      err[:, j - b0] = e
    w[:, b1:] -= err @ hinv[b0:b1, b1:]  # the block's errors onto every later column at once
  kp = scales.shape[1] * group_size
  codes = np.zeros((o, kp))
  codes[:, perm] = q
  return _pack(codes, scales, bits, group_size, k)
