"""Config parsing: every glm_moe_dsa field, and clear errors for bad configs."""

import json

import pytest
from transformers import GlmMoeDsaConfig

from glmjax.model.config import Config
from glmjax.errors import ConfigError

# GLM-5's published architecture (see shared/reference/glm5-architecture.md §1).
GLM5 = {
    "model_type": "glm_moe_dsa", "vocab_size": 154880, "hidden_size": 6144,
    "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78,
    "num_attention_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 3,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 32, "index_topk_freq": 4, "index_skip_topk_offset": 3,
    "rope_parameters": {"rope_type": "default", "rope_theta": 8000000.0},
    "eos_token_id": [154820, 154827, 154829], "num_nextn_predict_layers": 1,
}


def test_glm5_full_size():
  cfg = Config.from_dict(GLM5)
  assert cfg.qk_head_dim == 256 and cfg.attn_scale == 1 / 16
  assert len(cfg.moe_layers) == 75 and cfg.moe_layers[0] == 3
  full = [i for i, t in enumerate(cfg.indexer_types) if t == "full"]
  assert full[:5] == [0, 1, 2, 6, 10] and len(full) == 21
  assert cfg.eos_token_ids == (154820, 154827, 154829)
  assert cfg.rope_theta == 8e6 and cfg.num_nextn_predict_layers == 1
  assert cfg.is_moe(78) and not cfg.has_indexer(78)  # the MTP layer: MoE, no DSA
  hash(cfg)  # a jit static argument must be hashable


@pytest.mark.parametrize("extra", [
    {"index_topk_freq": 4, "index_skip_topk_offset": 3},
    {"index_topk_freq": 3},
    {"index_topk_pattern": "FSSFFSSF"},
    {"indexer_types": ["full", "shared"] * 4},
])
def test_indexer_types_match_transformers(extra):
  raw = {**GLM5, "num_hidden_layers": 8, **extra}
  for k in ("index_topk_freq", "index_skip_topk_offset"):
    if k not in extra:
      raw.pop(k, None)
  want = GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k != "model_type"}).indexer_types
  assert list(Config.from_dict(raw).indexer_types) == list(want)


def test_mlp_layer_types_and_eos_int():
  cfg = Config.from_dict({**GLM5, "num_hidden_layers": 4, "eos_token_id": 7,
                          "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]})
  assert cfg.moe_layers == (1, 3) and cfg.eos_token_ids == (7,)


def test_round_trip_through_hf_dict():
  cfg = Config.from_dict(GLM5)
  assert Config.from_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


@pytest.mark.parametrize("patch, message", [
    ({"model_type": "llama"}, "model_type"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"vocab_size": -3}, "vocab_size"),
    ({"vocab_size": 3.5}, "vocab_size"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"n_group": 3}, "n_group"),
    ({"n_group": 8, "topk_group": 9}, "topk_group"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"eos_token_id": [5, 10**7]}, "eos_token_id"),
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4}}, "rope_type"),
    ({"indexer_types": ["full"] * 3}, "indexer_types"),
    ({"indexer_types": ["shared"] + ["full"] * 77}, "indexer_types[0]"),
    ({"mlp_layer_types": ["moe"] * 78}, "mlp_layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rms_norm_eps": -1}, "rms_norm_eps"),
])
def test_bad_configs(patch, message):
  raw = {**GLM5, **patch}
  raw = {k: v for k, v in raw.items() if v is not None}
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
    Config.from_dict(raw)


def test_missing_key_named():
  raw = dict(GLM5)
  del raw["kv_lora_rank"]
  with pytest.raises(ConfigError, match="missing required key.*kv_lora_rank"):
    Config.from_dict(raw)


def test_bad_files(tmp_path):
  with pytest.raises(ConfigError, match="config file not found"):
    Config.from_json(tmp_path)
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
    Config.from_json(tmp_path)
  (tmp_path / "config.json").write_text("[1, 2]")
  with pytest.raises(ConfigError, match="expected a JSON object"):
    Config.from_json(tmp_path)
