"""Trains the embedded default model: a small GLM-5 (glm_moe_dsa) on the Python stdlib's source.

  nice -n 15 python scripts/train_embedded.py --work_dir=/tmp/embedded_run \
      --out_dir=/tmp/embedded_run/model --seed=0 --phases=256:700,512:300,1024:64 \
      --time_limit_min=80      # then copy /tmp/embedded_run/model/* to glmjax/embedded_model/

(the command that produced the shipped model: 1064 steps × 4096 tokens, 59 min on 2 shared CPU
cores; the time limit did not trigger).

Pipeline: corpus split (glmjax.formats.corpus) → byte-level BPE tokenizer → token stream →
AdamW training of every architectural part → bf16 HF checkpoint → held-out evaluation through
`glmjax.load`. The library parts live in glmjax.train; training differentiates the inference
forward pass itself (glmjax.model.forward.forward / mtp_forward) with dense attention,
attention taps for the indexer's distillation, and a fixed-capacity expert provider:
- MoE: the forward pass's own routing and combine; the experts run in fixed per-expert
  capacity slots (`--capacity`), pairs past them dropped and counted.
- Auxiliary-loss-free balancing: the correction bias is outside the optimizer; after each
  step, bias_e += γ · sign(mean_load − load_e) per MoE layer (MTP layer included).
- DSA indexer: its inputs are stop-gradiented, and it learns only from
  KL(mean-over-heads dense attention probs ‖ softmax(index scores)) over causal keys. The main
  attention sees every causal key for the first `--dense_attn_steps` steps (the indexer warms
  up on the KL), then the indexer's top-k selection (as inference does), the KL still applied.
- MTP: glmjax.model.forward.mtp_forward on the main model's hidden states; loss weight
  `--mtp_weight`.
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import dataclasses
import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glmjax.train import presets  # noqa: E402
from glmjax.train.evaluate import evaluate  # noqa: E402
from glmjax.train.loop import RunOptions, train  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("work_dir", "/tmp/glmjax_embedded_run", "Checkpoints, tokenizer, logs.")
flags.DEFINE_string("out_dir", None, "Where to write the shipped HF model (default: none).")
flags.DEFINE_integer("seed", 0, "Seed for init and data order.")
flags.DEFINE_integer("vocab_size", 4096, "BPE vocabulary size.")
flags.DEFINE_enum("size", "embedded", presets.SIZES, "Config preset.")
flags.DEFINE_string("phases", "256:700,512:300,1024:64",
                    "Context-length curriculum: comma-separated seq:steps phases, in order.")
flags.DEFINE_integer("batch_tokens", 4096, "Tokens per step (batch = batch_tokens // seq).")
flags.DEFINE_integer("dense_attn_steps", 150,
                     "Steps attending to every causal key, no DSA selection (indexer warm-up).")
flags.DEFINE_float("lr", 2e-3, "Peak learning rate.")
flags.DEFINE_integer("warmup", 50, "Warm-up steps.")
flags.DEFINE_float("weight_decay", 0.05, "AdamW weight decay (matrices only).")
flags.DEFINE_float("mtp_weight", 0.3, "Weight of the MTP next-next-token loss.")
flags.DEFINE_float("index_weight", 1.0, "Weight of the indexer KL loss.")
flags.DEFINE_float("gamma", 0.01, "Aux-loss-free bias update speed.")
flags.DEFINE_float("capacity", 2.0, "Expert capacity factor in training.")
flags.DEFINE_integer("log_every", 10, "Steps between log lines.")
flags.DEFINE_integer("ckpt_every", 50, "Steps between checkpoints.")
flags.DEFINE_float("time_limit_min", 0, "Stop (and export) after this many minutes; 0 = none.")
flags.DEFINE_integer("train_files", 0,
                     "Train on the first N training files only (quick runs); 0 = all.")
flags.DEFINE_bool("eval_only", False, "Only evaluate --out_dir (or the embedded model).")
flags.DEFINE_bool("eval_quick", False,
                  "Evaluate on the small held-out slice only (no other corpora, no MTP).")
flags.DEFINE_integer("eval_stride", 512, "Stride of the bits/byte scoring windows.")


def run_options() -> RunOptions:
  """The flags of a training run."""
  return RunOptions(**{f.name: getattr(FLAGS, f.name) for f in dataclasses.fields(RunOptions)})


def main(argv):
  del argv
  print("command: " + " ".join(sys.argv), flush=True)
  if not FLAGS.eval_only:
    train(run_options())
  if FLAGS.out_dir or FLAGS.eval_only:
    res = evaluate(FLAGS.out_dir, FLAGS.eval_stride, quick=FLAGS.eval_quick)
    print(json.dumps(res, indent=1), flush=True)
    os.makedirs(FLAGS.work_dir, exist_ok=True)
    with open(os.path.join(FLAGS.work_dir, "eval.json"), "w") as f:
      json.dump(res, f, indent=1)


if __name__ == "__main__":
  app.run(main)
