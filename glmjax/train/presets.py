"""The embedded model's architecture (and a tiny one for tests) and its fresh weights."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from glmjax.model.config import Config
from glmjax.model.weights import Weights, abstract, map_infos

SIZES = ("embedded", "tiny")


def make_config(size: str = "embedded", vocab_size: int = 4096, eos_id: int = 6) -> Config:
  """The architecture of the shipped model (or a tiny one for tests)."""
  if size == "tiny":
    raw = dict(hidden_size=48, intermediate_size=96, moe_intermediate_size=16,
               num_hidden_layers=3, num_attention_heads=2, q_lora_rank=24, kv_lora_rank=16,
               qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8,
               num_experts_per_tok=2, n_group=2, topk_group=2, index_topk=8, index_head_dim=16,
               index_n_heads=4, indexer_types=["full", "shared", "full"],
               mlp_layer_types=["dense", "sparse", "sparse"], max_position_embeddings=256)
  else:
    raw = dict(hidden_size=192, intermediate_size=512, moe_intermediate_size=64,
               num_hidden_layers=6, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64,
               qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32,
               num_experts_per_tok=4, n_group=4, topk_group=2, index_topk=128,
               index_head_dim=32, index_n_heads=8,
               indexer_types=["full", "shared", "full", "shared", "full", "shared"],
               mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
               max_position_embeddings=1024)
  raw.update(model_type="glm_moe_dsa", vocab_size=vocab_size, n_shared_experts=1,
             norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             eos_token_id=eos_id, num_nextn_predict_layers=1, tie_word_embeddings=False)
  return Config.from_dict(raw, source=f"{size} training config")


def init_params(cfg: Config, seed: int, std: float = 0.02) -> Weights:
  """Fresh weights: N(0, std) matrices (output projections scaled by 1/√(2L)), unit norms,
  zero biases. Deterministic in `seed` (numpy PCG64)."""
  rng = np.random.default_rng(seed)
  out_scale = 1.0 / math.sqrt(2 * (cfg.num_hidden_layers + 1))

  def make(info):
    if info.init == "ones":
      x = np.ones(info.shape)
    elif info.init == "zeros":
      x = np.zeros(info.shape)
    else:
      s = std
      name = info.hf_names[-1]
      if name.endswith(("o_proj.weight", "down_proj.weight")):
        s *= out_scale
      x = s * rng.standard_normal(info.shape)
    return jnp.asarray(x, jnp.float32)

  return map_infos(make, abstract(cfg, jnp.float32, with_mtp=True))
