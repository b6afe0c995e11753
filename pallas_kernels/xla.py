"""Pure-JAX grouped MoE: the XLA fallback and the shared combine step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import dataclasses


def combine_in_order(terms, weights):
  """``sum_k weights[r, k] * terms[r, k]`` accumulated strictly for k = 0..K-1.

  terms [R, K, D] f32, weights [R, K] -> [R, D] f32. Written as an explicit
  chain (not a reduction) so the summation order is fixed and every backend
  and every slot assignment adds the same terms in the same order.
  """
  w = weights.astype(jnp.float32)
  out = terms[:, 0] * w[:, 0, None]
  for k in range(1, terms.shape[1]):
    out = out + terms[:, k] * w[:, k, None]
  return out


def unpack_int4(packed, group_size: int):
  """uint8 ``[..., Kp/2]`` -> int8 ``[..., Kp]``: in each group of G features byte j holds
  q[j] + 8 in its low nibble and q[j + G/2] + 8 in its high nibble (jittable)."""
  half = group_size // 2
  if group_size <= 0 or group_size % 2 or packed.shape[-1] % half:
    raise ValueError(f"packed: last dim {packed.shape[-1]} is not a multiple of group_size/2 "
                     f"(group_size {group_size})")
  p = jnp.asarray(packed, dtype=jnp.uint8)
  p = p.reshape(*p.shape[:-1], p.shape[-1] // half, 1, half)
  lo = (p & 0xF).astype(jnp.int8) - 8
  hi = (p >> 4).astype(jnp.int8) - 8
  q = jnp.concatenate([lo, hi], axis=-2)  # [..., Kp/G, 2, G/2]
  return q.reshape(*q.shape[:-3], q.shape[-3] * group_size)


def dequantize(q, dtype=jnp.float32):
  """The logical matrix ``[..., O, K]`` of a group-wise quantized matrix ``q`` (any object with
  packed, scales, bits, group_size, in_features; glmjax's QArray), as a jnp array."""
  g = q.group_size
  ints = unpack_int4(q.packed, g) if q.bits == 4 else jnp.asarray(q.packed)  # [..., O, Kp]
  ints = ints.reshape(*ints.shape[:-1], ints.shape[-1] // g, g)
  scales = jnp.asarray(q.scales).astype(jnp.float32)[..., None]
  w = (ints.astype(jnp.float32) * scales).reshape(*ints.shape[:-2], -1)
  return w[..., :q.in_features].astype(dtype)


def take_experts(q, ids):
  """Gathers experts ``ids`` (any int shape) from a slot-stacked quantized matrix."""
  return dataclasses.replace(q, packed=jnp.take(q.packed, ids, axis=0, mode="clip"),
                             scales=jnp.take(q.scales, ids, axis=0, mode="clip"))


def dedupe_slots(slot_ids, bound: int | None = None):
  """Unique slots with a static bound (default ``U = R * K``).

  slot_ids [R, K] -> (uniq [U] int32 ascending, then the largest id repeated
  as padding; n [1] int32 real entries; inv [R, K] index of each id in uniq).
  ``bound`` must be >= the number of distinct ids (e.g. the pool size).
  """
  r, k = slot_ids.shape
  u = r * k if bound is None else min(bound, r * k)
  flat = slot_ids.reshape(-1).astype(jnp.int32)  # [R*K]
  srt = jnp.sort(flat)
  is_new = jnp.concatenate([jnp.ones((1,), bool), srt[1:] != srt[:-1]])
  n = jnp.sum(is_new, dtype=jnp.int32)
  pos = jnp.cumsum(is_new) - 1
  # Duplicate positions write equal values, so the scatter is deterministic.
  uniq = jnp.zeros((u,), jnp.int32).at[pos].set(srt, mode="drop")
  # Padding repeats the last real slot: a repeated block index is not
  # fetched again, and searchsorted still finds the first (real) entry.
  uniq = jnp.where(jnp.arange(u) < n, uniq, uniq[n - 1])
  inv = jnp.searchsorted(uniq, flat, side="left").astype(jnp.int32)
  return uniq, n.reshape(1), inv.reshape(r, k)


# Experts are computed per (row, rank) pair in chunks of this many pairs: every pair's
# arithmetic then has the same shapes whatever the batch, the pool or where an expert's weights
# came from, which is what makes offloaded runs bitwise equal to resident ones.
PAIR_CHUNK = 8


def expert_terms(x, pool, slot_ids, active=None):
  """Per (row, rank) expert outputs ``down_e(silu(gate_e x_r) * up_e x_r)``.

  x [R, D], slot_ids [R, K] -> [R, K, D] f32. Only selected experts are gathered and
  dequantized. Pairs where ``active`` [R, K] is False yield 0 (computed elsewhere).
  """
  hp = lax.Precision.HIGHEST
  r, k = slot_ids.shape
  n = r * k
  n_pad = -(-n // PAIR_CHUNK) * PAIR_CHUNK
  row = jnp.pad(jnp.repeat(jnp.arange(r), k), (0, n_pad - n))  # [P]
  flat = jnp.pad(slot_ids.reshape(-1), (0, n_pad - n))  # [P]
  xs = x.astype(jnp.float32)[row].reshape(-1, PAIR_CHUNK, x.shape[-1])  # [N, C, D]
  ids = flat.reshape(-1, PAIR_CHUNK)  # [N, C]
  inter = pool.intermediate

  def chunk(args):
    xc, sc = args  # [C, D], [C]
    gu = dequantize(take_experts(pool.gate_up, sc))  # [C, 2I, D]
    h = jnp.einsum("cd,cfd->cf", xc, gu, precision=hp)
    a = jax.nn.silu(h[:, :inter]) * h[:, inter:]  # [C, I]
    dn = dequantize(take_experts(pool.down, sc))  # [C, D, I]
    return jnp.einsum("cf,cdf->cd", a, dn, precision=hp)

  with jax.named_scope("per_pair"):
    ys = lax.map(chunk, (xs, ids)).reshape(n_pad, -1)[:n].reshape(r, k, -1)
  if active is not None:
    ys = jnp.where(active[..., None], ys, 0.0)
  return ys


def grouped_moe_reference(x, pool, slot_ids, weights):
  """XLA grouped MoE with the same contract as ``pallas_kernels.grouped_moe``."""
  with jax.named_scope("moe_reference"):
    terms = expert_terms(x, pool, slot_ids)
    with jax.named_scope("combine"):
      return combine_in_order(terms, weights)
