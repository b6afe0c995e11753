"""Simulation studies of proposed MoE-offload optimizations on a routing trace (one JSON report,
one markdown table per study).

  python scripts/negative_results.py --out=/tmp/neg.json            # records a trace first
  python scripts/negative_results.py --trace=/tmp/trace --studies=mass_filter --out=/tmp/neg.json

Without --trace it records ~--tokens positions of the embedded model on its held-out corpus
(scripts/replay.py, with the pilot kept for every expert so the softmax-mass filter sees all E
scores). The studies and their registry live in glmjax/studies/studies.py (mass_filter,
pilot_k_sweep, freq_eviction on the trace; verify_cap, stage_breakdown live).

Decode is modelled with per_token=True: each position is its own step, in trace order.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON output path.")
flags.DEFINE_string("trace", None, "Trace directory to study; default: record one.")
flags.DEFINE_string("record_to", None, "Where to keep the recorded trace (default: a temporary "
                    "directory, removed at exit).")
flags.DEFINE_integer("tokens", 16384, "Positions to record when no --trace is given.",
                     lower_bound=1)
flags.DEFINE_list("studies", None, "Studies to run (default: every registered one).")
flags.DEFINE_integer("capacity", None, "Slots per MoE layer for the fixed-capacity hit rates "
                     "(default 2 × top_k).", lower_bound=1)
flags.DEFINE_list("capacities", None, "Slots per MoE layer for freq_eviction (default top_k, "
                  "2 × top_k, 4 × top_k, each below E).")
flags.mark_flag_as_required("out")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from glmjax.errors import GlmjaxError, InputError
  from glmjax.studies.studies import STUDIES, Context, check_study_names, run_studies
  names = FLAGS.studies or list(STUDIES)
  try:
    check_study_names(names)
    try:
      caps = [int(c) for c in FLAGS.capacities] if FLAGS.capacities else None
    except ValueError:
      raise InputError(f"--capacities must be integers, got {FLAGS.capacities}") from None
    if caps is not None and min(caps) < 1:
      raise InputError(f"--capacities must be ≥ 1, got {caps}")
    ctx = Context(FLAGS.trace, FLAGS.record_to, FLAGS.tokens, FLAGS.capacity, caps)
    report = run_studies(ctx, names)
  except GlmjaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  with open(FLAGS.out, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  print(f"\nwrote {FLAGS.out}")
  return 0


if __name__ == "__main__":
  app.run(main)
