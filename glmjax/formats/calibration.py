"""Calibration statistics on disk, and the calibrated quantization of one expert (issue 30).

A statistics directory (written by `scripts/calibrate.py`) holds `calibration.json` (what was
measured, how, and a sha256 of the arrays) and one tensorstore zarr3 array per statistic, each
`[L, E, ...]` over the model's MoE layers in order (`glmjax.formats.calibrate` defines them):

    count [L, E]   gate_up_sq [L, E, D]   down_sq [L, E, F]
    gate_up_gram [L, E, D, D]   down_gram [L, E, F, F]      (only when they fit: GRAM_LIMIT)

All are float64 sums over the routed calibration tokens. `convert.py --quant=imatrix|gptq
--calibration=DIR` quantizes each routed expert with them (`quantize_expert`).

Fallback: an expert routed fewer than `min_tokens` calibration tokens (recorded in the json)
is quantized with its layer's pooled statistics (the sums over all its experts: every token
the layer routed) instead of its own, and counted (`Calibration.fallbacks`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np

from glmjax.errors import InputError
from glmjax.formats import calibrated, durable
from glmjax.formats.quantize import quantize
from glmjax.model.quant import QArray

META = "calibration.json"
KEYS = ("count", "gate_up_sq", "down_sq", "gate_up_gram", "down_gram")
METHODS = ("rtn", "imatrix", "gptq")
# Gram matrices are kept when all of them together take at most this many bytes (float64):
# every embedded-model layer (4 × 32 × (192² + 64²) × 8 = 39 MB); never at GLM-5's size
# (75 × 256 × (6144² + 2048²) × 8 = 6.4 TB), where gptq needs a layer-by-layer pass.
GRAM_LIMIT = 2 << 30
MIN_TOKENS = 64  # one group's worth of inputs: fewer, and the layer's pooled statistics serve
GPTQ_DAMP = 0.01  # × the mean diagonal of the Hessian (0.001 and 0.1 measured no better)
# Columns quantized by decreasing diag(H) (static groups keep the format): measured better on
# the embedded model (docs/measurements/quantization.md)
GPTQ_ACT_ORDER = True


def gram_bytes(n_layers: int, n_experts: int, hidden: int, intermediate: int) -> int:
  """Bytes of every Gram matrix of a model's MoE layers, float64."""
  return n_layers * n_experts * (hidden ** 2 + intermediate ** 2) * 8


def digest(arrays: dict) -> str:
  """sha256 of the statistics (names, dtypes, shapes and bytes, in KEYS order)."""
  h = hashlib.sha256()
  for k in KEYS:
    if k in arrays:
      a = np.ascontiguousarray(arrays[k])
      h.update(f"{k}:{a.dtype.str}:{a.shape};".encode())
      h.update(a.tobytes())
  return h.hexdigest()


def _spec(path: str, key: str) -> dict:
  return {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(path, key)}}


def save(path: str, arrays: dict, meta: dict) -> dict:
  """Writes `arrays` (float64 sums, `[L, E, ...]`) and `meta` (plus their digest) to the new
  directory `path`, built in a temporary sibling and renamed into place whole (`formats.durable`;
  kill points "calibration.array", "calibration.publish"): a killed save leaves nothing at
  `path`, and the rerun removes its temporary. Returns the meta."""
  import tensorstore as ts
  if os.path.lexists(path):
    raise InputError(f"{path}: already exists; statistics are never written over others")
  arrays = {k: np.asarray(arrays[k], np.float64) for k in KEYS if k in arrays}
  tmp = durable.staging_dir(path)
  try:
    for k, a in arrays.items():
      ts.open(_spec(tmp, k), create=True, dtype=ts.float64, shape=a.shape).result().write(
          a).result()
      durable.kill_point("calibration.array")
    meta = {**meta, "arrays": sorted(arrays), "sha256": digest(arrays)}
    with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
      json.dump(meta, f, indent=1)
    durable.publish_dir(tmp, path, point="calibration.publish")
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return meta


