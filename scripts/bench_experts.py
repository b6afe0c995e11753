"""CPU expert kernels at GLM-5 dims: numba (pallas_kernels.cpu) against the XLA paths.

One JSON report (medians of --repeats timed calls after one warm-up call):

* dram: read bandwidth of a ~1 GiB float32 array: jitted jnp.sum, numpy sum and a numba
  prange stream with the kernel's vector ops (the roof for a kernel reading its weights once).
* decode: one int4 expert (gate_up + down) applied to one token row, as GB/s of expert
  bytes: XLA's per-pair path (xla.expert_terms on a 1-slot pool, jitted; it pads to
  PAIR_CHUNK pairs), XLA dequantize-then-einsum (jitted), and numba expert_ffn. Calls
  rotate over all --experts experts, so weights come from DRAM, not the L3 cache.
* grouped: numba pool_terms on a pool of --experts random int4 experts with random top-k
  routing at each --tokens T: wall time and GFLOP/s, FLOPs = 2*T*K*(2I*D + D*I).
* score_128: 128 tokens through one MoE layer: numba pool_terms vs the per-pair XLA path
  (one timed call; ~30 s; --skip_per_pair skips it) vs XLA dequantize-once-then-einsum.
* pallas (on an accelerator, or with --pallas=interpret at small dims on a CPU): the same
  decode matvec (GB/s and fraction of HBM) and grouped T rows (GFLOP/s) through
  pallas_kernels.grouped_moe with the pool in device memory, each checked against numba.

Weights are random packed bytes and random small bf16 scales (no quantization needed for
timing). The machine may be shared: compare numbers from one run.

  python scripts/bench_experts.py --out /tmp/bench_experts.json
"""

from __future__ import annotations

import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numba  # noqa: E402
import numpy as np  # noqa: E402

from glmjax.bench import kernels as kernel_bench  # noqa: E402
from glmjax.bench.reporting import write_report  # noqa: E402
from pallas_kernels import cpu, cpu_vec, xla  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "", "JSON output path (stdout only if empty).")
flags.DEFINE_integer("repeats", 5, "Timed calls per measurement (median reported).")
flags.DEFINE_integer("hidden", 6144, "D (model width).")
flags.DEFINE_integer("intermediate", 2048, "I (expert FFN width).")
flags.DEFINE_integer("experts", 16, "Experts in the pool (one MoE layer's worth).")
flags.DEFINE_integer("top_k", 8, "K, experts per token.")
flags.DEFINE_integer("group_size", 64, "Quantization group size.")
flags.DEFINE_list("tokens", ["16", "128", "1024"], "Token counts T for the grouped runs.")
flags.DEFINE_bool("skip_per_pair", False, "Skip the slow per-pair XLA path at T=128.")
flags.DEFINE_float("dram_gib", 1.0, "Size of the DRAM bandwidth array in GiB.")
flags.DEFINE_integer("seed", 0, "RNG seed.")
flags.DEFINE_enum("pallas", "auto", ["auto", "off", "interpret"],
                  "Pallas rows: auto runs them when JAX has an accelerator; interpret runs the "
                  "kernels in interpret mode on a CPU (slow: a smoke test at small dims).")
flags.DEFINE_float("wait_idle_s", 120.0,
                   "Before each measurement wait up to this long for other processes to leave "
                   "the CPUs idle (the machine may be shared); 0 disables.")


