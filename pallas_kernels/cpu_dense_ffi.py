"""The dense CPU kernels (``pallas_kernels.cpu_dense``) as an XLA custom call, checked before use.

The second custom-call target next to the expert one (``cpu_ffi``), built the same way: a
numba ``cfunc`` handler reads XLA's typed-FFI call frame (``cpu_ffi.FrameLayout``) and runs
``cpu_dense.dense_core`` on the buffers in place (no copy of the weight). The same safety:

* at first use (``backend()``) ``self_test`` checks the FFI API version and compares the
  custom call with the direct kernels (``cpu_dense.qmatmul`` int4 and int8, ``bf16_matmul``)
  bit for bit on fresh random problems (T = 1 and a few tokens, widths not a multiple of the
  group); on a mismatch, an error or an unknown API version every later call takes
  ``jax.pure_callback`` (same bits, but it copies the weight on each call), after a
  ``RuntimeWarning`` with the reason;
* the handler reads no pointer before the frame's sizes, counts and buffer ranks match.

Operands: meta int32 [9] = (T, O, I, bits (4, 8 or ``cpu_dense.BF16``), G, numba threads,
mode, heads, N), x f32, the weight (packed codes [O, Kb], or the bf16 matrix [O, I]) and the
scales ([O, Kp/G]; a [1, 1] placeholder for bf16). Mode ``MATMUL``: x [T, I], result f32
[T, O]. Modes ``HEAD_KEYS`` / ``HEAD_VALUES`` (int4, int8 or bf16, an MLA kv_b of ``heads`` ×
(N + V) rows, ``cpu_dense.heads_core``): x [T, heads·N] → [T, heads·I], or x [T, heads·I] →
[T, heads·V]. The thread count is read when
the call is traced (as in ``cpu_ffi``: a read inside the handler would keep numba from caching
it).
"""

from __future__ import annotations

import threading
import warnings

import jax
import jax.numpy as jnp
import numba
import numpy as np
from numba import carray, cfunc, njit, types

from pallas_kernels import cpu, cpu_dense, cpu_ffi

TARGET = "glmjax_cpu_dense"
_META = 9
# meta[6], what the call computes: x @ Wᵀ, or an MLA kv_b per head (cpu_dense.heads_core).
MATMUL, HEAD_KEYS, HEAD_VALUES = 0, 1, 2
_ARG_RANKS = (1, 2, 2, 2)  # meta, x, weight, scales
_OUT_RANK = 2


@njit(cache=True)
def _args_ok(args, data_at, rank_at):
  for i in range(len(_ARG_RANKS)):
    if not cpu_ffi._buffer_ok(args[i], _ARG_RANKS[i], data_at, rank_at):
      return False
  return True


