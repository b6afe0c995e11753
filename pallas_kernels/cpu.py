"""Deterministic numba CPU kernels for group-wise int4/int8 MoE experts.

Standalone: takes raw numpy arrays and ints (nothing from ``glmjax``).

Weight format (one matrix ``W [O, K]``, groups of ``G`` input features, ``K``
zero-padded to ``Kp = ceil(K / G) * G``, one bf16 scale per row and group):

* int4: packed uint8 ``[O, Kp / 2]``; byte ``j < G/2`` of a group holds
  ``q[j] + 8`` in its low nibble and ``q[j + G/2] + 8`` in its high nibble.
* int8: packed int8 ``[O, Kp]``.
* scales: bf16 ``[O, Kp / G]`` (a bf16 array, or its bits as uint16).

An expert is ``gate_up [2I, D]`` (rows ``0..I-1`` gate, ``I..2I-1`` up) and
``down [D, I]``; for a token row ``x [D]`` its output is
``down . (silu(gate . x) * (up . x))``. A pool stacks experts on a leading
slot axis ``[S, ...]``.

Determinism
-----------
Every output element ``y[o] = sum_j W[o, j] * x[j]`` is computed by one fixed
sequence of float32 operations, whatever the batch, the other rows in the
call, the code path (decode, few-token, grouped, pool) or the thread count:

* the weight ``w[j] = q[j] * s`` is exact in float32 (a 4/8 bit integer
  times a bf16 scale), so every way of decoding it gives the same bits;
* the input, zero-padded to ``Kq`` (``Kp`` rounded up to 32), is cut into
  chunks of 16 features; chunk ``c`` goes lane-wise into accumulator
  ``A[c % 2]`` (16 lanes each) as ``A = fma(w, x, A)`` (one rounding),
  chunks in increasing order, starting from zero vectors;
* ``y = hsum(A0 + A1)`` where ``hsum`` halves a 16-lane vector by a fixed
  tree (lanes ``i`` and ``i + 8``, then ``i`` and ``i + 4``, ...).

The vector operations are explicit LLVM vector instructions on a numba type
of 16 float32 lanes (``llvm.fma`` for the accumulation, no fast-math flags),
so LLVM can neither reassociate nor contract differently per call site, and
the bits do not depend on the SIMD width the host compiles them to. Work is
split over output rows only (``prange``), never over the reduction axis. The
activation is ``float32(silu(float64(g)) * float64(u))`` with
``silu(v) = v / (1 + exp(-v))``.

Paths (all with the arithmetic above)
-------------------------------------
* n == 1 token row per expert (decode): each weight row is decoded chunk by
  chunk in registers and dotted with x in the same pass, four rows at a time
  for int4 G64 and int8 G % 32 == 0 (each row its own accumulators, the
  loads of x shared; ~17 GB/s of int4 weights from DRAM on 2 Zen 4 cores;
  with AVX-512 one ``vpermps`` from a 16-entry per-group table
  ``(q - 8) * s`` decodes 16 int4 weights, the low and high nibbles of 16
  bytes sharing one widening).
* 2 <= n <= 4: the same, with 4 token accumulators per weight row.
* n > 4 (grouped): each thread decodes a block of 16 weight rows once into a
  float32 buffer and applies it to tiles of 4 tokens with a 2 rows x 4 tokens
  register tile, the reduction in blocks of 1024 features.
* Group sizes without whole 16-lane chunks per scale (int4 ``G/2`` or int8
  ``G`` not a multiple of 16) decode with scalar code into the buffer.
* Matrices under ``PARALLEL_MIN_WEIGHTS`` weights run on the calling thread.

``pool_terms`` sorts the active (token, rank) pairs by slot and runs each
distinct slot once over all rows that chose it; inactive pairs are never
computed and their terms are exactly 0.

Compile time: inputs reach numba with one fixed set of types (flat read-only
C-contiguous uint8 weights, uint16 scales, float32 activations, int64
indices), so there is one specialization, which the custom call's handler
(``cpu_ffi``) reuses: it passes the same read-only types. The first call
compiles it (~17 s on 2 cores; the handler then ~10 s more) unless numba's
on-disk cache (``cache=True``, in ``__pycache__`` or ``NUMBA_CACHE_DIR``)
holds it (~0.4 s to load).
"""

from __future__ import annotations

import os

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, models, register_model

from pallas_kernels import numba_cache

numba_cache.install()  # before the first cached compile (see numba_cache: a race between processes)

__all__ = ["expert_ffn", "pool_terms", "pool_terms_jax", "LANES"]

LANES = 16  # float32 lanes per vector chunk
_DECODE_ROWS = 128  # output rows per prange task on the decode path
# A matrix with fewer (padded) weights than this is multiplied on the calling thread: a
# parallel region costs more than it saves on small matrices, and on a busy machine a region
# waits for every thread to be scheduled (milliseconds). Read at call time (tests set it to 0).
PARALLEL_MIN_WEIGHTS = 1 << 20
_ROW_BLOCK = 16  # weight rows decoded per buffer fill (grouped path)
_TOKEN_TILE = 64  # tokens per accumulator tile (grouped path)
_K_BLOCK = 1024  # reduction features per pass (grouped path); a multiple of 2 * LANES
_FEW_TOKENS = 4  # 2 <= n <= this: rows decoded in registers, all tokens at once
_FEW_ROWS = 32  # output rows per prange task on the few-token path

_JIT = dict(cache=True, nogil=True, error_model="numpy")


# ---------------------------------------------------------------------------
# A 16-lane float32 vector type for numba, with explicit LLVM vector ops.
# ---------------------------------------------------------------------------


class _F32x16(types.Type):

  def __init__(self):
    super().__init__(name="F32x16")


_f32x16 = _F32x16()
_VT = ir.VectorType(ir.FloatType(), LANES)
_I8V = ir.VectorType(ir.IntType(8), LANES)
_I32V = ir.VectorType(ir.IntType(32), LANES)


@register_model(_F32x16)
class _F32x16Model(models.PrimitiveModel):

  def __init__(self, dmm, fe_type):
    super().__init__(dmm, fe_type, _VT)


