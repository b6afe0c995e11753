"""A cost model of offloaded decoding: seconds per token from geometry, hardware and hit counts.

    from glmjax.studies.cost_model import Geometry, Hardware, Hits, predict, calibrate
    predict(geo, hw, Hits(pin=0.6, host=3.9, miss=3.4))["tok_s"]

The model, per token (one decode step; every MoE layer sees the same expected counts):

    s/token = dense_s + L · (overhead + miss · miss_overhead + pin_s + host_s + miss_s)

with L = `moe_layers`, B = `expert_bytes` and, per MoE layer, the expected numbers of experts
served by each tier (`Hits`: pin + host + miss = the layer's union, top_k at batch 1):

    pin_s  = pin · B / device_kernel             pinned experts, computed where they live
    host_s = host · B / cpu_kernel               host placement (the CPU kernel reads RAM)
           = host · B · (1/h2d + 1/device_kernel)   device placement (upload, then compute)
    miss_s = max(miss · r, miss · c) + min(r, c) · min(miss, 1)

where r = B / disk is one miss's read and c its compute (B / cpu_kernel under host placement,
B / h2d + B / device_kernel under device placement). Misses are all dispatched at once and
each is computed as it lands, so reading and computing overlap: the slower stage sets the
pace, and one item of the faster stage cannot hide (the first read before any compute, or
the last compute after the last read). `min(miss, 1)` keeps that term proportional below
one expected miss.

`overhead` (`layer_overhead_s`) is the fixed per-layer host cost (the round trip that reads
the routing ids, bookkeeping, kernel launches) and `miss_overhead` (`miss_overhead_s`) the fixed
software cost of one miss beyond its bytes (the hand-off from an I/O thread, the host-cache
insert and slab write, its own kernel call); `calibrate` fits both to measured runs. With a
per-layer constant alone the model could not follow the tier mix on this machine: a step that
misses nothing runs fused (one jit, no per-layer round trip), a thrashing one pays per miss. Every
bandwidth is in GB/s of 1e9 bytes. The pinned and host-hit terms add rather than overlap the
miss reads: the model is deliberately the simple upper-bound form. Resident compute that does
hide behind reads shows up in the calibrated overhead.
"""

from __future__ import annotations

import dataclasses
import math

from glmjax.errors import InputError

GB = 1e9  # bandwidths are in decimal GB/s
PLACEMENTS = ("host", "device")


