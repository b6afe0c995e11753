"""KL of quantized dense formats against the float embedded model, on held-out text (JSON).

  python scripts/dense_kl.py --json=out/dense_kl.json

Converts the embedded model six times (the converter's defaults: int4 experts with bf16
dense weights; then the recipes `--dense_bits=8` (group 128, its first decoder layer bf16) and
`--dense_bits=4`; int8 with its first layer int8 at group 64 (the int8 recipe before) and at
group 128; int4 with its first layer int8; int4 experts as by default) and reports each store's mean KL(float ‖ store) in nats
per token over the first --tokens tokens of each held-out stdlib file, and what the dense
format adds to the default store's KL.

Then a sweep on the float model (experts float, so only the dense change shows): each group of
dense matrices alone quantized to int4 (or int8), in-process, as the store would hold them:
the embedding, the lm head, each layer's attention and MLP / shared expert, and each kind of
matrix across layers. It says which matrices are the most sensitive, and what the embedding
costs quantized against bfloat16.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
import numpy as np  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("tokens", 384, "Tokens scored per file.", lower_bound=2)
flags.DEFINE_integer("files", None, "Score only the first N held-out files (default: all).",
                     lower_bound=1)
flags.DEFINE_bool("stores", True, "Convert and score the six stores.")
flags.DEFINE_bool("sweep", True, "Also run the per-matrix sweep on the float model.")
flags.DEFINE_string("json", None, "JSON output path (default: stdout only).")

ATTN = ("q_a", "q_b", "kv_a", "kv_b", "o")


def log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def mean_kl(ref: list[np.ndarray], got: list[np.ndarray]) -> float:
  """Mean over every scored token of KL(ref ‖ got), nats."""
  kl = np.concatenate([(np.exp(r) * (r - g)).sum(-1) for r, g in zip(ref, got)])
  return float(kl.mean())


def quantized(w, bits: int):
  """The float matrix `w` as a `--dense_bits` store's QArray, in groups of 64 (the sweep's,
  as docs/measurements/quantization.md reports it; the int8 recipe's group is 128)."""
  import jax
  from glmjax.formats.quantize import quantize
  return jax.tree_util.tree_map(jax.device_put, quantize(np.asarray(w, np.float32), bits))