def _c_array(a, dtype) -> bool:
  return isinstance(a, types.Array) and a.layout == "C" and a.dtype == dtype


# A diagnostic switch, read at import: every vector load and store (the only unchecked
# accesses: numba's own indexing has NUMBA_BOUNDSCHECK) traps (SIGILL, so faulthandler names
# the call) when its elements are not all inside the array. Compiled code is cached by source,
# not by this switch: use it with an empty NUMBA_CACHE_DIR.
VECTOR_BOUNDSCHECK = os.environ.get("PALLAS_KERNELS_VECTOR_BOUNDSCHECK", "") == "1"


def _elem_ptr(context, builder, arrty, arr, idx, idxty, elem_ty):
  """Pointer to flat element `idx` of a C-contiguous array, as `elem_ty*`."""
  a = context.make_array(arrty)(context, builder, arr)
  i = context.cast(builder, idx, idxty, types.intp)
  if VECTOR_BOUNDSCHECK:
    span = max(1, context.get_abi_sizeof(elem_ty)
               // context.get_abi_sizeof(context.get_data_type(arrty.dtype)))
    end = builder.add(i, ir.Constant(i.type, span))
    bad = builder.or_(builder.icmp_signed("<", i, ir.Constant(i.type, 0)),
                      builder.icmp_signed(">", end, a.nitems))
    with builder.if_then(bad, likely=False):
      trap = builder.module.declare_intrinsic("llvm.trap", fnty=ir.FunctionType(ir.VoidType(), []))
      builder.call(trap, [])
  return builder.bitcast(builder.gep(a.data, [i]), elem_ty.as_pointer())


@intrinsic
def _vzero(typingctx):

  def cg(context, builder, sig, args):
    return ir.Constant(_VT, None)

  return _f32x16(), cg


@intrinsic
def _vsplat(typingctx, s):
  if s != types.float32:
    return None

  def cg(context, builder, sig, args):
    v = builder.insert_element(ir.Constant(_VT, ir.Undefined), args[0],
                               ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(_VT, ir.Undefined),
                                  ir.Constant(_I32V, [0] * LANES))

  return _f32x16(s), cg


@intrinsic
def _vld(typingctx, arr, idx):
  """16 float32 from flat element `idx` of a C-contiguous float32 array."""
  if not _c_array(arr, types.float32):
    return None

  def cg(context, builder, sig, args):
    p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VT)
    return builder.load(p, align=4)

  return _f32x16(arr, idx), cg


@intrinsic
def _vst(typingctx, arr, idx, v):
  if not _c_array(arr, types.float32):
    return None

  def cg(context, builder, sig, args):
    p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VT)
    builder.store(args[2], p, align=4)
    return context.get_dummy_value()

  return types.none(arr, idx, _f32x16), cg


def _make_decode(kind):

  def typer(typingctx, arr, idx):
    if not _c_array(arr, types.uint8):
      return None

    def cg(context, builder, sig, args):
      p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _I8V)
      b = builder.load(p, align=1)
      if kind == "lo":
        b = builder.sub(builder.and_(b, ir.Constant(_I8V, [15] * LANES)),
                        ir.Constant(_I8V, [8] * LANES))
      elif kind == "hi":
        b = builder.sub(builder.lshr(b, ir.Constant(_I8V, [4] * LANES)),
                        ir.Constant(_I8V, [8] * LANES))
      return builder.sitofp(b, _VT)  # int8 lanes (signed) -> float32

    return _f32x16(arr, idx), cg

  typer.__name__ = f"_vq_{kind}"
  return intrinsic(typer)


_vq4lo = _make_decode("lo")  # low nibbles of 16 bytes, minus 8
_vq4hi = _make_decode("hi")  # high nibbles of 16 bytes, minus 8
_vq8 = _make_decode("i8")  # 16 bytes as int8


def _host_has_avx512() -> bool:
  if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
    return False  # compiling for a named (portable) target: no host intrinsics
  try:
    from llvmlite import binding
    feats = binding.get_host_cpu_features()
    return bool(feats.get("avx512f"))
  except Exception:  # pylint: disable=broad-except
    return False


# With AVX-512, int4 weights are decoded by one permute from a 16-entry table
# (q - 8) * s per group (vpermps): exact, so bitwise equal to the generic
# convert-and-multiply, and ~12% faster on the decode path. The cache key of
# numba includes the host CPU features, so a cached build matches the host.
_AVX512 = _host_has_avx512()


@intrinsic
def _vtab(typingctx, s):
  """[(n - 8) * s for n in 0..15] (exact), the int4 decode table of one group."""

  def cg(context, builder, sig, args):
    return builder.fmul(ir.Constant(_VT, [float(n - 8) for n in range(LANES)]), args[0])

  return _f32x16(_f32x16), cg


def _make_decode_scaled(kind):

  def typer(typingctx, arr, idx, tab, s):
    if not _c_array(arr, types.uint8):
      return None

    def cg(context, builder, sig, args):
      p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _I8V)
      b = builder.load(p, align=1)
      if _AVX512:
        # Widen the bytes first and shift in 32-bit lanes: the low and high nibbles of the
        # same 16 bytes then share one load and one widening (LLVM merges them), where a
        # byte shift before widening needs two. The widening shuffles bound this loop
        # (BUILD_NOTES §22: 1.06-1.15x the int4 matvec).
        z = builder.zext(b, _I32V)
        if kind == "hi":
          z = builder.lshr(z, ir.Constant(_I32V, [4] * LANES))
        fnty = ir.FunctionType(_VT, [_VT, _I32V])
        fn = builder.module.declare_intrinsic("llvm.x86.avx512.permvar.sf.512", fnty=fnty)
        return builder.call(fn, [args[2], z])  # uses the low 4 bits
      if kind == "hi":
        b = builder.lshr(b, ir.Constant(_I8V, [4] * LANES))
      if kind == "lo":
        b = builder.and_(b, ir.Constant(_I8V, [15] * LANES))
      q = builder.sitofp(builder.sub(b, ir.Constant(_I8V, [8] * LANES)), _VT)
      return builder.fmul(q, args[3])

    return _f32x16(arr, idx, _f32x16, _f32x16), cg

  typer.__name__ = f"_vq4{kind}_scaled"
  return intrinsic(typer)


