"""Generates tokens from a GLM-5 model (the embedded default unless --model is given).

  python scripts/generate.py --prompt_ids=5,6,7 --max_new_tokens=32
"""

from __future__ import annotations

import sys

from absl import app, flags, logging

import glmjax

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "HF checkpoint directory; default: the embedded model.")
flags.DEFINE_string("prompt_ids", "5,6,7,8", "Comma-separated prompt token ids.")
flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate at most.", lower_bound=0)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.", lower_bound=0.0)
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Dense weight dtype.")


def parse_ids(text: str) -> list[int]:
  try:
    ids = [int(t) for t in text.replace(" ", "").split(",") if t]
  except ValueError:
    raise glmjax.InputError(f"--prompt_ids must be comma-separated integers, got {text!r}") from None
  if not ids:
    raise glmjax.InputError("--prompt_ids is empty")
  return ids


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # keep JAX's backend probing off the console
  try:
    prompt = parse_ids(FLAGS.prompt_ids)
    model = glmjax.load(FLAGS.model, dtype=FLAGS.dtype)
    print(f"prompt: {prompt}", flush=True)
    result = model.generate(prompt, FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                            seed=FLAGS.seed, on_token=lambda t: print(t, end=" ", flush=True))
  except glmjax.GlmjaxError as e:
    print(f"\nerror: {e}", file=sys.stderr)
    return 1
  s = result.stats
  print(f"\n{int(s['new_tokens'])} tokens ({result.stop_reason}) | prefill {s['prefill_s']:.3f} s"
        f" | {s['decode_tok_s']:.1f} tok/s | compile {s['compile_s']:.1f} s")
  return 0


if __name__ == "__main__":
  app.run(main)
