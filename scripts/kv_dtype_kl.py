"""KL of each KV cache dtype choice against a float32 cache, on held-out text (JSON).

  python scripts/kv_dtype_kl.py --json=out/kv_dtype_kl.json

Scores the first --tokens tokens of each held-out stdlib file of the embedded corpus through the
KV cache (chunked prefill, so every position after the first chunk reads cached latents and
indexer keys), once with a float32 cache and once per other choice of `kv_dtype` (latent and
rope key) and `index_dtype` (indexer key), and reports the mean KL(float32 ‖ choice) in nats per
token, the top-1 agreement, and the bytes one position takes.
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
import numpy as np  # noqa: E402

from glmjax import cli  # noqa: E402

FLAGS = flags.FLAGS
cli.define_model_flag(cli.MODEL_KINDS)
flags.DEFINE_integer("tokens", 512, "Tokens scored per file.", lower_bound=2)
cli.define_load_flags(only=("prefill_chunk",), defaults={"prefill_chunk": 128},
                      notes={"prefill_chunk": "Here: smaller than --tokens, so later chunks read "
                             "the cache."})
flags.DEFINE_list("choices", ["float32:bfloat16", "float32:float8", "bfloat16:float32",
                                "bfloat16:bfloat16", "bfloat16:float8"],
                  "kv_dtype:index_dtype pairs compared with float32:float32.")
flags.DEFINE_integer("files", None, "Score only the first N held-out files (default: all 10).",
                     lower_bound=1)
flags.DEFINE_string("json", None, "JSON output path (default: stdout only).")

def log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import glmjax
  from glmjax.bench import reporting
  from glmjax.formats import corpus
  files = list(corpus.HELD_OUT[:FLAGS.files])
  texts = [corpus.read(f) for f in files]
  rows = []

  def scores(kv: str, index: str) -> list[np.ndarray]:
    with glmjax.load(FLAGS.model, **cli.load_options(), progress=False, kv_dtype=kv,
                     index_dtype=index) as m:
      ids = [m.tokenizer.encode(t)[:FLAGS.tokens] for t in texts if t]
      return [log_softmax(m.score(np.asarray([i]))[0]) for i in ids], m.kv_layout()

  ref, layout = scores("float32", "float32")
  for kv, index in (c.split(":") for c in FLAGS.choices):
    got, layout = scores(kv, index)
    kl = [float((np.exp(r) * (r - g)).sum(-1).mean()) for r, g in zip(ref, got)]
    agree = [float((r.argmax(-1) == g.argmax(-1)).mean()) for r, g in zip(ref, got)]
    rows.append(dict(kv_dtype=kv, index_dtype=index, kl_mean=float(np.mean(kl)),
                     kl_max=float(np.max(kl)), top1_agreement=float(np.mean(agree)),
                     bytes_per_position=layout.page_bytes() / layout.page_size))
    print(f"kv {kv:8s} index {index:8s}: KL {rows[-1]['kl_mean']:.2e} (max "
          f"{rows[-1]['kl_max']:.2e}), top-1 {rows[-1]['top1_agreement']:.4f}, "
          f"{rows[-1]['bytes_per_position']:.0f} B/position", flush=True)
  if FLAGS.json:
    reporting.write_report(dict(files=files, tokens=FLAGS.tokens, rows=rows),
                           FLAGS.json)
  return 0


if __name__ == "__main__":
  app.run(main)