_vq4lo_s = _make_decode_scaled("lo")  # (low nibble - 8) * s, given _vtab(s) and s
_vq4hi_s = _make_decode_scaled("hi")  # (high nibble - 8) * s


@intrinsic
def _vadd(typingctx, a, b):

  def cg(context, builder, sig, args):
    return builder.fadd(args[0], args[1])

  return _f32x16(_f32x16, _f32x16), cg


@intrinsic
def _vmul(typingctx, a, b):

  def cg(context, builder, sig, args):
    return builder.fmul(args[0], args[1])

  return _f32x16(_f32x16, _f32x16), cg


@intrinsic
def _vfma(typingctx, a, b, c):
  """a * b + c lane-wise with one rounding (llvm.fma: IEEE fused multiply-add everywhere)."""

  def cg(context, builder, sig, args):
    fn = builder.module.declare_intrinsic(
        f"llvm.fma.v{LANES}f32", fnty=ir.FunctionType(_VT, [_VT, _VT, _VT]))
    return builder.call(fn, list(args))

  return _f32x16(_f32x16, _f32x16, _f32x16), cg


@intrinsic
def _vhsum(typingctx, a):
  """Sum of the 16 lanes by a fixed halving tree."""

  def cg(context, builder, sig, args):
    v, n = args[0], LANES
    while n > 1:
      h = n // 2
      lo = builder.shuffle_vector(
          v, v, ir.Constant(ir.VectorType(ir.IntType(32), h), list(range(h))))
      hi = builder.shuffle_vector(
          v, v, ir.Constant(ir.VectorType(ir.IntType(32), h), list(range(h, n))))
      v, n = builder.fadd(lo, hi), h
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))

  return types.float32(_f32x16), cg


@intrinsic
def _bf16(typingctx, u):
  """bf16 bits (uint16) -> float32, exactly."""
  if u != types.uint16:
    return None

  def cg(context, builder, sig, args):
    z = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
    return builder.bitcast(z, ir.FloatType())

  return types.float32(u), cg


# ---------------------------------------------------------------------------
# Row kernels. All offsets are flat element indices. Helpers stay out of
# prange bodies (their vector locals then live in registers).
# ---------------------------------------------------------------------------


@njit(**_JIT)
def _q4g64_group(pk, pb, scale, x0, x1, x2, x3, a0, a1):
  """One int4 G64 group of a row (packed bytes pk[pb:pb + 32], bf16 scale bits) into the row's
  accumulators, in ``_fused_row``'s order; x0..x3 the group's four input chunks."""
  s = _vsplat(_bf16(scale))
  t = _vtab(s)
  a0 = _vfma(_vq4lo_s(pk, pb, t, s), x0, a0)
  a1 = _vfma(_vq4lo_s(pk, pb + 16, t, s), x1, a1)
  a0 = _vfma(_vq4hi_s(pk, pb, t, s), x2, a0)
  a1 = _vfma(_vq4hi_s(pk, pb + 16, t, s), x3, a1)
  return a0, a1


@njit(**_JIT)
def _q8_chunks(pk, pb, s, x0, x1, a0, a1):
  """Two int8 chunks of a row (pk[pb:pb + 32], scale vector s) into its accumulators."""
  return (_vfma(_vmul(_vq8(pk, pb), s), x0, a0),
          _vfma(_vmul(_vq8(pk, pb + LANES), s), x1, a1))


@njit(**_JIT)
def _fused_row(xb, xo, pk, po, sc, so, ng, g, bits):
  """W[row] . xb[xo:] with the row decoded chunk by chunk in registers (vec_ok only)."""
  a0 = _vzero()
  a1 = _vzero()
  if bits == 4 and g == 64:  # the GLM-5 layout, fully unrolled
    for gi in range(ng):
      xg = xo + gi * 64
      a0, a1 = _q4g64_group(pk, po + gi * 32, sc[so + gi], _vld(xb, xg), _vld(xb, xg + 16),
                            _vld(xb, xg + 32), _vld(xb, xg + 48), a0, a1)
  elif bits == 4 and g % 64 == 0:  # even number of chunks per half group
    half = g // 2
    for gi in range(ng):
      s = _vsplat(_bf16(sc[so + gi]))
      pb = po + gi * half
      xg = xo + gi * g
      for k in range(0, half, 2 * LANES):
        a0 = _vfma(_vmul(_vq4lo(pk, pb + k), s), _vld(xb, xg + k), a0)
        a1 = _vfma(_vmul(_vq4lo(pk, pb + k + LANES), s), _vld(xb, xg + k + LANES), a1)
      for k in range(0, half, 2 * LANES):
        a0 = _vfma(_vmul(_vq4hi(pk, pb + k), s), _vld(xb, xg + half + k), a0)
        a1 = _vfma(_vmul(_vq4hi(pk, pb + k + LANES), s), _vld(xb, xg + half + k + LANES), a1)
  elif bits == 4:  # odd number of chunks per half group: rotate the accumulators
    half = g // 2
    for gi in range(ng):
      s = _vsplat(_bf16(sc[so + gi]))
      pb = po + gi * half
      xg = xo + gi * g
      for k in range(0, half, LANES):
        w = _vmul(_vq4lo(pk, pb + k), s)
        a0, a1 = a1, _vfma(w, _vld(xb, xg + k), a0)
      for k in range(0, half, LANES):
        w = _vmul(_vq4hi(pk, pb + k), s)
        a0, a1 = a1, _vfma(w, _vld(xb, xg + half + k), a0)
  elif g % (2 * LANES) == 0:  # int8, even number of chunks per group
    for gi in range(ng):
      s = _vsplat(_bf16(sc[so + gi]))
      pb = po + gi * g
      xg = xo + gi * g
      for k in range(0, g, 2 * LANES):
        a0, a1 = _q8_chunks(pk, pb + k, s, _vld(xb, xg + k), _vld(xb, xg + k + LANES), a0, a1)
  else:  # int8, odd number of chunks per group
    for gi in range(ng):
      s = _vsplat(_bf16(sc[so + gi]))
      pb = po + gi * g
      xg = xo + gi * g
      for k in range(0, g, LANES):
        w = _vmul(_vq8(pk, pb + k), s)
        a0, a1 = a1, _vfma(w, _vld(xb, xg + k), a0)
  # After an odd chunk count a0/a1 hold A1/A0; the sum is the same (+ commutes).
  return _vhsum(_vadd(a0, a1))


