"""What the parts of one offload engine share (`EngineShared`): built once by the engine and
handed to each part (`Prefetcher`, `TieredProvider`, `FusedStep`, `pin_device_tier`) instead of
the same ten arguments to each."""

from __future__ import annotations

import collections
import dataclasses

from glmjax.formats.store import ExpertStore
from glmjax.model.config import Config
from glmjax.model.weights import Weights
from glmjax.offload.expert_io import ExpertReader
from glmjax.offload.tiers import Tiers


@dataclasses.dataclass(frozen=True)
class EngineShared:
  cfg: Config
  dense: Weights  # the dense weights; MoE layers' experts come from the tiers
  store: ExpertStore
  tiers: Tiers
  reader: ExpertReader  # the engine's I/O threads
  stats: collections.Counter  # the engine's counters (`telemetry`), which every part adds to
  moe_layers: list  # the main MoE layers' indices
  mesh: object = None  # a jax Mesh, or None

  @property
  def n_experts(self) -> int:
    return self.cfg.n_routed_experts

  @property
  def n_layers(self) -> int:
    """Decoder layers and MTP layers: the row count of the per-layer tables."""
    return self.cfg.num_hidden_layers + len(self.dense.mtp)
