"""Calibration statistics from a teacher-forced replay (issue 30): per MoE layer and routed
expert, what its inputs looked like on calibration text.

Per expert `e` of a MoE layer, over the real (non-padding) tokens routed to it:
- `count [E]`: how many tokens;
- `gate_up_sq [E, D]`: Σ x², x the normed hidden state the expert's gate_up reads;
- `down_sq [E, F]`: Σ a², a = silu(g)·u the SwiGLU output its down projection reads;
- with `gram=True`, `gate_up_gram [E, D, D]` = Σ xᵀx and `down_gram [E, F, F]` = Σ aᵀa
  (GPTQ's Hessians). Sums, not means: batches add up exactly on the host (float64).

The statistics are taken inside the same jitted forward that scores the text, by an expert
provider that wraps the resident one (as `records.recording` does for routing): the model's
outputs are unchanged. Each expert's SwiGLU output is recomputed from its own weights (float,
or the quantized pool dequantized: a store's statistics are the quantized model's), one expert
at a time (`lax.map`), so the working memory is one expert's `[T, 2F]`, not `[T, E, 2F]`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.model.config import Runtime
from glmjax.model.forward import Drive, forward, resident_experts, valid_rows
from glmjax.model.quant import ExpertPool, dequantize
from glmjax.model.weights import MoE
from pallas_kernels.xla import take_experts

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def expert_weights(experts, e):
  """Float `(gate_up [2F, D], down [D, F])` of expert `e` (a traced index) of a layer's float
  `Experts` or quantized `ExpertPool` (dequantized exactly)."""
  if isinstance(experts, ExpertPool):
    return (dequantize(take_experts(experts.gate_up, e)),
            dequantize(take_experts(experts.down, e)))
  return experts.gate_up[e].astype(F32), experts.down[e].astype(F32)


def expert_stats(flat, ids, valid, experts, gram: bool) -> dict:
  """One MoE layer's sums for tokens `flat [T, D]` routed to `ids [T, K]`, `valid [T]` the
  real tokens: a dict of `[E, ...]` float32 arrays (see the module docstring)."""
  n_experts = jax.tree_util.tree_leaves(experts)[0].shape[0]
  flat = flat.astype(F32)

  def one(e):
    routed = (jnp.any(ids == e, axis=-1) & valid).astype(F32)  # [T]
    gu, _ = expert_weights(experts, e)
    h = jnp.dot(flat, gu.T, precision=HIGHEST)  # [T, 2F]
    g, u = jnp.split(h, 2, axis=-1)
    x = flat * routed[:, None]  # [T, D], zero rows for tokens not routed here
    a = jax.nn.silu(g) * u * routed[:, None]  # [T, F]
    out = {"count": jnp.sum(routed), "gate_up_sq": jnp.sum(x * x, 0), "down_sq": jnp.sum(a * a, 0)}
    if gram:
      out["gate_up_gram"] = jnp.dot(x.T, x, precision=HIGHEST)
      out["down_gram"] = jnp.dot(a.T, a, precision=HIGHEST)
    return out

  return jax.lax.map(one, jnp.arange(n_experts))


def collecting(experts, out: list, gram: bool):
  """The provider `experts`, appending each MoE layer's `expert_stats` to `out` on the way."""
  def provide(layer, m: MoE, chunks):
    for r in chunks:
      out.append(expert_stats(r.flat, r.ids, valid_rows(r.x.shape, r.n_valid, jnp), m.experts,
                              gram))
    yield from experts(layer, m, chunks)
  return provide


@functools.partial(jax.jit, static_argnames=("cfg", "gram", "kernel"))
def stats_fn(w, tokens, n_valid, start, cfg, gram: bool = True, kernel: str = "auto") -> dict:
  """Per MoE layer (in order) the sums of `expert_stats` for `tokens [B, S]`, each row's first
  `n_valid [B]` positions real: a dict of `[L, E, ...]` arrays. No logits are kept."""
  out: list = []
  experts = collecting(resident_experts(Runtime(kernel)), out, gram)
  forward(w, tokens, cfg, n_valid=n_valid, start=start, drive=Drive(experts))
  return {k: jnp.stack([o[k] for o in out]) for k in out[0]}


class Accumulator:
  """Float64 running sums of `stats_fn`'s batches (on the host)."""

  def __init__(self):
    self.sums: dict[str, np.ndarray] = {}

  def add(self, batch: dict) -> None:
    for k, v in batch.items():
      v = np.asarray(v, np.float64)
      self.sums[k] = v if k not in self.sums else self.sums[k] + v


def gptq_layer(weights, layer: int, r: int, sums: dict, min_tokens: int, bits: int,
               group_size: int):
  """`weights` (a float model's) with MoE layer `layer`'s routed experts replaced by their
  `--quant=gptq` quantization under the `r`-th layer's statistics in `sums` (dequantized back
  to float32: the quantized model's numbers), exactly as `convert.py` quantizes them."""
  from glmjax.formats.calibration import expert_statistics, quantize_matrix
  from glmjax.formats.quality import with_layer
  ex = weights.layers[layer].mlp.experts
  parts = {}
  for name in ("gate_up", "down"):
    old = getattr(ex, name)
    mats = np.asarray(old, np.float32)  # [E, O, K]
    # Placed as the leaf it replaces (committed, same sharding): an uncommitted array would
    # make every pass a new mix of arguments, so stats_fn would compile once per MoE layer.
    parts[name] = jax.device_put(np.stack([
        np.asarray(dequantize(quantize_matrix(
            mats[e], "gptq", expert_statistics(sums, r, e, min_tokens), name, bits,
            group_size)), np.float32) for e in range(mats.shape[0])]), old.sharding)
  return with_layer(weights, layer, type(ex)(**parts))


