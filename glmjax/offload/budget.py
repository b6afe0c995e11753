"""The memory plan `load()` makes before it allocates anything, and the expert tiers' budgets.

The plan's parts: what this process holds already when it plans (its RSS: the interpreter, JAX,
numba, loaded libraries) and an allowance for what it takes later besides the other parts
(`RUNTIME_GROWTH`: compiled steps, kernels, libraries loaded on the way, transients), the dense
weights (in their format), the KV pages of one sequence of `PLAN_KV_POSITIONS` positions (the
pool grows on demand, each growth checked again), the routed experts a resident model holds, and
for an expert store the tiers' budgets plus a transient working set for the current layer's
non-pinned experts (their chunk bytes on the host and one padded device pool), at most
`min(E, rows·K)` experts twice over, and the prefetched reads (`expert_io.MAX_HINTS` chunks:
the hints queued, or read and held for their layer's step). On a CPU-only machine the
plan's total is what the process's peak RSS is compared with (tests/test_budget_headroom.py).

Host memory (`host_memory`): the memory total is physical RAM unless a lower limit applies
(`GLMJAX_MEMORY_GB`, or the process's cgroup memory limit); under such a limit, what is
available is the limit less what is already used inside it (the cgroup's usage less its inactive
page cache; for GLMJAX_MEMORY_GB this process's RSS), never more than the kernel's available
figure. The host margin left to the rest of the machine is max(4 GiB, 25% of the memory total)
(a 10% margin got a run OOM-killed beside a 4.7 GB process); an accelerator's is max(1 GiB, 5%).
A plan that cannot fit is refused with an `InputError` listing every part against the memory
there is.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import psutil

from glmjax.offload.engine import Budgets
from glmjax.offload.expert_io import MAX_HINTS
from glmjax.errors import InputError

GiB = 1 << 30
MAX_ROWS = 64  # rows (tokens) of one MoE step the working set is sized for
PLAN_KV_POSITIONS = 4096  # KV planned at load: one sequence this long (or max_context)
# Host RAM the process takes after planning beyond the planned parts: libraries imported while
# loading, compiled steps, the CPU kernels, transients (measured 0.30-0.50 GB on small models).
RUNTIME_GROWTH = GiB // 2
HOST_MARGIN_MIN = 4 * GiB  # host RAM automatic budgets leave to the rest of the machine:
HOST_MARGIN_FRACTION = 0.25  # at least this, and at least this share of the memory total
HOST_FLOOR_MIN = 2 * GiB  # an explicit budget is refused only when it would leave less than
HOST_FLOOR_FRACTION = 0.10  # this, and less than this share (what a user asked for may be
# tight: GLM-5's 77-layer synthetic store with a 4 GB host cache plans 15 GB on a 23.5 GB
# machine, inside the floor but not the automatic margin)
MEMORY_ENV = "GLMJAX_MEMORY_GB"  # a lower memory total, in GiB
CGROUP_ROOT = "/sys/fs/cgroup"  # where the cgroup file systems are mounted
PROC_CGROUP = "/proc/self/cgroup"  # this process's cgroups


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
  prefetch: int = 0  # prefetched reads queued or held for their layer's step, transient
  runtime: int = 0  # host RAM this process held when it planned (its RSS then)
  growth: int = 0  # host RAM it takes after planning besides the other parts (RUNTIME_GROWTH)

  def parts(self) -> dict[str, int]:
    names = {"runtime": "runtime (this process now)",
             "growth": "runtime growth (compiling, kernels)",
             "dense": f"dense weights ({self.dense_format})", "kv": "KV pages",
             "experts": "resident routed experts",
             "device_cache": "pinned experts", "host_cache": "host expert cache",
             "working": "expert working set", "prefetch": "prefetched reads"}
    return {label: getattr(self, k) for k, label in names.items() if getattr(self, k)}

  @property
  def total(self) -> int:
    """Every part's bytes. On a CPU-only machine, what the process's peak RSS is held to."""
    return sum(self.parts().values())


def refuse(parts: dict[str, int], room: int, memory: str):
  """The InputError for a plan whose `parts` exceed `room` bytes of `memory`."""
  width = max(len(k) for k in parts)
  lines = "".join(f"\n  {k:<{width}}  {gb(v):>12}" for k, v in parts.items())
  return InputError(f"this model does not fit: {gb(sum(parts.values()))} planned against "
                    f"{gb(room)} of {memory}:{lines}\n  {'available':<{width}}  {gb(room):>12}"
                    "\n(quantized dense weights, scripts/convert.py --dense_bits=8|4, or smaller "
                    "cache budgets and max_context shrink the plan)")


@dataclasses.dataclass(frozen=True)
class HostMemory:
  """Host RAM as automatic budgets see it: `total` is physical RAM or a lower limit
  (`source` says which), `available` what may still be allocated under it."""
  total: int
  available: int
  source: str = "physical RAM"

  @property
  def margin(self) -> int:
    """Left to the rest of the machine: max(4 GiB, 25% of the memory total)."""
    return max(HOST_MARGIN_MIN, int(self.total * HOST_MARGIN_FRACTION))

  @property
  def room(self) -> int:
    """What automatic budgets may still allocate: available less the margin (may be
    negative)."""
    return self.available - self.margin

  @property
  def floor(self) -> int:
    """What no plan may eat into: max(2 GiB, 10% of the memory total)."""
    return max(HOST_FLOOR_MIN, int(self.total * HOST_FLOOR_FRACTION))

  @property
  def hard_room(self) -> int:
    """What explicit budgets may still allocate: available less the floor."""
    return self.available - self.floor

  def describe(self) -> str:
    """The memory a refusal is against: RAM for this process after the floor, and why."""
    return (f"RAM after the margin (memory total {gb(self.total)}: {self.source}; "
            f"{gb(self.floor)} left to the rest of the machine)")


def host_memory() -> HostMemory:
  """Physical RAM, or the lowest limit below it (`GLMJAX_MEMORY_GB`, the cgroup's); under a
  limit, available = the limit less what is used inside it, at most psutil's available."""
  _trim()
  vm = psutil.virtual_memory()
  total, avail, source = int(vm.total), int(vm.available), "physical RAM"
  for limit, used, name in _limits():
    if limit < vm.total:
      avail = min(avail, limit - used)
      if limit < total:
        total, source = limit, name
  return HostMemory(total, avail, source)


def host_available() -> int:
  """Host bytes this process may still allocate after the margin (negative when none)."""
  return host_memory().room


def _limits():
  """(limit bytes, bytes already used under it, name) of each limit set on this process."""
  raw = os.environ.get(MEMORY_ENV)
  if raw is not None and raw.strip():
    try:
      value = float(raw)
    except ValueError:
      value = float("nan")
    if not 0 < value < float("inf"):
      raise InputError(f"{MEMORY_ENV}={raw!r} is not a memory size: give a positive number of "
                       "GiB (e.g. 16), or unset it to use the machine's RAM")
    yield int(value * GiB), _process_rss(), f"{MEMORY_ENV}={raw.strip()}"
  yield from _cgroup_limits()


def _cgroup_limits() -> list[tuple[int, int, str]]:
  """The memory limits of this process's cgroup and its ancestors, each with what that cgroup
  uses: cgroup v2 `memory.max` ("max": none) and `memory.current`, or v1
  `memory/memory.limit_in_bytes` (huge values: none, as any limit above RAM) and
  `memory.usage_in_bytes`. Usage counts the page cache, so its inactive file pages
  (`memory.stat`), which the kernel reclaims before it kills, are not counted as used (the
  "working set" container runtimes report)."""
  v2, v1 = "/", "/"
  try:
    with open(PROC_CGROUP) as f:
      for line in f:
        _, controllers, path = line.rstrip("\n").split(":", 2)
        if controllers == "":
          v2 = path
        elif "memory" in controllers.split(","):
          v1 = path
  except (OSError, ValueError):
    pass
  found = []
  for base, path, limit_file, usage_file, inactive in (
      (CGROUP_ROOT, v2, "memory.max", "memory.current", "inactive_file"),
      (os.path.join(CGROUP_ROOT, "memory"), v1, "memory.limit_in_bytes", "memory.usage_in_bytes",
       "total_inactive_file")):
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    for depth in range(len(parts), -1, -1):  # the process's own cgroup, then each parent
      d = os.path.join(base, *parts[:depth])
      limit, used = _read_int(os.path.join(d, limit_file)), _read_int(os.path.join(d, usage_file))
      if limit is not None and used is not None:
        used -= min(used, _stat(os.path.join(d, "memory.stat"), inactive))
        found.append((limit, used, "cgroup memory limit"))
  return found


def _read_int(path: str) -> int | None:
  """An integer cgroup file; None when absent, unreadable or "max"."""
  try:
    with open(path) as f:
      return int(f.read().strip())
  except (OSError, ValueError):
    return None


def _stat(path: str, key: str) -> int:
  """One counter of a cgroup's memory.stat (0 when absent)."""
  try:
    with open(path) as f:
      for line in f:
        name, _, value = line.partition(" ")
        if name == key:
          return int(value)
  except (OSError, ValueError):
    pass
  return 0


def _trim() -> None:
  """Hands the allocator's free heap back to the system: a model closed in this process leaves
  its freed memory in RSS, and out of what the system calls available, until then (2.6 GB
  after closing a 24-layer GLM-5-geometry store, 0.7 GB after the trim); the plan would count
  it twice."""
  try:
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc; elsewhere the figures are taken as they are
  except (OSError, AttributeError):
    pass


def _process_rss() -> int:
  return psutil.Process().memory_info().rss


def available() -> tuple[int, int | None]:
  """Host RAM this process may still allocate after the margin (`host_available`), and free
  accelerator memory after its margin (None on a CPU-only machine)."""
  free = _device_free()
  return host_available(), None if free is None else free - max(GiB, free // 20)


def plan_resident(dense: int, dense_format: str, kv: int, experts: int = 0) -> MemoryPlan:
  """The plan of a model held whole (an HF checkpoint): refused when it does not fit."""
  mem, free = host_memory(), _device_free()
  rss = _process_rss()
  plan = MemoryPlan(dense, dense_format, kv, "host" if free is None else "device",
                    experts=experts, runtime=rss, growth=RUNTIME_GROWTH)
  if free is None:  # all of it is host RAM, next to what the process holds already
    if plan.total > mem.hard_room + rss:  # a model held whole: refused only past the floor
      raise refuse(plan.parts(), mem.hard_room + rss, mem.describe())
    return plan
  dev_free = free - max(GiB, free // 20)
  on_device = dataclasses.replace(plan, runtime=0, growth=0).parts()
  if sum(on_device.values()) > dev_free:
    raise refuse(on_device, dev_free, "free accelerator memory after the margin")
  return plan


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
  # prefetch holds at most the queued hints' reads beyond the working set (expert_io)
  prefetch = MAX_HINTS * chunk_bytes
  mem = host_memory()
  avail = mem.room  # host RAM still to allocate; `rss` is held already, outside it
  rss = _process_rss()
  free = _device_free()
  per_slot = n_moe_layers * chunk_bytes  # one device slot in every MoE layer
  base = MemoryPlan(dense_bytes, dense_format, kv_bytes, "host" if free is None else "device",
                    working=working, prefetch=prefetch, runtime=rss, growth=RUNTIME_GROWTH)

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
    return (Budgets(device, host, read_buffer_bytes=working // 2 + prefetch),
            dataclasses.replace(base, device_cache=device, host_cache=host))

  if free is None:  # CPU: both tiers, the dense weights and the KV pages share host RAM
    need = RUNTIME_GROWTH + dense_bytes + kv_bytes + working + prefetch
    room, hard = avail - need, mem.hard_room - need  # automatic sizes; explicit ones
    if hard < 0:
      raise refuse(base.parts(), mem.hard_room + rss, mem.describe())
    if device is None and host is None:
      return done(total, 0) if room >= total else done(0, max(0, room))
    device = 0 if device is None else device
    host = max(0, min(total, room - device)) if host is None else host
    if device + host > hard:
      raise refuse(dataclasses.replace(base, device_cache=device, host_cache=host).parts(),
                   mem.hard_room + rss, mem.describe() + " (device_cache_gb and host_cache_gb "
                   "are both host RAM on a CPU-only machine)")
    return done(device, host)

  dev_free = free - max(GiB, free // 20)
  dev_room = dev_free - dense_bytes - kv_bytes - working
  # the runtime's and the prefetched reads are host RAM
  on_device = dataclasses.replace(base, runtime=0, growth=0, prefetch=0)
  if dev_room < 0:
    raise refuse(on_device.parts(), dev_free, "free accelerator memory after the margin")
  if device is None:
    device = max(0, min(total, dev_room))
  elif device > dev_room:
    raise refuse(dataclasses.replace(on_device, device_cache=device).parts(), dev_free,
                 f"free accelerator memory after the margin (device_cache_gb={device_cache_gb})")
  host_room = avail - RUNTIME_GROWTH - working - prefetch
  if host is None:
    host = max(0, min(total, host_room))
  elif host > mem.hard_room - RUNTIME_GROWTH - working - prefetch:
    raise refuse(dataclasses.replace(base, dense=0, kv=0, host_cache=host).parts(),
                 mem.hard_room + rss, f"{mem.describe()} (host_cache_gb={host_cache_gb})")
  return done(device, host)
