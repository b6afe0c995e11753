"""Speculative decoding and prefetch at two cache budgets, side by side (JSON output).

  python scripts/bench_speculative.py                # the embedded model, converted to a store

For each host budget (fraction of the expert bytes) and each draft setting, a fresh engine
generates --tokens greedy tokens from each prompt (after an unmeasured pass that compiles every
step shape the setting reaches). Reports acceptance, tokens per verify
forward, pilot recall and precision, prefetch usefulness, hit rate and tok/s (medians over
prompts), and whether the tokens equal plain decoding's.
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import os
import statistics

from absl import app, flags, logging

from glmjax import cli
from glmjax.bench.reporting import bench_store, store_geometry, write_report

FLAGS = flags.FLAGS
cli.define_model_flag(cli.STORE_KINDS, store_alias=True)
cli.define_load_flags(only=("prefill_chunk",))
flags.DEFINE_integer("tokens", 64, "Tokens generated per run.")
flags.DEFINE_list("host_fracs", ["0.25", "1.0"], "Host cache budgets, fractions of expert bytes.")
flags.DEFINE_list("drafts", ["0", "2", "auto"], "Draft settings.")
flags.DEFINE_string("out", None, "JSON output path (default: stdout).")

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n    ",
           "class Cache:\n    def __init__(self, size):\n        ",
           "def parse_args(args):\n    parser = argparse.ArgumentParser(",
           "    for key, value in sorted(items.items()):\n        "]


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import glmjax
  path = bench_store(FLAGS.model, "bench_spec.")
  total = store_geometry(path)["expert_bytes_total"]

  def one(host_frac, draft, prompt):
    for f in ("usage.json", "couple.npy"):
      if os.path.exists(os.path.join(path, f)):
        os.remove(os.path.join(path, f))
    model = glmjax.load(path, **cli.load_options(), progress=False, device_cache_gb=0,
                        host_cache_gb=host_frac * total / 2**30)
    text = prompt if model.tokenizer is not None else [5, 6, 7, 8, 9]
    return model.generate(text, FLAGS.tokens, stop_ids=[], draft=draft)

  one(1.0, "auto", PROMPTS[0])  # compile outside the measurements
  rows = []
  for host in (float(h) for h in FLAGS.host_fracs):
    plain = {p: one(host, 0, p).tokens for p in PROMPTS}
    for d in FLAGS.drafts:
      draft = d if d == "auto" else int(d)
      for p in PROMPTS:  # compile every shape this setting reaches, outside the measurement
        one(host, draft, p)
      runs = [(p, one(host, draft, p)) for p in PROMPTS]
      st = [r.stats for _, r in runs]

      def med(key, f=lambda s, k: s.get(k, 0.0)):
        return statistics.median(f(s, key) for s in st)

      def ratio(a, b):
        return statistics.median(s.get(a, 0.0) / s[b] for s in st if s.get(b))

      rows.append({
          "host_frac": host, "draft": d,
          "acceptance": ratio("draft_accepted", "draft_proposed") if draft else None,
          "tokens_per_forward": med("tokens_per_forward") if draft else 1.0,
          "pilot_recall": med("pilot_recall"), "pilot_precision": med("pilot_precision"),
          "prefetch_useful_frac": ratio("prefetch_useful", "prefetch_issued"),
          "hit_pct": 100 * ratio("expert_host_hits", "experts_used"),
          "experts_per_token": statistics.median(s["experts_used"] / FLAGS.tokens for s in st),
          "decode_tok_s": med("decode_tok_s"),
          "same_as_plain": all(r.tokens == plain[p] for p, r in runs)})
  write_report({"store": path, "tokens": FLAGS.tokens, "prompts": len(PROMPTS), "rows": rows},
               FLAGS.out)


if __name__ == "__main__":
  app.run(main)
