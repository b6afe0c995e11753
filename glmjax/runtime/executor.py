"""The `Executor` interface, what both executors share, the resident executor and the prefill
plan. `executor_for` picks the executor of a loaded model."""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from typing import Iterator, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from glmjax.model.config import Config, Runtime
from glmjax.runtime import compile_cache
from glmjax.model.forward import KVCache, bucket, entry_points, mtp_fn
from glmjax.model.records import RecordOptions

MIN_BUCKET = 1  # a prefill is padded to the next power of two (DESIGN.md §4: padding a 4-token
# prompt to 16 rows made its attention 4x the work)
STATS_EVERY_S = 600.0  # the offload statistics reach the store at most this often (and at close)


def chunk_plan(n: int, chunk: int) -> list[tuple[int, int, int]]:
  """How a prompt of `n` tokens is prefilled: (offset, real tokens, padded width) per chunk.
  Chunks of `chunk` tokens (0: one piece), only the last padded (to a power of two)."""
  if not chunk or n <= chunk:
    width = bucket(n, MIN_BUCKET)
    return [(0, n, min(width, chunk) if chunk else width)]
  full, rest = divmod(n, chunk)
  plan = [(j * chunk, chunk, chunk) for j in range(full)]
  if rest:
    plan.append((full * chunk, rest, min(bucket(rest, MIN_BUCKET), chunk)))
  return plan


class Executor(Protocol):
  """What decoding, speculation, serving and the studies need of a model's steps, whatever
  holds its weights. Lengths are host ints; every step returns the cache advanced."""

  cfg: Config
  chunk: int  # a prompt longer than this is prefilled chunk by chunk (0: one piece)
  expert_budget: int | None  # a verify pass's expert cap (offloaded stores; lossy) or None
  expert_bytes: int  # one routed expert's bytes in its store (0 without a store)
  dense_bytes: int | None  # the dense weights' bytes by the memory plan, when one was made
  stateless: bool  # its steps keep no host state between calls: one may run on another thread

  def put(self, x, dtype=None, batch: bool = False) -> jax.Array:
    """A host input as a device array (replicated over a mesh; `batch` splits it on `data`)."""

  def prefill(self, cache: KVCache, ids: np.ndarray, start: int, hidden: bool = False,
              recorder=None):
    """Writes `ids` `[S]` at start..: (logits `[V]` at the last token, hidden `[S, D]` numpy
    with `hidden`, the cache at start + S); a `recorder` gets the prompt's routing."""

  def prefill_rows(self, cache: KVCache, arr: np.ndarray) -> Iterator:
    """Writes `arr` `[B, S]` at 0.. chunk by chunk (`chunk_plan`): yields each chunk's
    (logits `[B, width, V]`, the cache so far)."""

  def step(self, cache: KVCache, tokens, length, absorbed: bool = True, n_valid=None,
           recorder=None, expert_cap=None):
    """Feeds `tokens` `[B, S]` at `length`: (logits `[B, S, V]`, hidden, cache advanced)."""

  def mtp(self, h, next_tokens, cache: KVCache, start: int):
    """MTP step(s) at start..: (logits, block output, the MTP cache)."""

  def score(self, arr: np.ndarray, n_valid: int):
    """Teacher-forced logits `[B, S, V]` of `arr` `[B, S]` in one pass (every row; positions
    at or past `n_valid` are padding, which routes no expert)."""

  def record(self, arr: np.ndarray, opts: RecordOptions, fetch: bool = True) -> dict:
    """Teacher-forced routing records of `arr` `[B, S]` (`records.route_record`)."""

  def warm_batch(self, cache: KVCache, tokens: np.ndarray, lengths) -> KVCache:
    """Compiles a batch's decode step ahead, changing no counters; returns the cache."""

  def warm_prefill(self, cache: KVCache, width: int) -> KVCache:
    """Compiles ahead what `prefill` runs for a one-row chunk `width` wide (a power of two,
    `chunk_plan`), changing no counters; `cache` is one row over the null page. Returns it."""

  def compiled(self) -> list[str]:
    """The step shapes met so far, one entry (the step's name) per shape and static choice."""

  def telemetry(self) -> dict | None: ...
  def tier_state(self) -> dict | None: ...
  def sum_over_processes(self, view: dict) -> dict: ...
  def stage_timing(self) -> dict: ...
  def warm_host(self) -> None: ...
  def resident_weights(self, why: str): ...
  def save_stats(self, force: bool = False) -> None: ...
  def close(self) -> None: ...


