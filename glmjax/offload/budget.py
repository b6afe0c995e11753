"""The memory plan `load()` makes before it allocates anything, and the expert tiers' budgets.

The plan's parts: the dense weights (in their format), the KV pages of one sequence of
`PLAN_KV_POSITIONS` positions (the pool grows on demand, each growth checked again), the
routed experts a resident model holds, and for an expert store the tiers' budgets plus a
transient working set for the current layer's non-pinned experts (their chunk bytes on the host
and one padded device pool), at most `min(E, rows·K)` experts twice over. The stated margin is
max(2 GiB, 10% of total RAM) on the host and max(1 GiB, 5%) on an accelerator. A plan that
cannot fit is refused with an `InputError` listing every part against the memory there is.
"""

from __future__ import annotations

import dataclasses

import jax
import psutil

from glmjax.offload.engine import Budgets
from glmjax.errors import InputError

GiB = 1 << 30
MAX_ROWS = 64  # rows (tokens) of one MoE step the working set is sized for
PLAN_KV_POSITIONS = 4096  # KV planned at load: one sequence this long (or max_context)


def gb(x: float) -> str:
  return f"{x / GiB:.3f} GB"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """What a loaded model holds, in bytes, planned before anything was allocated.

  `where` says which memory holds the dense part ("device" on an accelerator, "host" on a
  CPU-only machine)."""
  dense: int
  dense_format: str
  kv: int
  where: str
  experts: int = 0  # routed experts held whole (an HF checkpoint, or a store that all fits)
  device_cache: int = 0  # pinned experts (the device tier's budget)
  host_cache: int = 0  # the host tier's budget
  working: int = 0  # the current layer's non-pinned experts, transient

  def parts(self) -> dict[str, int]:
    names = {"dense": f"dense weights ({self.dense_format})", "kv": "KV pages",
             "experts": "resident routed experts", "device_cache": "pinned experts",
             "host_cache": "host expert cache", "working": "expert working set"}
    return {label: getattr(self, k) for k, label in names.items() if getattr(self, k)}


def refuse(parts: dict[str, int], room: int, memory: str):
  """The InputError for a plan whose `parts` exceed `room` bytes of `memory`."""
  width = max(len(k) for k in parts)
  lines = "".join(f"\n  {k:<{width}}  {gb(v):>12}" for k, v in parts.items())
  return InputError(f"this model does not fit: {gb(sum(parts.values()))} planned against "
                    f"{gb(room)} of {memory}:{lines}\n  {'available':<{width}}  {gb(room):>12}"
                    "\n(quantized dense weights, scripts/convert.py --dense_bits=8|4, or smaller "
                    "cache budgets and max_context shrink the plan)")


def available() -> tuple[int, int | None]:
  """Host RAM available after the margin, and free accelerator memory after its margin (None
  on a CPU-only machine)."""
  free = _device_free()
  host = psutil.virtual_memory().available - _host_margin()
  return host, None if free is None else free - max(GiB, free // 20)


def plan_resident(dense: int, dense_format: str, kv: int, experts: int = 0) -> MemoryPlan:
  """The plan of a model held whole (an HF checkpoint): refused when it does not fit."""
  host, device = available()
  where = "host" if device is None else "device"
  plan = MemoryPlan(dense, dense_format, kv, where, experts=experts)
  room = host if device is None else device
  if sum(plan.parts().values()) > room:
    raise refuse(plan.parts(), room, "RAM after the margin" if device is None else
                 "free accelerator memory after the margin")
  return plan


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
            n_moe_layers: int, n_experts: int, top_k: int, kv_bytes: int = 0,
            dense_format: str = "") -> tuple[Budgets, MemoryPlan]:
  """Budgets in bytes, and the whole plan. None means automatic; 0 disables a tier. Called
  before the dense weights (`dense_bytes`) and the KV pages (`kv_bytes`) are allocated: they
  are part of the plan."""
  total = n_moe_layers * n_experts * chunk_bytes
  working = 2 * min(n_experts, MAX_ROWS * top_k) * chunk_bytes
  avail = psutil.virtual_memory().available - _host_margin()
  free = _device_free()
  per_slot = n_moe_layers * chunk_bytes  # one device slot in every MoE layer
  base = MemoryPlan(dense_bytes, dense_format, kv_bytes, "host" if free is None else "device",
                    working=working)

  for name, v in (("device_cache_gb", device_cache_gb), ("host_cache_gb", host_cache_gb)):
    if v is not None and not v >= 0:
      raise InputError(f"{name} must be ≥ 0 (0 disables the tier), got {v}")
  device = None if device_cache_gb is None else int(device_cache_gb * GiB)
  host = None if host_cache_gb is None else int(host_cache_gb * GiB)
  if device is not None and 0 < device < per_slot:
    raise InputError(f"device_cache_gb={device_cache_gb} holds no expert: one slot in each of "
                     f"the {n_moe_layers} MoE layers needs {gb(per_slot)}; use 0 to disable the "
                     "device tier")

  def done(device: int, host: int) -> tuple[Budgets, MemoryPlan]:
    return Budgets(device, host), dataclasses.replace(base, device_cache=device, host_cache=host)

  if free is None:  # CPU: both tiers, the dense weights and the KV pages share host RAM
    room = avail - dense_bytes - kv_bytes - working
    if room < 0:
      raise refuse(base.parts(), avail, "RAM after the margin")
    if device is None and host is None:
      return done(total, 0) if room >= total else done(0, room)
    device = 0 if device is None else device
    host = max(0, min(total, room - device)) if host is None else host
    if device + host > room:
      raise refuse(dataclasses.replace(base, device_cache=device, host_cache=host).parts(),
                   avail, "RAM after the margin (device_cache_gb and host_cache_gb are both "
                   "host RAM on a CPU-only machine)")
    return done(device, host)

  dev_free = free - max(GiB, free // 20)
  dev_room = dev_free - dense_bytes - kv_bytes - working
  if dev_room < 0:
    raise refuse(base.parts(), dev_free, "free accelerator memory after the margin")
  if device is None:
    device = max(0, min(total, dev_room))
  elif device > dev_room:
    raise refuse(dataclasses.replace(base, device_cache=device).parts(), dev_free,
                 f"free accelerator memory after the margin (device_cache_gb={device_cache_gb})")
  host_room = avail - working
  if host is None:
    host = max(0, min(total, host_room))
  elif host > host_room:
    raise refuse({"host expert cache": host, "expert working set": working}, avail,
                 f"RAM after the margin (host_cache_gb={host_cache_gb})")
  return done(device, host)
