"""Dense weight formats side by side (issue 28): matvec speed and decode tok/s.

  python scripts/bench_dense.py --json=/tmp/dense.json [--vocab_size=16384 --head_rows=16384]

1. Matvec (T = 1, `layers.linear` under jit, as the model calls it) at GLM-5's dims: q_b, kv_b,
   o, the shared expert's gate_up and down, and a `--head_rows` slice of lm_head, for float32
   (XLA's dot), bfloat16, int8 and int4 (the recipes' groups, 128 and 64; the numba dense
   kernel on the CPU platform,
   the Pallas dense kernel on an accelerator, where "int8 xla" and "int4 xla" add XLA's
   dequantize-then-dot beside it). Median ms over `--reps` calls and the weight bytes read per
   second.
2. Decode on synthetic GLM-5-geometry stores (one dense and one MoE layer, `--experts` routed
   experts, `--vocab_size`, no MTP; `make_synthetic_store`), written under `--work` and deleted
   afterwards: bf16 stored (loaded as float32 and as bfloat16 dense weights), `dense_bits=8`
   and `4` (the recipes: int8 at group 128 with its first layer bf16), `4` with its first
   decoder layer int8 (`--dense_first_layer_bits=8`), and `8` at group 64 with its first layer
   int8 (the int8 recipe before). Quantized stores load with `dtype="auto"`, the default, so
   their float leaves (the int8 recipe's first layer) stay bf16.
   Every store holds all its experts in memory (no I/O), KV in float32 for all, so only the
   dense format differs. Median `decode_tok_s` over `--runs` greedy generations.

Issue 28's targets: int8 dense decode >= 2x float32, int4 >= 3x, bfloat16 >= float32.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("json", None, "Write the report here.", required=True)
flags.DEFINE_integer("head_rows", 16384, "Rows of lm_head [154880, 6144] in the matvec table.")
flags.DEFINE_integer("reps", 15, "Timed matvec calls per matrix and format (median).")
flags.DEFINE_integer("vocab_size", 16384, "Vocabulary of the synthetic decode stores.")
flags.DEFINE_integer("experts", 8, "Routed experts of the synthetic decode stores.")
flags.DEFINE_integer("max_new_tokens", 24, "Tokens per timed generation.")
flags.DEFINE_integer("runs", 7, "Timed generations per store (median of decode_tok_s).")
flags.DEFINE_string("work", None, "Where the synthetic stores go (default: a fresh /tmp dir).")
flags.DEFINE_bool("matvec", True, "Run part 1.")
flags.DEFINE_bool("decode", True, "Run part 2.")

FORMATS = ("float32", "bfloat16", "int8", "int4")


def _matrices(cfg, head_rows):
  """{name: (O, I)} of the benchmarked dense matrices, from the model's own declaration."""
  from glmjax.model import weights
  tree = weights.abstract(cfg, with_mtp=False)
  moe = next(l for l in tree.layers if getattr(l.mlp, "shared", None) is not None)
  a = moe.attn
  return {"q_b": a.q_b.shape, "kv_b": a.kv_b.shape, "o": a.o.shape,
          "shared.gate_up": moe.mlp.shared.gate_up.shape,
          "shared.down": moe.mlp.shared.down.shape,
          f"lm_head[:{head_rows}]": (head_rows, tree.lm_head.shape[1])}


def _as_format(w, fmt):
  """A float32 numpy matrix in one dense format, on the device (as the store would hold it)."""
  import jax
  import jax.numpy as jnp
  from glmjax.formats.quantize import quantize
  from glmjax.model.weights import dense_group
  if fmt in ("float32", "bfloat16"):
    return jnp.asarray(w, fmt)
  bits = {"int8": 8, "int4": 4}[fmt]
  return jax.tree.map(jnp.asarray, quantize(w, bits, dense_group(bits)))


def _median_ms(f, *args, reps):
  f(*args).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    f(*args).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def matvec_table(cfg, head_rows, reps):
  """{matrix: {format: {ms, gb_s, mb}}} and the summed ms per format (one decode step's
  worth of these matrices). On an accelerator `linear` runs int8/int4 through the Pallas dense
  kernel; the rows "int8 xla" and "int4 xla" time XLA's dequantize-then-dot beside it."""
  import jax
  import numpy as np
  from glmjax.model.layers import linear
  from glmjax.model.weights import nbytes
  from pallas_kernels import ops
  rng = np.random.default_rng(0)
  kernels = [(fmt, fmt, jax.jit(linear)) for fmt in FORMATS]
  if jax.default_backend() != "cpu":
    xla = jax.jit(functools.partial(ops.dense_matmul, backend="xla"))
    kernels += [(f"{fmt} xla", fmt, xla) for fmt in ("int8", "int4")]
  out = {}
  for name, (o, i) in _matrices(cfg, head_rows).items():
    w = (rng.standard_normal((o, i), np.float32) / np.float32(np.sqrt(i)))
    x = jax.numpy.asarray(rng.standard_normal((1, i), np.float32))
    out[name] = {}
    for label, fmt, f in kernels:
      wf = _as_format(w, fmt)
      ms = _median_ms(f, x, wf, reps=reps)
      mb = nbytes(wf) / 1e6
      out[name][label] = {"ms": round(ms, 3), "gb_s": round(mb / ms, 2), "mb": round(mb, 1)}
      del wf
      print(f"  {name:>18} {label:>8}: {ms:8.2f} ms {mb / ms:6.1f} GB/s", flush=True)
  total = {label: round(sum(r[label]["ms"] for r in out.values()), 2) for label, _, _ in kernels}
  return out, total