def with_quantized(w, bits_of):
  """Weights `w` with each dense matrix quantized to `bits_of(path)` bits (0: left float).
  Paths: "embed", "lm_head", "{i}.attn.{q_a,q_b,kv_a,kv_b,o}", "{i}.attn.indexer", "{i}.mlp"."""
  from glmjax.model.weights import MoE

  def q(x, path):
    b = bits_of(path)
    return quantized(x, b) if b else x

  out = dataclasses.replace(w, layers=list(w.layers), embed=q(w.embed, "embed"),
                            lm_head=None if w.lm_head is None else q(w.lm_head, "lm_head"))
  for i, lw in enumerate(w.layers):
    attn = {k: q(getattr(lw.attn, k), f"{i}.attn.{k}") for k in ATTN}
    ix = lw.attn.indexer
    if ix is not None:
      ix = dataclasses.replace(ix, wq_b=q(ix.wq_b, f"{i}.attn.indexer"),
                               wk=q(ix.wk, f"{i}.attn.indexer"))
    mlp = lw.mlp
    one = mlp.shared if isinstance(mlp, MoE) else mlp
    one = dataclasses.replace(one, gate_up=q(one.gate_up, f"{i}.mlp"), down=q(one.down, f"{i}.mlp"))
    mlp = dataclasses.replace(mlp, shared=one) if isinstance(mlp, MoE) else one
    out.layers[i] = dataclasses.replace(lw, attn=dataclasses.replace(lw.attn, indexer=ix, **attn),
                                        mlp=mlp)
  return out


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import glmjax
  from glmjax.bench import reporting
  from glmjax.formats import corpus, embedded
  from glmjax.formats.convert import convert
  from glmjax.model import forward
  files = list(corpus.HELD_OUT[:FLAGS.files])
  texts = [t for t in (corpus.read(f) for f in files) if t]
  src = embedded.ensure(progress=False)

  with glmjax.load(src, progress=False) as ref_model:
    ids = [np.asarray([ref_model.tokenizer.encode(t)[:FLAGS.tokens]], np.int32) for t in texts]
    ref = [log_softmax(ref_model.score(i)[0]) for i in ids]
    cfg, w_float = ref_model.config, ref_model.weights

  stores = {"default (bf16 dense)": {}, "int8 dense": {"dense_bits": 8},
            "int8 G64 dense, first layer int8": {"dense_bits": 8, "dense_group_size": 64,
                                                 "dense_first_layer_bits": 8},
            "int8 dense, first layer int8": {"dense_bits": 8, "dense_first_layer_bits": 8},
            "int4 dense": {"dense_bits": 4},
            "int4 dense, first layer int8": {"dense_bits": 4, "dense_first_layer_bits": 8}}
  rows = []
  with tempfile.TemporaryDirectory(prefix="dense-kl-") as tmp:
    for n, (name, kw) in enumerate(stores.items() if FLAGS.stores else ()):
      dst = os.path.join(tmp, str(n))
      convert(src, dst, progress=False, **kw)
      with glmjax.load(dst, progress=False) as m:
        got = [log_softmax(m.score(i)[0]) for i in ids]
      rows.append(dict(store=name, kl=mean_kl(ref, got)))
      rows[-1]["added_to_default"] = rows[-1]["kl"] - rows[0]["kl"]
      print(f"{name:30s} KL {rows[-1]['kl']:.3e}  (+{rows[-1]['added_to_default']:.2e})",
            flush=True)

  sweep = []
  if FLAGS.sweep:
    def scores(w):  # whole sequences, no cache: the same path for every variant
      score = forward.entry_points(w)["score"]
      return [log_softmax(np.asarray(score(w, i, forward.fresh_start(), cfg=cfg)[0]))
              for i in ids]

    ref_float = scores(w_float)

    def run(label, bits_of):
      sweep.append(dict(quantized=label, kl=mean_kl(ref_float, scores(with_quantized(
          w_float, bits_of)))))
      print(f"  {label:44s} KL {sweep[-1]['kl']:.3e}", flush=True)

    def only(bits, test):
      return lambda p: bits if test(p) else 0

    for b in (8, 4):
      run(f"int{b}: all dense matmuls and the embedding", lambda p, b=b: b)
      run(f"int{b}: all but the embedding", only(b, lambda p: p != "embed"))
      run(f"int{b}: embedding only", only(b, lambda p: p == "embed"))
      run(f"int{b}: lm_head only", only(b, lambda p: p == "lm_head"))
    run("int4, embedding int8", lambda p: 8 if p == "embed" else 4)
    run("int4, lm_head int8 (the --dense_bits=4 recipe)", lambda p: 8 if p == "lm_head" else 4)
    run("int4, lm_head and layer 0 int8",
        lambda p: 8 if p == "lm_head" or p.startswith("0.") else 4)
    run("int8 but the embedding, layer 0 float", lambda p: 0 if p == "embed" or
        p.startswith("0.") else 8)
    run("int4, embedding and lm_head int8", lambda p: 8 if p in ("embed", "lm_head") else 4)
    run("int4, embedding, lm_head and kv_b int8",
        lambda p: 8 if p in ("embed", "lm_head") or p.endswith("kv_b") else 4)
    for i in range(cfg.num_hidden_layers):
      run(f"int4: layer {i} attention only", only(4, lambda p, i=i: p.startswith(f"{i}.attn")))
      run(f"int4: layer {i} mlp/shared only", only(4, lambda p, i=i: p == f"{i}.mlp"))
    for k in ATTN + ("indexer",):
      run(f"int4: {k} (every layer) only", only(4, lambda p, k=k: p.endswith(f".attn.{k}")))
  if FLAGS.json:
    reporting.write_report(dict(files=files, tokens=FLAGS.tokens, stores=rows, sweep=sweep),
                           FLAGS.json)
  return 0


if __name__ == "__main__":
  app.run(main)
