"""Measures this machine's cost-model figures, calibrates the model against measured decoding at
three budgets, and predicts GLM-5.2 on a published consumer box (one JSON report).

  python scripts/cost_model.py --out=/tmp/cost.json
  python scripts/cost_model.py --model=/nvme/glm5-int4 --budgets=0,0.1 --out=/tmp/cost.json

Default store: the embedded model, converted to a temporary store. The study's steps are
described in glmjax/studies/cost_study.py; the model itself is glmjax/studies/cost_model.py, the
GLM-5.2 prediction glmjax/studies/glm52.py (its published figures, each with its source, in
glmjax/studies/published_figures.json).
"""

from __future__ import annotations

import shutil
import sys
import tempfile

from absl import app, flags, logging

from glmjax import cli

FLAGS = flags.FLAGS
cli.define_model_flag(cli.STORE_KINDS, store_alias=True)
flags.DEFINE_string("out", None, "JSON output path (also printed).")
flags.DEFINE_string("prompt", "import os\nimport sys\n\ndef main(", "Prompt text.")
flags.DEFINE_integer("tokens", 48, "Tokens generated per run.", lower_bound=4)
flags.DEFINE_integer("repeats", 3, "Measured runs per budget after the warm-up run (median).",
                     lower_bound=1)
flags.DEFINE_list("budgets", ["0", "0.25", "1.0"], "Host budgets, fractions of the expert bytes.")
cli.define_load_flags(only=("io_workers",), notes={"io_workers": "Also the disk measurement's."})
flags.DEFINE_integer("read_passes", 3, "Passes over every expert chunk per read measurement.")
flags.DEFINE_integer("kernel_calls", 2000, "Timed expert_ffn calls (median).")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import glmjax
  from glmjax.studies.cost_study import DecodeRuns, run_cost_study, summary
  from glmjax.bench.reporting import bench_store, write_report
  from glmjax.runtime import compile_cache
  compile_cache.enable()
  try:
    budgets = [float(b) for b in FLAGS.budgets]
  except ValueError:
    print(f"error: --budgets must be numbers, got {FLAGS.budgets}", file=sys.stderr)
    return 2
  if any(not 0 <= b <= 1 for b in budgets):
    print(f"error: --budgets must be fractions in [0, 1], got {FLAGS.budgets}", file=sys.stderr)
    return 2
  tmp = tempfile.mkdtemp(prefix="cost_model.")
  try:
    path = bench_store(FLAGS.model, "cost.")
    runs = DecodeRuns(FLAGS.prompt, FLAGS.tokens, FLAGS.repeats, FLAGS.io_workers)
    report = run_cost_study(
        path, budgets, tmp, runs, read_passes=FLAGS.read_passes, kernel_calls=FLAGS.kernel_calls,
        store_label=None if FLAGS.model else "embedded model (9M parameters), converted")
  except glmjax.GlmjaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  write_report(report, FLAGS.out)
  print(summary(report), file=sys.stderr)
  return 0


if __name__ == "__main__":
  app.run(main)
