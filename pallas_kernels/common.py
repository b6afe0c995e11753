"""Hardware queries: platform, device kind and peak HBM bandwidth."""

from __future__ import annotations

import jax

# Peak DRAM bandwidth in bytes/s from vendor datasheets, keyed by a lowercase
# substring of `device_kind`. Order matters: the first match wins, so more
# specific names come before their prefixes (e.g. "h100 pcie" before "h100").
_HBM_BYTES_PER_S: tuple[tuple[str, float], ...] = (
    ("gh200", 4.0e12),
    ("h200", 4.8e12),
    ("h100 pcie", 2.0e12),
    ("h100 nvl", 3.9e12),
    ("h100", 3.35e12),  # SXM
    ("h800", 3.35e12),
    ("b200", 8.0e12),
    ("a100-sxm4-80gb", 2.039e12),
    ("a100 80gb pcie", 1.935e12),
    ("a100", 2.0e12),
    ("a10g", 0.6e12),
    ("l40s", 0.864e12),
    ("l4", 0.3e12),
    ("rtx 5090", 1.79e12),
    ("rtx 4090", 1.0e12),
    ("rtx 3090", 0.936e12),
    ("tpu v6", 1.64e12),  # Trillium / v6e
    ("tpu v5 lite", 0.819e12),  # v5e reports itself as "TPU v5 lite"
    ("tpu v5e", 0.819e12),
    ("tpu v5p", 2.765e12),
    ("tpu v5", 2.765e12),
    ("tpu v4", 1.2e12),
)


def platform(device: jax.Device | None = None) -> str:
  """'cpu', 'gpu' or 'tpu' for `device` (default: the first JAX device)."""
  d = device or jax.devices()[0]
  return "gpu" if d.platform in ("cuda", "rocm", "gpu") else d.platform


def device_kind(device: jax.Device | None = None) -> str:
  """The device's kind string, e.g. 'NVIDIA H200' or 'TPU v5 lite'."""
  return (device or jax.devices()[0]).device_kind


def hbm_bandwidth(device: jax.Device | None = None) -> float | None:
  """Peak HBM bandwidth in bytes/s, or None for unknown devices (and CPUs)."""
  d = device or jax.devices()[0]
  if platform(d) == "cpu":
    return None
  kind = d.device_kind.lower()
  for key, bw in _HBM_BYTES_PER_S:
    if key in kind:
      return bw
  return None


def is_nvidia_gpu(device: jax.Device | None = None) -> bool:
  """True for CUDA devices (the only GPU target the Triton path is built for)."""
  return (device or jax.devices()[0]).platform in ("cuda", "gpu")
