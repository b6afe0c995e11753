"""This machine's figures for the offload cost model (glmjax.studies.cost_model), measured
through the engine's own code where it has one: the expert reader's per-chunk time, the CPU
kernel on one expert of a store (alone and as the engine's per-miss path), the host tier's
admission (a diagnostic), and host memcpy (the "upload" of a CPU-only machine). The disk itself
is measured by `glmjax.bench.reporting.disk_read_gbs`, the benchmarks' one disk probe.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from glmjax.studies.cost_model import GB


def _batches(items: list, size: int) -> list[list]:
  return [items[i:i + size] for i in range(0, len(items), size)]


def main_keys(store) -> list[tuple[int, int]]:
  """(layer, expert) of every expert in the store's main group."""
  layers = [l for l in store.layers if store.where[l][0] == "main"]
  return [(l, e) for l in layers for e in range(store.groups["main"][0].shape[1])]


def measure_reader(store_path: str, batch: int, workers: int, passes: int) -> dict:
  """The engine's miss path up to the bytes: its `ExpertReader` (priority queue, `workers`
  threads, tensorstore chunk reads with crc) serving `batch` demand reads at once, waited for
  with `as_completed` as `_compute` does. Seconds per chunk and GB/s, cold (page cache dropped
  before each pass) and warm."""
  from glmjax.formats.store import ExpertStore
  from glmjax.offload.expert_io import ExpertReader, drop_page_cache
  store = ExpertStore(store_path)
  keys = main_keys(store)
  nbytes = store.layout(keys[0][0]).nbytes
  reader = ExpertReader(lambda layer, expert, store=store: store.read_async(layer, expert).result(),
                        workers)
  out = {}
  try:
    for mode in ("warm-up", "cold", "warm"):
      times = []
      for _ in range(1 if mode == "warm-up" else passes):
        if mode == "cold":
          drop_page_cache(os.path.join(store_path, "experts"))
        for group in _batches(keys, batch):
          t0 = time.perf_counter()
          futures = {reader.submit(l, e): (l, e) for l, e in group}
          for _ in reader.as_completed(futures):
            pass
          times.append((time.perf_counter() - t0) / len(group))
      med = statistics.median(times)
      out[mode] = {"per_chunk_us": med * 1e6, "gbs": nbytes / med / GB}
  finally:
    reader.close()
  del out["warm-up"]
  return out


def median_s(fn, calls: int) -> float:
  """Median seconds of `calls` calls of `fn`, after 50 untimed ones."""
  for _ in range(50):  # compile (or load numba's cache) and warm the caches
    fn()
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def measure_cpu_kernel(store_path: str, calls: int, top_k: int) -> dict:
  """`expert_ffn` on one expert of the store at T=1 (the kernel alone), and the engine's whole
  per-miss compute (`_host_expert`: the chunk viewed as an expert, the token row gathered,
  the kernel, the result scattered into the layer's terms `[T, K, D]`): median seconds and GB/s
  of chunk bytes."""
  from glmjax.formats.store import ExpertStore
  from pallas_kernels import cpu
  store = ExpertStore(store_path)
  layer = main_keys(store)[0][0]
  layout = store.layout(layer)
  blob = store.read_async(layer, 0).result()  # [B] chunk bytes
  w = layout.unpack(blob)
  gu, dn = w.gate_up, w.down
  x = np.random.default_rng(0).standard_normal((1, layout.hidden)).astype(np.float32)  # [1, D]
  out = np.empty_like(x)
  terms = np.zeros((1, top_k, layout.hidden), np.float32)  # [T, K, D]
  t, k = np.array([0]), np.array([top_k - 1])

  def kernel():
    cpu.expert_ffn(x, gu.packed, gu.scales, dn.packed, dn.scales, gu.bits, gu.group_size,
                   dn.out_features, dn.in_features, out=out)

  def engine_path():
    e = layout.unpack(blob)
    g, d = e.gate_up, e.down
    terms[t, k] = cpu.expert_ffn(x[t], g.packed, g.scales, d.packed, d.scales, g.bits,
                                 g.group_size, d.out_features, d.in_features)

  kernel_s, path_s = median_s(kernel, calls), median_s(engine_path, calls)
  return {"median_s": kernel_s, "gbs": layout.nbytes / kernel_s / GB, "calls": calls,
          "engine_path_median_s": path_s, "engine_path_gbs": layout.nbytes / path_s / GB,
          "layout": {"hidden": layout.hidden, "intermediate": layout.intermediate,
                     "bits": layout.bits, "group_size": layout.group_size,
                     "nbytes": layout.nbytes}}


def measure_admission(store_path: str, top_k: int, calls: int = 200) -> dict:
  """Diagnostic, not a model input: the engine's host-tier admission of n just-read experts
  (`HostSlab.write`, one donated in-place jitted call per layer step), median seconds per
  call for n = 1 … top_k. The model has no term for it."""
  import jax
  from glmjax.formats.store import ExpertStore
  from glmjax.offload.tiers import HostSlab
  store = ExpertStore(store_path)
  layer = main_keys(store)[0][0]
  blob = store.read_async(layer, 0).result()
  slab = HostSlab(store.layout(layer), top_k)
  slots = [slab.alloc() for _ in range(top_k)]
  out = {}
  for n in sorted({1, max(1, top_k // 2), top_k}):
    def write():
      slab.write(slots[:n], [blob] * n)
      jax.block_until_ready(slab.pool)
    out[str(n)] = median_s(write, calls)
  return {"median_s_by_experts": out}


def measure_memcpy(nbytes: int = 64 << 20, repeats: int = 9) -> float:
  """Host memcpy GB/s (median): the "upload" of a CPU-only machine."""
  src = np.ones(nbytes, np.uint8)
  dst = np.empty_like(src)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - t0)
  return nbytes / statistics.median(times) / GB
