"""Quality of quantized expert stores against their float model, on held-out text (JSON).

  python scripts/quant_report.py --stores=/tmp/rtn,/tmp/gptq --json=out/quant.json

Per store: mean KL(float ‖ store) in nats per token and top-1 agreement over the first
--tokens tokens of each held-out file (default: the embedded corpus's held-out stdlib files,
never used in calibration), and a per-layer breakdown: each MoE layer's quantized experts
swapped alone into the float model. Same inputs, same numbers.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
import numpy as np  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("float", None, "The float HF checkpoint; default: the embedded model.")
flags.DEFINE_list("stores", None, "Expert stores converted from it, comma-separated.",
                  required=True)
flags.DEFINE_string("corpus", None, "Held-out text: a directory, text file or JSONL file; "
                    "default: the embedded corpus's held-out files.")
flags.DEFINE_integer("tokens", 512, "Tokens scored per file.", lower_bound=2)
flags.DEFINE_integer("files", None, "Only the first N files.", lower_bound=1)
flags.DEFINE_bool("per_layer", True, "Also the per-layer breakdown.")
flags.DEFINE_string("json", None, "JSON output path (default: stdout only).")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import glmjax
  from glmjax.bench import reporting
  from glmjax.formats import corpus
  from glmjax.formats.quality import report
  try:
    if FLAGS.corpus is None:
      named = [(f, corpus.read(f)) for f in corpus.split()[1]]
    else:
      named = corpus.texts_at(FLAGS.corpus)
    named = [(n, t) for n, t in named if t][:FLAGS.files]
    with glmjax.load(FLAGS.float, progress=False) as ref:
      seqs = [np.asarray(ref.tokenizer.encode(t)[:FLAGS.tokens], np.int32) for _, t in named]
      stores = {s: glmjax.load(s, progress=False) for s in FLAGS.stores}
      try:
        rows = report(ref, stores, seqs, FLAGS.per_layer)
      finally:
        for m in stores.values():
          m.close()
  except glmjax.GlmjaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  out = {"float": FLAGS.float or "embedded", "files": [n for n, _ in named],
         "tokens": FLAGS.tokens, "stores": rows}
  for s, r in rows.items():
    print(f"{s}: KL {r['kl']:.3e}  top-1 {r['top1_agreement']:.4f}", file=sys.stderr)
  reporting.write_report(out, FLAGS.json)
  return 0


if __name__ == "__main__":
  app.run(main)