def _log(msg: str) -> None:
  print(f"[bench_experts {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _time(fn, repeats: int, warmup: int = 1) -> dict:
  """kernel_bench.time_calls, waiting for an idle machine up to --wait_idle_s."""
  return kernel_bench.time_calls(fn, repeats, warmup, FLAGS.wait_idle_s)


def _decode(report, gu, dn, d, i, g, repeats):
  s = gu[0].shape[0]
  expert_bytes = sum(int(a[0].nbytes) for a in (*gu, *dn))
  packed_bytes = int(gu[0][0].nbytes + dn[0][0].nbytes)
  x = np.random.default_rng(2).standard_normal((1, d)).astype(np.float32)
  xj = jnp.asarray(x)
  out = dict(expert_bytes=expert_bytes, packed_bytes=packed_bytes, rotate_experts=s)
  args = [tuple(a[e] for a in (*gu, *dn)) for e in range(s)]

  t0 = time.perf_counter()
  y_numba = cpu.expert_ffn(x, *args[0], 4, g, d, i)
  out["numba_first_call_s"] = time.perf_counter() - t0
  t = _time(lambda k: cpu.expert_ffn(x, *args[k % s], 4, g, d, i), max(repeats, 2 * s))
  out["numba_expert_ffn"] = t
  _log(f"decode numba expert_ffn: {t['median_s'] * 1e3:.2f} ms")

  pools = [kernel_bench.int4_expert_pool(gu, dn, g, d, i, e, e + 1) for e in range(s)]
  ids = jnp.zeros((1, 1), jnp.int32)
  per_pair = jax.jit(xla.expert_terms)
  deq = jax.jit(kernel_bench.dequant_einsum_terms)
  y_ref = np.asarray(deq(xj, pools[0], ids))[0, 0]
  out["numba_vs_xla_max_rel_err"] = float(
      np.abs(y_numba[0] - y_ref).max() / np.abs(y_ref).max())
  for name, fn in (("xla_per_pair", lambda k: per_pair(xj, pools[k % s], ids)),
                   ("xla_dequant_einsum", lambda k: deq(xj, pools[k % s], ids))):
    t = _time(fn, max(3, min(repeats, s)))
    out[name] = t
    _log(f"decode {name}: {t['median_s'] * 1e3:.1f} ms")
  for name in ("numba_expert_ffn", "xla_per_pair", "xla_dequant_einsum"):
    out[name]["gb_per_s"] = expert_bytes / out[name]["median_s"] / 1e9
  out["numba_over_xla_per_pair"] = out["xla_per_pair"]["median_s"] / out["numba_expert_ffn"][
      "median_s"]
  out["numba_over_xla_dequant_einsum"] = (out["xla_dequant_einsum"]["median_s"] /
                                          out["numba_expert_ffn"]["median_s"])
  out["note"] = ("GB/s = expert bytes (packed + scales, gate_up + down) / median time; the "
                 "per-pair XLA path pads one pair to xla.PAIR_CHUNK pairs.")
  report["decode"] = out
  del pools


def _grouped_problems(s, d, k):
  """(T, x [T, D], top-k ids [T, K]) for each --tokens T; the same for every backend."""
  rng = np.random.default_rng(3)
  for t_count in (int(v) for v in FLAGS.tokens):
    x = rng.standard_normal((t_count, d)).astype(np.float32)
    yield t_count, x, kernel_bench.random_routing(rng, t_count, s, k)


def _grouped(report, gu, dn, d, i, g, k, repeats):
  flops_per_pair = kernel_bench.flops_per_pair(d, i)
  rows = []
  for t_count, x, ids in _grouped_problems(gu[0].shape[0], d, k):
    fn = lambda _, x=x, ids=ids: cpu.pool_terms(x, *gu, *dn, ids, None, 4, g, d, i)
    reps = repeats if t_count <= 256 else max(1, min(repeats, 2))
    t = _time(fn, reps)
    t.update(tokens=t_count, pairs=t_count * k, distinct_slots=int(np.unique(ids).size),
             flops=flops_per_pair * t_count * k,
             gflop_per_s=flops_per_pair * t_count * k / t["median_s"] / 1e9)
    rows.append(t)
    _log(f"grouped T={t_count}: {t['median_s']:.3f} s, {t['gflop_per_s']:.1f} GFLOP/s")
  report["grouped"] = rows


def _score_128(report, gu, dn, d, i, g, k, repeats):
  t_count = 128
  rng = np.random.default_rng(4)
  x = rng.standard_normal((t_count, d)).astype(np.float32)
  ids = kernel_bench.random_routing(rng, t_count, gu[0].shape[0], k)
  out = dict(tokens=t_count, top_k=k, experts=int(gu[0].shape[0]))
  y_numba = cpu.pool_terms(x, *gu, *dn, ids, None, 4, g, d, i)
  out["numba_pool_terms"] = _time(lambda _: cpu.pool_terms(x, *gu, *dn, ids, None, 4, g, d, i),
                                  repeats, warmup=0)
  _log(f"score_128 numba: {out['numba_pool_terms']['median_s']:.3f} s")
  pool = kernel_bench.int4_expert_pool(gu, dn, g, d, i)
  xj, idj = jnp.asarray(x), jnp.asarray(ids)
  deq = jax.jit(kernel_bench.dequant_einsum_terms)
  y_deq = np.asarray(deq(xj, pool, idj))
  out["numba_vs_xla_max_rel_err"] = float(np.abs(y_numba - y_deq).max() / np.abs(y_deq).max())
  out["xla_dequant_once_einsum"] = _time(lambda _: deq(xj, pool, idj), max(1, min(repeats, 3)),
                                         warmup=0)
  _log(f"score_128 xla dequant-once einsum: {out['xla_dequant_once_einsum']['median_s']:.3f} s")
  if FLAGS.skip_per_pair:
    out["xla_per_pair"] = "skipped (--skip_per_pair)"
  else:
    _log("score_128 xla per-pair: compiling, then one timed call (~30 s)")
    t0 = time.perf_counter()
    compiled = jax.jit(xla.expert_terms).lower(xj, pool, idj).compile()
    compile_s = time.perf_counter() - t0
    out["xla_per_pair"] = _time(lambda _: compiled(xj, pool, idj), 1, warmup=0)
    out["xla_per_pair"]["compile_s"] = compile_s
    out["speedup_numba_over_per_pair"] = (out["xla_per_pair"]["median_s"] /
                                          out["numba_pool_terms"]["median_s"])
    _log(f"score_128 xla per-pair: {out['xla_per_pair']['median_s']:.1f} s")
  out["speedup_numba_over_dequant_once"] = (out["xla_dequant_once_einsum"]["median_s"] /
                                            out["numba_pool_terms"]["median_s"])
  report["score_128"] = out


def _pallas_rows(report, gu, dn, d, i, g, k, repeats, interpret):
  """Decode matvec and grouped rows through the Pallas kernel, the pool in device memory."""
  from pallas_kernels import common, ops  # pylint: disable=import-outside-toplevel
  s = gu[0].shape[0]
  dev = jax.devices()[0]
  bw = common.hbm_bandwidth(dev)
  pool = kernel_bench.int4_expert_pool(gu, dn, g, d, i)
  moe = jax.jit(lambda x, p, ids, w: ops.grouped_moe(x, p, ids, w, backend="pallas",
                                                     interpret=interpret))
  call = lambda x, ids, w: moe(x, pool, ids, w)  # the pool is an operand, not a constant
  out = dict(device_kind=common.device_kind(dev), interpret=interpret, hbm_bytes_per_s=bw)

  expert_bytes = sum(int(a[0].nbytes) for a in (*gu, *dn))
  x = np.random.default_rng(2).standard_normal((1, d)).astype(np.float32)
  xj, one = jnp.asarray(x), jnp.ones((1, 1), jnp.float32)
  slot = [jnp.full((1, 1), e, jnp.int32) for e in range(s)]  # rotate: no expert stays cached
  t = _time(lambda n: call(xj, slot[n % s], one), max(repeats, 2 * s))
  y = np.asarray(call(xj, slot[0], one))[0]
  y_ref = cpu.expert_ffn(x, *(a[0] for a in (*gu, *dn)), 4, g, d, i)[0]
  t.update(expert_bytes=expert_bytes, gb_per_s=expert_bytes / t["median_s"] / 1e9,
           max_rel_err_vs_numba=float(np.abs(y - y_ref).max() / np.abs(y_ref).max()))
  if bw:
    t["hbm_fraction"] = expert_bytes / t["median_s"] / bw
  out["decode"] = t
  _log(f"pallas decode: {t['median_s'] * 1e3:.3f} ms, {t['gb_per_s']:.1f} GB/s")

  flops_per_pair = kernel_bench.flops_per_pair(d, i)
  rows = []
  for t_count, x, ids in _grouped_problems(s, d, k):
    xj, idj, wj = jnp.asarray(x), jnp.asarray(ids), jnp.ones(ids.shape, jnp.float32)
    row = dict(tokens=t_count, pairs=t_count * k)
    try:  # one shape the kernel's tiling rejects must not hide the others
      row.update(_time(lambda _, xj=xj, idj=idj, wj=wj: call(xj, idj, wj), repeats))
      y = np.asarray(call(xj, idj, wj))
      y_ref = cpu.pool_terms(x, *gu, *dn, ids, None, 4, g, d, i).sum(axis=1)
      row.update(gflop_per_s=flops_per_pair * t_count * k / row["median_s"] / 1e9,
                 max_rel_err_vs_numba=float(np.abs(y - y_ref).max() / np.abs(y_ref).max()))
      _log(f"pallas grouped T={t_count}: {row['median_s']:.4f} s, "
           f"{row['gflop_per_s']:.1f} GFLOP/s")
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = f"{type(e).__name__}: {e}"[:2000]
    rows.append(row)
  out["grouped"] = rows
  report["pallas"] = out


def main(argv):
  del argv
  d, i, g, k, s = (FLAGS.hidden, FLAGS.intermediate, FLAGS.group_size, FLAGS.top_k,
                   FLAGS.experts)
  repeats = max(1, FLAGS.repeats)
  report = dict(
      machine=dict(cpus=os.cpu_count(), processor=platform.processor() or platform.machine(),
                   numba_threads=numba.get_num_threads(), numba_version=numba.__version__,
                   jax_version=jax.__version__, jax_backend=jax.default_backend(),
                   avx512_int4_decode=bool(cpu_vec.AVX512)),
      shapes=dict(D=d, I=i, group_size=g, bits=4, experts=s, top_k=k),
      repeats=repeats)
  report["dram_read"] = kernel_bench.dram_read(FLAGS.dram_gib, lambda fn: _time(fn, repeats),
                                                _log)
  _log(f"building {s} random int4 experts at D={d}, I={i}, G={g}")
  rng = np.random.default_rng(FLAGS.seed)
  gu, dn = kernel_bench.random_int4_pool(rng, s, d, i, g)
  report["pool_bytes"] = int(sum(a.nbytes for a in (*gu, *dn)))
  _decode(report, gu, dn, d, i, g, repeats)
  _grouped(report, gu, dn, d, i, g, k, repeats)
  _score_128(report, gu, dn, d, i, g, k, repeats)
  accelerator = jax.default_backend() != "cpu"
  if FLAGS.pallas == "interpret" or (FLAGS.pallas == "auto" and accelerator):
    _pallas_rows(report, gu, dn, d, i, g, k, repeats, interpret=FLAGS.pallas == "interpret")
  else:
    report["pallas"] = ("not measured: no accelerator (--pallas=interpret runs the kernels "
                        "interpreted, for a smoke test)" if not accelerator else "off (--pallas)")
  write_report(report, FLAGS.out or None)


if __name__ == "__main__":
  app.run(main)