def collect(model, rows: list, batch: int, gram: bool, progress: bool = True,
            sequential: bool = True, bits: int = 4, group_size: int = 64) -> dict:
  """The float64 sums `[L, E, ...]` over `rows` ((tokens `[seq]`, real length, last) as
  `corpus.rows_of` gives them), `batch` rows per forward pass; layer-sequential when
  `sequential` (see `calibrate`)."""
  from tqdm import tqdm
  from glmjax.formats import calibration
  cfg, moe_layers, put = model.config, model.moe_layers, model.executor.put
  seq = len(rows[0][0])
  passes = len(moe_layers) if sequential else 1
  with tqdm(total=sum(r[1] for r in rows) * passes, unit="tok", unit_scale=True,
            disable=not progress,
            desc="calibrating" + (f" ({passes} layer-sequential passes)" if sequential else "")
            ) as bar:

    def one_pass(weights) -> dict:
      acc = Accumulator()
      for b in range(0, len(rows), batch):
        toks = np.zeros((batch, seq), np.int32)
        valid = np.zeros(batch, np.int32)
        for r, (row, length, _) in enumerate(rows[b:b + batch]):
          toks[r], valid[r] = row, length
        acc.add(stats_fn(weights, put(toks), put(valid), put(0, jnp.int32), cfg=cfg,
                         gram=gram, kernel=model.options.moe_kernel))
        bar.update(int(valid.sum()))
      return acc.sums

    weights = model.weights
    if passes > 1:  # float32 experts from the first pass on, as gptq_layer's are: one program
      from glmjax.formats.quality import with_layer  # for all passes (bfloat16: one a pass)
      for layer in moe_layers:
        ex = weights.layers[layer].mlp.experts
        weights = with_layer(weights, layer, type(ex)(gate_up=ex.gate_up.astype(jnp.float32),
                                                      down=ex.down.astype(jnp.float32)))
    sums = one_pass(weights)
    for r in range(1, passes):  # layer r's statistics from the pass after layer r-1 is quantized
      weights = gptq_layer(weights, moe_layers[r - 1], r - 1, sums, calibration.MIN_TOKENS,
                           bits, group_size)
      later = one_pass(weights)
      for k in sums:
        sums[k][r:] = later[k][r:]
  return sums


def calibrate(model, texts: list[str], max_tokens: int = 65536, batch: int = 4, seq: int = 512,
              gram: bool | None = None, progress: bool = True, sequential: bool = True,
              bits: int = 4, group_size: int = 64) -> tuple[dict, dict]:
  """Runs `model` (a resident `glmjax.Model`: float checkpoint or expert store) teacher-forced
  over `texts` (each one sequence, cut into rows of `seq`; `max_tokens` positions at most,
  0 = all) in batches of `batch` rows. Returns (float64 sums `[L, E, ...]`, meta).
  `gram=None` keeps the Gram matrices when they fit `formats.calibration.GRAM_LIMIT`.

  `sequential` (a float checkpoint with Grams only; GPTQ's sequential mode): each MoE layer's
  statistics are taken with the MoE layers before it already quantized by gptq at `bits` and
  `group_size` from their own statistics, as `convert.py --quant=gptq` will quantize them, so
  each layer is calibrated on the inputs the quantized model gives it. One forward pass per
  MoE layer instead of one."""
  from glmjax.errors import InputError
  from glmjax.formats import calibration, corpus, store
  model.executor.resident_weights(f"{model.path}: calibration runs the resident jitted forward "
                                  "(a layer-by-layer pass is not built)")
  if model.tokenizer is None:
    raise InputError(f"{model.path}: no tokenizer.json; a text corpus needs one")
  cfg = model.config
  moe_layers = model.moe_layers
  size = calibration.gram_bytes(len(moe_layers), cfg.n_routed_experts, cfg.hidden_size,
                                cfg.moe_intermediate_size)
  gram = size <= calibration.GRAM_LIMIT if gram is None else gram
  # A store's experts are quantized already; without Grams there is no gptq to run.
  sequential = sequential and gram and not store.is_store(model.path) and len(moe_layers) > 1
  sequences, total = [], 0
  for t in texts:  # only as much of the corpus as is read
    if max_tokens and total >= max_tokens:
      break
    sequences.append(np.asarray(model.tokenizer.encode(t), np.int32))
    total += len(sequences[-1])
  n = min(total, max_tokens) if max_tokens else total
  rows = list(corpus.rows_of(sequences, seq, n))
  sums = collect(model, rows, batch, gram, progress, sequential, bits, group_size)
  count = sums["count"]
  meta = {"tokens": n, "max_tokens": max_tokens, "batch": batch, "seq": seq, "gram": gram,
          "moe_layers": moe_layers, "n_experts": cfg.n_routed_experts, "hidden": cfg.hidden_size,
          "intermediate": cfg.moe_intermediate_size, "min_tokens": calibration.MIN_TOKENS,
          "fallback_experts": int((count < calibration.MIN_TOKENS).sum()),
          "min_expert_tokens": int(count.min()),
          "sequential": ({"method": "gptq", "bits": bits, "group_size": group_size}
                         if sequential else None)}
  return sums, meta
