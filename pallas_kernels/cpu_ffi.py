"""The CPU expert kernel (``pallas_kernels.cpu``) as an XLA custom call.

``pool_terms_xla`` runs inside ``jax.jit`` with zero-copy operands: XLA hands the kernel its
buffers' addresses through the typed FFI (``jax.ffi``), and a numba ``cfunc`` handler reads
them from the call frame (a C struct, see the offsets below) and views them as arrays. numba
is the only compiler here: no C++ extension to build at install time. A ``jax.pure_callback`` of the same
kernel copies every operand, the whole expert pool included, on each call (about 0.4 ms at the
embedded model's size, and ~15 ms per GB of pool), which is why it is not used here.

Operands: meta int32 [8] = (T, K, D, I, bits, G, S, numba threads), x f32 [T, D], gate_up packed
(uint8 view) and scales (uint16 view), down packed and scales, slot ids int32 [T, K], active
uint8 [T, K]. Result: f32 [T, K, D], 0 for inactive pairs. The arithmetic is ``cpu._moe``'s, so
results are bitwise those of ``cpu.pool_terms``.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numba
import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

from pallas_kernels import cpu

# The cached handler links against numba's thread-pool symbols (allocate_sched, ...), which
# exist only once the threading layer is started: start it before the cfunc is loaded.
numba.np.ufunc.parallel._launch_threads()

TARGET = "glmjax_cpu_pool_terms"
_META = 8


@njit(cache=True, nogil=True)
def _pool_terms_core(t, k, hidden, inter, bits, g, nthreads, x, gp, gs, dp, ds, ids, active,
                     out):
  """Sorts the active (token, rank) pairs by slot and runs each slot once (cpu._moe)."""
  n = 0
  for p in range(t * k):
    if active[p]:
      n += 1
  out[:] = 0.0
  if n == 0:
    return
  pairs = np.empty(n, np.int64)
  slots = np.empty(n, np.int64)
  n = 0
  for p in range(t * k):
    if active[p]:
      pairs[n] = p
      slots[n] = ids[p]
      n += 1
  order = np.argsort(slots, kind="mergesort")  # stable: rows of a slot in token order
  pairs = pairs[order]
  slots = slots[order]
  segs = 1
  for i in range(1, n):
    if slots[i] != slots[i - 1]:
      segs += 1
  seg_slot = np.empty(segs, np.int64)
  seg_start = np.empty(segs + 1, np.int64)
  j = 0
  for i in range(n):
    if i == 0 or slots[i] != slots[i - 1]:
      seg_slot[j] = slots[i]
      seg_start[j] = i
      j += 1
  seg_start[segs] = n
  half = g // 2 if bits == 4 else g
  vec_ok = half % cpu.LANES == 0
  cpu._moe(x, gp, gs, dp, ds, bits, g, hidden, inter, vec_ok, nthreads,
           cpu.PARALLEL_MIN_WEIGHTS, seg_slot, seg_start, pairs // k, pairs, out)


# Offsets below follow xla/ffi/api/c_api.h (API 0.x, x86-64/aarch64 LP64): XLA_FFI_CallFrame is
# {size, ext*, api*, ctx*, stage (+pad), args{size, ext*, n, types*, args**},
#  rets{size, ext*, n, types*, rets**}, ...}: args** is word 9, rets** word 14. An
# XLA_FFI_Buffer is {size, ext*, dtype (+pad), data*, rank, dims*}: data is word 3.
_ARGS, _RETS, _DATA = 9, 14, 3
_EXT_METADATA = 1
_API_MAJOR, _API_MINOR = 0, 3


@intrinsic
def _address(typingctx, addr):
  """An int64 address as a void pointer (to view C structs with carray)."""
  def codegen(context, builder, sig, args):
    return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
  return types.voidptr(types.int64), codegen


@intrinsic
def _readonly(typingctx, arr):
  """The same array typed read-only. The kernel's inputs then have the types the Python entry
  points give them (`cpu._readonly`), so the handler and `cpu.pool_terms` share one compiled
  specialization of every kernel function instead of compiling each twice."""
  def codegen(context, builder, sig, args):
    return impl_ret_borrowed(context, builder, sig.return_type, args[0])
  return arr.copy(readonly=True)(arr), codegen


@njit(cache=True)
def _words(addr, n):
  return carray(_address(addr), (n,), np.int64)


@njit(cache=True)
def _buffer_data(buffer_addr):
  """The data pointer of an XLA_FFI_Buffer."""
  return _address(_words(buffer_addr, 6)[_DATA])


@cfunc(types.int64(types.voidptr), cache=True)
def _ffi_handler(frame):
  """XLA_FFI_Error* handler(XLA_FFI_CallFrame*): returns 0 (no error)."""
  cf = carray(frame, (15,), np.int64)
  if cf[1] != 0:  # an extension: XLA asks for the handler's metadata (its API version)
    ext = _words(cf[1], 4)  # {size, type (+pad), next*, metadata*}
    if (ext[1] & 0xFFFFFFFF) == _EXT_METADATA:
      md = carray(_address(ext[3]), (10,), np.int32)  # {size; api_version{size, ext*, major,
      md[6] = _API_MAJOR                               #  minor}; traits}
      md[7] = _API_MINOR
      md[8] = 0
      return 0
  args = _words(cf[_ARGS], 8)
  rets = _words(cf[_RETS], 1)
  meta = carray(_buffer_data(args[0]), (_META,), np.int32)
  t, k, hidden, inter, bits, g, s = (np.int64(meta[0]), np.int64(meta[1]), np.int64(meta[2]),
                                     np.int64(meta[3]), np.int64(meta[4]), np.int64(meta[5]),
                                     np.int64(meta[6]))
  per = 2 if bits == 4 else 1
  ng_d = (hidden + g - 1) // g
  ng_i = (inter + g - 1) // g
  x = carray(_buffer_data(args[1]), (t, hidden), np.float32)
  gp = carray(_buffer_data(args[2]), (s * 2 * inter * ng_d * g // per,), np.uint8)
  gs = carray(_buffer_data(args[3]), (s * 2 * inter * ng_d,), np.uint16)
  dp = carray(_buffer_data(args[4]), (s * hidden * ng_i * g // per,), np.uint8)
  ds = carray(_buffer_data(args[5]), (s * hidden * ng_i,), np.uint16)
  ids = carray(_buffer_data(args[6]), (t * k,), np.int32)
  active = carray(_buffer_data(args[7]), (t * k,), np.uint8)
  out = carray(_buffer_data(rets[0]), (t * k, hidden), np.float32)
  _pool_terms_core(t, k, hidden, inter, bits, g, np.int64(meta[7]), _readonly(x),
                   _readonly(gp), _readonly(gs), _readonly(dp), _readonly(ds), ids, active, out)
  return 0


_registered = False
_lock = threading.Lock()


def _register() -> None:
  global _registered
  with _lock:
    if not _registered:
      jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(_ffi_handler.ctypes), platform="cpu")
      _registered = True


def pool_terms_xla(x, gu_packed, gu_scales, dn_packed, dn_scales, slot_ids, active=None, *, bits,
                   group_size, hidden, intermediate):
  """``cpu.pool_terms`` as an XLA custom call (CPU backend), usable inside ``jax.jit``.

  Shapes as in ``cpu.pool_terms``: pool leaves with a leading slot axis ``[S, ...]``; returns
  float32 [T, K, D]. Slot ids of active pairs must lie in [0, S) (not checked on this path:
  callers route into their own pools).
  """
  _register()
  t, k = slot_ids.shape
  s = gu_packed.shape[0]
  # numba's thread count is read here (a call from inside the kernel would keep numba from
  # caching the compiled handler: ~6 s at every process start).
  meta = jnp.asarray([t, k, hidden, intermediate, bits, group_size, s, numba.get_num_threads()],
                     jnp.int32)
  if active is None:
    active = jnp.ones((t, k), jnp.uint8)
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((t, k, hidden), jnp.float32))
  # The pool goes in as it is (bf16 scales, int8 or uint8 codes): the handler reads raw bytes.
  # A bitcast to uint16/uint8 here would be a copy of the whole pool in every call.
  return call(meta, jnp.asarray(x, jnp.float32), gu_packed, gu_scales, dn_packed, dn_scales,
              jnp.asarray(slot_ids, jnp.int32), jnp.asarray(active).astype(jnp.uint8))