@njit(**_JIT)
def _decode_row(pk, po, sc, so, ng, g, bits, vec_ok, kq, wb, wo):
  """wb[wo : wo + kq] = dequantized row (zero beyond Kp = ng * g)."""
  if vec_ok:
    if bits == 4:
      half = g // 2
      for gi in range(ng):
        s = _vsplat(_bf16(sc[so + gi]))
        t = _vtab(s)
        pb = po + gi * half
        wg = wo + gi * g
        for k in range(0, half, LANES):
          _vst(wb, wg + k, _vq4lo_s(pk, pb + k, t, s))
          _vst(wb, wg + half + k, _vq4hi_s(pk, pb + k, t, s))
    else:
      for gi in range(ng):
        s = _vsplat(_bf16(sc[so + gi]))
        pb = po + gi * g
        wg = wo + gi * g
        for k in range(0, g, LANES):
          _vst(wb, wg + k, _vmul(_vq8(pk, pb + k), s))
  else:
    for gi in range(ng):
      s = _bf16(sc[so + gi])
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


@njit(**_JIT)
def _dot1(wb, wo, xb, xo, j0, j1, st, so):
  """Accumulators st[so : so + 32] (A0, A1) += chunks [j0, j1) of wb[wo:] * xb[xo:]."""
  a0 = _vld(st, so)
  a1 = _vld(st, so + LANES)
  for j in range(j0, j1, 2 * LANES):
    a0 = _vfma(_vld(wb, wo + j), _vld(xb, xo + j), a0)
    a1 = _vfma(_vld(wb, wo + j + LANES), _vld(xb, xo + j + LANES), a1)
  _vst(st, so, a0)
  _vst(st, so + LANES, a1)


@njit(**_JIT)
def _dot2x4(wb, w0, w1, xb, x0, xs, j0, j1, st, s0, ss):
  """_dot1 for a 2 rows x 4 tokens tile: row i (wb[w0 or w1:]), token t (xb[x0 + t*xs:]).

  Accumulators of (row i, token t) at st[s0 + i*ss + 32*t :]. Each (row, token) pair sees
  the same operations in the same order as _dot1.
  """
  x1 = x0 + xs
  x2 = x1 + xs
  x3 = x2 + xs
  s1 = s0 + ss
  p0 = _vld(st, s0)
  p1 = _vld(st, s0 + 16)
  q0 = _vld(st, s0 + 32)
  q1 = _vld(st, s0 + 48)
  r0 = _vld(st, s0 + 64)
  r1 = _vld(st, s0 + 80)
  u0 = _vld(st, s0 + 96)
  u1 = _vld(st, s0 + 112)
  e0 = _vld(st, s1)
  e1 = _vld(st, s1 + 16)
  f0 = _vld(st, s1 + 32)
  f1 = _vld(st, s1 + 48)
  g0 = _vld(st, s1 + 64)
  g1 = _vld(st, s1 + 80)
  h0 = _vld(st, s1 + 96)
  h1 = _vld(st, s1 + 112)
  for j in range(j0, j1, 2 * LANES):
    wa = _vld(wb, w0 + j)
    wc = _vld(wb, w1 + j)
    v = _vld(xb, x0 + j)
    p0 = _vfma(wa, v, p0)
    e0 = _vfma(wc, v, e0)
    v = _vld(xb, x1 + j)
    q0 = _vfma(wa, v, q0)
    f0 = _vfma(wc, v, f0)
    v = _vld(xb, x2 + j)
    r0 = _vfma(wa, v, r0)
    g0 = _vfma(wc, v, g0)
    v = _vld(xb, x3 + j)
    u0 = _vfma(wa, v, u0)
    h0 = _vfma(wc, v, h0)
    k = j + LANES
    wa = _vld(wb, w0 + k)
    wc = _vld(wb, w1 + k)
    v = _vld(xb, x0 + k)
    p1 = _vfma(wa, v, p1)
    e1 = _vfma(wc, v, e1)
    v = _vld(xb, x1 + k)
    q1 = _vfma(wa, v, q1)
    f1 = _vfma(wc, v, f1)
    v = _vld(xb, x2 + k)
    r1 = _vfma(wa, v, r1)
    g1 = _vfma(wc, v, g1)
    v = _vld(xb, x3 + k)
    u1 = _vfma(wa, v, u1)
    h1 = _vfma(wc, v, h1)
  _vst(st, s0, p0)
  _vst(st, s0 + 16, p1)
  _vst(st, s0 + 32, q0)
  _vst(st, s0 + 48, q1)
  _vst(st, s0 + 64, r0)
  _vst(st, s0 + 80, r1)
  _vst(st, s0 + 96, u0)
  _vst(st, s0 + 112, u1)
  _vst(st, s1, e0)
  _vst(st, s1 + 16, e1)
  _vst(st, s1 + 32, f0)
  _vst(st, s1 + 48, f1)
  _vst(st, s1 + 64, g0)
  _vst(st, s1 + 80, g1)
  _vst(st, s1 + 96, h0)
  _vst(st, s1 + 112, h1)


@njit(**_JIT)
def _finish(st, so):
  return _vhsum(_vadd(_vld(st, so), _vld(st, so + LANES)))


