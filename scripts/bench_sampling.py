"""Times top-p filtering: a full-vocabulary sort against glmjax.decoding.sampling.filter_logits.

For each vocabulary size and distribution shape (batch 1), both jitted functions are compiled and
warmed up, then called alternately --repeats times so that they share machine conditions; the
report gives each median in ms, the speedup (full sort / glmjax), the nucleus size, whether it
exceeded glmjax's pre-selection (so its exact fallback ran), and whether both kept the same set.

  python scripts/bench_sampling.py                     # JSON to stdout
  python scripts/bench_sampling.py --out out/bench_sampling.json --repeats 100
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from glmjax.bench.reporting import write_report
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from glmjax.decoding import sampling  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "", "JSON output path (stdout if empty).")
flags.DEFINE_integer("repeats", 50, "Timed calls per function and case (median reported).")
flags.DEFINE_integer("warmup", 3, "Untimed calls per function after compiling.")
flags.DEFINE_float("top_p", 0.9, "Nucleus mass.")
flags.DEFINE_list("vocab", ["154880", "4096"], "Vocabulary sizes V.")
flags.DEFINE_integer("seed", 0, "Seed for the random logits.")

# Scales of a standard normal: x8 puts p=0.9 on a handful of tokens; x0.05 is nearly uniform, so
# the nucleus is most of the vocabulary.
_SHAPES = {"peaked": 8.0, "flat": 0.05}


def full_sort_top_p(logits: jax.Array, top_p: float) -> jax.Array:
  """Textbook top-p: argsort the whole vocabulary, cumulative mass, threshold. `[B, V]`."""
  x = logits.astype(jnp.float32)
  order = jnp.argsort(-x, axis=-1)                                        # [B, V]
  xs = jnp.take_along_axis(x, order, -1)                                  # [B, V] descending
  cum = jnp.cumsum(jax.nn.softmax(xs, -1), -1)                            # [B, V]
  first = jnp.argmax(cum >= top_p, -1)[:, None]                           # [B, 1]
  thr = jnp.take_along_axis(xs, first, -1)                                # [B, 1]
  return jnp.where(x >= thr, x, -jnp.inf)


def _time(fn, x) -> float:
  t0 = time.perf_counter()
  fn(x).block_until_ready()
  return (time.perf_counter() - t0) * 1e3


def bench_case(v: int, shape: str, top_p: float, repeats: int, warmup: int, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((1, v)).astype(np.float32) * _SHAPES[shape])  # [B, V]
  base = jax.jit(functools.partial(full_sort_top_p, top_p=top_p))
  ours = jax.jit(functools.partial(sampling.filter_logits, top_p=top_p))
  for fn in (base, ours):
    for _ in range(warmup + 1):  # the first call compiles
      fn(x).block_until_ready()
  t_base, t_ours = [], []
  for _ in range(repeats):
    t_base.append(_time(base, x))
    t_ours.append(_time(ours, x))
  kept_base = np.asarray(base(x)) > -np.inf
  kept_ours = np.asarray(ours(x)) > -np.inf
  nucleus = int(kept_ours.sum())
  med_base, med_ours = statistics.median(t_base), statistics.median(t_ours)
  return {
      "vocab": v, "dist": shape, "batch": 1, "nucleus": nucleus,
      "fallback": nucleus > min(v, sampling.PRESELECT),
      "full_sort_ms": round(med_base, 4), "glmjax_ms": round(med_ours, 4),
      "speedup": round(med_base / med_ours, 2),
      "same_kept_set": bool(np.array_equal(kept_base, kept_ours)),
  }


def main(argv):
  del argv
  results = [bench_case(int(v), shape, FLAGS.top_p, FLAGS.repeats, FLAGS.warmup, FLAGS.seed)
             for v in FLAGS.vocab for shape in _SHAPES]
  report = {
      "backend": jax.default_backend(), "device": str(jax.devices()[0]),
      "jax": jax.__version__, "top_p": FLAGS.top_p, "repeats": FLAGS.repeats,
      "preselect": sampling.PRESELECT, "results": results,
  }
  write_report(report, FLAGS.out)


if __name__ == "__main__":
  app.run(main)
