"""Resumable training state and the exported model."""

from __future__ import annotations

import os
import pickle
import shutil

import jax
import ml_dtypes

from glmjax.formats.checkpoint import save_hf
from glmjax.model.config import Config
from glmjax.model.weights import Weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def save_state(path: str, step: int, w, opt_state, history: list):
  """Weights, optimizer state and the log history after `step` steps (written atomically)."""
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    pickle.dump({"step": step, "w": jax.device_get(w), "opt": jax.device_get(opt_state),
                 "history": history}, f)
  os.replace(tmp, path)


def load_state(path: str) -> dict:
  """`save_state`'s dict: step, w, opt, history (numpy leaves)."""
  with open(path, "rb") as f:
    return pickle.load(f)


def export(w: Weights, cfg: Config, tok_dir: str, out_dir: str):
  """Writes the shipped model to `out_dir` (emptied first): a bf16 HF checkpoint (router,
  bias and indexer weights_proj stay float32, as `save_hf` keeps them) + tokenizer files."""
  os.makedirs(out_dir, exist_ok=True)
  for f in os.listdir(out_dir):
    os.remove(os.path.join(out_dir, f))
  save_hf(jax.device_get(w), cfg, out_dir, dtype=ml_dtypes.bfloat16)
  for f in TOKENIZER_FILES:
    shutil.copy(os.path.join(tok_dir, f), os.path.join(out_dir, f))
