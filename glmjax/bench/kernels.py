"""Helpers of the expert-kernel benchmarks (scripts/bench_experts.py): timing on a shared
machine, random int4 pools, the dequantize-then-einsum reference path, random routing, and
the DRAM read roof.

    from glmjax.bench import kernels as kernel_bench
    gu, dn = kernel_bench.random_int4_pool(np.random.default_rng(0), 16, 6144, 2048, 64)
    kernel_bench.time_calls(lambda i: fn(), repeats=5)["median_s"]
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from glmjax.model import quant

HIGHEST = jax.lax.Precision.HIGHEST


def wait_idle(max_wait_s: float) -> dict:
  """Waits up to `max_wait_s` for system CPU use below 20% (the machine may be shared);
  returns what it saw. 0 waits not at all."""
  import psutil
  t0, busy = time.perf_counter(), None
  while max_wait_s > 0 and time.perf_counter() - t0 < max_wait_s:
    busy = psutil.cpu_percent(interval=0.5)
    if busy < 20.0:
      break
  return dict(cpu_busy_percent_before=busy, waited_s=round(time.perf_counter() - t0, 1),
              loadavg_1m=os.getloadavg()[0])


def time_calls(fn, repeats: int, warmup: int = 1, wait_idle_s: float = 0.0) -> dict:
  """Median/min wall seconds of `repeats` calls to fn(i) after `warmup` untimed calls (each
  result waited for), with `wait_idle`'s report of the machine before the timed calls."""
  for i in range(warmup):
    jax.block_until_ready(fn(i))
  idle = wait_idle(wait_idle_s)
  ts = []
  for i in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(warmup + i))
    ts.append(time.perf_counter() - t0)
  return dict(median_s=statistics.median(ts), min_s=min(ts), repeats=repeats, **idle)


def random_int4_pool(rng, s: int, d: int, i: int, g: int):
  """Random int4 pool of `s` experts as numpy arrays: ((gate_up packed [S, 2I, D/2], scales
  [S, 2I, D/G]), (down packed [S, D, I/2], scales [S, D, I/G])), bf16 scales sized so
  activations stay O(1). No quantization: random bytes time the same."""

  def q(o, k):
    ng = -(-k // g)
    packed = rng.integers(0, 256, (s, o, ng * g // 2), dtype=np.uint8)
    mag = 1.0 / (np.sqrt(k) * 4)
    scales = (rng.uniform(0.5, 1.5, (s, o, ng)) * mag).astype(ml_dtypes.bfloat16)
    return packed, scales

  return q(2 * i, d), q(d, i)


def int4_expert_pool(gu, dn, g: int, d: int, i: int, lo: int = 0,
                     hi: int | None = None) -> quant.ExpertPool:
  """Experts lo..hi of a `random_int4_pool` as a jax ExpertPool (in device memory)."""
  sl = slice(lo, hi)
  return quant.ExpertPool(
      gate_up=quant.QArray(jnp.asarray(gu[0][sl]), jnp.asarray(gu[1][sl]), 4, g, d),
      down=quant.QArray(jnp.asarray(dn[0][sl]), jnp.asarray(dn[1][sl]), 4, g, i))


def dequant_einsum_terms(x, pool: quant.ExpertPool, slot_ids):
  """x [T, D], slot ids [T, K] -> terms [T, K, D]: every pool expert dequantized once and run
  densely, the routed terms picked (the XLA reference path)."""
  gu = quant.dequantize(pool.gate_up)  # [S, 2I, D]
  dn = quant.dequantize(pool.down)  # [S, D, I]
  inter = pool.intermediate
  h = jnp.einsum("td,sfd->tsf", x, gu, precision=HIGHEST)
  a = jax.nn.silu(h[..., :inter]) * h[..., inter:]
  y = jnp.einsum("tsi,sdi->tsd", a, dn, precision=HIGHEST)  # [T, S, D]
  return jnp.take_along_axis(y, slot_ids[..., None].astype(jnp.int32), axis=1)


def random_routing(rng, t: int, s: int, k: int) -> np.ndarray:
  """Top-k slot ids [T, K] int32: `k` distinct random slots of `s` per token."""
  return np.argsort(rng.random((t, s)), axis=1)[:, :k].astype(np.int32)


def flops_per_pair(d: int, i: int) -> int:
  """FLOPs of one (token, expert) pair: the gate_up [2I, D] and down [D, I] matvecs."""
  return 2 * (2 * i * d + d * i)


def dram_read(gib: float, timer, log=lambda msg: None) -> dict:
  """Read bandwidth of a ~`gib` GiB float32 array: jitted jnp.sum, numpy sum and a numba
  stream with the CPU kernel's vector ops (`pallas_kernels.cpu_stream`). `timer(fn)` times
  fn(i) (e.g. `time_calls` with the repeats bound); GB/s of the median."""
  from pallas_kernels.cpu_stream import stream_sum
  n = int(gib * 2**30) // 4
  log(f"dram: {n * 4 / 2**30:.2f} GiB float32")
  a = np.random.default_rng(1).random(n, dtype=np.float32)
  aj = jnp.asarray(a)
  jsum = jax.jit(jnp.sum)
  out = {}
  for name, fn in (("jax_jit_sum", lambda i: jsum(aj)), ("numpy_sum", lambda i: a.sum()),
                   ("numba_vector_stream", lambda i: stream_sum(a))):
    t = timer(fn)
    t["gb_per_s"] = a.nbytes / t["median_s"] / 1e9
    out[name] = t
    log(f"  {name}: {t['gb_per_s']:.1f} GB/s")
  return dict(bytes=a.nbytes, **out)
