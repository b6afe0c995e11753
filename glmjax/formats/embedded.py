"""The embedded default model: a small GLM-5 (glm_moe_dsa) trained on the Python stdlib's source.

The checkpoint ships inside the package (`glmjax/embedded_model/`: config.json, bf16
model.safetensors with the MTP layer, tokenizer.json, tokenizer_config.json,
generation_config.json). It was produced by `scripts/train_embedded.py` (the exact command is in
DESIGN.md §25) and exercises every architectural feature: dense and MoE layers, full and shared
DSA indexer layers with index_topk below the context, group-limited sigmoid routing with a
correction bias, a shared expert, and one MTP layer.
"""

from __future__ import annotations

import json
import os

from glmjax.errors import GlmjaxError

NAME = "glm5-stdlib-py-v1"
# The shipped files sit at the package root (glmjax/embedded_model/), beside this wing.
PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "embedded_model")
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json")


def _read_config() -> dict:
  try:
    with open(os.path.join(PATH, "config.json"), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return {}


# The shipped model's HF config.json as a dict ({} if the package was installed without it).
CONFIG = _read_config()


def ensure(progress: bool = True) -> str:
  """Path of the embedded default model (the directory shipped inside the package)."""
  del progress  # nothing to download or write
  missing = [f for f in FILES if not os.path.isfile(os.path.join(PATH, f))]
  if missing:
    raise GlmjaxError(f"{PATH}: the embedded model is incomplete (missing {', '.join(missing)}); "
                      "reinstall glmjax with its package data")
  return PATH
