"""The CPU expert kernel (``pallas_kernels.cpu``) as an XLA custom call, checked before use.

``pool_terms_xla`` runs inside ``jax.jit`` with zero-copy operands: XLA hands the kernel its
buffers' addresses through the typed FFI (``jax.ffi``), and a numba ``cfunc`` handler reads
them from the call frame (a C struct, see ``FrameLayout``) and views them as arrays. numba
is the only compiler here: no C++ extension to build at install time. A ``jax.pure_callback`` of
the same kernel (``cpu.pool_terms_jax``) copies every operand, the whole expert pool included, on
each call (about 0.4 ms at the embedded model's size, and ~15 ms per GB of pool), which is why
it is only the fallback.

Safety. The handler knows the call frame only as word offsets into XLA's C structs, which a
jaxlib release may change. So:

* At first use (``backend()``), ``self_test`` checks that jaxlib's FFI API version
  (``XLA_FFI_API_MAJOR/MINOR`` in the ``c_api.h`` that ``jax.ffi.include_dir()`` ships) is one
  the layout was checked against, then runs the custom call and the direct kernel
  (``cpu.pool_terms``) on small fresh random problems (int4 and int8) and compares them bit for
  bit. On a mismatch, an error, or an unknown API version every later call takes the
  ``jax.pure_callback`` path, after a ``RuntimeWarning`` naming the reason: never silently.
* The handler reads no pointer before the frame's self-described sizes and counts (struct
  sizes, 8 arguments, 1 result, each buffer's rank) match the layout; otherwise it computes
  nothing (and fills the result with NaN where the result can still be found), which the
  self-test sees as a mismatch.
* numba's thread pool is started through its public ``numba.get_num_threads()`` (the cached
  handler links against the pool's symbols), inside the checked first use.

Operands: meta int32 [8] = (T, K, D, I, bits, G, S, numba threads), x f32 [T, D], gate_up packed
(uint8 view) and scales (uint16 view), down packed and scales, slot ids int32 [T, K], active
uint8 [T, K]. Result: f32 [T, K, D], 0 for inactive pairs. The arithmetic is ``cpu._moe``'s, so
results are bitwise those of ``cpu.pool_terms`` (and of the fallback).
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numba
import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

from pallas_kernels import cpu

TARGET = "glmjax_cpu_pool_terms"
_META = 8


class FrameLayout(NamedTuple):
  """Word (8-byte) offsets into XLA's FFI structs, from xla/ffi/api/c_api.h (LP64: x86-64,
  aarch64). XLA_FFI_CallFrame is {size, ext*, api*, ctx*, stage (+pad), args, rets, attrs,
  future*}; XLA_FFI_Args and XLA_FFI_Rets are {size, ext*, n, types*, pointers**} (40 bytes);
  an XLA_FFI_Buffer is {size, ext*, dtype (+pad), data*, rank, dims*} (48 bytes)."""
  args: int = 5  # where XLA_FFI_Args starts in the call frame
  rets: int = 10  # where XLA_FFI_Rets starts in the call frame
  buffer_data: int = 3  # the data pointer in an XLA_FFI_Buffer
  buffer_rank: int = 4
  buffer_dims: int = 5


FRAME_LAYOUT = FrameLayout()
# XLA FFI API versions (major, minor) FRAME_LAYOUT was checked against: jax/jaxlib 0.10.2.
TESTED_API_VERSIONS = frozenset({(0, 3)})
_API_MAJOR, _API_MINOR = 0, 3  # the version the handler declares to XLA
_EXT_METADATA = 1
_LIST_BYTES, _BUFFER_BYTES = 40, 48  # struct sizes of XLA_FFI_Args/Rets and XLA_FFI_Buffer
_ARG_RANKS = (1, 2, 3, 3, 3, 3, 2, 2)  # meta, x, gu packed/scales, dn packed/scales, ids, active
_OUT_RANK = 3
_LOW_ADDRESS = 1 << 16  # no valid data pointer lies below Linux's mmap_min_addr


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
    # Imported here: a numba without it fails the handler's build, inside the self-test.
    from numba.core.imputils import impl_ret_borrowed
    return impl_ret_borrowed(context, builder, sig.return_type, args[0])
  return arr.copy(readonly=True)(arr), codegen


@njit(cache=True)
def _words(addr, n):
  return carray(_address(addr), (n,), np.int64)


@njit(cache=True)
def _list_ok(words, at, n):
  """Whether an XLA_FFI_Args/Rets at word `at` holds `n` entries and a pointer array."""
  return words[at] == _LIST_BYTES and words[at + 2] == n and words[at + 4] != 0


@njit(cache=True)
def _buffer_ok(buffer_addr, rank, data_at, rank_at):
  """Whether an XLA_FFI_Buffer pointer looks like one of `rank` dimensions with data."""
  if buffer_addr < _LOW_ADDRESS:
    return False
  b = _words(buffer_addr, 6)
  return b[0] == _BUFFER_BYTES and b[rank_at] == rank and b[data_at] >= _LOW_ADDRESS


@njit(cache=True)
def _args_ok(args, data_at, rank_at):
  for i in range(len(_ARG_RANKS)):
    if not _buffer_ok(args[i], _ARG_RANKS[i], data_at, rank_at):
      return False
  return True


@njit(cache=True)
def _data(buffer_addr, data_at):
  """The data pointer of an XLA_FFI_Buffer."""
  return _address(_words(buffer_addr, 6)[data_at])


@njit(cache=True)
def answered_metadata(ext_addr):
  """Whether the call frame's extension `ext_addr` (0: none) is XLA's request for the
  handler's metadata, answered here with the API version the handler declares."""
  if ext_addr == 0:
    return False
  ext = _words(ext_addr, 4)  # {size, type (+pad), next*, metadata*}
  if (ext[1] & 0xFFFFFFFF) != _EXT_METADATA:
    return False
  md = carray(_address(ext[3]), (10,), np.int32)  # {size; api_version{size, ext*, major,
  md[6] = _API_MAJOR                               #  minor}; traits}
  md[7] = _API_MINOR
  md[8] = 0
  return True


