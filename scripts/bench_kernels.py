"""Times grouped_moe at GLM-5 decode shapes and writes a JSON report.

Per (rows, backend[, variant]) config: median wall time of --repeats calls
after --warmup calls, weight bytes read (unique experts x bytes per expert),
the resulting GB/s and its fraction of the device's HBM peak, and for pallas
the max relative error against the xla path. A failing config is recorded
with its error instead of stopping the run.

  python scripts/bench_kernels.py --out out/bench.json          # GPU/TPU
  python scripts/bench_kernels.py --small --out /tmp/bench.json # CPU smoke
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from glmjax.bench.reporting import write_report
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from glmjax.model import quant  # noqa: E402
from pallas_kernels import common, ops, tuning  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["1", "2", "3", "4"], "Token rows R to time.")
flags.DEFINE_integer("repeats", 20, "Timed calls per config (median reported).")
flags.DEFINE_integer("warmup", 3, "Untimed calls per config (after compile).")
flags.DEFINE_enum("backend", "both", ["both", "pallas", "xla"], "Backends.")
flags.DEFINE_string("out", "", "JSON output path (stdout if empty).")
flags.DEFINE_bool("small", False, "Tiny shapes for a CPU smoke test.")
flags.DEFINE_integer("hidden", 6144, "D (model width).")
flags.DEFINE_integer("intermediate", 2048, "I (expert FFN width).")
flags.DEFINE_integer("experts_per_row", 8, "K, experts per token row.")
flags.DEFINE_integer("pool_slots", 32, "S, experts resident in the pool.")
flags.DEFINE_integer("group_size", 64, "Quantization group size.")
flags.DEFINE_enum("bits", "4", ["4", "8"], "Weight bits.")
flags.DEFINE_string("flavour", "", "Pallas flavour override (pointer|prefetch).")
flags.DEFINE_list(
    "variants", [],
    "Extra pallas BlockConfigs to time, each "
    "mode:block_n:block_n_down:block_k[:num_warps[:num_stages[:precision]]].")
flags.DEFINE_integer("seed", 0, "RNG seed.")


def _parse_variant(text: str) -> tuning.BlockConfig:
  f = text.split(":")
  kw = dict(mode=f[0], block_n=int(f[1]), block_n_down=int(f[2]),
            block_k=int(f[3]))
  if len(f) > 4:
    kw["num_warps"] = int(f[4])
  if len(f) > 5:
    kw["num_stages"] = int(f[5])
  if len(f) > 6:
    kw["precision"] = f[6]
  return tuning.BlockConfig(**kw)


def _random_q(key, lead, out_f, in_f, bits, group):
  """Random packed weights and scales: timing does not need real quantization."""
  shapes = quant.qarray_shapes(out_f, in_f, bits, group, lead=lead)
  k1, k2 = jax.random.split(key)
  if bits == 4:
    packed = jax.random.randint(k1, shapes.packed.shape, 0, 256, jnp.int32)
    packed = packed.astype(jnp.uint8)
  else:
    packed = jax.random.randint(k1, shapes.packed.shape, -127, 128, jnp.int32)
    packed = packed.astype(jnp.int8)
  # Scale so activations stay O(1) through the two projections.
  mag = 1.0 / (np.sqrt(in_f) * (4 if bits == 4 else 64))
  scales = (jax.random.uniform(k2, shapes.scales.shape, jnp.float32, 0.5, 1.5)
            * mag).astype(jnp.bfloat16)
  return quant.QArray(packed=packed, scales=scales, bits=bits,
                      group_size=group, in_features=in_f)


def _time(fn, warmup: int, repeats: int):
  jax.block_until_ready(fn())  # compile
  for _ in range(warmup):
    jax.block_until_ready(fn())
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts), min(ts)


def main(argv):
  del argv
  if FLAGS.small:
    d, i, s, g, k = 256, 128, 8, 32, 4
  else:
    d, i, s, g, k = (FLAGS.hidden, FLAGS.intermediate, FLAGS.pool_slots,
                     FLAGS.group_size, FLAGS.experts_per_row)
  bits = int(FLAGS.bits)
  dev = jax.devices()[0]
  plat = common.platform(dev)
  bw = common.hbm_bandwidth(dev)
  key = jax.random.PRNGKey(FLAGS.seed)
  kgu, kdn, kx = jax.random.split(key, 3)
  pool = quant.ExpertPool(
      gate_up=_random_q(kgu, (s,), 2 * i, d, bits, g),
      down=_random_q(kdn, (s,), d, i, bits, g))
  pool.check()
  expert_bytes = pool.nbytes // s
  report = dict(
      device_kind=common.device_kind(dev), platform=plat,
      hbm_bytes_per_s=bw, jax_version=jax.__version__,
      shapes=dict(D=d, I=i, K=k, S=s, group_size=g, bits=bits),
      expert_bytes=expert_bytes, results=[])
  interpret = plat == "cpu"
  backends = ["pallas", "xla"] if FLAGS.backend == "both" else [FLAGS.backend]
  rng = np.random.default_rng(FLAGS.seed)
  variants = [None]
  for text in FLAGS.variants:
    try:
      variants.append(_parse_variant(text))
    except (ValueError, IndexError) as e:
      report.setdefault("variant_errors", []).append(f"{text!r}: {e}")

  for r_text in FLAGS.rows:
    r = int(r_text)
    x = jax.random.normal(jax.random.fold_in(kx, r), (r, d), jnp.float32)
    ids = np.stack([rng.choice(s, size=min(k, s), replace=False)
                    for _ in range(r)]).astype(np.int32)  # [R, K]
    w = rng.random(ids.shape).astype(np.float32)
    w /= w.sum(-1, keepdims=True)
    ids_j, w_j = jnp.asarray(ids), jnp.asarray(w)
    n_unique = len(np.unique(ids))
    bytes_read = n_unique * expert_bytes
    ref_out = None
    runs = []
    if "xla" in backends:
      runs.append(("xla", None))
    if "pallas" in backends:
      runs += [("pallas", v) for v in variants]
    for name, cfg in runs:
      entry = dict(rows=r, backend=name, unique_experts=n_unique,
                   bytes_read=bytes_read)
      try:
        kw = dict(backend=name)
        if name == "pallas":
          kw.update(interpret=interpret, config=cfg,
                    flavour=FLAGS.flavour or None)
          used = cfg or tuning.lookup(r, d, i, bits, g)
          entry["config"] = used.__dict__.copy()
        # One jitted dispatch per call, so Python overhead is not timed.
        call = jax.jit(lambda *a, kw=kw: ops.grouped_moe(*a, **kw))
        fn = lambda call=call: call(x, pool, ids_j, w_j)
        med, best = _time(fn, FLAGS.warmup, FLAGS.repeats)
        out = np.asarray(fn())
        entry.update(median_s=med, min_s=best, gb_per_s=bytes_read / med / 1e9,
                     finite=bool(np.isfinite(out).all()))
        if bw:
          entry["hbm_fraction"] = bytes_read / med / bw
        if name == "xla":
          ref_out = out
        elif ref_out is not None:
          scale = float(np.abs(ref_out).max()) or 1.0
          entry["max_rel_err_vs_xla"] = float(
              np.abs(out - ref_out).max() / scale)
      except Exception as e:  # one bad config must not hide the others
        entry["error"] = f"{type(e).__name__}: {e}"[:2000]
        entry["traceback"] = traceback.format_exc()[-3000:]
      report["results"].append(entry)
      print(json.dumps({k_: v for k_, v in entry.items()
                        if k_ != "traceback"}), flush=True)

  write_report(report, FLAGS.out)


if __name__ == "__main__":
  app.run(main)
