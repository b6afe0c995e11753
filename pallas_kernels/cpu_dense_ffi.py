"""The dense CPU kernels (``pallas_kernels.cpu_dense``) as XLA custom calls, checked before
use, next to the expert one (``cpu_ffi``) and built and checked the same way (``ffi_common``: a
numba ``cfunc`` handler reads XLA's call frame and runs a kernel on the buffers in place, no
copy of the weight).

Two targets, one per weight family, each its own ``ffi_common.CheckedCall`` (``BF16_CALL``,
``QUANT_CALL``) registered at its first use, so that a model compiles only the kernels of the
formats it holds (the handler of a target compiles every kernel it can reach):

* ``glmjax_cpu_dense_bf16``: bfloat16 weights (``cpu_dense.bf16_core``, ``bf16_heads_core``);
* ``glmjax_cpu_dense_quant``: group-wise int4/int8 weights (``cpu_dense.quant_core``,
  ``quant_heads_core``).

``matmul_xla`` and ``heads_xla`` pick the target from ``bits`` (``call_for``). Each target's
first-use self-test compares it with the direct kernels of its own formats
(``cpu_dense.bf16_matmul`` and ``heads_matmul``, or ``qmatmul`` int4 and int8 and
``heads_matmul``) bit for bit on fresh random problems (T = 1 and a few tokens, widths not a
multiple of the group); after a failure every call to that target takes ``jax.pure_callback``
(same bits, but it copies the weight on each call); the other target decides for itself.

Operands (both targets): meta int32 [9] = (T, O, I, bits (4, 8 or ``cpu_dense.BF16``), G, numba
threads, mode, heads, N), x f32, the weight (packed codes [O, Kb], or the bf16 matrix [O, I])
and the scales ([O, Kp/G]; a [1, 1] placeholder for bf16). A handler given a `bits` of the
other family computes nothing (NaN). Mode ``MATMUL``: x [T, I], result f32 [T, O]. Modes
``HEAD_KEYS`` / ``HEAD_VALUES`` (an MLA kv_b of ``heads`` × (N + V) rows, the heads cores):
x [T, heads·N] → [T, heads·I], or x [T, heads·I] → [T, heads·V]. The thread count is read when
the call is traced (as in ``cpu_ffi``: a read inside the handler would keep numba from caching
it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numba
import numpy as np
from numba import carray, njit

from pallas_kernels import cpu_dense, cpu_rows
from pallas_kernels.ffi_common import (Case, CheckedCall, answered_metadata, arg_buffers, data,
                                       host_callback, readonly, result_buffer, result_dims)

_META = 9
# meta[6], what the call computes: x @ Wᵀ, or an MLA kv_b per head (the cpu_dense heads cores).
MATMUL, HEAD_KEYS, HEAD_VALUES = 0, 1, 2
_ARG_RANKS = (1, 2, 2, 2)  # meta, x, weight, scales
_OUT_RANK = 2


@njit(cache=True)
def _columns(mode, o, i_dim, heads, n_dim):
  """(x columns, result columns) of a call, or (-1, -1) for rows that are not heads x (N + V)."""
  if mode == MATMUL:
    return i_dim, o
  if heads <= 0 or o % heads or o // heads <= n_dim:
    return -1, -1
  if mode == HEAD_KEYS:
    return heads * n_dim, heads * i_dim
  return heads * i_dim, o - heads * n_dim


@njit(cache=True)
def _operands(cf, args_at, rets_at, data_at, rank_at, dims_at):
  """(argument buffers, meta, result, x columns) of the call whose frame words are `cf`, the
  sizes checked (``ffi_common``); empty argument buffers when there is nothing to compute (the
  result then holds NaN where it can be found)."""
  nothing = (np.empty(0, np.int64), np.zeros(_META, np.int32), np.empty((0, 0), np.float32),
             np.int64(-1))
  if answered_metadata(cf[1]):
    return nothing
  ret = result_buffer(cf, rets_at, _OUT_RANK, data_at, rank_at)
  if ret == 0:
    return nothing  # no result to be found: the self-test sees whatever the buffer held
  dims = result_dims(ret, dims_at, _OUT_RANK)
  out = carray(data(ret, data_at), (dims[0], dims[1]), np.float32)
  args = arg_buffers(cf, args_at, _ARG_RANKS, data_at, rank_at)
  if args.size == 0:
    out[:] = np.nan
    return nothing
  meta = carray(data(args[0], data_at), (_META,), np.int32)
  x_cols, out_cols = _columns(np.int64(meta[6]), np.int64(meta[1]), np.int64(meta[2]),
                              np.int64(meta[7]), np.int64(meta[8]))
  if x_cols < 0 or meta[0] != dims[0] or out_cols != dims[1]:
    out[:] = np.nan
    return nothing
  return args, meta, out, x_cols


@njit(cache=True)
def _heads_args(meta):
  """(heads, N, V, part, threads) of a kv_b call (modes HEAD_KEYS / HEAD_VALUES)."""
  o, i_dim, heads, n_dim = (np.int64(meta[1]), np.int64(meta[2]), np.int64(meta[7]),
                            np.int64(meta[8]))
  part = cpu_dense.KEYS if np.int64(meta[6]) == HEAD_KEYS else cpu_dense.VALUES
  th = np.int64(meta[5]) if o * i_dim >= cpu_rows.PARALLEL_MIN_WEIGHTS else np.int64(1)
  return heads, n_dim, o // heads - n_dim, part, th


def _bf16_handler_for(args_at, rets_at, data_at, rank_at, dims_at):
  """The bf16 target's handler body for one frame layout (numba caches one build per layout):
  it reaches only ``cpu_dense.bf16_core`` and ``bf16_heads_core``."""

  def handler(frame):
    """XLA_FFI_Error* handler(XLA_FFI_CallFrame*): returns 0 (no error)."""
    cf = carray(frame, (rets_at + 5,), np.int64)
    args, meta, out, x_cols = _operands(cf, args_at, rets_at, data_at, rank_at, dims_at)
    if args.size == 0:
      return 0
    if meta[3] != cpu_dense.BF16:  # a quantized weight: the other target's
      out[:] = np.nan
      return 0
    t, o, i_dim = np.int64(meta[0]), np.int64(meta[1]), np.int64(meta[2])
    x = readonly(carray(data(args[1], data_at), (t, x_cols), np.float32))
    w16 = readonly(carray(data(args[2], data_at), (o * i_dim,), np.uint16))
    if np.int64(meta[6]) == MATMUL:
      cpu_dense.bf16_core(t, o, i_dim, np.int64(meta[5]), cpu_rows.PARALLEL_MIN_WEIGHTS, x, w16,
                          out)
    else:
      heads, n_dim, v_dim, part, th = _heads_args(meta)
      cpu_dense.bf16_heads_core(t, heads, n_dim, v_dim, i_dim, part, th, x, w16, out)
    return 0

  return handler


def _quant_handler_for(args_at, rets_at, data_at, rank_at, dims_at):
  """The int4/int8 target's handler body for one frame layout: it reaches only
  ``cpu_dense.quant_core`` and ``quant_heads_core``."""

  def handler(frame):
    """XLA_FFI_Error* handler(XLA_FFI_CallFrame*): returns 0 (no error)."""
    cf = carray(frame, (rets_at + 5,), np.int64)
    args, meta, out, x_cols = _operands(cf, args_at, rets_at, data_at, rank_at, dims_at)
    if args.size == 0:
      return 0
    t, o, i_dim = np.int64(meta[0]), np.int64(meta[1]), np.int64(meta[2])
    bits, g = np.int64(meta[3]), np.int64(meta[4])
    if (bits != 4 and bits != 8) or g <= 0:  # a bf16 weight (the other target's), or no format
      out[:] = np.nan
      return 0
    x = readonly(carray(data(args[1], data_at), (t, x_cols), np.float32))
    kp = (i_dim + g - 1) // g * g
    pk = readonly(carray(data(args[2], data_at), (o * (kp // 2 if bits == 4 else kp),), np.uint8))
    sc = readonly(carray(data(args[3], data_at), (o * (kp // g),), np.uint16))
    if np.int64(meta[6]) == MATMUL:
      cpu_dense.quant_core(t, o, i_dim, bits, g, np.int64(meta[5]), cpu_rows.PARALLEL_MIN_WEIGHTS,
                           x, pk, sc, out)
    else:
      heads, n_dim, v_dim, part, th = _heads_args(meta)
      cpu_dense.quant_heads_core(t, heads, n_dim, v_dim, i_dim, bits, g, part, th, x, pk, sc, out)
    return 0

  return handler


def _case(run, args, statics, want):
  return Case(run, args, statics, want, f"bits={statics['bits']}, T={args[0].shape[0]}")


def _head_cases(rng, t, w, scales, fmt):
  """A kv_b of 3 heads x (N = 5 + V) rows (the weight's first 36) per head, keys and values."""
  hs = dict(fmt, heads=3, n_dim=5)
  w, scales = w[:36], None if scales is None else scales[:36]
  for part in (cpu_dense.KEYS, cpu_dense.VALUES):
    xh = rng.standard_normal((t, 3 * (5 if part == cpu_dense.KEYS else fmt["in_features"])))
    xh = xh.astype(np.float32)
    yield _case(_ffi_heads, (xh, w, scales), dict(hs, part=part),
                cpu_dense.heads_matmul(xh, w, scales, **hs, part=part))


def _quant_cases():
  """Fresh random problems against the direct kernels: int4 and int8 with I not a multiple of
  G, at T = 1 and T = 6; each as a matmul and as a kv_b per head (keys and values)."""
  rng = np.random.default_rng()
  o, i_dim = 37, 90
  for t in (1, 6):
    x = rng.standard_normal((t, i_dim)).astype(np.float32)
    for bits, g in ((4, 32), (8, 20)):
      ng = -(-i_dim // g)
      packed = rng.integers(0, 256, (o, ng * g // 2 if bits == 4 else ng * g), dtype=np.uint8)
      packed = packed if bits == 4 else packed.view(np.int8)
      scales = (rng.uniform(0.5, 1.5, (o, ng)) / 64).astype(jnp.bfloat16)
      fmt = dict(bits=bits, group_size=g, in_features=i_dim)
      yield _case(_ffi_matmul, (x, packed, scales), fmt,
                  cpu_dense.qmatmul(x, packed, scales, **fmt))
      yield from _head_cases(rng, t, packed, scales, fmt)


def _bf16_cases():
  """Fresh random problems against the direct kernels: bf16 with I not a multiple of 32, at
  T = 1 and T = 6; each as a matmul and as a kv_b per head (keys and values)."""
  rng = np.random.default_rng()
  o, i_dim = 37, 90
  for t in (1, 6):
    x = rng.standard_normal((t, i_dim)).astype(np.float32)
    w = rng.standard_normal((o, i_dim)).astype(jnp.bfloat16)
    fmt = dict(bits=cpu_dense.BF16, group_size=0, in_features=i_dim)
    yield _case(_ffi_matmul, (x, w, None), fmt, cpu_dense.bf16_matmul(x, w))
    yield from _head_cases(rng, t, w, None, fmt)


def _meta(t, o, in_features, bits, group_size, mode=MATMUL, heads=0, n_dim=0):
  return jnp.asarray([t, o, in_features, bits, group_size, numba.get_num_threads(), mode, heads,
                      n_dim], jnp.int32)


def _scales(scales):
  """The scales operand: a bf16 weight has none, so a [1, 1] placeholder goes in."""
  return jnp.zeros((1, 1), jnp.uint16) if scales is None else scales


def _ffi_matmul(target, x, w, scales, *, bits, group_size, in_features):
  t, o = x.shape[0], w.shape[0]
  scales = _scales(scales)
  call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((t, o), jnp.float32),
                          vmap_method="sequential")
  # The weight goes in as stored (bf16, int8 or uint8): the handler reads raw bytes.
  return call(_meta(t, o, in_features, bits, group_size), jnp.asarray(x, jnp.float32), w, scales)


def _heads_cols(o, in_features, heads, n_dim, part):
  return heads * in_features if part == cpu_dense.KEYS else o - heads * n_dim


def _ffi_heads(target, x, packed, scales, *, bits, group_size, in_features, heads, n_dim, part):
  t, o = x.shape[0], packed.shape[0]
  scales = _scales(scales)
  mode = HEAD_KEYS if part == cpu_dense.KEYS else HEAD_VALUES
  call = jax.ffi.ffi_call(
      target, jax.ShapeDtypeStruct((t, _heads_cols(o, in_features, heads, n_dim, part)),
                                   jnp.float32), vmap_method="sequential")
  return call(_meta(t, o, in_features, bits, group_size, mode, heads, n_dim),
              jnp.asarray(x, jnp.float32), packed, scales)


BF16_CALL = CheckedCall("glmjax_cpu_dense_bf16", _bf16_handler_for, _bf16_cases,
                        reference="pallas_kernels.cpu_dense (bf16)",
                        owner=__name__ + " (bfloat16 weights)", copies="the weight")
QUANT_CALL = CheckedCall("glmjax_cpu_dense_quant", _quant_handler_for, _quant_cases,
                         reference="pallas_kernels.cpu_dense (int4/int8)",
                         owner=__name__ + " (int4/int8 weights)", copies="the weight")
CALLS = (BF16_CALL, QUANT_CALL)


def call_for(bits) -> CheckedCall:
  """The target of a weight format: ``BF16_CALL`` for ``cpu_dense.BF16``, else ``QUANT_CALL``."""
  return BF16_CALL if bits == cpu_dense.BF16 else QUANT_CALL


def self_test(layout=None) -> str | None:
  """Both targets' first-use checks (the test suite's warm-up builds both): None when both
  pass, else each failing target's reason."""
  reasons = [(c.name, c.self_test(layout)) for c in CALLS]
  return "; ".join(f"{name}: {r}" for name, r in reasons if r is not None) or None


def _callback_heads(x, packed, scales, **st):
  cols = _heads_cols(packed.shape[0], st["in_features"], st["heads"], st["n_dim"], st["part"])
  result = jax.ShapeDtypeStruct((x.shape[0], cols), jnp.float32)
  return host_callback(cpu_dense.heads_matmul, result, x, packed, scales, **st)


def heads_xla(x, packed, scales, *, bits, group_size, in_features, heads, n_dim, part):
  """``cpu_dense.heads_matmul`` inside ``jax.jit`` (the custom call of the weight's family, or
  ``jax.pure_callback`` after its failed self-test): an MLA kv_b ``[heads (N + V),
  in_features]`` applied per head. x ``[..., heads·N]`` (part KEYS) or ``[..., heads·C]``
  (VALUES); returns float32 ``[..., heads·C]`` or ``[..., heads·V]``. A bfloat16 kv_b:
  `packed` is the matrix, `bits` ``cpu_dense.BF16``, `scales` None."""
  lead = x.shape[:-1]
  x2 = jnp.reshape(x, (-1, x.shape[-1])).astype(jnp.float32)
  y = call_for(bits).call(_ffi_heads, _callback_heads, x2, packed, _scales(scales), bits=bits,
                          group_size=group_size, in_features=in_features, heads=heads,
                          n_dim=n_dim, part=part)
  return jnp.reshape(y, (*lead, y.shape[-1]))


def _callback_matmul(x, w, scales, *, bits, group_size, in_features):
  result = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
  if bits == cpu_dense.BF16:
    return host_callback(cpu_dense.bf16_matmul, result, x, w)
  return host_callback(cpu_dense.qmatmul, result, x, w, scales, bits=bits,
                       group_size=group_size, in_features=in_features)


def matmul_xla(x, w, scales=None, *, bits, group_size=0, in_features):
  """``x [..., I] @ Wᵀ`` on the CPU inside ``jax.jit``: the custom call of the weight's family
  (``call_for(bits)``), or ``jax.pure_callback`` (same bits) when it failed its self-test.

  `w` is the packed codes ``[O, Kb]`` with bf16 `scales` ``[O, Kp/G]`` (bits 4 or 8, group
  `group_size`), or a bfloat16 matrix ``[O, I]`` (bits ``cpu_dense.BF16``, scales None).
  Returns float32 ``[..., O]``.
  """
  lead = x.shape[:-1]
  x2 = jnp.reshape(x, (-1, x.shape[-1])).astype(jnp.float32)  # [T, I]
  y = call_for(bits).call(_ffi_matmul, _callback_matmul, x2, w, scales, bits=bits,
                          group_size=group_size, in_features=in_features)
  return jnp.reshape(y, (*lead, w.shape[0]))