@njit(**_JIT)
def _fused_rows4(xb, pk, po, kb, sc, so, ng, g, bits):
  """``_fused_row`` of the four rows at pk[po], pk[po + kb], ... (int4 G64, or int8 with
  G % 32 == 0), each with its own two accumulators in its own order (so bitwise the same),
  sharing the loads of x. Four independent accumulator pairs hide the latency of the
  multiply-add chains."""
  a0 = _vzero()
  a1 = _vzero()
  b0 = _vzero()
  b1 = _vzero()
  c0 = _vzero()
  c1 = _vzero()
  d0 = _vzero()
  d1 = _vzero()
  if bits == 4:
    for gi in range(ng):
      j = gi * 64
      x0 = _vld(xb, j)
      x1 = _vld(xb, j + 16)
      x2 = _vld(xb, j + 32)
      x3 = _vld(xb, j + 48)
      pb = po + gi * 32
      a0, a1 = _q4g64_group(pk, pb, sc[so + gi], x0, x1, x2, x3, a0, a1)
      b0, b1 = _q4g64_group(pk, pb + kb, sc[so + ng + gi], x0, x1, x2, x3, b0, b1)
      c0, c1 = _q4g64_group(pk, pb + 2 * kb, sc[so + 2 * ng + gi], x0, x1, x2, x3, c0, c1)
      d0, d1 = _q4g64_group(pk, pb + 3 * kb, sc[so + 3 * ng + gi], x0, x1, x2, x3, d0, d1)
  else:
    for gi in range(ng):
      sa = _vsplat(_bf16(sc[so + gi]))
      sb = _vsplat(_bf16(sc[so + ng + gi]))
      s_c = _vsplat(_bf16(sc[so + 2 * ng + gi]))
      sd = _vsplat(_bf16(sc[so + 3 * ng + gi]))
      for k in range(0, g, 2 * LANES):
        j = gi * g + k
        x0 = _vld(xb, j)
        x1 = _vld(xb, j + LANES)
        a0, a1 = _q8_chunks(pk, po + j, sa, x0, x1, a0, a1)
        b0, b1 = _q8_chunks(pk, po + kb + j, sb, x0, x1, b0, b1)
        c0, c1 = _q8_chunks(pk, po + 2 * kb + j, s_c, x0, x1, c0, c1)
        d0, d1 = _q8_chunks(pk, po + 3 * kb + j, sd, x0, x1, d0, d1)
  return (_vhsum(_vadd(a0, a1)), _vhsum(_vadd(b0, b1)), _vhsum(_vadd(c0, c1)),
          _vhsum(_vadd(d0, d1)))


@njit(**_JIT)
def _put4(yb, r, ys):
  """yb[r : r + 4] = the four row results `ys` of a four-row decode loop."""
  yb[r] = ys[0]
  yb[r + 1] = ys[1]
  yb[r + 2] = ys[2]
  yb[r + 3] = ys[3]


@njit(**_JIT)
def _fused_rows(xb, pk, sc, row0, r_lo, r_hi, kb, ng, g, bits, yb):
  """Decode path (one token row xb[:Kq]): yb[r] for output rows [r_lo, r_hi)."""
  r = r_lo
  if (bits == 4 and g == 64) or (bits == 8 and g % (2 * LANES) == 0):
    # four rows at a time (BUILD_NOTES §22: 1.2-1.5x the one-row loop)
    while r + 4 <= r_hi:
      _put4(yb, r, _fused_rows4(xb, pk, (row0 + r) * kb, kb, sc, (row0 + r) * ng, ng, g, bits))
      r += 4
  for rr in range(r, r_hi):
    yb[rr] = _fused_row(xb, 0, pk, (row0 + rr) * kb, sc, (row0 + rr) * ng, ng, g, bits)


