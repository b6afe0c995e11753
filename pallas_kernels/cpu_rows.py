"""The row kernels of group-wise int4/int8 matrices, shared by the numba expert kernels
(``cpu``) and dense kernels (``cpu_dense``): ``qmatmul`` (``yb[t, r] = W[row0 + r] . xb[t]``)
and the pieces ``cpu_dense`` reuses (``decode_row``, ``dot1``, ``dot2x4``, ``finish``,
``put4``, ``qmatmul_serial``), plus the Python-side operand checks (``flat_packed``,
``flat_scales``, ``readonly``). Standalone: raw numpy arrays and ints.

Weight format (one matrix ``W [O, K]``, groups of ``G`` input features, ``K`` zero-padded to
``Kp = ceil(K / G) * G``, one bf16 scale per row and group): int4 packed uint8 ``[O, Kp / 2]``
(byte ``j < G/2`` of a group holds ``q[j] + 8`` in its low nibble and ``q[j + G/2] + 8`` in its
high nibble), int8 packed int8 ``[O, Kp]``, scales bf16 ``[O, Kp / G]`` (or their uint16 bits).

Determinism
-----------
Every output element ``y[o] = sum_j W[o, j] * x[j]`` is computed by one fixed sequence of
float32 operations, whatever the batch, the other rows in the call, the code path or the
thread count:

* the weight ``w[j] = q[j] * s`` is exact in float32 (a 4/8 bit integer times a bf16 scale),
  so every way of decoding it gives the same bits;
* the input, zero-padded to ``Kq`` (``Kp`` rounded up to 32), is cut into chunks of 16
  features; chunk ``c`` goes lane-wise into accumulator ``A[c % 2]`` (16 lanes each) as
  ``A = fma(w, x, A)`` (one rounding), chunks in increasing order, from zero vectors;
* ``y = hsum(A0 + A1)`` with ``cpu_vec.vhsum``'s fixed tree.

Work is split over output rows only (``prange``), never over the reduction axis.

Paths (all with the arithmetic above)
-------------------------------------
* n == 1 token row (decode): each weight row is decoded chunk by chunk in registers and dotted
  with x in the same pass, four rows at a time for int4 G64 and int8 G % 32 == 0 (each row its
  own accumulators, the loads of x shared; ~17 GB/s of int4 weights from DRAM on 2 Zen 4
  cores).
* 2 <= n <= 4: the same, with 4 token accumulators per weight row.
* n > 4 (grouped): each thread decodes a block of 16 weight rows once into a float32 buffer
  and applies it to tiles of 4 tokens with a 2 rows x 4 tokens register tile, the reduction in
  blocks of 1024 features.
* Group sizes without whole 16-lane chunks per scale (int4 ``G/2`` or int8 ``G`` not a
  multiple of 16) decode with scalar code into the buffer.
* Matrices under ``PARALLEL_MIN_WEIGHTS`` weights run on the calling thread (the callers
  decide: ``qmatmul``'s ``nthreads``).

All offsets are flat element indices. Helpers stay out of prange bodies (their vector locals
then live in registers).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from pallas_kernels.cpu_vec import (JIT, LANES, bf16, vadd, vfma, vhsum, vld, vmul, vq4hi,
                                    vq4hi_s, vq4lo, vq4lo_s, vq8, vsplat, vst, vtab, vzero)

_DECODE_ROWS = 128  # output rows per prange task on the decode path
# A matrix with fewer (padded) weights than this is multiplied on the calling thread: a
# parallel region costs more than it saves on small matrices, and on a busy machine a region
# waits for every thread to be scheduled (milliseconds). Read at call time by the Python entry
# points of cpu and cpu_dense (tests set it to 0); the custom calls' handlers read it when
# numba compiles them.
PARALLEL_MIN_WEIGHTS = 1 << 20
_ROW_BLOCK = 16  # weight rows decoded per buffer fill (grouped path)
_TOKEN_TILE = 64  # tokens per accumulator tile (grouped path)
_K_BLOCK = 1024  # reduction features per pass (grouped path); a multiple of 2 * LANES
_FEW_TOKENS = 4  # 2 <= n <= this: rows decoded in registers, all tokens at once
_FEW_ROWS = 32  # output rows per prange task on the few-token path


@njit(**JIT)
def _q4g64_group(pk, pb, scale, x0, x1, x2, x3, a0, a1):
  """One int4 G64 group of a row (packed bytes pk[pb:pb + 32], bf16 scale bits) into the row's
  accumulators, in ``_fused_row``'s order; x0..x3 the group's four input chunks."""
  s = vsplat(bf16(scale))
  t = vtab(s)
  a0 = vfma(vq4lo_s(pk, pb, t, s), x0, a0)
  a1 = vfma(vq4lo_s(pk, pb + 16, t, s), x1, a1)
  a0 = vfma(vq4hi_s(pk, pb, t, s), x2, a0)
  a1 = vfma(vq4hi_s(pk, pb + 16, t, s), x3, a1)
  return a0, a1


@njit(**JIT)
def _q8_chunks(pk, pb, s, x0, x1, a0, a1):
  """Two int8 chunks of a row (pk[pb:pb + 32], scale vector s) into its accumulators."""
  return (vfma(vmul(vq8(pk, pb), s), x0, a0),
          vfma(vmul(vq8(pk, pb + LANES), s), x1, a1))


@njit(**JIT)
def _fused_row(xb, xo, pk, po, sc, so, ng, g, bits):
  """W[row] . xb[xo:] with the row decoded chunk by chunk in registers (vec_ok only)."""
  a0 = vzero()
  a1 = vzero()
  if bits == 4 and g == 64:  # the GLM-5 layout, fully unrolled
    for gi in range(ng):
      xg = xo + gi * 64
      a0, a1 = _q4g64_group(pk, po + gi * 32, sc[so + gi], vld(xb, xg), vld(xb, xg + 16),
                            vld(xb, xg + 32), vld(xb, xg + 48), a0, a1)
  elif bits == 4 and g % 64 == 0:  # even number of chunks per half group
    half = g // 2
    for gi in range(ng):
      s = vsplat(bf16(sc[so + gi]))
      pb = po + gi * half
      xg = xo + gi * g
      for k in range(0, half, 2 * LANES):
        a0 = vfma(vmul(vq4lo(pk, pb + k), s), vld(xb, xg + k), a0)
        a1 = vfma(vmul(vq4lo(pk, pb + k + LANES), s), vld(xb, xg + k + LANES), a1)
      for k in range(0, half, 2 * LANES):
        a0 = vfma(vmul(vq4hi(pk, pb + k), s), vld(xb, xg + half + k), a0)
        a1 = vfma(vmul(vq4hi(pk, pb + k + LANES), s), vld(xb, xg + half + k + LANES), a1)
  elif bits == 4:  # odd number of chunks per half group: rotate the accumulators
    half = g // 2
    for gi in range(ng):
      s = vsplat(bf16(sc[so + gi]))
      pb = po + gi * half
      xg = xo + gi * g
      for k in range(0, half, LANES):
        w = vmul(vq4lo(pk, pb + k), s)
        a0, a1 = a1, vfma(w, vld(xb, xg + k), a0)
      for k in range(0, half, LANES):
        w = vmul(vq4hi(pk, pb + k), s)
        a0, a1 = a1, vfma(w, vld(xb, xg + half + k), a0)
  elif g % (2 * LANES) == 0:  # int8, even number of chunks per group
    for gi in range(ng):
      s = vsplat(bf16(sc[so + gi]))
      pb = po + gi * g
      xg = xo + gi * g
      for k in range(0, g, 2 * LANES):
        a0, a1 = _q8_chunks(pk, pb + k, s, vld(xb, xg + k), vld(xb, xg + k + LANES), a0, a1)
  else:  # int8, odd number of chunks per group
    for gi in range(ng):
      s = vsplat(bf16(sc[so + gi]))
      pb = po + gi * g
      xg = xo + gi * g
      for k in range(0, g, LANES):
        w = vmul(vq8(pk, pb + k), s)
        a0, a1 = a1, vfma(w, vld(xb, xg + k), a0)
  # After an odd chunk count a0/a1 hold A1/A0; the sum is the same (+ commutes).
  return vhsum(vadd(a0, a1))


@njit(**JIT)
def decode_row(pk, po, sc, so, ng, g, bits, vec_ok, kq, wb, wo):
  """wb[wo : wo + kq] = dequantized row (zero beyond Kp = ng * g)."""
  if vec_ok:
    if bits == 4:
      half = g // 2
      for gi in range(ng):
        s = vsplat(bf16(sc[so + gi]))
        t = vtab(s)
        pb = po + gi * half
        wg = wo + gi * g
        for k in range(0, half, LANES):
          vst(wb, wg + k, vq4lo_s(pk, pb + k, t, s))
          vst(wb, wg + half + k, vq4hi_s(pk, pb + k, t, s))
    else:
      for gi in range(ng):
        s = vsplat(bf16(sc[so + gi]))
        pb = po + gi * g
        wg = wo + gi * g
        for k in range(0, g, LANES):
          vst(wb, wg + k, vmul(vq8(pk, pb + k), s))
  else:
    for gi in range(ng):
      s = bf16(sc[so + gi])
      wg = wo + gi * g
      if bits == 4:
        half = g // 2
        pb = po + gi * half
        for k in range(half):
          b = np.int32(pk[pb + k])
          wb[wg + k] = np.float32((b & 15) - 8) * s
          wb[wg + half + k] = np.float32((b >> 4) - 8) * s
      else:
        pb = po + gi * g
        for k in range(g):
          wb[wg + k] = np.float32(np.int8(pk[pb + k])) * s
  for j in range(ng * g, kq):
    wb[wo + j] = np.float32(0.0)


@njit(**JIT)
def dot1(wb, wo, xb, xo, j0, j1, st, so):
  """Accumulators st[so : so + 32] (A0, A1) += chunks [j0, j1) of wb[wo:] * xb[xo:]."""
  a0 = vld(st, so)
  a1 = vld(st, so + LANES)
  for j in range(j0, j1, 2 * LANES):
    a0 = vfma(vld(wb, wo + j), vld(xb, xo + j), a0)
    a1 = vfma(vld(wb, wo + j + LANES), vld(xb, xo + j + LANES), a1)
  vst(st, so, a0)
  vst(st, so + LANES, a1)


@njit(**JIT)
def dot2x4(wb, w0, w1, xb, x0, xs, j0, j1, st, s0, ss):
  """dot1 for a 2 rows x 4 tokens tile: row i (wb[w0 or w1:]), token t (xb[x0 + t*xs:]).

  Accumulators of (row i, token t) at st[s0 + i*ss + 32*t :]. Each (row, token) pair sees
  the same operations in the same order as dot1.
  """
  x1 = x0 + xs
  x2 = x1 + xs
  x3 = x2 + xs
  s1 = s0 + ss
  p0 = vld(st, s0)
  p1 = vld(st, s0 + 16)
  q0 = vld(st, s0 + 32)
  q1 = vld(st, s0 + 48)
  r0 = vld(st, s0 + 64)
  r1 = vld(st, s0 + 80)
  u0 = vld(st, s0 + 96)
  u1 = vld(st, s0 + 112)
  e0 = vld(st, s1)
  e1 = vld(st, s1 + 16)
  f0 = vld(st, s1 + 32)
  f1 = vld(st, s1 + 48)
  g0 = vld(st, s1 + 64)
  g1 = vld(st, s1 + 80)
  h0 = vld(st, s1 + 96)
  h1 = vld(st, s1 + 112)
  for j in range(j0, j1, 2 * LANES):
    wa = vld(wb, w0 + j)
    wc = vld(wb, w1 + j)
    v = vld(xb, x0 + j)
    p0 = vfma(wa, v, p0)
    e0 = vfma(wc, v, e0)
    v = vld(xb, x1 + j)
    q0 = vfma(wa, v, q0)
    f0 = vfma(wc, v, f0)
    v = vld(xb, x2 + j)
    r0 = vfma(wa, v, r0)
    g0 = vfma(wc, v, g0)
    v = vld(xb, x3 + j)
    u0 = vfma(wa, v, u0)
    h0 = vfma(wc, v, h0)
    k = j + LANES
    wa = vld(wb, w0 + k)
    wc = vld(wb, w1 + k)
    v = vld(xb, x0 + k)
    p1 = vfma(wa, v, p1)
    e1 = vfma(wc, v, e1)
    v = vld(xb, x1 + k)
    q1 = vfma(wa, v, q1)
    f1 = vfma(wc, v, f1)
    v = vld(xb, x2 + k)
    r1 = vfma(wa, v, r1)
    g1 = vfma(wc, v, g1)
    v = vld(xb, x3 + k)
    u1 = vfma(wa, v, u1)
    h1 = vfma(wc, v, h1)
  vst(st, s0, p0)
  vst(st, s0 + 16, p1)
  vst(st, s0 + 32, q0)
  vst(st, s0 + 48, q1)
  vst(st, s0 + 64, r0)
  vst(st, s0 + 80, r1)
  vst(st, s0 + 96, u0)
  vst(st, s0 + 112, u1)
  vst(st, s1, e0)
  vst(st, s1 + 16, e1)
  vst(st, s1 + 32, f0)
  vst(st, s1 + 48, f1)
  vst(st, s1 + 64, g0)
  vst(st, s1 + 80, g1)
  vst(st, s1 + 96, h0)
  vst(st, s1 + 112, h1)


@njit(**JIT)
def finish(st, so):
  return vhsum(vadd(vld(st, so), vld(st, so + LANES)))


@njit(**JIT)
def _fused_rows4(xb, pk, po, kb, sc, so, ng, g, bits):
  """``_fused_row`` of the four rows at pk[po], pk[po + kb], ... (int4 G64, or int8 with
  G % 32 == 0), each with its own two accumulators in its own order (so bitwise the same),
  sharing the loads of x. Four independent accumulator pairs hide the latency of the
  multiply-add chains."""
  a0 = vzero()
  a1 = vzero()
  b0 = vzero()
  b1 = vzero()
  c0 = vzero()
  c1 = vzero()
  d0 = vzero()
  d1 = vzero()
  if bits == 4:
    for gi in range(ng):
      j = gi * 64
      x0 = vld(xb, j)
      x1 = vld(xb, j + 16)
      x2 = vld(xb, j + 32)
      x3 = vld(xb, j + 48)
      pb = po + gi * 32
      a0, a1 = _q4g64_group(pk, pb, sc[so + gi], x0, x1, x2, x3, a0, a1)
      b0, b1 = _q4g64_group(pk, pb + kb, sc[so + ng + gi], x0, x1, x2, x3, b0, b1)
      c0, c1 = _q4g64_group(pk, pb + 2 * kb, sc[so + 2 * ng + gi], x0, x1, x2, x3, c0, c1)
      d0, d1 = _q4g64_group(pk, pb + 3 * kb, sc[so + 3 * ng + gi], x0, x1, x2, x3, d0, d1)
  else:
    for gi in range(ng):
      sa = vsplat(bf16(sc[so + gi]))
      sb = vsplat(bf16(sc[so + ng + gi]))
      s_c = vsplat(bf16(sc[so + 2 * ng + gi]))
      sd = vsplat(bf16(sc[so + 3 * ng + gi]))
      for k in range(0, g, 2 * LANES):
        j = gi * g + k
        x0 = vld(xb, j)
        x1 = vld(xb, j + LANES)
        a0, a1 = _q8_chunks(pk, po + j, sa, x0, x1, a0, a1)
        b0, b1 = _q8_chunks(pk, po + kb + j, sb, x0, x1, b0, b1)
        c0, c1 = _q8_chunks(pk, po + 2 * kb + j, s_c, x0, x1, c0, c1)
        d0, d1 = _q8_chunks(pk, po + 3 * kb + j, sd, x0, x1, d0, d1)
  return (vhsum(vadd(a0, a1)), vhsum(vadd(b0, b1)), vhsum(vadd(c0, c1)),
          vhsum(vadd(d0, d1)))


@njit(**JIT)
def put4(yb, r, ys):
  """yb[r : r + 4] = the four row results `ys` of a four-row decode loop."""
  yb[r] = ys[0]
  yb[r + 1] = ys[1]
  yb[r + 2] = ys[2]
  yb[r + 3] = ys[3]


@njit(**JIT)
def _fused_rows(xb, pk, sc, row0, r_lo, r_hi, kb, ng, g, bits, yb):
  """Decode path (one token row xb[:Kq]): yb[r] for output rows [r_lo, r_hi)."""
  r = r_lo
  if (bits == 4 and g == 64) or (bits == 8 and g % (2 * LANES) == 0):
    # four rows at a time (DESIGN.md §13: 1.2-1.5x the one-row loop)
    while r + 4 <= r_hi:
      put4(yb, r, _fused_rows4(xb, pk, (row0 + r) * kb, kb, sc, (row0 + r) * ng, ng, g, bits))
      r += 4
  for rr in range(r, r_hi):
    yb[rr] = _fused_row(xb, 0, pk, (row0 + rr) * kb, sc, (row0 + rr) * ng, ng, g, bits)


@njit(**JIT)
def _fused4(xb, x0, x1, x2, x3, pk, po, sc, so, g, bits, gi0, gi1, st, s0):
  """Accumulators st[s0 + 32*t :] of tokens t = 0..3 (xb[x0:], ...) += row . x over groups
  [gi0, gi1), the row decoded chunk by chunk in registers (int4 G%64==0, int8 G%32==0)."""
  p0 = vld(st, s0)
  p1 = vld(st, s0 + 16)
  q0 = vld(st, s0 + 32)
  q1 = vld(st, s0 + 48)
  r0 = vld(st, s0 + 64)
  r1 = vld(st, s0 + 80)
  u0 = vld(st, s0 + 96)
  u1 = vld(st, s0 + 112)
  if bits == 4 and g == 64:  # the GLM-5 layout, unrolled
    for gi in range(gi0, gi1):
      s = vsplat(bf16(sc[so + gi]))
      t = vtab(s)
      pb = po + gi * 32
      j = gi * 64
      wa = vq4lo_s(pk, pb, t, s)
      wc = vq4lo_s(pk, pb + 16, t, s)
      p0 = vfma(wa, vld(xb, x0 + j), p0)
      p1 = vfma(wc, vld(xb, x0 + j + 16), p1)
      q0 = vfma(wa, vld(xb, x1 + j), q0)
      q1 = vfma(wc, vld(xb, x1 + j + 16), q1)
      r0 = vfma(wa, vld(xb, x2 + j), r0)
      r1 = vfma(wc, vld(xb, x2 + j + 16), r1)
      u0 = vfma(wa, vld(xb, x3 + j), u0)
      u1 = vfma(wc, vld(xb, x3 + j + 16), u1)
      wa = vq4hi_s(pk, pb, t, s)
      wc = vq4hi_s(pk, pb + 16, t, s)
      j += 32
      p0 = vfma(wa, vld(xb, x0 + j), p0)
      p1 = vfma(wc, vld(xb, x0 + j + 16), p1)
      q0 = vfma(wa, vld(xb, x1 + j), q0)
      q1 = vfma(wc, vld(xb, x1 + j + 16), q1)
      r0 = vfma(wa, vld(xb, x2 + j), r0)
      r1 = vfma(wc, vld(xb, x2 + j + 16), r1)
      u0 = vfma(wa, vld(xb, x3 + j), u0)
      u1 = vfma(wc, vld(xb, x3 + j + 16), u1)
  elif bits == 4:
    half = g // 2
    for gi in range(gi0, gi1):
      s = vsplat(bf16(sc[so + gi]))
      t = vtab(s)
      pb = po + gi * half
      for hi in range(2):
        for k in range(0, half, 2 * LANES):
          if hi == 0:
            wa = vq4lo_s(pk, pb + k, t, s)
            wc = vq4lo_s(pk, pb + k + LANES, t, s)
          else:
            wa = vq4hi_s(pk, pb + k, t, s)
            wc = vq4hi_s(pk, pb + k + LANES, t, s)
          j = gi * g + hi * half + k
          p0 = vfma(wa, vld(xb, x0 + j), p0)
          p1 = vfma(wc, vld(xb, x0 + j + LANES), p1)
          q0 = vfma(wa, vld(xb, x1 + j), q0)
          q1 = vfma(wc, vld(xb, x1 + j + LANES), q1)
          r0 = vfma(wa, vld(xb, x2 + j), r0)
          r1 = vfma(wc, vld(xb, x2 + j + LANES), r1)
          u0 = vfma(wa, vld(xb, x3 + j), u0)
          u1 = vfma(wc, vld(xb, x3 + j + LANES), u1)
  else:
    for gi in range(gi0, gi1):
      s = vsplat(bf16(sc[so + gi]))
      pb = po + gi * g
      for k in range(0, g, 2 * LANES):
        wa = vmul(vq8(pk, pb + k), s)
        wc = vmul(vq8(pk, pb + k + LANES), s)
        j = gi * g + k
        p0 = vfma(wa, vld(xb, x0 + j), p0)
        p1 = vfma(wc, vld(xb, x0 + j + LANES), p1)
        q0 = vfma(wa, vld(xb, x1 + j), q0)
        q1 = vfma(wc, vld(xb, x1 + j + LANES), q1)
        r0 = vfma(wa, vld(xb, x2 + j), r0)
        r1 = vfma(wc, vld(xb, x2 + j + LANES), r1)
        u0 = vfma(wa, vld(xb, x3 + j), u0)
        u1 = vfma(wc, vld(xb, x3 + j + LANES), u1)
  vst(st, s0, p0)
  vst(st, s0 + 16, p1)
  vst(st, s0 + 32, q0)
  vst(st, s0 + 48, q1)
  vst(st, s0 + 64, r0)
  vst(st, s0 + 80, r1)
  vst(st, s0 + 96, u0)
  vst(st, s0 + 112, u1)


@njit(**JIT)
def _fused_tiles(xb, n, kq, pk, sc, row0, r_lo, r_hi, kb, ng, g, bits, yb, o):
  """Few-token path: rows [r_lo, r_hi) x all n tokens in tiles of 4, decoded in registers."""
  ntile = (n + 3) // 4
  ts = 8 * LANES  # accumulator floats of one 4-token tile
  st = np.empty(ntile * ts, np.float32)
  for r in range(r_lo, r_hi):
    ra = row0 + r
    st[:] = 0.0
    for tl in range(ntile):
      t0 = 4 * tl  # missing tokens of the last tile repeat the last token (not stored)
      _fused4(xb, t0 * kq, min(t0 + 1, n - 1) * kq, min(t0 + 2, n - 1) * kq,
              min(t0 + 3, n - 1) * kq, pk, ra * kb, sc, ra * ng, g, bits, 0, ng, st, tl * ts)
    for t in range(n):
      yb[t * o + r] = finish(st, (t // 4) * ts + (t % 4) * 2 * LANES)


@njit(**JIT)
def _grouped_rows(xb, n, kq, pk, sc, row0, blk, nblk, step, kb, ng, g, bits, vec_ok, yb, o):
  """Grouped path for row blocks blk, blk + step, ... < nblk (one thread's share).

  A block of _ROW_BLOCK weight rows is decoded once into wbuf; tokens go in super-tiles of
  _TOKEN_TILE, the reduction in blocks of _K_BLOCK features (so a 4-token x tile stays in L1
  across the block's rows), accumulators carried in st between K blocks.
  """
  wbuf = np.empty(_ROW_BLOCK * kq, np.float32)
  ss = 2 * LANES * _TOKEN_TILE  # accumulator stride of one row in st
  st = np.empty(_ROW_BLOCK * ss, np.float32)
  while blk < nblk:
    r_lo = blk * _ROW_BLOCK
    nr = min(_ROW_BLOCK, o - r_lo)
    for i in range(nr):
      r = row0 + r_lo + i
      decode_row(pk, r * kb, sc, r * ng, ng, g, bits, vec_ok, kq, wbuf, i * kq)
    for t_lo in range(0, n, _TOKEN_TILE):
      nt = min(_TOKEN_TILE, n - t_lo)
      nt4 = nt - nt % 4
      st[:] = 0.0
      for j0 in range(0, kq, _K_BLOCK):
        j1 = min(kq, j0 + _K_BLOCK)
        for t in range(0, nt4, 4):
          xo = (t_lo + t) * kq
          for i in range(0, nr - 1, 2):
            dot2x4(wbuf, i * kq, (i + 1) * kq, xb, xo, kq, j0, j1, st, i * ss + t * 2 * LANES,
                    ss)
          if nr % 2:
            for tt in range(t, t + 4):
              dot1(wbuf, (nr - 1) * kq, xb, (t_lo + tt) * kq, j0, j1, st,
                    (nr - 1) * ss + tt * 2 * LANES)
        for tt in range(nt4, nt):
          for i in range(nr):
            dot1(wbuf, i * kq, xb, (t_lo + tt) * kq, j0, j1, st, i * ss + tt * 2 * LANES)
      for tt in range(nt):
        for i in range(nr):
          yb[(t_lo + tt) * o + r_lo + i] = finish(st, i * ss + tt * 2 * LANES)
    blk += step


@njit(**JIT)
def _few_tokens_ok(n, g, bits):
  """Whether n tokens take the few-token path (rows decoded in registers, 4-token tiles)."""
  return n <= _FEW_TOKENS and (g % (4 * LANES) == 0 if bits == 4 else g % (2 * LANES) == 0)


@njit(**JIT)
def qmatmul_serial(xb, n, kq, pk, sc, row0, o, kb, ng, g, bits, vec_ok, yb):
  """``qmatmul`` on the calling thread (no parallel region): the same results. For callers
  that parallelize over something else (the dense kernels' heads)."""
  if vec_ok and n == 1:
    _fused_rows(xb, pk, sc, row0, 0, o, kb, ng, g, bits, yb)
  elif _few_tokens_ok(n, g, bits):
    _fused_tiles(xb, n, kq, pk, sc, row0, 0, o, kb, ng, g, bits, yb, o)
  else:
    nblk = (o + _ROW_BLOCK - 1) // _ROW_BLOCK
    _grouped_rows(xb, n, kq, pk, sc, row0, 0, nblk, 1, kb, ng, g, bits, vec_ok, yb, o)


@njit(parallel=True, **JIT)
def qmatmul(xb, n, kq, pk, sc, row0, o, kb, ng, g, bits, vec_ok, nthreads, yb):
  """yb[t, r] = W[row0 + r] . xb[t] for r < o, t < n (xb, yb flat, row strides kq, o).

  nthreads <= 1 runs on the calling thread (no parallel region). Rows are independent, so the
  split never changes a result.
  """
  if nthreads <= 1:
    qmatmul_serial(xb, n, kq, pk, sc, row0, o, kb, ng, g, bits, vec_ok, yb)
  elif vec_ok and n == 1:
    nchunk = (o + _DECODE_ROWS - 1) // _DECODE_ROWS
    for c in prange(nchunk):
      r_lo = np.int64(c) * _DECODE_ROWS
      _fused_rows(xb, pk, sc, row0, r_lo, min(o, r_lo + _DECODE_ROWS), kb, ng, g, bits, yb)
  elif _few_tokens_ok(n, g, bits):
    nchunk = (o + _FEW_ROWS - 1) // _FEW_ROWS
    for c in prange(nchunk):
      r_lo = np.int64(c) * _FEW_ROWS
      _fused_tiles(xb, n, kq, pk, sc, row0, r_lo, min(o, r_lo + _FEW_ROWS), kb, ng, g, bits,
                   yb, o)
  else:
    nblk = (o + _ROW_BLOCK - 1) // _ROW_BLOCK
    nth = min(nthreads, nblk)
    for p in prange(nth):
      _grouped_rows(xb, n, kq, pk, sc, row0, np.int64(p), nblk, nth, kb, ng, g, bits, vec_ok,
                    yb, o)


# ---------------------------------------------------------------------------
# Python side: operands reach numba with one set of types (one compiled specialization).
# ---------------------------------------------------------------------------


def vec_ok(bits: int, group_size: int) -> bool:
  """Whether whole 16-lane chunks of a group share one scale (vector decode)."""
  return (group_size // 2 if bits == 4 else group_size) % LANES == 0


def readonly(a):
  """A read-only view: inputs always reach numba with one type, whether the caller's array
  was writable or not (jax buffers are read-only), so there is one compiled specialization."""
  a = a.view()
  a.flags.writeable = False
  return a


def flat_packed(a, name):
  a = np.asarray(a)
  if a.dtype not in (np.uint8, np.int8):
    raise ValueError(f"{name}: expected uint8 (int4) or int8 (int8) packed weights, got {a.dtype}")
  return readonly(np.ascontiguousarray(a).view(np.uint8).reshape(-1))


def flat_scales(a, name):
  a = np.asarray(a)
  if a.dtype.name not in ("bfloat16", "uint16", "int16"):
    raise ValueError(f"{name}: expected bf16 (or its uint16 bits), got {a.dtype}")
  return readonly(np.ascontiguousarray(a).view(np.uint16).reshape(-1))
