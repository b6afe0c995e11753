"""Deterministic numba CPU kernels for dense matmuls ``y[T, O] = x[T, I] @ Wᵀ``.

Standalone (nothing from ``glmjax``). ``W [O, I]`` is either

* group-wise int4/int8 (the expert layout of ``pallas_kernels.cpu``: packed codes
  ``[O, Kp/2]`` uint8 or ``[O, Kp]`` int8, bf16 scales ``[O, Kp/G]``); the arithmetic is
  ``cpu_rows.qmatmul``'s, the expert kernels' own row kernels (one decoder, not two), or
* bfloat16 (its bits as uint16 ``[O, I]``), upcast in registers (a shift: exact).

Arithmetic (both formats, every T, every thread count): as in ``pallas_kernels.cpu_rows``. The
input row is zero-padded to ``Kq`` (the padded width rounded up to 32), each output element
is the sum of 16-feature chunks, chunk ``c`` fused-multiply-added into accumulator
``A[c % 2]`` in increasing order, then ``hsum(A0 + A1)``. So an output row depends only on
its own input row and ``W``: bitwise the same for T = 1 (decode), T <= 8 (verify) and a
prefill chunk, and the same as the expert kernels for a quantized ``W``.

Loop order and threading. Work is split over output rows only (numba ``prange``, numba's
thread pool, the one the expert kernels use). Decode (T = 1) streams each weight row once and
dots it in registers; more tokens decode a block of 16 weight rows once into a float32
buffer and apply it to tiles of 4 tokens (reduction in blocks of 1024 features, so a token
tile stays in L1), as ``cpu_rows``' grouped path does. Matrices under
``cpu_rows.PARALLEL_MIN_WEIGHTS`` weights run on the calling thread.

``quant_heads_core`` / ``bf16_heads_core`` apply an MLA kv_b ``[H (N + V), C]`` per head
(attention's absorbed form) without dequantizing it whole: the value rows of head h times that
head's latent context (the format's matmul rows: ``cpu_rows.qmatmul_serial``, or the bf16
loops, at the head's rows), and the query's N entries times the head's key rows (rows decoded
one by one and accumulated in row order); parallel over heads.

One entry per weight family, so that a model compiles only the formats it holds: ``bf16_core``
and ``bf16_heads_core`` reach only the bf16 code, ``quant_core`` and ``quant_heads_core`` only
the int4/int8 code (``bits`` a run-time 4 or 8). One compiled specialization per kernel: each
takes read-only C-contiguous inputs (x float32 [T, I], flat uint8 codes and uint16 scales, or
flat uint16 bf16 bits) from the Python entry points and from the custom calls' handlers
(``cpu_dense_ffi``: one target per family) alike.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.extending import intrinsic

from pallas_kernels import cpu_rows
from pallas_kernels.cpu_vec import (JIT, LANES, VT, bf16, c_array, elem_ptr, f32x16, vadd, vfma,
                                    vhsum, vld, vst, vzero)

__all__ = ["qmatmul", "bf16_matmul", "heads_matmul", "quant_core", "bf16_core",
           "quant_heads_core", "bf16_heads_core", "BF16", "KEYS", "VALUES"]

BF16 = 16  # the `bits` code of a bfloat16 weight (heads_matmul, the custom calls)
KEYS, VALUES = 0, 1  # the heads cores' two uses of an MLA kv_b
_DECODE_ROWS = 128  # output rows per prange task at T = 1
_ROW_BLOCK = 16  # bf16 weight rows decoded per buffer fill (T > 1)
_K_BLOCK = 1024  # reduction features per pass (T > 1); a multiple of 2 * LANES
# Decode rows of a bf16 W go four at a time from this many features (x over 16 KB in float32,
# beyond the L1 cache, so each row re-read x from L2: GLM-5's o, MLPs and head, 1.3-1.8x);
# shorter rows stream as fast or faster one at a time (0.6-0.8x four at a time at 2,048 features,
# even at 4,096 and 5,120).
_BF16_ROWS4_MIN_K = 6144
_I16V = ir.VectorType(ir.IntType(16), LANES)
_I32V = ir.VectorType(ir.IntType(32), LANES)


@intrinsic
def _vbf16(typingctx, arr, idx):
  """16 bf16 (uint16 bits, flat element `idx`) as float32 lanes, exactly (bits << 16)."""
  if not c_array(arr, numba.types.uint16):
    return None

  def cg(context, builder, sig, args):
    p = elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _I16V)
    b = builder.zext(builder.load(p, align=2), _I32V)
    return builder.bitcast(builder.shl(b, ir.Constant(_I32V, [16] * LANES)), VT)

  return f32x16(arr, idx), cg


@njit(**JIT)
def _bf16_row(xb, w, wo, kq):
  """W[row] . xb[:kq] with the bf16 row (kq features, no padding) upcast in registers."""
  a0 = vzero()
  a1 = vzero()
  for j in range(0, kq, 2 * LANES):
    a0 = vfma(_vbf16(w, wo + j), vld(xb, j), a0)
    a1 = vfma(_vbf16(w, wo + j + LANES), vld(xb, j + LANES), a1)
  return vhsum(vadd(a0, a1))


@njit(**JIT)
def _bf16_rows4(xb, w, wo, i_dim, kq):
  """`_bf16_row` of the four rows at w[wo], w[wo + i_dim], ..., each with its own two
  accumulators in its own order (so bitwise the same), sharing the loads of x: four
  independent accumulator pairs hide the multiply-add latency (DESIGN.md §13)."""
  a0 = vzero()
  a1 = vzero()
  b0 = vzero()
  b1 = vzero()
  c0 = vzero()
  c1 = vzero()
  d0 = vzero()
  d1 = vzero()
  for j in range(0, kq, 2 * LANES):
    x0 = vld(xb, j)
    x1 = vld(xb, j + LANES)
    a0 = vfma(_vbf16(w, wo + j), x0, a0)
    a1 = vfma(_vbf16(w, wo + j + LANES), x1, a1)
    b0 = vfma(_vbf16(w, wo + i_dim + j), x0, b0)
    b1 = vfma(_vbf16(w, wo + i_dim + j + LANES), x1, b1)
    c0 = vfma(_vbf16(w, wo + 2 * i_dim + j), x0, c0)
    c1 = vfma(_vbf16(w, wo + 2 * i_dim + j + LANES), x1, c1)
    d0 = vfma(_vbf16(w, wo + 3 * i_dim + j), x0, d0)
    d1 = vfma(_vbf16(w, wo + 3 * i_dim + j + LANES), x1, d1)
  return (vhsum(vadd(a0, a1)), vhsum(vadd(b0, b1)),
          vhsum(vadd(c0, c1)), vhsum(vadd(d0, d1)))


@njit(**JIT)
def _bf16_decode_span(xb, w, i_dim, kq, r_lo, r_hi, yb):
  """Decode (one token row xb): yb[r] for output rows [r_lo, r_hi), four rows at a time when
  x is longer than `_BF16_ROWS4_MIN_K` (bitwise the same either way)."""
  r = r_lo
  while kq >= _BF16_ROWS4_MIN_K and r + 4 <= r_hi:
    cpu_rows.put4(yb, r, _bf16_rows4(xb, w, r * i_dim, i_dim, kq))
    r += 4
  for rr in range(r, r_hi):
    yb[rr] = _bf16_row(xb, w, rr * i_dim, kq)


@njit(**JIT)
def _bf16_decode_rows(w, i_dim, r_lo, nr, kq, wbuf):
  """wbuf[r * kq :] = bf16 row r_lo + r as float32, zero beyond i_dim (r < nr)."""
  for r in range(nr):
    wo = (r_lo + r) * i_dim
    bo = r * kq
    j = 0
    while j + LANES <= i_dim:
      vst(wbuf, bo + j, _vbf16(w, wo + j))
      j += LANES
    for jj in range(j, i_dim):
      wbuf[bo + jj] = bf16(w[wo + jj])
    for jj in range(i_dim, kq):
      wbuf[bo + jj] = np.float32(0.0)


@njit(**JIT)
def _bf16_block_tokens(wbuf, nr, xb, n, kq, st, yb, o, r_lo):
  """yb[t, r_lo + r] for the nr decoded rows in wbuf and all n tokens (cpu's tile order)."""
  ss = 2 * LANES * 4  # accumulators of one row x a 4-token tile
  n4 = n - n % 4
  for t in range(0, n4, 4):
    st[:nr * ss] = 0.0
    for j0 in range(0, kq, _K_BLOCK):
      j1 = min(kq, j0 + _K_BLOCK)
      for i in range(0, nr - 1, 2):
        cpu_rows.dot2x4(wbuf, i * kq, (i + 1) * kq, xb, t * kq, kq, j0, j1, st, i * ss, ss)
      if nr % 2:
        for tt in range(4):
          cpu_rows.dot1(wbuf, (nr - 1) * kq, xb, (t + tt) * kq, j0, j1, st,
                    (nr - 1) * ss + tt * 2 * LANES)
    for tt in range(4):
      for i in range(nr):
        yb[(t + tt) * o + r_lo + i] = cpu_rows.finish(st, i * ss + tt * 2 * LANES)
  for t in range(n4, n):
    for i in range(nr):
      st[:2 * LANES] = 0.0
      cpu_rows.dot1(wbuf, i * kq, xb, t * kq, 0, kq, st, 0)
      yb[t * o + r_lo + i] = cpu_rows.finish(st, 0)


@njit(**JIT)
def _bf16_rows(xb, n, kq, w, i_dim, o, blk, nblk, step, yb):
  """Row blocks blk, blk + step, ... < nblk of a bf16 matmul (one thread's share)."""
  wbuf = np.empty(_ROW_BLOCK * kq, np.float32)
  st = np.empty(_ROW_BLOCK * 2 * LANES * 4, np.float32)
  while blk < nblk:
    r_lo = blk * _ROW_BLOCK
    nr = min(_ROW_BLOCK, o - r_lo)
    _bf16_decode_rows(w, i_dim, r_lo, nr, kq, wbuf)
    _bf16_block_tokens(wbuf, nr, xb, n, kq, st, yb, o, r_lo)
    blk += step


@njit(parallel=True, **JIT)
def _bf16_matmul(xb, n, kq, w, i_dim, o, nthreads, yb):
  """yb[t, r] = W[r] . xb[t] for a bf16 W [o, i_dim] (xb, yb flat, row strides kq, o)."""
  if n == 1 and i_dim == kq:  # decode: rows streamed once, dotted in registers
    nchunk = (o + _DECODE_ROWS - 1) // _DECODE_ROWS
    if nthreads <= 1:
      _bf16_decode_span(xb, w, i_dim, kq, 0, o, yb)
    else:
      for c in prange(nchunk):
        r_lo = np.int64(c) * _DECODE_ROWS
        _bf16_decode_span(xb, w, i_dim, kq, r_lo, min(o, r_lo + _DECODE_ROWS), yb)
    return
  nblk = (o + _ROW_BLOCK - 1) // _ROW_BLOCK
  if nthreads <= 1:
    _bf16_rows(xb, n, kq, w, i_dim, o, 0, nblk, 1, yb)
  else:
    nth = min(nthreads, nblk)
    for p in prange(nth):
      _bf16_rows(xb, n, kq, w, i_dim, o, np.int64(p), nblk, nth, yb)


@njit(**JIT)
def _kq(kp):
  """The padded width `kp` rounded up to a whole number of accumulator pairs (32 features)."""
  return (kp + 2 * LANES - 1) // (2 * LANES) * (2 * LANES)


@njit(**JIT)
def _padded_rows(x, t, i_dim, kq):
  """x [t, i_dim] as t flat rows of kq features, zero beyond i_dim."""
  xb = np.zeros(t * kq, np.float32)
  for r in range(t):
    for j in range(i_dim):
      xb[r * kq + j] = x[r, j]
  return xb


@njit(**JIT)
def bf16_core(t, o, i_dim, nthreads, min_par, x, w16, out):
  """out[t, o] = x[t, i_dim] @ Wᵀ for W = w16 (bf16 bits [o, i_dim]). Parallel (nthreads)
  when W has >= min_par weights."""
  kq = _kq(i_dim)
  th = nthreads if o * kq >= min_par else 1
  xb = _padded_rows(x, t, i_dim, kq)
  if t == 0 or o == 0:
    return
  _bf16_matmul(xb, t, kq, w16, i_dim, o, th, out.reshape(t * o))


@njit(**JIT)
def quant_core(t, o, i_dim, bits, g, nthreads, min_par, x, pk, sc, out):
  """out[t, o] = x[t, i_dim] @ Wᵀ for W = (pk codes, sc scales), bits 4 or 8, group g
  (``cpu_rows.qmatmul``). Parallel (nthreads) when W has >= min_par weights."""
  kp = (i_dim + g - 1) // g * g
  kq = _kq(kp)
  th = nthreads if o * kq >= min_par else 1
  xb = _padded_rows(x, t, i_dim, kq)
  if t == 0 or o == 0:
    return
  kb = kp // 2 if bits == 4 else kp
  vec_ok = (g // 2 if bits == 4 else g) % LANES == 0
  cpu_rows.qmatmul(xb, t, kq, pk, sc, 0, o, kb, kp // g, g, bits, vec_ok, th, out.reshape(t * o))


@njit(**JIT)
def _bf16_head_values(xb, t, kq, w16, row0, v_dim, c_dim, yb):
  """yb[r * V + v] = W[row0 + v] . xb[r * kq:] for a bf16 W with rows of C: the bf16 matmul's
  own loops on the head's V rows (so each row's bits do not depend on T)."""
  w = w16[row0 * c_dim:(row0 + v_dim) * c_dim]
  if t == 1 and c_dim == kq:
    _bf16_decode_span(xb, w, c_dim, kq, 0, v_dim, yb)
  else:
    _bf16_rows(xb, t, kq, w, c_dim, v_dim, 0, (v_dim + _ROW_BLOCK - 1) // _ROW_BLOCK, 1, yb)


@njit(**JIT)
def _head_x(x, hh, t, c_dim, kq):
  """Head hh's latent context x[:, hh*C : (hh+1)*C] as t flat rows of kq features."""
  xb = np.zeros(t * kq, np.float32)
  for r in range(t):
    for j in range(c_dim):
      xb[r * kq + j] = x[r, hh * c_dim + j]
  return xb


@njit(**JIT)
def _put_values(yb, hh, t, v_dim, out):
  for r in range(t):
    for v in range(v_dim):
      out[r, hh * v_dim + v] = yb[r * v_dim + v]


@njit(**JIT)
def _add_key_row(acc, x, col, wbuf):
  """acc[r, :] += x[r, col] * (a decoded key row, wbuf): one of a head's N rows, in n order."""
  for r in range(acc.shape[0]):
    q = x[r, col]
    for j in range(acc.shape[1]):
      acc[r, j] += q * wbuf[j]


@njit(**JIT)
def _put_keys(acc, hh, out):
  c_dim = acc.shape[1]
  for r in range(acc.shape[0]):
    for j in range(c_dim):
      out[r, hh * c_dim + j] = acc[r, j]


@njit(**JIT)
def _head_bf16(hh, t, n_dim, v_dim, c_dim, kq, part, x, w16, out):
  """bf16_heads_core for head hh (see there)."""
  r0 = hh * (n_dim + v_dim)
  if part == VALUES:  # out[t, hh, v] = W[r0 + N + v] . x[t, hh, :]: the rows' own kernel
    yb = np.empty(t * v_dim, np.float32)
    _bf16_head_values(_head_x(x, hh, t, c_dim, kq), t, kq, w16, r0 + n_dim, v_dim, c_dim, yb)
    _put_values(yb, hh, t, v_dim, out)
  else:  # out[t, hh, :] = sum_n x[t, hh, n] * W[r0 + n, :]: decoded rows, added in n order
    acc = np.zeros((t, c_dim), np.float32)
    wbuf = np.empty(kq, np.float32)
    for nn in range(n_dim):
      _bf16_decode_rows(w16, c_dim, r0 + nn, 1, kq, wbuf)
      _add_key_row(acc, x, hh * n_dim + nn, wbuf)
    _put_keys(acc, hh, out)


@njit(**JIT)
def _head_quant(hh, t, n_dim, v_dim, c_dim, kq, kb, ng, g, bits, vec_ok, part, x, pk, sc, out):
  """quant_heads_core for head hh (see there)."""
  r0 = hh * (n_dim + v_dim)
  if part == VALUES:
    yb = np.empty(t * v_dim, np.float32)
    cpu_rows.qmatmul_serial(_head_x(x, hh, t, c_dim, kq), t, kq, pk, sc, r0 + n_dim, v_dim, kb,
                            ng, g, bits, vec_ok, yb)
    _put_values(yb, hh, t, v_dim, out)
  else:
    acc = np.zeros((t, c_dim), np.float32)
    wbuf = np.empty(kq, np.float32)
    for nn in range(n_dim):
      row = r0 + nn
      cpu_rows.decode_row(pk, row * kb, sc, row * ng, ng, g, bits, vec_ok, kq, wbuf, 0)
      _add_key_row(acc, x, hh * n_dim + nn, wbuf)
    _put_keys(acc, hh, out)


@njit(parallel=True, **JIT)
def bf16_heads_core(t, heads, n_dim, v_dim, c_dim, part, nthreads, x, w16, out):
  """An MLA kv_b ``W [heads * (N + V), C]`` (bf16 bits in ``w16``, rows of C read as they are)
  applied per head without upcasting it whole: ``part`` KEYS: ``out[t, h*C + c] = sum_n
  x[t, h*N + n] W[h(N+V) + n, c]`` (the query absorbed into latent space); VALUES:
  ``out[t, h*V + v] = W[h(N+V) + N + v] . x[t, h*C : (h+1)*C]`` (the latent context out to
  values). Parallel over heads."""
  kq = _kq(c_dim)
  if nthreads <= 1:
    for hh in range(heads):
      _head_bf16(hh, t, n_dim, v_dim, c_dim, kq, part, x, w16, out)
  else:
    for hh in prange(heads):
      _head_bf16(np.int64(hh), t, n_dim, v_dim, c_dim, kq, part, x, w16, out)


@njit(parallel=True, **JIT)
def quant_heads_core(t, heads, n_dim, v_dim, c_dim, bits, g, part, nthreads, x, pk, sc, out):
  """``bf16_heads_core`` for a group-wise quantized kv_b (codes ``pk``, scales ``sc``, bits 4 or
  8, group g): without dequantizing it whole."""
  kp = (c_dim + g - 1) // g * g
  ng = kp // g
  kb = kp // 2 if bits == 4 else kp
  vec_ok = (g // 2 if bits == 4 else g) % LANES == 0
  kq = _kq(kp)
  if nthreads <= 1:
    for hh in range(heads):
      _head_quant(hh, t, n_dim, v_dim, c_dim, kq, kb, ng, g, bits, vec_ok, part, x, pk, sc, out)
  else:
    for hh in prange(heads):
      _head_quant(np.int64(hh), t, n_dim, v_dim, c_dim, kq, kb, ng, g, bits, vec_ok, part, x,
                  pk, sc, out)


def _as_x(x, i_dim):
  x = np.ascontiguousarray(x, dtype=np.float32)
  if x.ndim != 2 or x.shape[1] != i_dim:
    raise ValueError(f"x: expected [T, {i_dim}], got shape {x.shape}")
  return x


def _threads_args():
  return numba.get_num_threads(), int(cpu_rows.PARALLEL_MIN_WEIGHTS)


def qmatmul(x, packed, scales, bits, group_size, in_features):
  """x @ Wᵀ for a group-wise quantized W (the expert layout, see module docstring).

  Args:
    x: float [T, in_features] (converted to float32).
    packed: uint8 [O, Kp/2] (int4) or int8 [O, Kp] (int8); Kp = ceil(I / G) * G.
    scales: bf16 (or its uint16 bits) [O, Kp/G].
    bits: 4 or 8. group_size: G. in_features: I (the unpadded input width).

  Returns:
    float32 [T, O]; each row bitwise independent of T and of the other rows.
  """
  _check_quantized(packed, scales, bits, group_size, in_features)
  x = _as_x(x, in_features)
  out = np.empty((x.shape[0], np.shape(packed)[0]), np.float32)
  quant_core(x.shape[0], out.shape[1], in_features, bits, group_size, *_threads_args(),
             cpu_rows.readonly(x), cpu_rows.flat_packed(packed, "packed"),
             cpu_rows.flat_scales(scales, "scales"), out)
  return out


def _check_quantized(packed, scales, bits, group_size, in_features):
  if bits not in (4, 8):
    raise ValueError(f"bits must be 4 or 8, got {bits}")
  if group_size <= 0 or (bits == 4 and group_size % 2):
    raise ValueError(f"group_size must be positive (even for int4), got {group_size}")
  o = np.shape(packed)[0]
  ng = -(-in_features // group_size)
  want_p = (o, ng * group_size // (2 if bits == 4 else 1))
  want_dt = np.uint8 if bits == 4 else np.int8
  if tuple(np.shape(packed)) != want_p or np.asarray(packed).dtype != want_dt:
    raise ValueError(f"packed: expected {np.dtype(want_dt).name} {want_p}, got "
                     f"{np.asarray(packed).dtype} {tuple(np.shape(packed))}")
  if tuple(np.shape(scales)) != (o, ng):
    raise ValueError(f"scales: expected shape {(o, ng)}, got {tuple(np.shape(scales))}")


def heads_matmul(x, packed, scales, bits, group_size, in_features, heads, n_dim, part):
  """``quant_heads_core`` or ``bf16_heads_core`` (per-head use of an MLA kv_b
  ``[heads * (N + V), C]``, C = in_features):
  quantized (``packed``, ``scales``, ``bits`` 4 or 8), or bfloat16 (``bits`` ``BF16``:
  ``packed`` is the bf16 matrix or its uint16 bits, ``scales`` and ``group_size`` unused).

  x: float [T, heads * N] (KEYS) or [T, heads * C] (VALUES). Returns float32 [T, heads * C]
  (KEYS) or [T, heads * V] (VALUES); each row bitwise independent of T.
  """
  o = np.shape(packed)[0]
  c_dim = in_features
  if bits == BF16:
    w = np.asarray(packed)
    if w.ndim != 2 or w.shape[1] != c_dim or w.dtype.name not in ("bfloat16", "uint16"):
      raise ValueError(f"w: expected bfloat16 [O, {c_dim}], got {w.dtype} {w.shape}")
  else:
    _check_quantized(packed, scales, bits, group_size, c_dim)
  if o % heads or o // heads <= n_dim:
    raise ValueError(f"kv_b rows {o} are not heads ({heads}) x (N={n_dim} + V)")
  v_dim = o // heads - n_dim
  x = _as_x(x, heads * (n_dim if part == KEYS else c_dim))
  out = np.empty((x.shape[0], heads * (c_dim if part == KEYS else v_dim)), np.float32)
  nthreads = numba.get_num_threads() if o * c_dim >= cpu_rows.PARALLEL_MIN_WEIGHTS else 1
  if bits == BF16:
    bf16_heads_core(x.shape[0], heads, n_dim, v_dim, c_dim, part, nthreads, cpu_rows.readonly(x),
                    cpu_rows.flat_scales(w, "w"), out)
  else:
    quant_heads_core(x.shape[0], heads, n_dim, v_dim, c_dim, bits, group_size, part, nthreads,
                     cpu_rows.readonly(x), cpu_rows.flat_packed(packed, "packed"),
                     cpu_rows.flat_scales(scales, "scales"), out)
  return out


def bf16_matmul(x, w):
  """x @ Wᵀ for a bfloat16 W [O, I] (a bf16 array or its uint16 bits), accumulated in float32.

  Returns float32 [T, O]; each row bitwise independent of T and of the other rows.
  """
  w = np.asarray(w)
  if w.ndim != 2 or w.dtype.name not in ("bfloat16", "uint16"):
    raise ValueError(f"w: expected bfloat16 [O, I], got {w.dtype} {w.shape}")
  x = _as_x(x, w.shape[1])
  out = np.empty((x.shape[0], w.shape[0]), np.float32)
  bf16_core(x.shape[0], w.shape[0], w.shape[1], *_threads_args(), cpu_rows.readonly(x),
            cpu_rows.flat_scales(w, "w"), out)
  return out
