"""Tiny random `GlmMoeDsaForCausalLM` checkpoints: the independent reference for model math.

Norm weights, the router bias and the indexer's LayerNorm are randomised because their default
values (ones, zeros) would hide bugs in how they are applied. Indexer tests use 16 indexer heads
so that an index score is almost never exactly 0 (a ReLU of every head), which would create ties
whose order torch.topk leaves unspecified.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

BASE = dict(
    vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
    num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=3, n_routed_experts=8,
    num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
    qk_nope_head_dim=12, index_topk=4, index_head_dim=16, index_n_heads=16,
    first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=[1, 2],
)


# The smallest glm_moe_dsa that still has every part (dense + MoE layers, DSA, MTP on request),
# for tests that build glmjax weights directly rather than through transformers.
TINY = dict(
    model_type="glm_moe_dsa", vocab_size=64, hidden_size=32, intermediate_size=48,
    moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16,
    kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
    num_experts_per_tok=2, index_head_dim=8, index_n_heads=2, first_k_dense_replace=1,
)


def tiny_config(**overrides):
  """A glmjax Config: `TINY` with `overrides`."""
  from glmjax.model.config import Config
  return Config.from_dict({**TINY, **overrides})


def hf_config(**overrides) -> GlmMoeDsaConfig:
  return GlmMoeDsaConfig(**{**BASE, **overrides})


def randomize(model: torch.nn.Module, seed: int, std: float = 0.2) -> torch.nn.Module:
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      p.copy_(1 + 0.1 * noise if "norm" in name else std * noise)
    for name, b in model.named_buffers():
      if "e_score_correction_bias" in name:
        b.copy_(0.1 * torch.randn(b.shape, generator=gen))
  return model.eval()


def make_hf(path: str, seed: int = 0, std: float = 0.2, **overrides) -> GlmMoeDsaForCausalLM:
  """Builds, randomises and saves a tiny HF model at `path`; returns the torch model."""
  torch.manual_seed(seed)
  model = randomize(GlmMoeDsaForCausalLM(hf_config(**overrides)), seed, std)
  model.save_pretrained(path)
  return model


def hf_logits(model, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def rel_err(a, b) -> float:
  """max |a - b| / max |b|: the parity metric used throughout."""
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def tokens(seed: int, batch: int, seq: int, vocab: int = BASE["vocab_size"]) -> np.ndarray:
  return np.random.default_rng(seed).integers(3, vocab, size=(batch, seq)).astype(np.int32)


def shard(path: str, n: int = 3) -> None:
  """Re-saves a single-file checkpoint as `n` shards with an index (tests the sharded path)."""
  from glmjax.formats.checkpoint import INDEX, SINGLE
  from glmjax.formats.safetensors_io import SafetensorsFile, write
  import json
  src = SafetensorsFile(os.path.join(path, SINGLE))
  names = sorted(src.keys())
  weight_map = {}
  for i in range(n):
    fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    part = {k: np.array(src.read(k)) for k in names[i::n]}
    write(os.path.join(path, fname), part)
    weight_map.update({k: fname for k in part})
  del src
  os.remove(os.path.join(path, SINGLE))
  with open(os.path.join(path, INDEX), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)


FP8_SKIP = ("norm", "mlp.gate.weight", "embed_tokens", "lm_head", "e_score_correction_bias",
            "weights_proj")


def to_fp8(src: str, dst: str, block=(16, 24)) -> None:
  """Writes an FP8 (float8_e4m3fn + `weight_scale_inv`) copy of a single-file checkpoint, with
  block scales as in GLM-5-FP8; `block` need not divide the matrices."""
  import json
  import shutil
  import ml_dtypes
  from glmjax.formats.safetensors_io import SafetensorsFile, write
  os.makedirs(dst, exist_ok=True)
  f = SafetensorsFile(os.path.join(src, "model.safetensors"))
  out = {}
  bo, bi = block
  for name in f.keys():
    w = np.array(f.read(name), dtype=np.float32)
    if w.ndim != 2 or any(s in name for s in FP8_SKIP):
      out[name] = w
      continue
    o, i = w.shape
    nb_o, nb_i = -(-o // bo), -(-i // bi)
    scale = np.zeros((nb_o, nb_i), np.float32)
    q = np.zeros_like(w)
    for a in range(nb_o):
      for b in range(nb_i):
        blk = w[a * bo:(a + 1) * bo, b * bi:(b + 1) * bi]
        scale[a, b] = max(np.abs(blk).max(), 1e-12) / 448.0
        q[a * bo:(a + 1) * bo, b * bi:(b + 1) * bi] = blk / scale[a, b]
    out[name] = q.astype(ml_dtypes.float8_e4m3fn)
    out[name + "_scale_inv"] = scale
  write(os.path.join(dst, "model.safetensors"), out)
  with open(os.path.join(src, "config.json")) as fh:
    cfg = json.load(fh)
  cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": list(block)}
  with open(os.path.join(dst, "config.json"), "w") as fh:
    json.dump(cfg, fh)
  for extra in ("generation_config.json",):
    if os.path.exists(os.path.join(src, extra)):
      shutil.copyfile(os.path.join(src, extra), os.path.join(dst, extra))
