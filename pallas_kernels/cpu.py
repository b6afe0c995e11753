"""Deterministic numba CPU kernels for group-wise int4/int8 MoE experts.

Standalone: takes raw numpy arrays and ints (nothing from ``glmjax``).

An expert is ``gate_up [2I, D]`` (rows ``0..I-1`` gate, ``I..2I-1`` up) and ``down [D, I]``,
each in the group-wise format of ``cpu_rows`` (packed codes, bf16 scales); for a token row
``x [D]`` its output is ``down . (silu(gate . x) * (up . x))``. A pool stacks experts on a
leading slot axis ``[S, ...]``.

The matmuls are ``cpu_rows.qmatmul`` (its arithmetic makes every output row bitwise
independent of the batch, the path and the thread count). The activation is
``float32(silu(float64(g)) * float64(u))`` with ``silu(v) = v / (1 + exp(-v))``.

``pool_terms`` sorts the active (token, rank) pairs by slot and runs each distinct slot once
over all rows that chose it (``moe_core``); inactive pairs are never computed and their terms
are exactly 0.

Compile time: inputs reach numba with one fixed set of types (flat read-only C-contiguous
uint8 weights, uint16 scales, float32 activations, int64 indices), so there is one
specialization, which the custom call's handler (``cpu_ffi``) reuses: it passes the same
read-only types. The first call compiles it (~17 s on 2 cores; the handler then ~10 s more)
unless numba's on-disk cache (``cache=True``, in ``__pycache__`` or ``NUMBA_CACHE_DIR``) holds
it (~0.4 s to load).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit

from pallas_kernels import cpu_rows
from pallas_kernels.cpu_vec import JIT, LANES

__all__ = ["expert_ffn", "pool_terms", "pool_terms_jax", "moe_core", "LANES"]



@njit(**JIT)
def _activate(h, n, inter, ab, kq):
  """ab[t, i] = silu(h[t, i]) * h[t, inter + i]; ab zero beyond inter (row stride kq)."""
  for t in range(n):
    for i in range(inter):
      gv = np.float64(h[t * 2 * inter + i])
      uv = np.float64(h[t * 2 * inter + inter + i])
      ab[t * kq + i] = np.float32(gv / (1.0 + np.exp(-gv)) * uv)
    for i in range(inter, kq):
      ab[t * kq + i] = np.float32(0.0)


@njit(**JIT)
def moe_core(x, gu_pk, gu_sc, dn_pk, dn_sc, bits, g, hidden, inter, vec_ok, nthreads, min_par,
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
    cpu_rows.qmatmul(xb, n, kq_gu, gu_pk, gu_sc, slot * 2 * inter, 2 * inter, kb_gu, ng_gu, g,
                     bits, vec_ok, th_gu, h)
    ab = np.empty(n * kq_dn, np.float32)
    _activate(h, n, inter, ab, kq_dn)
    y = np.empty(n * hidden, np.float32)
    cpu_rows.qmatmul(ab, n, kq_dn, dn_pk, dn_sc, slot * hidden, hidden, kb_dn, ng_dn, g, bits,
                     vec_ok, th_dn, y)
    for i in range(n):
      orow = pair_out[s0 + i]
      for j in range(hidden):
        out[orow, j] = y[i * hidden + j]


# ---------------------------------------------------------------------------
# Python API
# ---------------------------------------------------------------------------


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
  moe_core(cpu_rows.readonly(x), cpu_rows.flat_packed(gp, "gu_packed"),
           cpu_rows.flat_scales(gs, "gu_scales"), cpu_rows.flat_packed(dp, "dn_packed"),
           cpu_rows.flat_scales(ds, "dn_scales"), int(bits), int(group_size), int(hidden),
           int(intermediate), cpu_rows.vec_ok(bits, group_size), numba.get_num_threads(),
           int(cpu_rows.PARALLEL_MIN_WEIGHTS), seg_slot, seg_start, pair_row, pair_out, out)


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