@njit(**_JIT)
def _fused4(xb, x0, x1, x2, x3, pk, po, sc, so, g, bits, gi0, gi1, st, s0):
  """Accumulators st[s0 + 32*t :] of tokens t = 0..3 (xb[x0:], ...) += row . x over groups
  [gi0, gi1), the row decoded chunk by chunk in registers (int4 G%64==0, int8 G%32==0)."""
  p0 = _vld(st, s0)
  p1 = _vld(st, s0 + 16)
  q0 = _vld(st, s0 + 32)
  q1 = _vld(st, s0 + 48)
  r0 = _vld(st, s0 + 64)
  r1 = _vld(st, s0 + 80)
  u0 = _vld(st, s0 + 96)
  u1 = _vld(st, s0 + 112)
  if bits == 4 and g == 64:  # the GLM-5 layout, unrolled
    for gi in range(gi0, gi1):
      s = _vsplat(_bf16(sc[so + gi]))
      t = _vtab(s)
      pb = po + gi * 32
      j = gi * 64
      wa = _vq4lo_s(pk, pb, t, s)
      wc = _vq4lo_s(pk, pb + 16, t, s)
      p0 = _vfma(wa, _vld(xb, x0 + j), p0)
      p1 = _vfma(wc, _vld(xb, x0 + j + 16), p1)
      q0 = _vfma(wa, _vld(xb, x1 + j), q0)
      q1 = _vfma(wc, _vld(xb, x1 + j + 16), q1)
      r0 = _vfma(wa, _vld(xb, x2 + j), r0)
      r1 = _vfma(wc, _vld(xb, x2 + j + 16), r1)
      u0 = _vfma(wa, _vld(xb, x3 + j), u0)
      u1 = _vfma(wc, _vld(xb, x3 + j + 16), u1)
      wa = _vq4hi_s(pk, pb, t, s)
      wc = _vq4hi_s(pk, pb + 16, t, s)
      j += 32
      p0 = _vfma(wa, _vld(xb, x0 + j), p0)
      p1 = _vfma(wc, _vld(xb, x0 + j + 16), p1)
      q0 = _vfma(wa, _vld(xb, x1 + j), q0)
      q1 = _vfma(wc, _vld(xb, x1 + j + 16), q1)
      r0 = _vfma(wa, _vld(xb, x2 + j), r0)
      r1 = _vfma(wc, _vld(xb, x2 + j + 16), r1)
      u0 = _vfma(wa, _vld(xb, x3 + j), u0)
      u1 = _vfma(wc, _vld(xb, x3 + j + 16), u1)
  elif bits == 4:
    half = g // 2
    for gi in range(gi0, gi1):
      s = _vsplat(_bf16(sc[so + gi]))
      t = _vtab(s)
      pb = po + gi * half
      for hi in range(2):
        for k in range(0, half, 2 * LANES):
          if hi == 0:
            wa = _vq4lo_s(pk, pb + k, t, s)
            wc = _vq4lo_s(pk, pb + k + LANES, t, s)
          else:
            wa = _vq4hi_s(pk, pb + k, t, s)
            wc = _vq4hi_s(pk, pb + k + LANES, t, s)
          j = gi * g + hi * half + k
          p0 = _vfma(wa, _vld(xb, x0 + j), p0)
          p1 = _vfma(wc, _vld(xb, x0 + j + LANES), p1)
          q0 = _vfma(wa, _vld(xb, x1 + j), q0)
          q1 = _vfma(wc, _vld(xb, x1 + j + LANES), q1)
          r0 = _vfma(wa, _vld(xb, x2 + j), r0)
          r1 = _vfma(wc, _vld(xb, x2 + j + LANES), r1)
          u0 = _vfma(wa, _vld(xb, x3 + j), u0)
          u1 = _vfma(wc, _vld(xb, x3 + j + LANES), u1)
  else:
    for gi in range(gi0, gi1):
      s = _vsplat(_bf16(sc[so + gi]))
      pb = po + gi * g
      for k in range(0, g, 2 * LANES):
        wa = _vmul(_vq8(pk, pb + k), s)
        wc = _vmul(_vq8(pk, pb + k + LANES), s)
        j = gi * g + k
        p0 = _vfma(wa, _vld(xb, x0 + j), p0)
        p1 = _vfma(wc, _vld(xb, x0 + j + LANES), p1)
        q0 = _vfma(wa, _vld(xb, x1 + j), q0)
        q1 = _vfma(wc, _vld(xb, x1 + j + LANES), q1)
        r0 = _vfma(wa, _vld(xb, x2 + j), r0)
        r1 = _vfma(wc, _vld(xb, x2 + j + LANES), r1)
        u0 = _vfma(wa, _vld(xb, x3 + j), u0)
        u1 = _vfma(wc, _vld(xb, x3 + j + LANES), u1)
  _vst(st, s0, p0)
  _vst(st, s0 + 16, p1)
  _vst(st, s0 + 32, q0)
  _vst(st, s0 + 48, q1)
  _vst(st, s0 + 64, r0)
  _vst(st, s0 + 80, r1)
  _vst(st, s0 + 96, u0)
  _vst(st, s0 + 112, u1)