class Steps:
  """What both executors share: inputs onto the device or mesh, ahead-of-time compilation,
  and the offload engine's telemetry (an all-resident store keeps its engine for it)."""

  def __init__(self, cfg: Config, weights, options, mesh=None, engine=None,
               dense_bytes: int | None = None):
    self.cfg, self.weights, self.mesh, self.engine = cfg, weights, mesh, engine
    # The static half of every compiled step (the options that become static arguments).
    self.runtime = Runtime(options.moe_kernel, mesh, options.attention)
    self.chunk = options.prefill_chunk
    self.compile_unit = options.compile_unit
    self.progress = options.progress  # a bar over a chunked prefill's chunks
    self.dense_bytes = dense_bytes
    self.expert_budget = None if engine is None else engine.expert_budget
    self.expert_bytes = 0 if engine is None else engine.chunk_bytes
    self._shapes_met: set = set()  # (step, static arguments, shapes) keys, for `compiled`
    self._stats_saved_at = time.monotonic()

  def __repr__(self):
    return (f"{type(self).__name__}(kernel={self.runtime.kernel!r}, "
            f"attention={self.runtime.impl!r})")

  def with_attention(self, impl: str) -> "Steps":
    """This executor with attention `impl` ("sparse" or "dense") and its own compiled steps:
    benchmarks compare the two on one loaded model."""
    other = copy.copy(self)
    other.runtime, other._shapes_met = dataclasses.replace(self.runtime, impl=impl), set()
    return other

  def put(self, x, dtype=None, batch: bool = False) -> jax.Array:
    """A host input (ids, lengths, page tables) as a device array: on the model's device, or
    replicated over its mesh (with `batch`, split along `data` when that axis divides it)."""
    if self.mesh is None:  # committed to the device, as every step's output is: a jit compiles
      # once per mix of committed and uncommitted arguments (a void fused step's page table
      # and length are its outputs), which an offloaded store's soak met as late compilations.
      # A host value goes by `device_put`, which compiles nothing (`jnp.asarray` compiles a
      # program per shape and dtype: each new page-table width or batch was one more).
      if not isinstance(x, jax.Array):
        x = np.asarray(x, dtype)
      elif dtype is not None and x.dtype != dtype:
        x = x.astype(dtype)
      return jax.device_put(x, jax.local_devices()[0])
    from glmjax import sharding
    x = np.asarray(x, dtype)
    n = sharding.axis_size(self.mesh, "data")
    split = batch and n > 1 and x.shape[0] % n == 0
    return sharding.put(x, sharding.batch_split(self.mesh) if split else
                        sharding.replicated(self.mesh))

  def _met(self, fn, args: tuple, static: dict, dynamic: dict | None = None):
    """`fn` with its `static` arguments, after noting them and the argument shapes
    (`compiled`); a shape met for the first time compiles the layer programs it lacks when it
    runs."""
    dynamic = dynamic or {}
    leaves = jax.tree_util.tree_leaves((args[1:], dynamic))  # the weights' shapes never change
    key = (fn, tuple(sorted(static.items())), tuple(sorted(dynamic)),
           tuple((a.shape, a.dtype) for a in leaves))
    if key not in self._shapes_met:
      compile_cache.relieve_map_pressure()
      self._shapes_met.add(key)
    return functools.partial(fn, **static)

  def ids(self, x) -> jax.Array:
    """Token ids for the engine's prefill: committed to the device as `put`'s (a mesh takes
    them as they are)."""
    return jnp.asarray(x, jnp.int32) if self.mesh is not None else self.put(x, jnp.int32)

  def _at(self, cache: KVCache, length) -> KVCache:
    return KVCache(cache.layers, cache.pages, self.put(length, jnp.int32))

  def compiled(self) -> list[str]:
    return sorted(key[0].__name__ for key in self._shapes_met)

  # --- the engine's telemetry (None / no-ops without one) ------------------------------------
  def telemetry(self) -> dict | None:
    """The offload counters and gauges (`OffloadEngine.telemetry`), or None."""
    return None if self.engine is None else self.engine.telemetry()

  def tier_state(self) -> dict | None:
    """The tiers' contents, for a trace to replay from (offloaded runs only)."""
    return None

  def sum_over_processes(self, view: dict) -> dict:
    """`view` (this process's telemetry) with the additive counters summed over every process:
    a collective that every process calls."""
    from glmjax.offload.owners import counter_layers, sum_counters
    return view if self.engine is None else sum_counters(view, counter_layers(self.engine))

  def stage_timing(self) -> dict:
    """Turns per-stage timing on (each timed stage waits for its results, so the overlap is
    lost) and returns the dict of seconds per stage that the following steps add to."""
    if self.engine is None:
      raise NotImplementedError("stage timing is the offload engine's (an expert store's)")
    self.engine.stage_s = {}
    return self.engine.stage_s

  def warm_host(self) -> None:
    """Reads every expert the host cache has room for (benchmarks' warm starts)."""
    if self.engine is not None:
      self.engine.warm_host()

  def save_stats(self, force: bool = False) -> None:
    """Writes the usage histogram and co-activation table to the store (about 20 MB at GLM-5's
    size): at close, and after a request at most every STATS_EVERY_S seconds."""
    now = time.monotonic()
    if self.engine is not None and (force or now - self._stats_saved_at >= STATS_EVERY_S):
      self.engine.save()
      self._stats_saved_at = now

  def resident_weights(self, why: str):
    """The whole weight tree, routed experts included, for work that needs all of it at hand
    (calibration, the quality report); else an InputError that starts with `why`."""
    from glmjax.errors import InputError
    raise InputError(f"{why}: its experts do not all fit in memory")

  def close(self) -> None:
    """Stops the I/O threads (the engine saves its statistics as it closes)."""
    if self.engine is not None:
      self.engine.close()


