"""The physical limit of offloaded decoding, and how far a measured run is from it.

A request can go no faster than its compute with every expert resident, nor than the disk can
deliver the fewest bytes any cache policy of the same capacity must read. Belady's MIN over the
run's own live trace gives that fewest: no demand policy misses less, and prefetching moves
reads earlier without making them fewer than MIN's. So

  limit_s_per_token = max(compute_s_per_token, belady_bytes / disk_bandwidth / tokens)

and `ratio` = measured / limit (1.0 is the limit itself).
"""

from __future__ import annotations

from glmjax.errors import InputError
from glmjax.replay.simulate import simulate
from glmjax.replay.trace import Trace


def capacity_experts(tier_state: dict, layers=None) -> int:
  """Experts the engine's tiers hold at once (`Engine.tier_state()`): the host cache's budget in
  whole chunks plus the device slots of `layers` (default: every pooled layer). Belady gets them
  as one shared cache, at least as good as the engine's per-layer pools and host LRU: a lower
  bound on reads."""
  chunk = int(tier_state["chunk_bytes"])
  if chunk <= 0:
    raise InputError(f"tier state has chunk_bytes {chunk}; expected a positive expert size")
  pools = [int(l) for l in tier_state.get("pins") or {}]
  if layers is not None:
    pools = [l for l in pools if l in set(layers)]
  device = int(tier_state.get("slots") or 0) * len(pools)  # slots are per layer
  return int(tier_state["host_bytes"]) // chunk + device


def belady_reads(trace: Trace, capacity: int) -> dict:
  """Belady (MIN) over `trace` with one cache of `capacity` experts: its misses and bytes."""
  r = simulate(trace, "belady", total=int(capacity))
  return {"belady_misses": int(r["misses"]), "belady_bytes": int(r["misses"]) * trace.expert_bytes,
          "requests": int(r["requests"]), "capacity_experts": int(capacity)}


def decode_limit(*, compute_s: float, io_bytes: int, disk_gbs: float, measured_s: float,
                 tokens: int) -> dict:
  """The limit and the ratio for a request of `tokens` generated tokens.

  compute_s: the request's time with every expert resident; io_bytes: the fewest bytes any
  policy must read (`belady_reads`); disk_gbs: measured read bandwidth (GB/s, 1e9 bytes);
  measured_s: the offloaded request's time. All per request; results are per token.
  """
  if tokens <= 0 or disk_gbs <= 0 or compute_s < 0 or measured_s <= 0 or io_bytes < 0:
    raise InputError(f"decode_limit needs tokens > 0, disk_gbs > 0, measured_s > 0 and "
                     f"non-negative compute and bytes; got tokens={tokens}, disk_gbs={disk_gbs}, "
                     f"compute_s={compute_s}, measured_s={measured_s}, io_bytes={io_bytes}")
  compute = compute_s / tokens
  io = io_bytes / (disk_gbs * 1e9) / tokens
  limit = max(compute, io)
  return {"compute_s_per_token": compute, "io_s_per_token": io,
          "limit_s_per_token": limit, "bound": "io" if io >= compute else "compute",
          "measured_s_per_token": measured_s / tokens, "ratio": measured_s / tokens / limit,
          "disk_gbs": disk_gbs}