def _handler_for(args_at, rets_at, data_at, rank_at, dims_at):
  """The handler's Python body for one frame layout (numba caches one build per layout)."""
  words, data, ro = cpu_ffi._words, cpu_ffi._data, cpu_ffi._readonly

  def handler(frame):
    """XLA_FFI_Error* handler(XLA_FFI_CallFrame*): returns 0 (no error)."""
    cf = carray(frame, (rets_at + 5,), np.int64)
    if cpu_ffi.answered_metadata(cf[1]):
      return 0
    if (cf[0] < (rets_at + 5) * 8 or not cpu_ffi._list_ok(cf, rets_at, 1)
        or not cpu_ffi._buffer_ok(words(cf[rets_at + 4], 1)[0], _OUT_RANK, data_at, rank_at)):
      return 0  # no result to be found: the self-test sees whatever the buffer held
    ret = words(cf[rets_at + 4], 1)[0]
    dims = words(words(ret, 6)[dims_at], _OUT_RANK)
    out = carray(data(ret, data_at), (dims[0], dims[1]), np.float32)
    if not cpu_ffi._list_ok(cf, args_at, 4) or not _args_ok(words(cf[args_at + 4], 4), data_at,
                                                            rank_at):
      out[:] = np.nan
      return 0
    args = words(cf[args_at + 4], 4)
    meta = carray(data(args[0], data_at), (_META,), np.int32)
    t, o, i_dim, bits, g = (np.int64(meta[0]), np.int64(meta[1]), np.int64(meta[2]),
                            np.int64(meta[3]), np.int64(meta[4]))
    mode, heads, n_dim = np.int64(meta[6]), np.int64(meta[7]), np.int64(meta[8])
    if mode == MATMUL:
      x_cols, out_cols = i_dim, o
    elif heads <= 0 or o % heads or o // heads <= n_dim:
      out[:] = np.nan
      return 0
    elif mode == HEAD_KEYS:
      x_cols, out_cols = heads * n_dim, heads * i_dim
    else:
      x_cols, out_cols = heads * i_dim, o - heads * n_dim
    if t != dims[0] or out_cols != dims[1]:
      out[:] = np.nan
      return 0
    x = carray(data(args[1], data_at), (t, x_cols), np.float32)
    if bits == cpu_dense.BF16:
      w16 = carray(data(args[2], data_at), (o * i_dim,), np.uint16)
      pk = carray(data(args[3], data_at), (1,), np.uint8)  # unused placeholder
      sc = carray(data(args[3], data_at), (1,), np.uint16)
    else:
      kp = (i_dim + g - 1) // g * g
      pk = carray(data(args[2], data_at), (o * (kp // 2 if bits == 4 else kp),), np.uint8)
      sc = carray(data(args[3], data_at), (o * (kp // g),), np.uint16)
      w16 = sc  # unused placeholder
    if mode != MATMUL:
      part = cpu_dense.KEYS if mode == HEAD_KEYS else cpu_dense.VALUES
      th = np.int64(meta[5]) if o * i_dim >= cpu.PARALLEL_MIN_WEIGHTS else np.int64(1)
      cpu_dense.heads_core(t, heads, n_dim, o // heads - n_dim, i_dim, bits, g, part, th, ro(x),
                           ro(pk), ro(w16), ro(sc), out)
      return 0
    cpu_dense.dense_core(t, o, i_dim, bits, g, np.int64(meta[5]), cpu.PARALLEL_MIN_WEIGHTS,
                         ro(x), ro(pk), ro(w16), ro(sc), out)
    return 0

  return handler


_lock = threading.RLock()
_handlers: dict = {}  # target name -> compiled cfunc (kept alive: XLA holds its address)
_backend: str | None = None  # "ffi" or "callback", decided at first use
_ffi_target: str | None = None


def target_name(layout: cpu_ffi.FrameLayout) -> str:
  """The custom-call target registered for a frame layout."""
  return TARGET + "_" + "_".join(str(w) for w in layout)


def _register(layout: cpu_ffi.FrameLayout) -> str:
  target = target_name(layout)
  with _lock:
    if target not in _handlers:
      numba.get_num_threads()  # starts numba's thread pool (see cpu_ffi._register)
      handler = cfunc(types.int64(types.voidptr), cache=True)(_handler_for(*layout))
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler.ctypes), platform="cpu")
      _handlers[target] = handler
  return target


def _self_test_problems():
  """(x, weight, scales, statics, direct result) with fresh random contents: int4 and int8
  with I not a multiple of G, and bf16 with I not a multiple of 32, at T = 1 and T = 6; each
  as a matmul and as a kv_b per head (keys and values)."""
  rng = np.random.default_rng()
  o, i_dim = 37, 90
  for t in (1, 6):
    x = rng.standard_normal((t, i_dim)).astype(np.float32)
    for bits, g in ((4, 32), (8, 20)):
      ng = -(-i_dim // g)
      packed = rng.integers(0, 256, (o, ng * g // 2 if bits == 4 else ng * g), dtype=np.uint8)
      packed = packed if bits == 4 else packed.view(np.int8)
      scales = (rng.uniform(0.5, 1.5, (o, ng)) / 64).astype(jnp.bfloat16)
      statics = dict(bits=bits, group_size=g, in_features=i_dim)
      yield x, packed, scales, statics, cpu_dense.qmatmul(x, packed, scales, **statics)
      hs = dict(bits=bits, group_size=g, in_features=i_dim, heads=3, n_dim=5)  # 37 - 1 rows
      hp, hsc = packed[:36], scales[:36]
      for part in (cpu_dense.KEYS, cpu_dense.VALUES):
        xh = rng.standard_normal((t, 3 * (5 if part == cpu_dense.KEYS else i_dim)))
        xh = xh.astype(np.float32)
        yield xh, hp, hsc, dict(hs, part=part), cpu_dense.heads_matmul(xh, hp, hsc, **hs,
                                                                       part=part)
    w = rng.standard_normal((o, i_dim)).astype(jnp.bfloat16)
    statics = dict(bits=cpu_dense.BF16, group_size=0, in_features=i_dim)
    yield x, w, None, statics, cpu_dense.bf16_matmul(x, w)
    hs = dict(statics, heads=3, n_dim=5)
    for part in (cpu_dense.KEYS, cpu_dense.VALUES):
      xh = rng.standard_normal((t, 3 * (5 if part == cpu_dense.KEYS else i_dim)))
      xh = xh.astype(np.float32)
      yield xh, w[:36], None, dict(hs, part=part), cpu_dense.heads_matmul(xh, w[:36], None, **hs,
                                                                          part=part)


def self_test(layout: cpu_ffi.FrameLayout | None = None) -> str | None:
  """Runs the custom call built for `layout` (default ``cpu_ffi.FRAME_LAYOUT``) against the
  direct kernels. Returns None when every value agrees bit for bit, else the reason."""
  layout = cpu_ffi.FRAME_LAYOUT if layout is None else layout
  version = cpu_ffi.ffi_api_version()
  if version not in cpu_ffi.TESTED_API_VERSIONS:
    return (f"jaxlib's XLA FFI API version is {version}; the frame layout was checked against "
            f"{sorted(cpu_ffi.TESTED_API_VERSIONS)}")
  try:
    target = _register(layout)
    for x, w, scales, statics, want in _self_test_problems():
      call = _ffi_heads if "part" in statics else _ffi_matmul
      with jax.ensure_compile_time_eval():  # evaluated now even inside a jit trace
        got = np.asarray(jax.jit(lambda a, b, c, st=statics, f=call: f(target, a, b, c, **st))(
            x, w, scales))
      if not np.array_equal(got, want):
        bad = int(np.sum(~(got == want)))
        return (f"bits={statics['bits']}, T={x.shape[0]}: {bad} of {want.size} values differ "
                "from pallas_kernels.cpu_dense")
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {e}"
  return None


def backend() -> str:
  """"ffi" or "callback", decided once per process by ``self_test`` at first use; "callback"
  comes with a RuntimeWarning naming the reason."""
  global _backend, _ffi_target
  with _lock:
    if _backend is None:
      layout = cpu_ffi.FRAME_LAYOUT
      reason = self_test(layout)
      if reason is not None:
        warnings.warn(f"pallas_kernels.cpu_dense_ffi: the XLA custom call failed its self-test "
                      f"({reason}); falling back to jax.pure_callback, which copies the weight "
                      "on each call", RuntimeWarning, stacklevel=3)
      _backend = "ffi" if reason is None else "callback"
      _ffi_target = target_name(layout) if reason is None else None
    return _backend


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


def heads_xla(x, packed, scales, *, bits, group_size, in_features, heads, n_dim, part):
  """``cpu_dense.heads_matmul`` inside ``jax.jit`` (the custom call, or ``jax.pure_callback``
  after a failed self-test): an MLA kv_b ``[heads (N + V), in_features]`` applied per head.
  x ``[..., heads·N]`` (part KEYS) or ``[..., heads·C]`` (VALUES); returns float32
  ``[..., heads·C]`` or ``[..., heads·V]``. A bfloat16 kv_b: `packed` is the matrix, `bits`
  ``cpu_dense.BF16``, `scales` None."""
  scales = _scales(scales)
  lead = x.shape[:-1]
  x2 = jnp.reshape(x, (-1, x.shape[-1])).astype(jnp.float32)
  st = dict(bits=bits, group_size=group_size, in_features=in_features, heads=heads,
            n_dim=n_dim, part=part)
  cols = _heads_cols(packed.shape[0], in_features, heads, n_dim, part)
  if backend() == "callback":
    y = jax.pure_callback(
        lambda a, b, c: cpu_dense.heads_matmul(np.asarray(a), np.asarray(b), np.asarray(c), **st),
        jax.ShapeDtypeStruct((x2.shape[0], cols), jnp.float32), x2, packed, scales,
        vmap_method="sequential")
  else:
    y = _ffi_heads(_ffi_target, x2, packed, scales, **st)
  return jnp.reshape(y, (*lead, cols))


def _callback_matmul(x, w, scales, *, bits, group_size, in_features):
  result = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
  if bits == cpu_dense.BF16:
    return jax.pure_callback(lambda a, b: cpu_dense.bf16_matmul(np.asarray(a), np.asarray(b)),
                             result, x, w, vmap_method="sequential")
  return jax.pure_callback(
      lambda a, b, c: cpu_dense.qmatmul(np.asarray(a), np.asarray(b), np.asarray(c), bits,
                                        group_size, in_features),
      result, x, w, scales, vmap_method="sequential")


def matmul_xla(x, w, scales=None, *, bits, group_size=0, in_features):
  """``x [..., I] @ Wᵀ`` on the CPU inside ``jax.jit``: the custom call, or
  ``jax.pure_callback`` (same bits) when it failed its self-test.

  `w` is the packed codes ``[O, Kb]`` with bf16 `scales` ``[O, Kp/G]`` (bits 4 or 8, group
  `group_size`), or a bfloat16 matrix ``[O, I]`` (bits ``cpu_dense.BF16``, scales None).
  Returns float32 ``[..., O]``.
  """
  lead = x.shape[:-1]
  x2 = jnp.reshape(x, (-1, x.shape[-1])).astype(jnp.float32)  # [T, I]
  statics = dict(bits=bits, group_size=group_size, in_features=in_features)
  if backend() == "callback":
    y = _callback_matmul(x2, w, scales, **statics)
  else:
    y = _ffi_matmul(_ffi_target, x2, w, scales, **statics)
  return jnp.reshape(y, (*lead, w.shape[0]))