@njit(**_JIT)
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
      yb[t * o + r] = _finish(st, (t // 4) * ts + (t % 4) * 2 * LANES)


@njit(**_JIT)
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
      _decode_row(pk, r * kb, sc, r * ng, ng, g, bits, vec_ok, kq, wbuf, i * kq)
    for t_lo in range(0, n, _TOKEN_TILE):
      nt = min(_TOKEN_TILE, n - t_lo)
      nt4 = nt - nt % 4
      st[:] = 0.0
      for j0 in range(0, kq, _K_BLOCK):
        j1 = min(kq, j0 + _K_BLOCK)
        for t in range(0, nt4, 4):
          xo = (t_lo + t) * kq
          for i in range(0, nr - 1, 2):
            _dot2x4(wbuf, i * kq, (i + 1) * kq, xb, xo, kq, j0, j1, st, i * ss + t * 2 * LANES,
                    ss)
          if nr % 2:
            for tt in range(t, t + 4):
              _dot1(wbuf, (nr - 1) * kq, xb, (t_lo + tt) * kq, j0, j1, st,
                    (nr - 1) * ss + tt * 2 * LANES)
        for tt in range(nt4, nt):
          for i in range(nr):
            _dot1(wbuf, i * kq, xb, (t_lo + tt) * kq, j0, j1, st, i * ss + tt * 2 * LANES)
      for tt in range(nt):
        for i in range(nr):
          yb[(t_lo + tt) * o + r_lo + i] = _finish(st, i * ss + tt * 2 * LANES)
    blk += step


@njit(**_JIT)
def _few_tokens_ok(n, g, bits):
  """Whether n tokens take the few-token path (rows decoded in registers, 4-token tiles)."""
  return n <= _FEW_TOKENS and (g % (4 * LANES) == 0 if bits == 4 else g % (2 * LANES) == 0)


@njit(**_JIT)
def qmatmul_serial(xb, n, kq, pk, sc, row0, o, kb, ng, g, bits, vec_ok, yb):
  """``_qmatmul`` on the calling thread (no parallel region): the same results. For callers
  that parallelize over something else (the dense kernels' heads)."""
  if vec_ok and n == 1:
    _fused_rows(xb, pk, sc, row0, 0, o, kb, ng, g, bits, yb)
  elif _few_tokens_ok(n, g, bits):
    _fused_tiles(xb, n, kq, pk, sc, row0, 0, o, kb, ng, g, bits, yb, o)
  else:
    nblk = (o + _ROW_BLOCK - 1) // _ROW_BLOCK
    _grouped_rows(xb, n, kq, pk, sc, row0, 0, nblk, 1, kb, ng, g, bits, vec_ok, yb, o)


@njit(parallel=True, **_JIT)
def _qmatmul(xb, n, kq, pk, sc, row0, o, kb, ng, g, bits, vec_ok, nthreads, yb):
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


@njit(**_JIT)
def _activate(h, n, inter, ab, kq):
  """ab[t, i] = silu(h[t, i]) * h[t, inter + i]; ab zero beyond inter (row stride kq)."""
  for t in range(n):
    for i in range(inter):
      gv = np.float64(h[t * 2 * inter + i])
      uv = np.float64(h[t * 2 * inter + inter + i])
      ab[t * kq + i] = np.float32(gv / (1.0 + np.exp(-gv)) * uv)
    for i in range(inter, kq):
      ab[t * kq + i] = np.float32(0.0)


@njit(**_JIT)
def _moe(x, gu_pk, gu_sc, dn_pk, dn_sc, bits, g, hidden, inter, vec_ok, nthreads, min_par,
         seg_slot, seg_start, pair_row, pair_out, out):
  """For each segment: rows x[pair_row[seg]] through expert seg_slot -> out[pair_out[seg]].

  A matmul runs in parallel (nthreads) when its weight matrix has >= min_par elements.
  """
  ng_gu = (hidden + g - 1) // g
  ng_dn = (inter + g - 1) // g
  kq_gu = (ng_gu * g + 2 * LANES - 1) // (2 * LANES) * (2 * LANES)
  kq_dn = (ng_dn * g + 2 * LANES - 1) // (2 * LANES) * (2 * LANES)
  per_byte = 2 if bits == 4 else 1
  kb_gu = ng_gu * g // per_byte
  kb_dn = ng_dn * g // per_byte
  th_gu = nthreads if 2 * inter * kq_gu >= min_par else 1
  th_dn = nthreads if hidden * kq_dn >= min_par else 1
  for si in range(seg_slot.shape[0]):
    slot = seg_slot[si]
    s0 = seg_start[si]
    n = seg_start[si + 1] - s0
    xb = np.zeros(n * kq_gu, np.float32)
    for i in range(n):
      xr = pair_row[s0 + i]
      for j in range(hidden):
        xb[i * kq_gu + j] = x[xr, j]
    h = np.empty(n * 2 * inter, np.float32)
    _qmatmul(xb, n, kq_gu, gu_pk, gu_sc, slot * 2 * inter, 2 * inter, kb_gu, ng_gu, g,
             bits, vec_ok, th_gu, h)
    ab = np.empty(n * kq_dn, np.float32)
    _activate(h, n, inter, ab, kq_dn)
    y = np.empty(n * hidden, np.float32)
    _qmatmul(ab, n, kq_dn, dn_pk, dn_sc, slot * hidden, hidden, kb_dn, ng_dn, g, bits,
             vec_ok, th_dn, y)
    for i in range(n):
      orow = pair_out[s0 + i]
      for j in range(hidden):
        out[orow, j] = y[i * hidden + j]


# ---------------------------------------------------------------------------
# Python API
# ---------------------------------------------------------------------------


def _vec_ok(bits: int, group_size: int) -> bool:
  """Whether whole 16-lane chunks of a group share one scale (vector decode)."""
  return (group_size // 2 if bits == 4 else group_size) % LANES == 0


def _readonly(a):
  """A read-only view: inputs always reach numba with one type, whether the caller's array
  was writable or not (jax buffers are read-only), so there is one compiled specialization."""
  a = a.view()
  a.flags.writeable = False
  return a


def _flat_packed(a, name):
  a = np.asarray(a)
  if a.dtype not in (np.uint8, np.int8):
    raise ValueError(f"{name}: expected uint8 (int4) or int8 (int8) packed weights, got {a.dtype}")
  return _readonly(np.ascontiguousarray(a).view(np.uint8).reshape(-1))


def _flat_scales(a, name):
  a = np.asarray(a)
  if a.dtype.name not in ("bfloat16", "uint16", "int16"):
    raise ValueError(f"{name}: expected bf16 (or its uint16 bits), got {a.dtype}")
  return _readonly(np.ascontiguousarray(a).view(np.uint16).reshape(-1))


def _check(bits, group_size, hidden, intermediate, gu_packed, gu_scales, dn_packed,
           dn_scales, lead):
  if bits not in (4, 8):
    raise ValueError(f"bits must be 4 or 8, got {bits}")
  if group_size <= 0 or (bits == 4 and group_size % 2):
    raise ValueError(f"group_size must be positive (even for int4), got {group_size}")
  if hidden <= 0 or intermediate <= 0:
    raise ValueError(f"hidden/intermediate must be positive, got {hidden}, {intermediate}")
  want_dt = np.uint8 if bits == 4 else np.int8
  per = 2 if bits == 4 else 1
  for name, p, s, o, k in (("gate_up", gu_packed, gu_scales, 2 * intermediate, hidden),
                           ("down", dn_packed, dn_scales, hidden, intermediate)):
    ng = -(-k // group_size)
    want_p = (*lead, o, ng * group_size // per)
    want_s = (*lead, o, ng)
    if tuple(np.shape(p)) != want_p or np.asarray(p).dtype != want_dt:
      raise ValueError(f"{name} packed: expected {np.dtype(want_dt).name} {want_p} for int{bits}, "
                       f"G={group_size}, got {np.asarray(p).dtype} {tuple(np.shape(p))}")
    if tuple(np.shape(s)) != want_s:
      raise ValueError(f"{name} scales: expected shape {want_s}, got {tuple(np.shape(s))}")


def _as_x(x, hidden):
  x = np.ascontiguousarray(x, dtype=np.float32)
  if x.ndim != 2 or x.shape[1] != hidden:
    raise ValueError(f"x: expected [n, {hidden}], got shape {x.shape}")
  return x


def _run(x, weights, bits, group_size, hidden, intermediate, seg_slot, seg_start, pair_row,
         pair_out, out):
  gp, gs, dp, ds = weights
  _moe(_readonly(x), _flat_packed(gp, "gu_packed"), _flat_scales(gs, "gu_scales"),
       _flat_packed(dp, "dn_packed"), _flat_scales(ds, "dn_scales"), int(bits), int(group_size),
       int(hidden), int(intermediate), _vec_ok(bits, group_size), numba.get_num_threads(),
       int(PARALLEL_MIN_WEIGHTS), seg_slot, seg_start, pair_row, pair_out, out)


def expert_ffn(x, gu_packed, gu_scales, dn_packed, dn_scales, bits, group_size, hidden,
               intermediate, out=None):
  """One quantized expert applied to n token rows.

  Args:
    x: float32 [n, D] (other float dtypes are converted).
    gu_packed: gate_up packed weights, uint8 [2I, Kp_D/2] (int4) or int8 [2I, Kp_D].
    gu_scales: bf16 (or uint16 bits) [2I, Kp_D/G].
    dn_packed: down packed weights, uint8 [D, Kp_I/2] (int4) or int8 [D, Kp_I].
    dn_scales: bf16 (or uint16 bits) [D, Kp_I/G].
    bits: 4 or 8. group_size: G. hidden: D. intermediate: I.
    out: optional float32 [n, D] C-contiguous array to write into.

  Returns:
    float32 [n, D]: ``down . (silu(gate . x) * (up . x))`` per row (unweighted).
    Each row is bitwise independent of the other rows and of n.
  """
  _check(bits, group_size, hidden, intermediate, gu_packed, gu_scales, dn_packed, dn_scales, ())
  x = _as_x(x, hidden)
  n = x.shape[0]
  if out is None:
    out = np.empty((n, hidden), np.float32)
  elif (out.shape != (n, hidden) or out.dtype != np.float32 or not out.flags.c_contiguous):
    raise ValueError(
        f"out: expected C-contiguous float32 {(n, hidden)}, got {out.dtype} {out.shape}")
  if n == 0:
    return out
  idx = np.arange(n, dtype=np.int64)
  _run(x, (gu_packed, gu_scales, dn_packed, dn_scales), bits, group_size, hidden, intermediate,
       np.zeros(1, np.int64), np.array([0, n], np.int64), idx, idx, out)
  return out


def pool_terms(x, gu_packed, gu_scales, dn_packed, dn_scales, slot_ids, active, bits, group_size,
               hidden, intermediate):
  """Per (token, rank) expert outputs from a slot-stacked pool, grouped by slot.

  Args:
    x: float32 [T, D].
    gu_packed / gu_scales: [S, 2I, Kp_D/2 or Kp_D] / [S, 2I, Kp_D/G] (see expert_ffn).
    dn_packed / dn_scales: [S, D, Kp_I/2 or Kp_I] / [S, D, Kp_I/G].
    slot_ids: int [T, K], the pool slot of each (token, rank) pair.
    active: bool [T, K] or None (all active). Inactive pairs are not computed
      and their slot ids are ignored.
    bits, group_size, hidden, intermediate: as in expert_ffn.

  Returns:
    float32 [T, K, D]: ``terms[t, k] = expert_{slot_ids[t, k]}(x[t])``, exactly
    0 where inactive. Each distinct slot is read once for all its rows; a
    term is bitwise equal to ``expert_ffn`` of that row alone.
  """
  gu_packed, dn_packed = np.asarray(gu_packed), np.asarray(dn_packed)
  if gu_packed.ndim != 3:
    raise ValueError(f"gu_packed: expected [S, 2I, Kb], got shape {gu_packed.shape}")
  s_count = gu_packed.shape[0]
  _check(bits, group_size, hidden, intermediate, gu_packed, gu_scales, dn_packed, dn_scales,
         (s_count,))
  x = _as_x(x, hidden)
  t_count = x.shape[0]
  slot_ids = np.asarray(slot_ids)
  if slot_ids.ndim != 2 or slot_ids.shape[0] != t_count or slot_ids.dtype.kind not in "iu":
    raise ValueError(
        f"slot_ids: expected int [{t_count}, K], got {slot_ids.dtype} {slot_ids.shape}")
  k_count = slot_ids.shape[1]
  flat = slot_ids.reshape(-1).astype(np.int64)
  if active is None:
    pairs = np.arange(flat.size, dtype=np.int64)
  else:
    active = np.asarray(active)
    if active.shape != slot_ids.shape:
      raise ValueError(f"active: expected shape {slot_ids.shape}, got {active.shape}")
    pairs = np.flatnonzero(active.reshape(-1).astype(bool)).astype(np.int64)
  out = np.zeros((t_count * k_count, hidden), np.float32)
  if pairs.size:
    slots = flat[pairs]
    if slots.min() < 0 or slots.max() >= s_count:
      raise ValueError(f"slot_ids: active ids must lie in [0, {s_count}), got "
                       f"[{slots.min()}, {slots.max()}]")
    order = np.argsort(slots, kind="stable")
    pairs, slots = pairs[order], slots[order]
    starts = np.flatnonzero(np.r_[True, slots[1:] != slots[:-1]])
    seg_start = np.r_[starts, slots.size].astype(np.int64)
    _run(x, (gu_packed, gu_scales, dn_packed, dn_scales), bits, group_size, hidden,
         intermediate, slots[starts].astype(np.int64), seg_start, pairs // k_count, pairs, out)
  return out.reshape(t_count, k_count, hidden)


def pool_terms_jax(x, gu_packed, gu_scales, dn_packed, dn_scales, slot_ids, active=None, *, bits,
                   group_size, hidden, intermediate):
  """``pool_terms`` as a JAX op (``jax.pure_callback``), usable inside ``jax.jit``.

  Same arguments as ``pool_terms`` (jax or numpy arrays; bf16 scales as jax
  bf16); returns float32 [T, K, D]. The callback runs on the host, so this is
  for CPU-resident pools.
  """
  import jax
  import jax.numpy as jnp

  t_count, k_count = slot_ids.shape
  result = jax.ShapeDtypeStruct((t_count, k_count, hidden), jnp.float32)
  statics = dict(bits=bits, group_size=group_size, hidden=hidden, intermediate=intermediate)

  def host(x, gp, gs, dp, ds, ids, act):
    return pool_terms(np.asarray(x), np.asarray(gp), np.asarray(gs).view(np.uint16),
                      np.asarray(dp), np.asarray(ds).view(np.uint16), np.asarray(ids),
                      None if act is None else np.asarray(act), **statics)

  if active is None:
    return jax.pure_callback(lambda *a: host(*a, None), result, x, gu_packed, gu_scales,
                             dn_packed, dn_scales, slot_ids)
  return jax.pure_callback(host, result, x, gu_packed, gu_scales, dn_packed, dn_scales,
                           slot_ids, active)
