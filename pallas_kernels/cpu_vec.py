"""A 16-lane float32 vector type for numba, with explicit LLVM vector operations: the building
blocks every numba CPU kernel (``cpu_rows``, ``cpu``, ``cpu_dense``, ``cpu_stream``) computes with.

Why explicit vectors. The kernels promise bitwise results that do not depend on the batch, the
code path or the thread count (``cpu_rows``). numba's own loops leave vectorization, and with it
the order of a reduction, to LLVM; here every operation is an LLVM vector instruction on a
numba type of 16 float32 lanes (``llvm.fma`` for accumulation, no fast-math flags), so LLVM can
neither reassociate nor contract differently per call site, and the bits do not depend on the
SIMD width the host compiles them to. ``vhsum`` adds the 16 lanes by one fixed halving tree
(lanes ``i`` and ``i + 8``, then ``i`` and ``i + 4``, ...).

Decoders: ``vq4lo``/``vq4hi`` (the low/high nibbles of 16 bytes, minus 8), ``vq8`` (16 int8),
``vq4lo_s``/``vq4hi_s`` (the same times a group's scale; with AVX-512 one ``vpermps`` from the
16-entry table ``vtab(s)`` = ``(n - 8) * s``, exact, so the same bits), ``bf16`` (bf16 bits to
float32, exactly). ``JIT`` is the options every kernel function is compiled with
(``cache=True``: numba's on-disk cache, under ``numba_cache``'s lock, installed on import here,
before any kernel module compiles).
"""

from __future__ import annotations

import os

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, models, register_model

from pallas_kernels import numba_cache

numba_cache.install()  # before the first cached compile (see numba_cache: a race between processes)

LANES = 16  # float32 lanes per vector chunk
JIT = dict(cache=True, nogil=True, error_model="numpy")  # every kernel function's njit options


class F32x16(types.Type):

  def __init__(self):
    super().__init__(name="F32x16")


f32x16 = F32x16()
VT = ir.VectorType(ir.FloatType(), LANES)
_I8V = ir.VectorType(ir.IntType(8), LANES)
_I32V = ir.VectorType(ir.IntType(32), LANES)


@register_model(F32x16)
class _F32x16Model(models.PrimitiveModel):

  def __init__(self, dmm, fe_type):
    super().__init__(dmm, fe_type, VT)


def c_array(a, dtype) -> bool:
  return isinstance(a, types.Array) and a.layout == "C" and a.dtype == dtype


# A diagnostic switch, read at import: every vector load and store (the only unchecked
# accesses: numba's own indexing has NUMBA_BOUNDSCHECK) traps (SIGILL, so faulthandler names
# the call) when its elements are not all inside the array. Compiled code is cached by source,
# not by this switch: use it with an empty NUMBA_CACHE_DIR.
VECTOR_BOUNDSCHECK = os.environ.get("PALLAS_KERNELS_VECTOR_BOUNDSCHECK", "") == "1"


def elem_ptr(context, builder, arrty, arr, idx, idxty, elem_ty):
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
def vzero(typingctx):

  def cg(context, builder, sig, args):
    return ir.Constant(VT, None)

  return f32x16(), cg


@intrinsic
def vsplat(typingctx, s):
  if s != types.float32:
    return None

  def cg(context, builder, sig, args):
    v = builder.insert_element(ir.Constant(VT, ir.Undefined), args[0],
                               ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(VT, ir.Undefined),
                                  ir.Constant(_I32V, [0] * LANES))

  return f32x16(s), cg


@intrinsic
def vld(typingctx, arr, idx):
  """16 float32 from flat element `idx` of a C-contiguous float32 array."""
  if not c_array(arr, types.float32):
    return None

  def cg(context, builder, sig, args):
    p = elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], VT)
    return builder.load(p, align=4)

  return f32x16(arr, idx), cg


@intrinsic
def vst(typingctx, arr, idx, v):
  if not c_array(arr, types.float32):
    return None

  def cg(context, builder, sig, args):
    p = elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], VT)
    builder.store(args[2], p, align=4)
    return context.get_dummy_value()

  return types.none(arr, idx, f32x16), cg


