"""Routing statistics of a GLM-5 model on held-out text, as JSON.

  python scripts/analyze_routing.py --out=/tmp/routing.json          # the embedded model

For each MoE layer (on the held-out stdlib files, teacher-forced in non-overlapping windows of the
model's context):
- load: each expert's fraction of the (token, expert) pairs: min, max, max/mean, coefficient of
  variation, experts never chosen.
- consecutive overlap: mean |E_t ∩ E_{t+1}| / K between neighbouring tokens of a window
  (random routing would give ≈ K/E).
- pilot recall: apply layer L+1's post-attention norm, router and correction bias (its real
  group-limited top-K) to layer L's post-attention residual, and report the mean recall of layer
  L+1's actual top-K (|pilot ∩ actual| / K). `pilot_from_output` does the same from layer L's
  output residual (the input of layer L+1, one MoE block later than the post-attention signal).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import glmjax  # noqa: E402
from glmjax import cli  # noqa: E402
from glmjax.formats import corpus  # noqa: E402
from glmjax.model.attention import attention  # noqa: E402
from glmjax.model.layers import F32, rms_norm, swiglu  # noqa: E402
from glmjax.model.forward import moe_block as moe  # noqa: E402
from glmjax.model.moe import route  # noqa: E402
from glmjax.model.weights import MoE  # noqa: E402

FLAGS = flags.FLAGS
cli.define_model_flag("an HF checkpoint directory; default: the embedded model")
flags.DEFINE_string("out", None, "Write the JSON report here (also printed).")
flags.DEFINE_integer("max_windows", 24, "Windows of context length to analyse at most.")
flags.DEFINE_integer("window", 0, "Window length (default: max_position_embeddings).")


def routing_trace(w, tokens, cfg):
  """Per layer: post-attention residual, MoE routing ids (or None), output residual."""
  b, s = tokens.shape
  x = w.embed[tokens].astype(F32)
  selection, trace = None, []
  for lw in w.layers:
    h = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)
    a, _, selection = attention(lw.attn, h, 0, cfg, selection=selection)
    mid = x + a
    h2 = rms_norm(mid, lw.mlp_norm, cfg.rms_norm_eps)
    if isinstance(lw.mlp, MoE):
      ids, _ = route(h2.reshape(b * s, -1), lw.mlp.router, lw.mlp.bias, cfg)
      x = mid + moe(lw.mlp, h2, cfg)
      ids = ids.reshape(b, s, -1)
    else:
      ids = None
      x = mid + swiglu(h2, lw.mlp.gate_up, lw.mlp.down)
    trace.append((mid, ids, x))
  return trace


def pilot_ids(mid, lw, cfg):
  b, s, d = mid.shape
  h = rms_norm(mid, lw.mlp_norm, cfg.rms_norm_eps)
  ids, _ = route(h.reshape(b * s, d), lw.mlp.router, lw.mlp.bias, cfg)
  return ids.reshape(b, s, -1)


def overlap(a, b):
  """Mean |a ∩ b| / K over rows of id arrays `[N, K]`."""
  hits = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1)
  return float(np.mean(hits / a.shape[1]))


def analyze(model, windows: np.ndarray) -> dict:
  cfg, w = model.config, model.weights
  e, k = cfg.n_routed_experts, cfg.num_experts_per_tok

  @jax.jit
  def run(toks):
    trace = routing_trace(w, toks, cfg)
    ids = [t[1] for t in trace]
    pilots, pilots_out = [], []
    for i in range(len(w.layers) - 1):
      nxt = w.layers[i + 1]
      if isinstance(nxt.mlp, MoE) and ids[i] is not None:
        pilots.append(pilot_ids(trace[i][0], nxt, cfg))
        pilots_out.append(pilot_ids(trace[i][2], nxt, cfg))
    return [x for x in ids if x is not None], pilots, pilots_out

  all_ids, all_p, all_po = None, None, None
  for i in range(0, len(windows), 4):
    ids, p, po = jax.device_get(run(jnp.asarray(windows[i:i + 4])))
    if all_ids is None:
      all_ids, all_p, all_po = [[x] for x in ids], [[x] for x in p], [[x] for x in po]
    else:
      for lst, new in ((all_ids, ids), (all_p, p), (all_po, po)):
        for j, x in enumerate(new):
          lst[j].append(x)
  ids = [np.concatenate(x) for x in all_ids]  # per MoE layer [N, S, K]
  pil = [np.concatenate(x) for x in all_p]
  pil_out = [np.concatenate(x) for x in all_po]
  moe_layers = list(cfg.moe_layers)
  layers = []
  for j, li in enumerate(moe_layers):
    a = ids[j]
    load = np.bincount(a.ravel(), minlength=e) / a.size
    stats = {
        "layer": li,
        "load_min": float(load.min()), "load_max": float(load.max()),
        "load_max_over_mean": float(load.max() * e), "load_cv": float(load.std() / load.mean()),
        "experts_unused": int(np.sum(load == 0)),
        "consecutive_overlap": overlap(a[:, :-1].reshape(-1, k), a[:, 1:].reshape(-1, k)),
    }
    if j + 1 < len(moe_layers) and moe_layers[j + 1] == li + 1:
      nxt = ids[j + 1].reshape(-1, k)
      stats["pilot_recall_next_layer"] = overlap(nxt, pil[j].reshape(-1, k))
      stats["pilot_from_output_recall_next_layer"] = overlap(nxt, pil_out[j].reshape(-1, k))
    layers.append(stats)
  summary = {
      "mean_consecutive_overlap": float(np.mean([s["consecutive_overlap"] for s in layers])),
      "mean_pilot_recall": float(np.mean([s["pilot_recall_next_layer"] for s in layers
                                          if "pilot_recall_next_layer" in s])),
      "mean_pilot_from_output_recall": float(np.mean(
          [s["pilot_from_output_recall_next_layer"] for s in layers
           if "pilot_from_output_recall_next_layer" in s])),
      "random_baseline": k / e,
  }
  return {"experts": e, "top_k": k, "tokens": int(ids[0].shape[0] * ids[0].shape[1]),
          "layers": layers, "summary": summary}


def main(argv):
  del argv
  from glmjax.decoding.text import Tokenizer
  model = glmjax.load(FLAGS.model, progress=False)
  tok = Tokenizer.from_dir(model.path)
  eos = tok.token_id("<|endoftext|>")
  length = FLAGS.window or model.config.max_position_embeddings
  _, held = corpus.split()
  stream = np.concatenate([[eos] + tok.encode(corpus.read(f)) for f in held]).astype(np.int32)
  n = min(len(stream) // length, FLAGS.max_windows)
  windows = stream[:n * length].reshape(n, length)
  report = analyze(model, windows)
  report.update(model=model.path, text="held-out stdlib files: " + ", ".join(held),
                window=length)
  text = json.dumps(report, indent=1)
  print(text)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  app.run(main)
