"""Compile time of the resident steps against depth: does it grow with the layers?

  python scripts/bench_compile.py --layers=4,24 --json=docs/bench_compile.json

For each total depth L (the tiny synthetic geometry: its one dense layer, then L - 1 MoE layers of
float experts, alternating full and shared indexers), the resident executor's `prefill_fn`
(one --prefill_tokens chunk) and `decode_fn` (one token) over a --capacity-position cache are
traced, lowered and compiled from abstract weights (nothing is allocated), the persistent
cache off and the in-memory caches cleared before each of --repeats rounds. Reports medians
and each depth's ratio to the first. The forward is a Python loop over the layers inside one
jit, so today the compile grows with L (DESIGN.md §4).
"""

from __future__ import annotations

import datetime
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp

from glmjax.bench.reporting import write_report
from glmjax.formats.synthetic import DENSE_LAYERS, synthetic_config
from glmjax.model import kvcache, weights
from glmjax.model.config import Config
from glmjax.model.forward import decode_fn, prefill_fn

FLAGS = flags.FLAGS
flags.DEFINE_list("layers", ["4", "24"], "Total decoder layers (depths) to compile.")
flags.DEFINE_integer("prefill_tokens", 64, "Tokens of the prefill chunk.", lower_bound=1)
flags.DEFINE_integer("capacity", 512, "Cache positions.", lower_bound=1)
flags.DEFINE_integer("repeats", 3, "Rounds per depth (medians reported).", lower_bound=1)
flags.DEFINE_string("json", None, "JSON output path (default: stdout only).")


def abstract_steps(layers: int) -> dict:
  """The lowered-and-compiled prefill and decode steps at `layers` depth, timed (seconds)."""
  raw = synthetic_config("tiny", moe_layers=layers - DENSE_LAYERS, mtp=False)
  cfg = Config.from_dict(raw)
  sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  w = jax.tree_util.tree_map(sds, weights.abstract(cfg, jnp.float32, with_mtp=False),
                             is_leaf=weights.is_info)
  cache = jax.eval_shape(lambda: kvcache.init_cache(cfg, 1, FLAGS.capacity))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  steps = {"prefill": lambda: prefill_fn.lower(w, cache, i32(1, FLAGS.prefill_tokens), i32(),
                                               cfg=cfg),
           "decode": lambda: decode_fn.lower(w, cache, i32(1, 1), cfg=cfg)}
  out = {}
  for name, lower in steps.items():
    t0 = time.perf_counter()
    lowered = lower()
    t1 = time.perf_counter()
    lowered.compile()
    out[name] = {"trace_lower_s": t1 - t0, "compile_s": time.perf_counter() - t1}
  return out


def main(argv):
  del argv
  jax.config.update("jax_enable_compilation_cache", False)
  depths = [int(x) for x in FLAGS.layers]
  if min(depths) <= DENSE_LAYERS:
    raise app.UsageError(f"--layers must exceed the geometry's {DENSE_LAYERS} dense layers")
  rounds = {d: [] for d in depths}
  for _ in range(FLAGS.repeats):
    for d in depths:  # interleaved, so drift in the machine's load hits every depth alike
      jax.clear_caches()
      rounds[d].append(abstract_steps(d))
  rows = []
  for d in depths:
    med = {f"{step}_{k}": statistics.median(r[step][k] for r in rounds[d])
           for step in ("prefill", "decode") for k in ("trace_lower_s", "compile_s")}
    med["total_s"] = sum(med.values())
    rows.append({"layers": d, **med})
  for row in rows:
    row["ratio_to_first"] = row["total_s"] / rows[0]["total_s"]
    print(f"L={row['layers']:3d}  total {row['total_s']:6.2f} s  "
          f"(×{row['ratio_to_first']:.2f})  prefill compile {row['prefill_compile_s']:.2f} s  "
          f"decode compile {row['decode_compile_s']:.2f} s")
  report = {"date": datetime.date.today().isoformat(), "geometry": "tiny",
            "prefill_tokens": FLAGS.prefill_tokens, "capacity": FLAGS.capacity,
            "repeats": FLAGS.repeats, "rows": rows}
  write_report(report, FLAGS.json)


if __name__ == "__main__":
  app.run(main)