class ResidentExecutor(Steps):
  """Steps over resident weights: each decoder layer two jitted halves (`layer_step`; the layers
  with the same half share its executable: compile time does not grow with depth), inlined
  into one program per step for a shallow model (`forward.entry_points`)."""

  stateless = True

  @functools.cached_property
  def fns(self) -> dict:
    """The prefill, decode, score and record entry points for this model's depth."""
    return entry_points(self.weights, self.compile_unit)

  def _static(self, **kw) -> dict:
    return dict(cfg=self.cfg, runtime=self.runtime, **kw)

  def resident_weights(self, why: str):
    del why  # every weight is resident here
    return self.weights

  def prefill(self, cache, ids, start, hidden=False, recorder=None):
    plan = chunk_plan(len(ids), self.chunk)
    record = RecordOptions() if recorder is not None else None
    records, xs, logits = [], [], None
    bar = tqdm(total=len(ids), desc="prefill", unit="tok", leave=False,
               disable=not self.progress or len(plan) == 1)
    for o, n, w in plan:
      cache = self._at(cache, start + o)
      toks = self.put(np.pad(ids[o:o + n], (0, w - n))[None].astype(np.int32))
      args = (self.weights, cache, toks, self.put(n, jnp.int32))
      fn = self._met(self.fns["prefill"], args, self._static(
          record=record, hidden="all" if hidden else "last"))
      out = fn(*args)
      logits, x, cache = out.logits, out.hidden, out.cache
      if hidden:
        xs.append(np.asarray(x[0, :n]))
      if record is not None:
        records.append(jax.tree_util.tree_map(lambda a, n=n: np.asarray(a)[:, :n], out.records))
      if not bar.disable:
        logits.block_until_ready()  # the bar moves as chunks finish, not as they are queued
      bar.update(n)
    bar.close()
    if recorder is not None:
      recorder.add(ids, {k: np.concatenate([r[k] for r in records], axis=1) for k in records[0]},
                   slice(0, len(ids)))
    return logits[0], np.concatenate(xs) if hidden else None, cache

  def prefill_rows(self, cache, arr):
    for o, n, w in chunk_plan(arr.shape[1], self.chunk):
      toks = np.pad(arr[:, o:o + n], ((0, 0), (0, w - n)))
      logits, _, cache = self.step(cache, toks, o, absorbed=None)
      yield logits, cache

  def step(self, cache, tokens, length, absorbed=True, n_valid=None, recorder=None,
           expert_cap=None):
    del expert_cap  # a verify pass's cap only bounds what an offloaded store reads
    cache = self._at(cache, length)
    toks = self.put(tokens, jnp.int32)
    record = RecordOptions() if recorder is not None else None
    nv = {} if n_valid is None else {"n_valid": self.put(n_valid, jnp.int32)}
    args = (self.weights, cache, toks)
    fn = self._met(self.fns["decode"], args, self._static(absorbed=absorbed, record=record), nv)
    out = fn(*args, **nv)
    if recorder is not None:
      add_records(recorder, tokens, n_valid, out.records)
    return out.logits, out.hidden, out.cache

  def mtp(self, h, next_tokens, cache, start):
    return mtp_fn(self.weights, h, next_tokens, cache, self.put(start, jnp.int32),
                  **self._static())

  def score(self, arr, n_valid):
    logits = self.fns["score"](self.weights, self.put(arr, batch=True), self.put(0, jnp.int32),
                      n_valid=self.put(n_valid, jnp.int32), **self._static())
    if self.mesh is not None:  # every process gets every row (a data-split batch is gathered)
      from glmjax import sharding
      logits = sharding.gather(logits, self.mesh)
    return logits

  def record(self, arr, opts, fetch=True):
    out = self.fns["record"](self.weights, self.put(arr), self.put(0, jnp.int32),
                             **self._static(opts=opts))
    return {k: np.asarray(v) for k, v in out.items()} if fetch else out

  def warm_batch(self, cache, tokens, lengths):
    return self.step(cache, tokens, lengths, n_valid=np.zeros(len(tokens), np.int32))[2]

  def warm_prefill(self, cache, width):
    # one all-padding chunk (n_valid 0) through `prefill`'s step: it writes only past the
    # length, on the null page
    args = (self.weights, self._at(cache, 0), self.put(np.zeros((1, width), np.int32)),
            self.put(0, jnp.int32))
    fn = self._met(self.fns["prefill"], args, self._static(record=None, hidden="last"))
    return fn(*args).cache


def add_records(recorder, tokens, n_valid, records) -> None:
  """A step's routing `records` into `recorder`, for its first real positions."""
  toks = np.asarray(tokens)
  n = toks.shape[1] if n_valid is None else int(np.max(n_valid))
  recorder.add(toks[0, :n], records, slice(0, n))


def executor_for(cfg: Config, weights, options, mesh=None, engine=None,
                 dense_bytes: int | None = None) -> Steps:
  """The executor of a loaded model: the engine's layer steps while some routed experts live
  outside the resident weights, else the resident layer steps (an all-resident engine stays
  for its telemetry)."""
  if engine is not None and not engine.all_resident:
    from glmjax.runtime.offloaded import OffloadExecutor
    return OffloadExecutor(cfg, weights, options, mesh, engine, dense_bytes)
  return ResidentExecutor(cfg, weights, options, mesh, engine, dense_bytes)
