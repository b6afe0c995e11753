"""Jitted batch replay: runs a model teacher-forced over a corpus and writes a routing trace.

  python scripts/replay.py --out=/tmp/trace                  # embedded model, held-out corpus
  python scripts/replay.py --model=/nvme/glm5-int4 --corpus=docs/ --batch=8 --seq=512 \\
      --max_tokens=200000 --out=/tmp/glm5-trace

Each batch of --batch rows × --seq tokens is one forward pass (one trace step), recorded inside
the jit (resident models) or through the engine's layer steps (stores whose experts do not fit):
per position and MoE layer the top-k ids and weights, the top --top_m selection scores and the
pilot's top --pilot_p prediction of the next MoE layer. Each corpus file is one sequence, cut
into rows; padding is never recorded. Read the result with glmjax.replay.Trace.open(--out).
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import concurrent.futures
import time

T_START = time.perf_counter()  # the whole command, imports included

import os
import sys

from absl import app, flags, logging
import numpy as np

from glmjax import cli

FLAGS = flags.FLAGS
cli.define_model_flag(cli.MODEL_KINDS)
flags.DEFINE_string("corpus", None, "A text file or a directory of them (recursively, sorted); "
                    "default: the embedded model's held-out stdlib files.")
flags.DEFINE_integer("batch", 4, "Rows per forward pass.", lower_bound=1)
flags.DEFINE_integer("seq", 256, "Tokens per row.", lower_bound=1)
flags.DEFINE_integer("max_tokens", 65536, "Positions to record at most (0 = the whole corpus).",
                     lower_bound=0)
flags.DEFINE_integer("top_m", 64, "Selection scores kept per position and layer (capped at E).",
                     lower_bound=1)
flags.DEFINE_integer("pilot_p", 16, "Pilot predictions kept per position and layer (capped at E).",
                     lower_bound=1)
flags.DEFINE_string("out", None, "Trace directory to write (must not exist).")
cli.define_load_flags(only=("device_cache_gb", "host_cache_gb"))
flags.mark_flag_as_required("out")


def corpus_texts(path: str | None) -> list[tuple[str, str]]:
  """(name, text) of each corpus file, in a fixed order (default: the held-out stdlib files)."""
  from glmjax.formats import corpus
  if path is None:
    return [(rel, corpus.read(rel)) for rel in corpus.split()[1]]
  return corpus.texts_at(path)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import glmjax
  from tqdm import tqdm
  from glmjax.model.records import RecordOptions
  from glmjax.replay import record
  from glmjax.formats import corpus
  from glmjax.runtime import compile_cache
  compile_cache.enable()  # a second replay of the same shapes starts without compiling
  try:
    if os.path.lexists(FLAGS.out):
      raise glmjax.InputError(f"--out {FLAGS.out}: already exists; a trace is never written over "
                              "another")
    texts = corpus_texts(FLAGS.corpus)
    with glmjax.load(FLAGS.model, **cli.load_options(), progress=False) as model:
      if model.tokenizer is None:
        raise glmjax.InputError(f"{model.path}: no tokenizer.json; a text corpus needs one")
      opts = RecordOptions(FLAGS.top_m, FLAGS.pilot_p)
      # The step compiles (over a second on a cold start) on a worker thread while this one
      # tokenizes the corpus and creates the trace: XLA compiles without holding the GIL.
      pool = concurrent.futures.ThreadPoolExecutor(1)
      warm = None if not model.executor.stateless else pool.submit(
          model.record_routing, np.zeros((FLAGS.batch, FLAGS.seq), np.int32), opts, False)
      sequences, total = [], 0
      for _, t in texts:  # only as much of the corpus as the replay reads
        if FLAGS.max_tokens and total >= FLAGS.max_tokens:
          break
        sequences.append(np.asarray(model.tokenizer.encode(t), np.int32))
        total += len(sequences[-1])
      n = min(total, FLAGS.max_tokens) if FLAGS.max_tokens else total
      meta = record.manifest(model.config, model.moe_layers, model.executor.expert_bytes, opts,
                             source="replay", batch=FLAGS.batch, seq=FLAGS.seq,
                             corpus=FLAGS.corpus or "held-out stdlib")
      e = model.config.n_routed_experts
      rows = list(corpus.rows_of(sequences, FLAGS.seq, n))
      groups = [rows[b:b + FLAGS.batch] for b in range(0, len(rows), FLAGS.batch)]

      def dispatch(group):  # the next batch's records start computing before this one is saved
        toks = np.stack([r for r, _, _ in group]
                        + [np.zeros(FLAGS.seq, np.int32)] * (FLAGS.batch - len(group)))
        return model.record_routing(toks, opts, fetch=False)  # [L, B·S, ...]

      with record.writer(FLAGS.out, meta, n, (min(opts.top_m, e), min(opts.pilot_p, e))) as out, \
          tqdm(total=n, unit="tok", unit_scale=True, desc="replay") as bar:
        if warm is not None:
          warm.result()  # compiled (and any error raised here, in order)
        pending = dispatch(groups[0]) if groups else None
        for step, group in enumerate(groups):
          recs = pending
          pending = dispatch(groups[step + 1]) if step + 1 < len(groups) else None
          recs = {k: np.asarray(v) for k, v in recs.items()}
          for i, (row, real, last) in enumerate(group):
            part = record.positions_first(recs, slice(i * FLAGS.seq, i * FLAGS.seq + real))
            out.append(part["ids"], part["weights"], row[:real], np.full(real, step),
                       scores=part["scores"], score_ids=part["score_ids"], pilot=part["pilot"],
                       pilot_scores=part["pilot_scores"])
            if last:
              out.end_sequence()
            bar.update(real)
    seconds = time.perf_counter() - T_START
    print(f"{n} positions, {len(model.moe_layers)} MoE layers → {FLAGS.out} "
          f"({n / seconds:.0f} tok/s over the whole command, start-up included)")
  except glmjax.GlmjaxError as err:
    print(f"error: {err}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  app.run(main)
