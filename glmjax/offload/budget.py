"""Memory budgets of the expert tiers: explicit, or chosen from free memory with a margin.

The budgets cover cached experts only. What must be resident on top of them: the dense weights,
and a transient working set for the current layer's non-pinned experts (their chunk bytes on the
host and one padded device pool), at most `min(E, rows·K)` experts twice over. The stated
margin is max(2 GiB, 10% of total RAM) on the host and max(1 GiB, 5%) on an accelerator, plus
that working set.
"""

from __future__ import annotations

import jax
import psutil

from glmjax.offload.engine import Budgets
from glmjax.errors import InputError

GiB = 1 << 30
MAX_ROWS = 64  # rows (tokens) of one MoE step the working set is sized for


def _host_margin() -> int:
  return max(2 * GiB, psutil.virtual_memory().total // 10)


def _device_free() -> int | None:
  """Free accelerator memory in bytes; None on CPU, where "device" memory is host RAM."""
  dev = jax.devices()[0]
  if dev.platform == "cpu":
    return None
  stats = dev.memory_stats() or {}
  if "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def resolve(device_cache_gb, host_cache_gb, *, dense_bytes: int, chunk_bytes: int,
            n_moe_layers: int, n_experts: int, top_k: int) -> Budgets:
  """Budgets in bytes. None means automatic; 0 disables a tier. Called before the dense
  weights (`dense_bytes`) are allocated: they are part of the plan."""
  total = n_moe_layers * n_experts * chunk_bytes
  working = 2 * min(n_experts, MAX_ROWS * top_k) * chunk_bytes
  avail = psutil.virtual_memory().available - _host_margin()
  free = _device_free()
  per_slot = n_moe_layers * chunk_bytes  # one device slot in every MoE layer

  def gb(x):
    return f"{x / GiB:.3f} GB"

  for name, v in (("device_cache_gb", device_cache_gb), ("host_cache_gb", host_cache_gb)):
    if v is not None and not v >= 0:
      raise InputError(f"{name} must be ≥ 0 (0 disables the tier), got {v}")
  device = None if device_cache_gb is None else int(device_cache_gb * GiB)
  host = None if host_cache_gb is None else int(host_cache_gb * GiB)
  if device is not None and 0 < device < per_slot:
    raise InputError(f"device_cache_gb={device_cache_gb} holds no expert: one slot in each of "
                     f"the {n_moe_layers} MoE layers needs {gb(per_slot)}; use 0 to disable the "
                     "device tier")

  if free is None:  # CPU: both tiers and the dense weights share host RAM
    room = avail - dense_bytes - working
    if room < 0:
      raise InputError(f"not enough memory: dense weights {gb(dense_bytes)} + working set "
                       f"{gb(working)} exceed the {gb(avail)} available after the margin")
    if device is None and host is None:
      return Budgets(total, 0) if room >= total else Budgets(0, room)
    device = 0 if device is None else device
    host = max(0, min(total, room - device)) if host is None else host
    if device + host > room:
      raise InputError(f"device_cache_gb + host_cache_gb = {gb(device + host)} exceed the "
                       f"{gb(room)} left after dense weights, working set and margin")
    return Budgets(device, host)

  dev_room = free - dense_bytes - max(GiB, free // 20) - working
  if dev_room < 0:
    raise InputError(f"accelerator memory too small: dense weights {gb(dense_bytes)} + working "
                     f"set {gb(working)} do not fit in the {gb(free)} free")
  if device is None:
    device = max(0, min(total, dev_room))
  elif device > dev_room:
    raise InputError(f"device_cache_gb={device_cache_gb} exceeds the {gb(dev_room)} of "
                     "accelerator memory left after dense weights, working set and margin")
  host_room = avail - working
  if host is None:
    host = max(0, min(total, host_room))
  elif host > host_room:
    raise InputError(f"host_cache_gb={host_cache_gb} exceeds the {gb(host_room)} of RAM "
                     "available after the margin")
  return Budgets(device, host)