def _positive(obj, names: tuple[str, ...], zero_ok: tuple[str, ...] = (),
              inf_ok: tuple[str, ...] = ()) -> None:
  """Raises InputError naming the first field of `obj` that is not a finite number > 0
  (≥ 0 for the fields in `zero_ok`; infinity allowed for those in `inf_ok`)."""
  kind = type(obj).__name__
  for name in names:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
      raise InputError(f"{kind}.{name} must be a number, got {v!r}")
    if math.isinf(v) and name not in inf_ok:
      raise InputError(f"{kind}.{name} must be finite, got {v!r}")
    if not (v >= 0 if name in zero_ok else v > 0):
      raise InputError(f"{kind}.{name} must be {'≥' if name in zero_ok else '>'} 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Geometry:
  """What the model reads per token: MoE layers, experts per layer, top-k, bytes of one
  expert, and the dense part's seconds per token (attention, shared expert, lm head)."""
  moe_layers: int
  experts: int
  top_k: int
  expert_bytes: float
  dense_s_per_token: float

  def __post_init__(self):
    for name in ("moe_layers", "experts", "top_k"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InputError(f"Geometry.{name} must be an integer ≥ 1, got {v!r}")
    if self.top_k > self.experts:
      raise InputError(f"Geometry.top_k ({self.top_k}) exceeds Geometry.experts ({self.experts})")
    _positive(self, ("expert_bytes", "dense_s_per_token"), zero_ok=("dense_s_per_token",))


@dataclasses.dataclass(frozen=True)
class Hardware:
  """Bandwidths in GB/s (1e9 bytes) and the fixed host overhead per MoE layer in seconds.
  A bandwidth may be `math.inf` for a stage that costs nothing (no bus on a CPU-only box).
  `miss_overhead_s` is the fixed cost of one miss beyond its bytes."""
  disk_gbs: float
  h2d_gbs: float
  cpu_kernel_gbs: float
  device_kernel_gbs: float
  layer_overhead_s: float = 0.0
  miss_overhead_s: float = 0.0

  def __post_init__(self):
    bandwidths = ("disk_gbs", "h2d_gbs", "cpu_kernel_gbs", "device_kernel_gbs")
    overheads = ("layer_overhead_s", "miss_overhead_s")
    _positive(self, (*bandwidths, *overheads), zero_ok=overheads, inf_ok=bandwidths)


@dataclasses.dataclass(frozen=True)
class Hits:
  """Expected experts per MoE layer per token served by each tier: pinned (device pool),
  host cache, and misses read from the store."""
  pin: float
  host: float
  miss: float

  def __post_init__(self):
    _positive(self, ("pin", "host", "miss"), zero_ok=("pin", "host", "miss"))

  @property
  def total(self) -> float:
    return self.pin + self.host + self.miss

  @classmethod
  def from_counts(cls, pin: float, host: float, miss: float, layer_steps: float) -> "Hits":
    """Totals over a run (e.g. `simulate(trace, "engine")`'s pin_hits, host_hits, misses)
    divided by its number of (step, MoE layer) pairs."""
    if not layer_steps > 0:
      raise InputError(f"layer_steps must be > 0, got {layer_steps!r}")
    return cls(pin / layer_steps, host / layer_steps, miss / layer_steps)

  @classmethod
  def from_rates(cls, hit_rate: float, pin_share: float, top_k: int) -> "Hits":
    """From a published hit rate and the share of all expert uses served by the pinned tier
    (both fractions), at batch 1: `top_k` experts per layer and token."""
    if not 0 <= hit_rate <= 1:
      raise InputError(f"hit_rate must be in [0, 1], got {hit_rate!r}")
    if not 0 <= pin_share <= hit_rate:
      raise InputError(f"pin_share must be in [0, hit_rate={hit_rate}], got {pin_share!r}")
    return cls(pin_share * top_k, (hit_rate - pin_share) * top_k, (1 - hit_rate) * top_k)


def _check_hits(geometry: Geometry, hits: Hits) -> None:
  if not isinstance(hits, Hits):
    raise InputError(f"hits must be a Hits, got {type(hits).__name__}")
  # A layer's union never holds more than every expert once (top_k at batch 1, up to E when a
  # step carries several tokens).
  if hits.total > geometry.experts + 1e-9:
    raise InputError(f"hits: pin + host + miss = {hits.total:g} experts per layer exceeds the "
                     f"{geometry.experts} experts a layer has")


def predict(geometry: Geometry, hardware: Hardware, hits: Hits,
            placement: str = "host") -> dict:
  """Predicted decode seconds per token and tok/s (see the module docstring for the model).

  placement: where host-cached and missed experts are computed, "host" (the CPU kernel where
  the bytes are; colibri's rule for streamed experts) or "device" (uploaded over h2d first).
  Returns s_per_token, tok_s and the per-token breakdown (dense_s, overhead_s, pin_s, host_s,
  miss_s, plus miss_read_s / miss_compute_s: the two stages before overlap).
  """
  if not isinstance(geometry, Geometry):
    raise InputError(f"geometry must be a Geometry, got {type(geometry).__name__}")
  if not isinstance(hardware, Hardware):
    raise InputError(f"hardware must be a Hardware, got {type(hardware).__name__}")
  if placement not in PLACEMENTS:
    raise InputError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
  _check_hits(geometry, hits)
  b, hw = geometry.expert_bytes, hardware
  device = b / (hw.device_kernel_gbs * GB)  # one pinned expert's compute
  cpu = b / (hw.cpu_kernel_gbs * GB)
  upload = b / (hw.h2d_gbs * GB)
  held = cpu if placement == "host" else upload + device  # a host-cached expert
  read = b / (hw.disk_gbs * GB)
  compute = held  # a miss, once landed, runs where a host-cached expert would
  pin_s = hits.pin * device
  host_s = hits.host * held
  miss_s = max(hits.miss * read, hits.miss * compute) + min(read, compute) * min(hits.miss, 1.0)
  layers = geometry.moe_layers
  parts = {
      "dense_s": geometry.dense_s_per_token,
      "overhead_s": layers * (hw.layer_overhead_s + hits.miss * hw.miss_overhead_s),
      "pin_s": layers * pin_s,
      "host_s": layers * host_s,
      "miss_s": layers * miss_s,
  }
  total = sum(parts.values())
  return {"s_per_token": total, "tok_s": 1.0 / total if total > 0 else math.inf,
          "placement": placement, **parts,
          "miss_read_s": layers * hits.miss * read, "miss_compute_s": layers * hits.miss * compute,
          "expert_bytes_read_per_token": layers * hits.miss * b}


def calibrate(runs, geometry: Geometry, hardware: Hardware, placement: str = "host",
              per_miss: bool = True) -> dict:
  """Fits `layer_overhead_s` and `miss_overhead_s` to measured runs by least squares.

  runs: a sequence of (Hits, measured seconds per token). The prediction is affine in both
  overheads, predicted_i = a_i + L · (overhead + miss_i · miss_overhead) with a_i the
  prediction at zero overheads, so the fit is linear least squares. `miss_overhead_s` is fitted
  only with `per_miss` and at least two distinct miss counts (else it stays 0 and the overhead
  is mean(measured_i − a_i) / L). The per-run predictions use the fit as is; a negative value
  means the other terms already over-predict (the returned Hardware clamps it at 0).
  Returns layer_overhead_s, miss_overhead_s, the calibrated Hardware, and per run: measured,
  predicted and relative error (predicted / measured − 1), plus the largest absolute one.
  """
  runs = list(runs)
  if not runs:
    raise InputError("calibrate needs at least one measured run")
  for i, run in enumerate(runs):
    if not (isinstance(run, (tuple, list)) and len(run) == 2 and isinstance(run[0], Hits)):
      raise InputError(f"runs[{i}] must be a (Hits, measured s/token) pair, got {run!r}")
    if isinstance(run[1], bool) or not isinstance(run[1], (int, float)) or not run[1] > 0:
      raise InputError(f"runs[{i}]: measured s/token must be > 0, got {run[1]!r}")
  zero = dataclasses.replace(hardware, layer_overhead_s=0.0, miss_overhead_s=0.0)
  base = [predict(geometry, zero, h, placement)["s_per_token"] for h, _ in runs]
  layers = geometry.moe_layers
  gap = [(m - a) / layers for (_, m), a in zip(runs, base)]  # per layer, to be explained
  misses = [h.miss for h, _ in runs]
  if per_miss and len(set(misses)) > 1:
    mx, my = sum(misses) / len(runs), sum(gap) / len(runs)
    per_miss_s = (sum((x - mx) * (y - my) for x, y in zip(misses, gap))
                  / sum((x - mx) ** 2 for x in misses))
    overhead = my - per_miss_s * mx
  else:
    per_miss_s, overhead = 0.0, sum(gap) / len(runs)
  fitted = dataclasses.replace(hardware, layer_overhead_s=max(overhead, 0.0),
                               miss_overhead_s=max(per_miss_s, 0.0))
  out = []
  for (h, m), a in zip(runs, base):
    p = a + layers * (overhead + h.miss * per_miss_s)
    out.append({"hits": dataclasses.asdict(h), "measured_s": m, "predicted_s": p,
                "rel_error": p / m - 1.0})
  return {"layer_overhead_s": overhead, "miss_overhead_s": per_miss_s, "hardware": fitted,
          "runs": out, "max_abs_rel_error": max(abs(r["rel_error"]) for r in out)}
