"""How far quantized stores are from their float model, on held-out text (issue 30's report).

Per store: mean KL(float ‖ store) in nats per scored token and top-1 agreement (the share of
positions where both models' most likely next token is the same), over teacher-forced
sequences. The per-layer breakdown swaps one MoE layer's quantized experts (the store's own
pool, as the store computes them) into the float model at a time: the error that layer's
quantization adds alone. Everything runs the resident jitted forward with fixed shapes, so the
same inputs give the same numbers (tested).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from glmjax.model.config import Runtime
from glmjax.model.forward import entry_points, fresh_start


def log_softmax(x) -> np.ndarray:
  """float64 log-probabilities of logits `[..., V]`."""
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref: list[np.ndarray], got: list[np.ndarray]) -> dict:
  """KL(ref ‖ got) mean over all positions, per sequence, and top-1 agreement; inputs are
  log-probabilities `[S, V]` per sequence."""
  kls = [(np.exp(r) * (r - g)).sum(-1) for r, g in zip(ref, got)]
  agree = np.concatenate([r.argmax(-1) == g.argmax(-1) for r, g in zip(ref, got)])
  return {"kl": float(np.concatenate(kls).mean()),
          "kl_per_sequence": [float(k.mean()) for k in kls], "top1_agreement": float(agree.mean())}


def scores(weights, cfg, sequences: list[np.ndarray], kernel: str = "auto") -> list[np.ndarray]:
  """Log-probabilities `[S, V]` of each int32 sequence `[S]` under `weights` (one pass each)."""
  score = entry_points(weights)["score"]
  return [log_softmax(score(weights, np.asarray(s, np.int32)[None], fresh_start(), cfg=cfg,
                            runtime=Runtime(kernel))[0]) for s in sequences]


def with_layer(weights, layer: int, experts):
  """`weights` with MoE layer `layer`'s routed experts replaced by `experts`."""
  layers = list(weights.layers)
  lw = layers[layer]
  layers[layer] = dataclasses.replace(lw, mlp=dataclasses.replace(lw.mlp, experts=experts))
  return dataclasses.replace(weights, layers=layers)


def report(float_model, stores: dict, sequences: list[np.ndarray], per_layer: bool = True,
           ) -> dict:
  """{store name: {kl, kl_per_sequence, top1_agreement, layers: {layer: kl}}} for each resident
  `glmjax.Model` in `stores` against `float_model` on `sequences`."""
  cfg = float_model.config
  ref = scores(float_model.weights, cfg, sequences)
  out = {}
  for name, m in stores.items():
    m.executor.resident_weights(f"{m.path}: the report needs every expert resident")
    kernel = m.options.moe_kernel
    row = compare(ref, scores(m.weights, cfg, sequences, kernel))
    if per_layer:
      row["layers"] = {
          str(i): compare(ref, scores(with_layer(float_model.weights, i, m.weights.layers[i].mlp
                                                 .experts), cfg, sequences, kernel))["kl"]
          for i in m.moe_layers}
    out[name] = row
  return out
