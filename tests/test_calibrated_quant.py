"""The calibrated quantizers against plain float64 references written here: the weighted one
picks, per group, the candidate scale of least importance-weighted error; GPTQ's codes equal
the textbook column loop (Frantar et al., Algorithm 1 without lazy batches) for the same
static scales. Both keep the store's format (decoded by the kernels' own dequantize)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from glmjax.formats import calibrated
from glmjax.formats.quantize import quantize
from glmjax.model.quant import dequantize

G = 64


def _decode(q) -> np.ndarray:
  return np.asarray(dequantize(q), np.float64)


def _bf16(x):
  return float(np.float64(x).astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("bits", [4, 8])
def test_weighted_scales_minimise_the_weighted_error(bits):
  rng = np.random.default_rng(0)
  w = rng.standard_normal((6, 150)) * np.exp(rng.standard_normal((6, 1)))
  w[2, 64:128] = 0.0  # an all-zero group
  a = rng.gamma(0.5, 1.0, 150)  # heavy-tailed channel importance, as activations have
  got = calibrated.quantize_weighted(w, a, bits, G)
  w_hat = _decode(got)
  qmax, qmin = (7, -8) if bits == 4 else (127, -127)
  rtn_total = 0.0
  for r in range(6):
    for g0 in range(0, 150, G):
      wg, ag = w[r, g0:g0 + G], a[g0:g0 + G]
      amax = np.abs(wg).max()

      def err(s):  # the weighted squared error of a group coded with scale s, plainly
        total = 0.0
        for x, imp in zip(wg, ag):
          q = 0.0 if s == 0 else min(max(round(x / s), qmin), qmax)
          total += imp * (x - q * s) ** 2
        return total
      cands = [_bf16(amax / (qmax + c)) for c in calibrated.GRID]
      chosen = float(ag @ (wg - w_hat[r, g0:g0 + G]) ** 2)
      assert chosen == pytest.approx(min(err(s) for s in cands), rel=1e-9, abs=1e-15)
      rtn_total += err(_bf16(amax / qmax))
  rtn = _decode(quantize(w, bits, G))
  assert float(((w - w_hat) ** 2 * a).sum()) <= float(((w - rtn) ** 2 * a).sum())
  assert float(((w - w_hat) ** 2 * a).sum()) <= rtn_total + 1e-12
  if bits == 4:  # the code −8 that amax / 7 never uses is in play
    assert got.packed.size and np.any((np.asarray(got.packed) & 15) == 0)


def _textbook_gptq(w, h, scales, bits, damp, perm=None):
  """Algorithm 1 of the GPTQ paper, one column at a time, all later columns updated each
  time, float64, with the given static group scales; columns in the order `perm` (codes
  returned in that order)."""
  perm = np.arange(w.shape[1]) if perm is None else perm
  w = w[:, perm].astype(np.float64)
  k = w.shape[1]
  h = h[np.ix_(perm, perm)].astype(np.float64)
  h[np.diag_indices(k)] += damp * np.mean(np.diag(h))
  u = np.linalg.cholesky(np.linalg.inv(h)).T
  qmax, qmin = (7, -8) if bits == 4 else (127, -127)
  codes = np.zeros_like(w)
  for j in range(k):
    for r in range(w.shape[0]):
      s = scales[r, perm[j] // G]
      codes[r, j] = 0.0 if s == 0 else min(max(round(w[r, j] / s), qmin), qmax)
      e = (w[r, j] - codes[r, j] * s) / u[j, j]
      for c in range(j + 1, k):
        w[r, c] -= e * u[j, c]
  return codes


def test_gptq_equals_the_textbook_loop_and_beats_round_to_nearest():
  rng = np.random.default_rng(1)
  k = 2 * G
  x = rng.standard_normal((512, k)) @ (np.eye(k) + 0.3 * rng.standard_normal((k, k)))
  h = x.T @ x  # correlated inputs: error compensation has something to use
  w = rng.standard_normal((5, k))
  got = calibrated.quantize_gptq(w, h, 4, G, damp=0.01, block=48)  # blocks cut across groups
  scales = np.asarray(got.scales, np.float64)
  np.testing.assert_array_equal(
      scales, np.asarray(calibrated.quantize_weighted(w, np.diag(h), 4, G).scales, np.float64))
  codes = _textbook_gptq(w, h, scales, 4, 0.01)
  w_hat = _decode(got)
  np.testing.assert_array_equal(w_hat, codes * np.repeat(scales, G, axis=1))
  out_err = lambda v: float(np.trace((w - v) @ h @ (w - v).T))  # the layer output's error
  assert out_err(w_hat) < 0.8 * out_err(_decode(quantize(w, 4, G)))


def test_gptq_act_order_keeps_static_groups_and_equals_the_textbook_loop():
  """Columns quantized by decreasing diag(H), each with its own group's scale: the codes
  equal the textbook loop run in that order, and the stored groups are the usual ones."""
  rng = np.random.default_rng(2)
  k = 2 * G + 20  # a partial last group
  x = rng.standard_normal((400, k)) * np.exp(rng.standard_normal(k)) @ (
      np.eye(k) + 0.2 * rng.standard_normal((k, k)))
  h = x.T @ x
  w = rng.standard_normal((4, k))
  perm = calibrated.act_order(h)
  assert not np.array_equal(perm, np.arange(k))
  got = calibrated.quantize_gptq(w, h, 4, G, damp=0.01, block=40, order=perm)
  scales = np.asarray(got.scales, np.float64)
  np.testing.assert_array_equal(
      scales, np.asarray(calibrated.quantize_weighted(w, np.diag(h), 4, G).scales, np.float64))
  codes = np.zeros_like(w)
  codes[:, perm] = _textbook_gptq(w, h, scales, 4, 0.01, perm)
  np.testing.assert_array_equal(_decode(got), codes * np.repeat(scales, G, axis=1)[:, :k])
