"""The architecture config: a frozen, hashable dataclass parsed from HF `config.json`.

It holds only what fixes the model's math and shapes. Runtime options (cache budgets, kernel
choice, prefetch, drafting) live in `glmjax.options` so that changing them never retraces.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from glmjax.errors import ConfigError

MODEL_TYPE = "glm_moe_dsa"


@dataclasses.dataclass(frozen=True)
class Runtime:
  """How the model's math is computed, never what it computes: the one static bundle that every
  jitted step takes beside `Config` (changing it compiles new executables).

  kernel: the quantized experts' backend ("auto" by platform, "cpu" numba, "xla", "pallas");
  mesh: None, or the Mesh the weights are sharded over (the MoE block's shard_map);
  impl: the attention's, "sparse" (DSA over the selected keys) or "dense" (the masked reference);
  taps: training's requests of the attention (`glmjax.model.attention.Taps`, with impl="dense").
  Taps collect traced values, so a Runtime that holds them is unhashable and can key no jit:
  training calls the pure pass inside its own."""
  kernel: str = "auto"
  mesh: Any = None
  impl: str = "sparse"
  taps: Any = None

# Keys without which the shapes are unknowable: a config lacking one is refused rather than
# silently given transformers' full-size defaults.
_REQUIRED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
    "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
)

# Upper bounds that no real model reaches; they catch corrupt or hostile configs before any
# allocation is attempted.
_LIMITS = {
    "vocab_size": 4_000_000, "hidden_size": 65_536, "num_hidden_layers": 1_024,
    "num_attention_heads": 1_024, "q_lora_rank": 65_536, "kv_lora_rank": 65_536,
    "qk_nope_head_dim": 4_096, "qk_rope_head_dim": 4_096, "v_head_dim": 4_096,
    "n_routed_experts": 16_384, "num_experts_per_tok": 1_024, "moe_intermediate_size": 262_144,
    "intermediate_size": 1_048_576, "index_topk": 1 << 24, "index_head_dim": 4_096,
    "index_n_heads": 1_024, "n_shared_experts": 64, "n_group": 16_384, "topk_group": 16_384,
    "num_nextn_predict_layers": 16, "max_position_embeddings": 1 << 26,
}


@dataclasses.dataclass(frozen=True)
class Config:
  """GLM-5 (`glm_moe_dsa`) architecture. Field names follow HF `config.json`."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  moe_intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  q_lora_rank: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  n_routed_experts: int
  num_experts_per_tok: int
  n_shared_experts: int = 1
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 2.5
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10_000.0
  index_topk: int = 2048
  index_head_dim: int = 128
  index_n_heads: int = 32
  indexer_types: tuple[str, ...] = ()
  mlp_layer_types: tuple[str, ...] = ()
  eos_token_ids: tuple[int, ...] = ()
  num_nextn_predict_layers: int = 0
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 202_752

  # --- derived -------------------------------------------------------------------------
  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def attn_scale(self) -> float:
    return self.qk_head_dim ** -0.5

  @property
  def shared_intermediate_size(self) -> int:
    return self.moe_intermediate_size * self.n_shared_experts

  def is_moe(self, layer: int) -> bool:
    """Whether decoder layer `layer` (the MTP layer included) has routed experts."""
    return layer >= self.num_hidden_layers or self.mlp_layer_types[layer] == "sparse"

  def has_indexer(self, layer: int) -> bool:
    """Whether `layer` runs its own DSA indexer ("full"); "shared" layers reuse the last one."""
    return layer < self.num_hidden_layers and self.indexer_types[layer] == "full"

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i in range(self.num_hidden_layers) if self.is_moe(i))

  # --- parsing -------------------------------------------------------------------------
  @classmethod
  def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "Config":
    """Parses and validates an HF config dict; errors name `source`."""
    if not isinstance(raw, dict):
      raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type != MODEL_TYPE:
      raise ConfigError(f"{source}: model_type is {model_type!r}; glmjax runs {MODEL_TYPE!r} only")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
      raise ConfigError(f"{source}: missing required key(s): {', '.join(missing)}")

    def integer(key, default=None, lo=1):
      v = raw.get(key, default)
      if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{source}: {key} must be an integer, got {v!r}")
      hi = _LIMITS.get(key, 1 << 30)
      if not lo <= v <= hi:
        raise ConfigError(f"{source}: {key}={v} is outside the sane range [{lo}, {hi}]")
      return v

    def number(key, default, lo, hi):
      v = raw.get(key, default)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ConfigError(f"{source}: {key} must be a number in [{lo}, {hi}], got {v!r}")
      return float(v)

    n_layers = integer("num_hidden_layers")
    fields = {k: integer(k) for k in _REQUIRED}
    fields["n_shared_experts"] = integer("n_shared_experts", 1, lo=0)
    fields["n_group"] = integer("n_group", 1)
    fields["topk_group"] = integer("topk_group", 1)
    fields["index_topk"] = integer("index_topk", 2048)
    fields["index_head_dim"] = integer("index_head_dim", 128)
    fields["index_n_heads"] = integer("index_n_heads", 32)
    fields["num_nextn_predict_layers"] = integer("num_nextn_predict_layers", 0, lo=0)
    fields["max_position_embeddings"] = integer("max_position_embeddings", 202_752)
    fields["routed_scaling_factor"] = number("routed_scaling_factor", 1.0, 0.0, 1e6)
    fields["rms_norm_eps"] = number("rms_norm_eps", 1e-5, 0.0, 1.0)
    fields["norm_topk_prob"] = bool(raw.get("norm_topk_prob", True))
    fields["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    fields["rope_theta"] = _rope_theta(raw, source)
    fields["indexer_types"] = _indexer_types(raw, n_layers, source)
    fields["mlp_layer_types"] = _mlp_layer_types(raw, n_layers, source)
    fields["eos_token_ids"] = _eos_ids(raw.get("eos_token_id"), fields["vocab_size"], source)

    if raw.get("hidden_act", "silu") != "silu":
      raise ConfigError(f"{source}: hidden_act {raw['hidden_act']!r} unsupported (GLM-5 uses silu)")
    if raw.get("attention_bias", False) or raw.get("mlp_bias", False):
      raise ConfigError(f"{source}: attention_bias/mlp_bias are not part of GLM-5 and unsupported")
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
      raise ConfigError(f"{source}: scoring_func {raw['scoring_func']!r} unsupported (sigmoid only)")
    cfg = cls(**fields)
    cfg._validate(source)
    return cfg

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> "Config":
    """Reads `config.json` (or a directory holding it)."""
    path = os.fspath(path)
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    try:
      with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    except FileNotFoundError:
      raise ConfigError(f"{path}: config file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return cls.from_dict(raw, source=path)

  def to_hf_dict(self) -> dict[str, Any]:
    """The HF `config.json` contents for this config (used when writing checkpoints)."""
    d = dataclasses.asdict(self)
    d.pop("eos_token_ids")
    d.pop("rope_theta")
    d["indexer_types"] = list(self.indexer_types)
    d["mlp_layer_types"] = list(self.mlp_layer_types)
    d["first_k_dense_replace"] = next(
        (i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"), self.num_hidden_layers)
    eos = list(self.eos_token_ids)
    d["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    d.update(model_type=MODEL_TYPE, architectures=["GlmMoeDsaForCausalLM"], hidden_act="silu",
             num_key_value_heads=self.num_attention_heads, head_dim=self.qk_rope_head_dim,
             rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
             attention_bias=False, dtype="float32")
    return d

  def _validate(self, source: str) -> None:
    def bad(msg):
      raise ConfigError(f"{source}: {msg}")

    e, k = self.n_routed_experts, self.num_experts_per_tok
    if k > e:
      bad(f"num_experts_per_tok={k} exceeds n_routed_experts={e}")
    if e % self.n_group:
      bad(f"n_routed_experts={e} is not divisible by n_group={self.n_group}")
    if self.topk_group > self.n_group:
      bad(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
    per_group = e // self.n_group
    if self.n_group > 1 and per_group < 2:
      bad("group-limited routing needs at least 2 experts per group")
    if k > self.topk_group * per_group:
      bad(f"num_experts_per_tok={k} exceeds the {self.topk_group}×{per_group} experts "
          "that group-limited routing leaves")
    if self.qk_rope_head_dim % 2:
      bad(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    if self.index_head_dim < self.qk_rope_head_dim:
      bad(f"index_head_dim={self.index_head_dim} is smaller than qk_rope_head_dim")
    if self.indexer_types and self.indexer_types[0] != "full":
      bad("indexer_types[0] must be 'full': a 'shared' layer needs an earlier full layer")
    # Weight bytes at fp32 for the dense part; a config claiming petabytes is corrupt.
    if self.vocab_size * self.hidden_size > (1 << 36):
      bad(f"vocab_size×hidden_size = {self.vocab_size * self.hidden_size:,} is absurd")


def _rope_theta(raw: dict, source: str) -> float:
  rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
  if not isinstance(rope, dict):
    raise ConfigError(f"{source}: rope_parameters must be an object")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise ConfigError(f"{source}: rope_type {rope_type!r} is unsupported (GLM-5 uses 'default')")
  theta = rope.get("rope_theta", raw.get("rope_theta", 10_000.0))
  if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
    raise ConfigError(f"{source}: rope_theta must be a number > 1, got {theta!r}")
  return float(theta)


def _indexer_types(raw: dict, n_layers: int, source: str) -> tuple[str, ...]:
  """Explicit `indexer_types`, else `index_topk_pattern`, else the freq/offset formula."""
  types = raw.get("indexer_types")
  pattern = raw.get("index_topk_pattern")
  if types is None and pattern is not None:
    if isinstance(pattern, str):
      if set(pattern) - {"F", "S"}:
        raise ConfigError(f"{source}: index_topk_pattern may hold only 'F' and 'S': {pattern!r}")
      types = [{"F": "full", "S": "shared"}[c] for c in pattern]
    else:
      types = list(pattern)
  if types is None:
    freq = max(int(raw.get("index_topk_freq", 1)), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
  if not isinstance(types, (list, tuple)) or len(types) != n_layers:
    raise ConfigError(f"{source}: indexer_types must list {n_layers} entries, got {types!r}")
  if set(types) - {"full", "shared"}:
    raise ConfigError(f"{source}: indexer_types entries must be 'full' or 'shared': {types!r}")
  return tuple(types)


def _mlp_layer_types(raw: dict, n_layers: int, source: str) -> tuple[str, ...]:
  types = raw.get("mlp_layer_types")
  if types is None:
    n_dense = min(int(raw.get("first_k_dense_replace", 3)), n_layers)
    types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
  if not isinstance(types, (list, tuple)) or len(types) != n_layers:
    raise ConfigError(f"{source}: mlp_layer_types must list {n_layers} entries, got {types!r}")
  if set(types) - {"dense", "sparse"}:
    raise ConfigError(f"{source}: mlp_layer_types entries must be 'dense' or 'sparse': {types!r}")
  return tuple(types)


def _eos_ids(eos: Any, vocab: int, source: str) -> tuple[int, ...]:
  ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
  if not isinstance(ids, (list, tuple)) or not all(
      isinstance(i, int) and not isinstance(i, bool) for i in ids):
    raise ConfigError(f"{source}: eos_token_id must be an int or a list of ints, got {eos!r}")
  for i in ids:
    if not 0 <= i < vocab:
      raise ConfigError(f"{source}: eos_token_id {i} is outside the vocabulary (size {vocab})")
  return tuple(ids)
