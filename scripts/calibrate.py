"""Calibration statistics for `convert.py --quant=imatrix|gptq` (issue 30).

  python scripts/calibrate.py --out=/tmp/stats                      # embedded model, 65,536 tokens
  python scripts/calibrate.py --model=/models/GLM-5 --corpus=docs.jsonl --out=/nvme/stats
  python scripts/convert.py --src=/models/GLM-5 --dst=/nvme/glm5-gptq --quant=gptq \\
      --calibration=/nvme/stats

Runs the model teacher-forced over the corpus (jitted, batches of --batch rows × --seq tokens)
and records per MoE layer and routed expert: the token count, Σ x² of its gate_up inputs (the
normed hidden state) and of its down inputs (the SwiGLU output), and, when every layer's fit in
2 GiB (`glmjax.formats.calibration.GRAM_LIMIT`), the Gram matrices Σ xᵀx GPTQ needs. The
default corpus is the embedded model's training split (shuffled with a fixed seed), never its
held-out files. --model may be a float checkpoint or an expert store (then the statistics are
the quantized model's). Experts routed fewer than 64 tokens are quantized later with their
layer's pooled statistics; their number is printed and recorded.

Layer-sequential (the default, --sequential; a float checkpoint with Gram matrices): each MoE
layer's statistics are taken with the MoE layers before it already quantized by gptq at
--expert_bits and --group_size (the converter's defaults, 4 and 64), as `convert.py
--quant=gptq` will quantize them: one pass over the corpus per MoE layer (GPTQ's own
sequential mode; on the embedded model lower KL than one pass on four 64k samples of five,
mean -3.6%, but not at 16k tokens: DESIGN.md §24).
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

from glmjax import cli  # noqa: E402

FLAGS = flags.FLAGS
cli.define_model_flag(cli.MODEL_KINDS)
flags.DEFINE_string("out", None, "Statistics directory to write (must not exist; it appears "
                    "whole at the end, so a killed run leaves nothing there to delete).",
                    required=True)
flags.DEFINE_string("corpus", None, "A directory of text files, a text file or a JSONL file "
                    "(\"text\" field); default: the embedded corpus's training split.")
flags.DEFINE_integer("max_tokens", 65536, "Calibration tokens at most (0 = the whole corpus).",
                     lower_bound=0)
flags.DEFINE_integer("batch", 4, "Rows per forward pass.", lower_bound=1)
flags.DEFINE_integer("seq", 512, "Tokens per row.", lower_bound=1)
flags.DEFINE_bool("sequential", True, "Take each MoE layer's statistics with the layers before "
                  "it gptq-quantized (one pass per MoE layer); float checkpoints with Grams.")
flags.DEFINE_enum("expert_bits", "4", ["4", "8"], "Bits the sequential passes quantize with "
                  "(use convert.py's --expert_bits).")
flags.DEFINE_integer("group_size", 64, "Group size the sequential passes quantize with (use "
                     "convert.py's --group_size).", lower_bound=2)
flags.DEFINE_enum("gram", "auto", ["auto", "on", "off"],
                  "Keep the Gram matrices (gptq needs them); auto: when they fit 2 GiB.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import glmjax
  from glmjax.formats import calibration, corpus, store
  from glmjax.formats.calibrate import calibrate
  t0 = time.perf_counter()
  try:
    if os.path.lexists(FLAGS.out):
      raise glmjax.InputError(f"--out {FLAGS.out}: already exists")
    if FLAGS.corpus is None:
      texts = [t for t in (corpus.read(f) for f in corpus.train_sample()) if t]
    else:
      texts = [t for _, t in corpus.texts_at(FLAGS.corpus)]
    with glmjax.load(FLAGS.model, progress=False) as model:
      sums, meta = calibrate(model, texts, FLAGS.max_tokens, FLAGS.batch, FLAGS.seq,
                             gram={"auto": None, "on": True, "off": False}[FLAGS.gram],
                             sequential=FLAGS.sequential, bits=int(FLAGS.expert_bits),
                             group_size=FLAGS.group_size)
      meta.update(model=os.path.abspath(model.path),
                  corpus=FLAGS.corpus or "embedded training split",
                  quantized_model=store.is_store(model.path))
    meta = calibration.save(FLAGS.out, sums, meta)
  except glmjax.GlmjaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"{FLAGS.out}: {meta['tokens']} tokens, {len(meta['moe_layers'])} MoE layers, Gram "
        f"matrices {'kept' if meta['gram'] else 'not kept'}; {meta['fallback_experts']} experts "
        f"under {meta['min_tokens']} tokens (pooled fallback; fewest: {meta['min_expert_tokens']})"
        f"{'; layer-sequential' if meta['sequential'] else ''}"
        f" in {time.perf_counter() - t0:.1f} s; sha256 {meta['sha256'][:16]}")
  return 0


if __name__ == "__main__":
  app.run(main)
