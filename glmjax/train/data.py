"""The training data: the tokenizer, the token stream, the data order and the curriculum."""

from __future__ import annotations

import os

import numpy as np

from glmjax.decoding.text import Tokenizer, train_bpe_tokenizer
from glmjax.errors import InputError
from glmjax.formats import corpus

EOS_TOKEN = "<|endoftext|>"  # the document separator and end of text


def build_tokenizer(work_dir: str, vocab_size: int, train_files) -> Tokenizer:
  """The byte-level BPE of `work_dir`/tokenizer, trained on `train_files` on the first call
  (its generation config samples at temperature 0.8, top-p 0.95, and stops at EOS_TOKEN)."""
  tok_dir = os.path.join(work_dir, "tokenizer")
  if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
    return Tokenizer.from_dir(tok_dir)
  texts = [t for t in (corpus.read(f) for f in train_files) if t]
  tmp = train_bpe_tokenizer(texts, vocab_size, tok_dir + ".tmp")
  eos = tmp.token_id(EOS_TOKEN)
  gen = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "eos_token_id": eos,
         "pad_token_id": eos}
  tok = train_bpe_tokenizer(texts, vocab_size, tok_dir + ".tmp", generation_config=gen)
  os.rename(tok_dir + ".tmp", tok_dir)
  return tok


def token_stream(tok: Tokenizer, files, eos: int) -> np.ndarray:
  """All files' tokens `[N]` int32, each file preceded by the document separator `eos`."""
  texts = [t for t in (corpus.read(f) for f in files) if t]
  return np.concatenate([np.asarray([eos] + tok.encode(t), np.int32) for t in texts])


def batch_at(stream: np.ndarray, seed: int, step: int, batch: int, length: int) -> np.ndarray:
  """The training batch `[batch, length]` of `step`: random crops of the stream (depends only
  on seed and step, so a resumed run sees the same data)."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(stream) - length, size=batch)
  return np.stack([stream[s:s + length] for s in starts])


def parse_phases(spec: str) -> list[tuple[int, int]]:
  """The context-length curriculum "seq:steps,seq:steps,..." → [(seq, steps), ...]."""
  try:
    phases = [tuple(int(v) for v in p.split(":")) for p in spec.split(",")]
  except ValueError:
    phases = []
  if not phases or any(len(p) != 2 or min(p) < 1 for p in phases):
    raise InputError(f"phases {spec!r}: expected comma-separated seq:steps pairs, e.g. 256:700")
  return phases


def phase_at(phases: list[tuple[int, int]], step: int, batch_tokens: int) -> tuple[int, int]:
  """(sequence length, batch size) of global step `step`: batch = batch_tokens // seq."""
  for seq, n in phases:
    if step < n:
      break
    step -= n
  return seq, max(batch_tokens // seq, 1)
