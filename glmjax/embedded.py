"""The embedded default model.

Until a trained model ships, the default is a small GLM-5-architecture model with deterministic
random weights, written once in HF format to a cache directory. It exercises every architectural
feature: dense and MoE layers, full and shared indexer layers, group-limited routing, an
index_topk smaller than a typical prompt, and an MTP layer.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from glmjax.config import Config
from glmjax.errors import GlmjaxError

NAME = "glm5-tiny-random-v1"
SEED = 20261130

CONFIG = {
    "model_type": "glm_moe_dsa", "vocab_size": 1024, "hidden_size": 128,
    "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 5,
    "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 16, "num_experts_per_tok": 4,
    "n_shared_experts": 1, "n_group": 2, "topk_group": 2, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "index_topk": 16, "index_head_dim": 32, "index_n_heads": 8,
    "indexer_types": ["full", "shared", "full", "shared", "shared"],
    "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse"],
    "eos_token_id": [1, 2], "num_nextn_predict_layers": 1, "max_position_embeddings": 4096,
}


def cache_dir() -> str:
  """Where generated models live: $GLMJAX_CACHE, else ~/.cache/glmjax."""
  return os.environ.get("GLMJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "glmjax")


def ensure(progress: bool = True) -> str:
  """Path of the embedded default model, writing it on first use (atomically)."""
  from glmjax import checkpoint, weights

  root = cache_dir()
  path = os.path.join(root, NAME)
  if os.path.exists(os.path.join(path, "config.json")):
    return path
  try:
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=NAME + ".", dir=root)
  except OSError as e:
    raise GlmjaxError(f"cannot write the embedded model under {root} ({e}); set GLMJAX_CACHE "
                      "to a writable directory") from None
  cfg = Config.from_dict(CONFIG, source="embedded config")
  w = weights.init(cfg, seed=SEED, std=0.08)
  checkpoint.save_hf(w, cfg, tmp)
  try:
    os.rename(tmp, path)
  except OSError:  # another process won the race; its copy is identical
    shutil.rmtree(tmp, ignore_errors=True)
  return path
