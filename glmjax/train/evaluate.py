"""Held-out evaluation of an exported model through the inference path (`glmjax.load`)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import glmjax
from glmjax.decoding.text import Tokenizer
from glmjax.formats import corpus
from glmjax.model.forward import forward
from glmjax.model.mtp import mtp_logits
from glmjax.train.data import EOS_TOKEN

MTP_WINDOWS = 24  # held-out windows of the MTP acceptance measurement


def mtp_agreement(logits_fn, ids: np.ndarray, ctx: int) -> dict:
  """Teacher-forced MTP greedy acceptance over the first MTP_WINDOWS windows of `ctx` + 1
  tokens of `ids`: at position i (true prefix t_0..t_{i+1} known) the draft argmax MTP_i(t_{i+2})
  is accepted iff it equals the main model's greedy argmax at i + 1 (what greedy verification
  would emit); also the MTP head's top-1 accuracy. `logits_fn(chunk)` gives both argmaxes."""
  n = (len(ids) - 1) // (ctx + 1)
  acc = hit = cnt = 0
  for i in range(0, min(n, MTP_WINDOWS), 4):
    chunk = np.stack([ids[j * (ctx + 1):(j + 1) * (ctx + 1)] for j in range(i, min(i + 4, n))])
    main_arg, mtp_arg = map(np.asarray, logits_fn(jnp.asarray(chunk)))
    # main_arg[:, j] predicts t_{j+1}; mtp_arg[:, j] predicts t_{j+2}
    acc += int(np.sum(mtp_arg[:, :-1] == main_arg[:, 1:]))
    hit += int(np.sum(mtp_arg[:, :-1] == chunk[:, 2:ctx + 1]))
    cnt += mtp_arg[:, :-1].size
  return {"greedy_acceptance": acc / cnt, "top1_accuracy": hit / cnt, "positions": cnt}


def evaluate(model_dir: str | None, stride: int = 512, quick: bool = False) -> dict:
  """Bits per byte on the held-out stdlib files (`quick`: the small held-out slice only) and,
  unless quick, on this repository's code and a numpy sample, plus the MTP acceptance; the
  model at `model_dir` (None: the embedded one), scored in windows of its full context."""
  model = glmjax.load(model_dir, progress=False)
  cfg, w = model.config, model.weights
  tok = Tokenizer.from_dir(model.path)
  eos = tok.token_id(EOS_TOKEN)
  ctx = cfg.max_position_embeddings

  @jax.jit
  def logp_fn(toks):
    return jax.nn.log_softmax(forward(w, toks, cfg)[0], axis=-1)

  @jax.jit
  def argmax_fn(toks):
    logits, h, _ = forward(w, toks[:, :-1], cfg)
    mlog, _ = mtp_logits(w, h, toks[:, 1:], cfg)
    return jnp.argmax(logits, -1), jnp.argmax(mlog, -1)

  def score(x):
    return logp_fn(jnp.asarray(x))

  held = corpus.HELD_OUT_SMALL if quick else corpus.split()[1]
  res = {}
  t0 = time.time()
  res["stdlib_heldout"] = corpus.bits_per_byte(score, [corpus.read(f) for f in held], tok.encode,
                                               eos, ctx, stride, batch=4)
  if not quick:
    for name, files in (("repo_glmjax", corpus.non_stdlib_files()),
                        ("numpy_sample", corpus.numpy_files())):
      texts = []
      for f in files:
        with open(f, encoding="utf-8") as fh:
          texts.append(fh.read())
      res[name] = corpus.bits_per_byte(score, texts, tok.encode, eos, ctx, stride, batch=4)
    ids = np.concatenate([[eos] + tok.encode(corpus.read(f)) for f in held]).astype(np.int32)
    res["mtp"] = mtp_agreement(argmax_fn, ids, ctx)
  res["eval_s"] = time.time() - t0
  res["context"] = ctx
  res["stride"] = stride
  return res
