"""The CPU expert kernel (``pallas_kernels.cpu``) as an XLA custom call, checked before use.

``pool_terms_xla`` runs inside ``jax.jit`` with zero-copy operands: a numba ``cfunc`` handler
reads XLA's call frame and runs the expert kernel on the buffers in place (``ffi_common``, which
also holds the first-use self-test and the fallback). The fallback, after a failed self-test, is
``cpu.pool_terms_jax`` (a ``jax.pure_callback``): it copies every operand, the whole expert pool
included, on each call (about 0.4 ms at the embedded model's size, and ~15 ms per GB of pool).
The self-test compares the custom call with the direct kernel (``cpu.pool_terms``) on small
fresh random problems (int4 and int8, some pairs inactive).

Operands: meta int32 [8] = (T, K, D, I, bits, G, S, numba threads), x f32 [T, D], gate_up packed
(uint8 view) and scales (uint16 view), down packed and scales, slot ids int32 [T, K], active
uint8 [T, K]. Result: f32 [T, K, D], 0 for inactive pairs. The arithmetic is
``cpu.moe_core``'s, so results are bitwise those of ``cpu.pool_terms`` (and of the fallback).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numba
import numpy as np
from numba import carray, njit

from pallas_kernels import cpu, cpu_rows
from pallas_kernels.cpu_vec import LANES
from pallas_kernels.ffi_common import (Case, CheckedCall, answered_metadata, arg_buffers, data,
                                       poison, readonly, result_buffer)

TARGET = "glmjax_cpu_pool_terms"
_META = 8
_ARG_RANKS = (1, 2, 3, 3, 3, 3, 2, 2)  # meta, x, gu packed/scales, dn packed/scales, ids, active
_OUT_RANK = 3


@njit(cache=True, nogil=True)
def _pool_terms_core(t, k, hidden, inter, bits, g, nthreads, x, gp, gs, dp, ds, ids, active,
                     out):
  """Sorts the active (token, rank) pairs by slot and runs each slot once (cpu.moe_core)."""
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
  vec_ok = half % LANES == 0
  cpu.moe_core(x, gp, gs, dp, ds, bits, g, hidden, inter, vec_ok, nthreads,
               cpu_rows.PARALLEL_MIN_WEIGHTS, seg_slot, seg_start, pairs // k, pairs, out)


def _handler_for(args_at, rets_at, data_at, rank_at, dims_at):
  """The handler's Python body for one frame layout (numba caches one build per layout)."""

  def handler(frame):
    """XLA_FFI_Error* handler(XLA_FFI_CallFrame*): returns 0 (no error)."""
    cf = carray(frame, (rets_at + 5,), np.int64)
    if answered_metadata(cf[1]):
      return 0
    ret = result_buffer(cf, rets_at, _OUT_RANK, data_at, rank_at)
    if ret == 0:
      return 0  # no result to be found: the self-test sees whatever the buffer held
    args = arg_buffers(cf, args_at, _ARG_RANKS, data_at, rank_at)
    if args.size == 0:
      poison(ret, data_at, dims_at, _OUT_RANK)
      return 0
    meta = carray(data(args[0], data_at), (_META,), np.int32)
    t, k, hidden, inter, bits, g, s = (np.int64(meta[0]), np.int64(meta[1]), np.int64(meta[2]),
                                       np.int64(meta[3]), np.int64(meta[4]), np.int64(meta[5]),
                                       np.int64(meta[6]))
    per = 2 if bits == 4 else 1
    ng_d = (hidden + g - 1) // g
    ng_i = (inter + g - 1) // g
    x = carray(data(args[1], data_at), (t, hidden), np.float32)
    gp = carray(data(args[2], data_at), (s * 2 * inter * ng_d * g // per,), np.uint8)
    gs = carray(data(args[3], data_at), (s * 2 * inter * ng_d,), np.uint16)
    dp = carray(data(args[4], data_at), (s * hidden * ng_i * g // per,), np.uint8)
    ds = carray(data(args[5], data_at), (s * hidden * ng_i,), np.uint16)
    ids = carray(data(args[6], data_at), (t * k,), np.int32)
    active = carray(data(args[7], data_at), (t * k,), np.uint8)
    out = carray(data(ret, data_at), (t * k, hidden), np.float32)
    _pool_terms_core(t, k, hidden, inter, bits, g, np.int64(meta[7]), readonly(x),
                     readonly(gp), readonly(gs), readonly(dp), readonly(ds), ids, active, out)
    return 0

  return handler


def _self_test_cases():
  """Small pools with fresh random contents, int4 and int8, some pairs inactive, each against
  ``cpu.pool_terms``."""
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
    statics = dict(bits=bits, group_size=g, hidden=hidden, intermediate=inter)
    yield Case(_ffi_terms, (x, *leaves, ids, active), statics,
               cpu.pool_terms(x, *leaves, ids, active, **statics), f"int{bits}")


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


CALL = CheckedCall(TARGET, _handler_for, _self_test_cases,
                   reference="pallas_kernels.cpu.pool_terms", owner=__name__,
                   copies="every operand, the whole expert pool included")
self_test, backend = CALL.self_test, CALL.backend  # the first-use check (conftest warms it)


def pool_terms_xla(x, gu_packed, gu_scales, dn_packed, dn_scales, slot_ids, active=None, *, bits,
                   group_size, hidden, intermediate):
  """``cpu.pool_terms`` as an XLA custom call (CPU backend), usable inside ``jax.jit``; the
  ``jax.pure_callback`` path (same bits) when the custom call failed its self-test.

  Shapes as in ``cpu.pool_terms``: pool leaves with a leading slot axis ``[S, ...]``; returns
  float32 [T, K, D]. Slot ids of active pairs must lie in [0, S) (not checked on this path:
  callers route into their own pools).
  """
  return CALL.call(_ffi_terms, cpu.pool_terms_jax, x, gu_packed, gu_scales, dn_packed,
                   dn_scales, slot_ids, active, bits=bits, group_size=group_size, hidden=hidden,
                   intermediate=intermediate)