class Calibration:
  """A statistics directory, read whole (the embedded model's is ~40 MB with Grams)."""

  def __init__(self, path: str):
    import tensorstore as ts
    meta_path = os.path.join(path, META)
    if not os.path.exists(meta_path):
      raise InputError(f"{path}: not a calibration statistics directory (no {META}); write "
                       "one with scripts/calibrate.py")
    with open(meta_path, encoding="utf-8") as f:
      self.meta = json.load(f)
    self.path = path
    self.arrays = {k: ts.open(_spec(path, k), open=True).result().read().result()
                   for k in self.meta["arrays"]}
    if digest(self.arrays) != self.meta["sha256"]:
      raise InputError(f"{path}: statistics do not match their recorded sha256 (damaged or "
                       "edited); calibrate again")
    self.sha256 = self.meta["sha256"]
    self.moe_layers = list(self.meta["moe_layers"])
    self.min_tokens = int(self.meta.get("min_tokens", MIN_TOKENS))

  @property
  def has_gram(self) -> bool:
    return "gate_up_gram" in self.arrays

  def check(self, moe_layers, n_experts: int, hidden: int, intermediate: int,
            method: str) -> None:
    """Raises InputError unless these statistics fit a model of this geometry and `method`."""
    want = {"count": (len(moe_layers), n_experts),
            "gate_up_sq": (len(moe_layers), n_experts, hidden),
            "down_sq": (len(moe_layers), n_experts, intermediate)}
    if list(moe_layers) != self.moe_layers:
      raise InputError(f"{self.path}: statistics of MoE layers {self.moe_layers}, the model has "
                       f"{list(moe_layers)}")
    for k, shape in want.items():
      if tuple(self.arrays[k].shape) != shape:
        raise InputError(f"{self.path}: {k} has shape {self.arrays[k].shape}, this model needs "
                         f"{shape}")
    if method == "gptq" and not self.has_gram:
      raise InputError(f"{self.path}: no Gram matrices (too large to keep whole); --quant=gptq "
                       "needs them")

  def fallbacks(self) -> list[tuple[int, int]]:
    """(layer, expert) of every expert quantized with its layer's pooled statistics."""
    count = self.arrays["count"]
    return [(self.moe_layers[r], int(e)) for r, e in zip(*np.nonzero(count < self.min_tokens))]

  def expert(self, layer: int, e: int) -> dict:
    """The statistics used for expert `e` of MoE layer `layer` (its own, or the fallback)."""
    return expert_statistics(self.arrays, self.moe_layers.index(layer), e, self.min_tokens)


def expert_statistics(arrays: dict, r: int, e: int, min_tokens: int = MIN_TOKENS) -> dict:
  """Expert `e` of the `r`-th MoE layer's statistics from `[L, E, ...]` sums: its own, or, when
  it was routed fewer than `min_tokens` tokens, its layer's pooled ones (the fallback rule)."""
  if arrays["count"][r, e] >= min_tokens:
    return {k: a[r, e] for k, a in arrays.items()}
  return {k: a[r].sum(0) for k, a in arrays.items()}


def quantize_matrix(w: np.ndarray, method: str, stats: dict, part: str, bits: int,
                    group_size: int) -> QArray:
  """`w [O, K]` (an expert's `part` "gate_up" or "down" matrix) quantized by `method` with
  that expert's statistics (`Calibration.expert`); "rtn" needs none."""
  if method == "rtn":
    return quantize(np.asarray(w, np.float32), bits, group_size)
  if method == "imatrix":
    return calibrated.quantize_weighted(w, stats[part + "_sq"], bits, group_size)
  if method == "gptq":
    h = stats[part + "_gram"]
    return calibrated.quantize_gptq(w, h, bits, group_size, damp=GPTQ_DAMP,
                                    order=calibrated.act_order(h) if GPTQ_ACT_ORDER else None)
  raise InputError(f"quant must be one of {METHODS}, got {method!r}")