def _handler_for(args_at, rets_at, data_at, rank_at, dims_at):
  """The handler's Python body for one frame layout (numba caches one build per layout)."""

  def handler(frame):
    """XLA_FFI_Error* handler(XLA_FFI_CallFrame*): returns 0 (no error)."""
    cf = carray(frame, (rets_at + 5,), np.int64)
    if answered_metadata(cf[1]):
      return 0
    if (cf[0] < (rets_at + 5) * 8 or not _list_ok(cf, rets_at, 1)
        or not _buffer_ok(_words(cf[rets_at + 4], 1)[0], _OUT_RANK, data_at, rank_at)):
      return 0  # no result to be found: the self-test sees whatever the buffer held
    ret = _words(cf[rets_at + 4], 1)[0]
    if not _list_ok(cf, args_at, 8) or not _args_ok(_words(cf[args_at + 4], 8), data_at,
                                                    rank_at):
      dims = _words(_words(ret, 6)[dims_at], _OUT_RANK)
      carray(_data(ret, data_at), (dims[0] * dims[1] * dims[2],), np.float32)[:] = np.nan
      return 0
    args = _words(cf[args_at + 4], 8)
    meta = carray(_data(args[0], data_at), (_META,), np.int32)
    t, k, hidden, inter, bits, g, s = (np.int64(meta[0]), np.int64(meta[1]), np.int64(meta[2]),
                                       np.int64(meta[3]), np.int64(meta[4]), np.int64(meta[5]),
                                       np.int64(meta[6]))
    per = 2 if bits == 4 else 1
    ng_d = (hidden + g - 1) // g
    ng_i = (inter + g - 1) // g
    x = carray(_data(args[1], data_at), (t, hidden), np.float32)
    gp = carray(_data(args[2], data_at), (s * 2 * inter * ng_d * g // per,), np.uint8)
    gs = carray(_data(args[3], data_at), (s * 2 * inter * ng_d,), np.uint16)
    dp = carray(_data(args[4], data_at), (s * hidden * ng_i * g // per,), np.uint8)
    ds = carray(_data(args[5], data_at), (s * hidden * ng_i,), np.uint16)
    ids = carray(_data(args[6], data_at), (t * k,), np.int32)
    active = carray(_data(args[7], data_at), (t * k,), np.uint8)
    out = carray(_data(ret, data_at), (t * k, hidden), np.float32)
    _pool_terms_core(t, k, hidden, inter, bits, g, np.int64(meta[7]), _readonly(x),
                     _readonly(gp), _readonly(gs), _readonly(dp), _readonly(ds), ids, active,
                     out)
    return 0

  return handler


_lock = threading.RLock()
_handlers: dict = {}  # target name -> compiled cfunc (kept alive: XLA holds its address)
_backend: str | None = None  # "ffi" or "callback", decided at first use
_ffi_target: str | None = None  # the target that passed the self-test


def target_name(layout: FrameLayout) -> str:
  """The custom-call target registered for a frame layout (one handler build per layout)."""
  return TARGET + "_" + "_".join(str(w) for w in layout)


def _register(layout: FrameLayout) -> str:
  target = target_name(layout)
  with _lock:
    if target not in _handlers:
      # Starts numba's thread pool (public API): the cached handler links against its symbols
      # (allocate_sched, ...), which exist only once the threading layer runs.
      numba.get_num_threads()
      handler = cfunc(types.int64(types.voidptr), cache=True)(_handler_for(*layout))
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler.ctypes), platform="cpu")
      _handlers[target] = handler
  return target


def ffi_api_version() -> tuple[int, int] | None:
  """(major, minor) of the XLA FFI C API in the c_api.h jaxlib ships; None if unreadable."""
  path = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
  try:
    with open(path, encoding="utf-8") as f:
      found = dict(re.findall(r"#define XLA_FFI_API_(MAJOR|MINOR) (\d+)", f.read()))
  except OSError:
    return None
  if set(found) != {"MAJOR", "MINOR"}:
    return None
  return int(found["MAJOR"]), int(found["MINOR"])


def _self_test_problems():
  """Small pools with fresh random contents (a stale result buffer cannot match by chance):
  (x, pool leaves, slot ids, active, statics) for int4 and int8, some pairs inactive."""
  rng = np.random.default_rng()
  t, k, s, hidden, inter = 5, 2, 3, 40, 24
  for bits, g in ((4, 32), (8, 20)):
    leaves = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
      ng = -(-cols // g)
      width = ng * g // 2 if bits == 4 else ng * g
      packed = rng.integers(0, 256, (s, rows, width), dtype=np.uint8)
      scales = (rng.uniform(0.5, 1.5, (s, rows, ng)) / (8 * np.sqrt(cols))).astype(jnp.bfloat16)
      leaves += [packed if bits == 4 else packed.view(np.int8), scales]
    x = rng.standard_normal((t, hidden)).astype(np.float32)
    ids = rng.integers(0, s, (t, k)).astype(np.int32)
    active = rng.random((t, k)) < 0.7
    active[0] = True
    yield x, leaves, ids, active, dict(bits=bits, group_size=g, hidden=hidden,
                                       intermediate=inter)


def self_test(layout: FrameLayout | None = None) -> str | None:
  """Runs the custom call built for `layout` (default ``FRAME_LAYOUT``) against the direct
  kernel ``cpu.pool_terms`` on small problems. Returns None when every value agrees bit for
  bit, else the reason: an unknown FFI API version, a mismatch, or the error raised."""
  layout = FRAME_LAYOUT if layout is None else layout
  version = ffi_api_version()
  if version not in TESTED_API_VERSIONS:
    return (f"jaxlib's XLA FFI API version is {version}; the frame layout was checked against "
            f"{sorted(TESTED_API_VERSIONS)}")
  try:
    target = _register(layout)
    for x, leaves, ids, active, statics in _self_test_problems():
      want = cpu.pool_terms(x, *leaves, ids, active, **statics)
      # Evaluated now even when the first use is inside a jit trace.
      with jax.ensure_compile_time_eval():
        got = np.asarray(jax.jit(lambda *a, st=statics: _ffi_terms(target, *a, **st))(
            x, *leaves, ids, active))
      if not np.array_equal(got, want):
        bad = int(np.sum(~(got == want)))
        return (f"int{statics['bits']}: {bad} of {want.size} values differ from "
                "pallas_kernels.cpu.pool_terms")
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {e}"
  return None


def backend() -> str:
  """"ffi" (the custom call) or "callback" (``jax.pure_callback``), decided once per process
  by ``self_test`` at first use; choosing "callback" issues a RuntimeWarning with the reason."""
  global _backend, _ffi_target
  with _lock:
    if _backend is None:
      layout = FRAME_LAYOUT
      reason = self_test(layout)
      if reason is not None:
        warnings.warn(f"pallas_kernels.cpu_ffi: the XLA custom call failed its self-test "
                      f"({reason}); falling back to jax.pure_callback, which copies every "
                      "operand, the whole expert pool included, on each call", RuntimeWarning,
                      stacklevel=3)
      _backend = "ffi" if reason is None else "callback"
      _ffi_target = target_name(layout) if reason is None else None
    return _backend


def _ffi_terms(target, x, gu_packed, gu_scales, dn_packed, dn_scales, slot_ids, active, *,
               bits, group_size, hidden, intermediate):
  t, k = slot_ids.shape
  s = gu_packed.shape[0]
  # numba's thread count is read here (a call from inside the kernel would keep numba from
  # caching the compiled handler: ~6 s at every process start).
  meta = jnp.asarray([t, k, hidden, intermediate, bits, group_size, s, numba.get_num_threads()],
                     jnp.int32)
  if active is None:
    active = jnp.ones((t, k), jnp.uint8)
  call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((t, k, hidden), jnp.float32))
  # The pool goes in as it is (bf16 scales, int8 or uint8 codes): the handler reads raw bytes.
  # A bitcast to uint16/uint8 here would be a copy of the whole pool in every call.
  return call(meta, jnp.asarray(x, jnp.float32), gu_packed, gu_scales, dn_packed, dn_scales,
              jnp.asarray(slot_ids, jnp.int32), jnp.asarray(active).astype(jnp.uint8))


def pool_terms_xla(x, gu_packed, gu_scales, dn_packed, dn_scales, slot_ids, active=None, *, bits,
                   group_size, hidden, intermediate):
  """``cpu.pool_terms`` as an XLA custom call (CPU backend), usable inside ``jax.jit``; the
  ``jax.pure_callback`` path (same bits) when the custom call failed its self-test.

  Shapes as in ``cpu.pool_terms``: pool leaves with a leading slot axis ``[S, ...]``; returns
  float32 [T, K, D]. Slot ids of active pairs must lie in [0, S) (not checked on this path:
  callers route into their own pools).
  """
  statics = dict(bits=bits, group_size=group_size, hidden=hidden, intermediate=intermediate)
  args = (x, gu_packed, gu_scales, dn_packed, dn_scales, slot_ids, active)
  if backend() == "callback":
    return cpu.pool_terms_jax(*args, **statics)
  return _ffi_terms(_ffi_target, *args, **statics)