def _make_decode(kind):

  def typer(typingctx, arr, idx):
    if not c_array(arr, types.uint8):
      return None

    def cg(context, builder, sig, args):
      p = elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _I8V)
      b = builder.load(p, align=1)
      if kind == "lo":
        b = builder.sub(builder.and_(b, ir.Constant(_I8V, [15] * LANES)),
                        ir.Constant(_I8V, [8] * LANES))
      elif kind == "hi":
        b = builder.sub(builder.lshr(b, ir.Constant(_I8V, [4] * LANES)),
                        ir.Constant(_I8V, [8] * LANES))
      return builder.sitofp(b, VT)  # int8 lanes (signed) -> float32

    return f32x16(arr, idx), cg

  typer.__name__ = f"_vq_{kind}"
  return intrinsic(typer)


vq4lo = _make_decode("lo")  # low nibbles of 16 bytes, minus 8
vq4hi = _make_decode("hi")  # high nibbles of 16 bytes, minus 8
vq8 = _make_decode("i8")  # 16 bytes as int8


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
AVX512 = _host_has_avx512()


@intrinsic
def vtab(typingctx, s):
  """[(n - 8) * s for n in 0..15] (exact), the int4 decode table of one group."""

  def cg(context, builder, sig, args):
    return builder.fmul(ir.Constant(VT, [float(n - 8) for n in range(LANES)]), args[0])

  return f32x16(f32x16), cg


def _make_decode_scaled(kind):

  def typer(typingctx, arr, idx, tab, s):
    if not c_array(arr, types.uint8):
      return None

    def cg(context, builder, sig, args):
      p = elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _I8V)
      b = builder.load(p, align=1)
      if AVX512:
        # Widen the bytes first and shift in 32-bit lanes: the low and high nibbles of the
        # same 16 bytes then share one load and one widening (LLVM merges them), where a
        # byte shift before widening needs two. The widening shuffles bound this loop
        # (DESIGN.md §13: 1.06-1.15x the int4 matvec).
        z = builder.zext(b, _I32V)
        if kind == "hi":
          z = builder.lshr(z, ir.Constant(_I32V, [4] * LANES))
        fnty = ir.FunctionType(VT, [VT, _I32V])
        fn = builder.module.declare_intrinsic("llvm.x86.avx512.permvar.sf.512", fnty=fnty)
        return builder.call(fn, [args[2], z])  # uses the low 4 bits
      if kind == "hi":
        b = builder.lshr(b, ir.Constant(_I8V, [4] * LANES))
      if kind == "lo":
        b = builder.and_(b, ir.Constant(_I8V, [15] * LANES))
      q = builder.sitofp(builder.sub(b, ir.Constant(_I8V, [8] * LANES)), VT)
      return builder.fmul(q, args[3])

    return f32x16(arr, idx, f32x16, f32x16), cg

  typer.__name__ = f"_vq4{kind}_scaled"
  return intrinsic(typer)


vq4lo_s = _make_decode_scaled("lo")  # (low nibble - 8) * s, given vtab(s) and s
vq4hi_s = _make_decode_scaled("hi")  # (high nibble - 8) * s


@intrinsic
def vadd(typingctx, a, b):

  def cg(context, builder, sig, args):
    return builder.fadd(args[0], args[1])

  return f32x16(f32x16, f32x16), cg


@intrinsic
def vmul(typingctx, a, b):

  def cg(context, builder, sig, args):
    return builder.fmul(args[0], args[1])

  return f32x16(f32x16, f32x16), cg


@intrinsic
def vfma(typingctx, a, b, c):
  """a * b + c lane-wise with one rounding (llvm.fma: IEEE fused multiply-add everywhere)."""

  def cg(context, builder, sig, args):
    fn = builder.module.declare_intrinsic(
        f"llvm.fma.v{LANES}f32", fnty=ir.FunctionType(VT, [VT, VT, VT]))
    return builder.call(fn, list(args))

  return f32x16(f32x16, f32x16, f32x16), cg


@intrinsic
def vhsum(typingctx, a):
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

  return types.float32(f32x16), cg


@intrinsic
def bf16(typingctx, u):
  """bf16 bits (uint16) -> float32, exactly."""
  if u != types.uint16:
    return None

  def cg(context, builder, sig, args):
    z = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
    return builder.bitcast(z, ir.FloatType())

  return types.float32(u), cg