def decode_rows(work, vocab_size, experts, max_new_tokens, runs):
  """{format: {tok_s (median), runs, dense_gb}} on synthetic GLM-5 stores (1 dense + 1 MoE)."""
  import glmjax
  from glmjax.formats.synthetic import make_synthetic_store
  # (row, dense_bits, first layer's bits (None: the recipe's), group size, load dtype). The
  # last two rows set the first layer apart from the recipe: on a store whose first (dense) layer
  # holds over half its dense bytes (GLM-5: 2.1%).
  plans = (("float32", 0, None, None, "float32"), ("bfloat16", 0, None, None, "bfloat16"),
           ("int8", 8, None, None, "auto"), ("int4", 4, None, None, "auto"),
           ("int4, first layer int8", 4, 8, None, "auto"),
           ("int8 G64, first layer int8", 8, 8, 64, "auto"))
  out = {}
  for store_key in dict.fromkeys((b, f, g) for _, b, f, g, _ in plans):
    bits, first, group = store_key
    path = os.path.join(work, f"dense{bits}_{first}_{group}")
    t0 = time.perf_counter()
    make_synthetic_store(path, geometry="glm5", moe_layers=1, experts=experts,
                         vocab_size=vocab_size, mtp=False, progress=False, dense_bits=bits,
                         dense_first_layer_bits=first, dense_group_size=group)
    print(f"  store dense_bits={bits} G{group or 'recipe'} first layer "
          f"{'recipe' if first is None else first}: {time.perf_counter() - t0:.0f} s",
          flush=True)
    for fmt, b, f, g, dtype in plans:
      if (b, f, g) != store_key:
        continue
      with glmjax.load(path, dtype=dtype, kv_dtype="float32", progress=False) as m:
        m.generate("def fibonacci(n):", 2, stop_ids=[])  # compile
        tok_s = [m.generate("def fibonacci(n):", max_new_tokens, stop_ids=[]).stats[
            "decode_tok_s"] for _ in range(runs)]
        out[fmt] = {"tok_s": round(statistics.median(tok_s), 3),
                    "runs": [round(t, 3) for t in tok_s],
                    "dense_gb": round(m.executor.dense_bytes / 1e9, 3)}
      print(f"  decode {fmt:>22}: {out[fmt]['tok_s']:.2f} tok/s {out[fmt]['runs']}", flush=True)
    shutil.rmtree(path)
  return out


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every part it writes and reads
  import jax
  from glmjax.formats.synthetic import synthetic_config
  from glmjax.model.config import Config
  report = {"command": " ".join(sys.argv), "backend": jax.default_backend(),
            "cpus": os.cpu_count()}
  cfg = Config.from_dict(synthetic_config("glm5", 1, FLAGS.experts, FLAGS.vocab_size, False))
  if FLAGS.matvec:
    print("matvec (T = 1), median ms and weight GB/s:")
    table, total = matvec_table(cfg, FLAGS.head_rows, FLAGS.reps)
    report["matvec"] = table
    report["matvec_total_ms"] = total
    report["matvec_speedup_vs_float32"] = {f: round(total["float32"] / total[f], 2)
                                           for f in total}
  if FLAGS.decode:
    work = FLAGS.work or tempfile.mkdtemp(prefix="bench_dense.", dir="/tmp")
    try:
      print(f"decode (synthetic GLM-5 stores, vocab {FLAGS.vocab_size}) under {work}:")
      rows = decode_rows(work, FLAGS.vocab_size, FLAGS.experts, FLAGS.max_new_tokens,
                         FLAGS.runs)
    finally:
      if not FLAGS.work:
        shutil.rmtree(work, ignore_errors=True)
    report["decode"] = rows
    base = rows["float32"]["tok_s"]
    report["decode_speedup_vs_float32"] = {f: round(r["tok_s"] / base, 2)
                                           for f, r in rows.items()}
    report["targets_met"] = {
        "int8 >= 2x float32": rows["int8"]["tok_s"] >= 2 * base,
        "int4 >= 3x float32": rows["int4"]["tok_s"] >= 3 * base,
        "bfloat16 >= float32": rows["bfloat16"]["tok_s"] >= base}
  with open(FLAGS.json, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2)
  print(json.dumps({k: report[k] for k in report if k not in ("matvec", "decode")}, indent=2))
  return 0


if __name__ == "__main__":
  app.run(main)
