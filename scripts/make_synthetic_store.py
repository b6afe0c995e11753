"""Writes an expert store of random weights (no source checkpoint) for benchmarks and tests.

  python scripts/make_synthetic_store.py --geometry=glm5 --moe_layers=2 --experts=32 \\
      --vocab_size=4096 --dst=/tmp/glm5_synth [--dense_bits=8]

GLM-5's dims (hidden 6144, experts 6144×2048 as int4 G=64 chunks of 20.05 MB, int8 MTP experts)
after one dense layer, or a tiny geometry for tests; the same --seed gives the same bytes.
`glmjax.load(--dst)` loads the result like a converted store. See glmjax/formats/synthetic.py.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("dst", None, "Store directory to create (absent or empty; an interrupted "
                    "synthetic store there is started over).", required=True)
flags.DEFINE_enum("geometry", "glm5", ["glm5", "tiny"],
                  "glm5: GLM-5's exact dims (hidden 6144, expert intermediate 2048, 64 heads, "
                  "MLA and DSA as published); tiny: hidden 128, for tests.")
flags.DEFINE_integer("moe_layers", 2, "MoE layers (the model has one dense layer before them).")
flags.DEFINE_integer("experts", None, "Routed experts per MoE layer (default: the geometry's; "
                     "256 for glm5, 8 for tiny). At least the geometry's top-k (8 / 2).")
flags.DEFINE_integer("vocab_size", None, "Vocabulary size (default: 154880 for glm5, 4096 for "
                     "tiny); at least the shipped tokenizer's 4096.")
flags.DEFINE_integer("seed", 0, "Seed of every random weight; same seed, same bytes.")
flags.DEFINE_float("zipf", 0.0, "Zipf exponent of expert popularity, set through the routers' "
                   "e_score_correction_bias (0: no skew; 1: the r-th most popular expert is "
                   "picked about 1/r as often as the first).")
flags.DEFINE_bool("mtp", True, "Include GLM-5's MTP layer (its experts int8, group 'mtp').")
flags.DEFINE_integer("workers", 2, "Threads generating and writing expert chunks.")
flags.DEFINE_enum("dense_bits", "0", ["0", "4", "8"],
                  "Dense weights: 0 bf16; 8 or 4 the quantized dense format `convert.py "
                  "--dense_bits` writes.")
flags.DEFINE_enum("dense_first_layer_bits", "auto", ["auto", "0", "4", "8"],
                  "With --dense_bits: the first decoder layer's width (auto: the --dense_bits "
                  "recipe's; 0: bf16), as `convert.py --dense_first_layer_bits`.")
flags.DEFINE_integer("dense_group_size", None, "With --dense_bits: input features per scale "
                     "of the quantized dense weights (default: the recipe's), as `convert.py "
                     "--dense_group_size` (the experts stay at 64).")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from glmjax.errors import GlmjaxError
  from glmjax.formats.synthetic import make_synthetic_store, store_bytes
  existed = os.path.exists(os.path.join(FLAGS.dst, "manifest.json"))
  t0 = time.perf_counter()
  try:
    m = make_synthetic_store(FLAGS.dst, geometry=FLAGS.geometry, moe_layers=FLAGS.moe_layers,
                             experts=FLAGS.experts, vocab_size=FLAGS.vocab_size,
                             seed=FLAGS.seed, zipf=FLAGS.zipf, mtp=FLAGS.mtp,
                             workers=FLAGS.workers, dense_bits=int(FLAGS.dense_bits),
                             dense_first_layer_bits=(None if FLAGS.dense_first_layer_bits == "auto"
                                                     else int(FLAGS.dense_first_layer_bits)),
                             dense_group_size=FLAGS.dense_group_size)
  except GlmjaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  dt = time.perf_counter() - t0
  q = m["quant"]
  dense, experts, _ = store_bytes(m["source_config"], q.get("dense_bits", 0),
                                  q.get("dense_first_layer_bits"), q.get("dense_group_size"))
  gb = (dense + experts) / 1e9
  what = (f"{len(m['moe_layers'])} MoE layers × {m['source_config']['n_routed_experts']} "
          f"experts, {gb:.2f} GB")
  if existed:
    print(f"{FLAGS.dst}: synthetic store already complete ({what})")
  else:
    print(f"{FLAGS.dst}: synthetic store complete ({what}) in {dt:.1f} s "
          f"({gb * 1e3 / dt:.0f} MB/s)")
  return 0


if __name__ == "__main__":
  app.run(main)
