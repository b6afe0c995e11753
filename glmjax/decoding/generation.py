"""The generation core: a request, the model's steps over a paged KV cache, the decode loop.

`Runner` runs a model's forward steps: one jit per step for resident weights, or the offload
engine's layer steps. A prompt longer than `prefill_chunk` tokens is written into the cache
chunk by chunk (only the last chunk is padded), so no step's temporaries grow with the prompt:
resident weights go chunk by chunk through every layer; the engine goes layer by layer through
every chunk, so each MoE layer reads its experts once per prompt. `Model.generate`,
`ChatSession`, speculative decoding and the server's batch all run through it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from glmjax.decoding.logprobs import MAX_LOGPROBS, TokenLogprob
from glmjax.errors import InputError
from glmjax.model.forward import (JITTED, KVCache, RecordOptions, bucket, decode_fn, mtp_fn,
                                  prefill_fn, stack_records)

MIN_BUCKET = 16  # a prefill is padded to at least this many positions (few compiled shapes)


@dataclasses.dataclass
class GenerationResult:
  """What `Model.generate` returns.

  Attributes:
    tokens: the new token ids (a stop token that ended generation is not included).
    stats: flat dict of numbers: prompt_tokens, new_tokens, compile_s (before decoding),
      prefill_s, prefill_chunks, decode_s, decode_compile_s (shapes first met while decoding),
      decode_tok_s (from the second decode step on, compilation left out), kv_pages and
      kv_bytes (the request's pages and their bytes), and for expert stores the offload
      telemetry (expert_pin_hits, expert_host_hits, expert_misses, expert_bytes_read,
      prefill_expert_bytes, io_service_s, io_wait_s, misses_layer_N, ...), over this call.
    stop_reason: "stop_token", "stop_string" or "max_new_tokens".
    text: the decoded new text (None without a tokenizer), cut before a matched stop string.
  """
  tokens: list[int]
  stats: dict[str, float]
  stop_reason: str = "max_new_tokens"
  text: str | None = None


MAX_SEED = 2 ** 63  # seeds are int64 PRNG keys: 0 ≤ seed < 2**63


@dataclasses.dataclass
class Request:
  """One generation request's settings and output: what `emit` records, and why it stopped."""
  max_new_tokens: int
  picker: Any  # sampling.TokenPicker
  seed: int
  stops: set
  stream: Any = None  # text.StreamDecoder
  matcher: Any = None  # text.StopMatcher
  on_token: Callable[[int], None] | None = None
  on_text: Callable[[str], None] | None = None
  on_score: Callable[[tuple], None] | None = None  # each (token, TokenLogprob), before its text
  recorder: Any = None  # glmjax.replay.record.LiveRecorder when the run is traced
  logprobs: int | None = None  # record each new token's logprob and this many alternatives
  out: list = dataclasses.field(default_factory=list)
  pieces: list = dataclasses.field(default_factory=list)
  # (token, TokenLogprob) per token picked, `out`'s and then the stop token that ended it
  scores: list = dataclasses.field(default_factory=list)
  reason: str = "max_new_tokens"
  cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
  _pending: Any = None

  def pick(self, logits) -> int:
    """The next token from logits `[V]` (the picker's choice), noting its logprob and the top
    `logprobs` alternatives under the distribution sampled from when asked to."""
    tok = self.picker.pick(logits)
    if self.logprobs is not None:
      self._pending = (tok, TokenLogprob.of(self.picker.logprobs(logits), tok, self.logprobs))
    return tok

  def emit(self, tok: int) -> bool:
    """Records `tok`; True when generation must stop (stop token/string, or length)."""
    if self._pending is not None:
      self.scores.append(self._pending)
      if self.on_score:
        self.on_score(self._pending)
      self._pending = None
    if tok in self.stops:
      self.reason = "stop_token"
      return True
    self.out.append(tok)
    self.picker.observe(tok)
    if self.on_token:
      self.on_token(tok)
    if self.stream is not None:
      piece = self.stream.feed(tok)
      if self.matcher is not None:
        piece, hit = self.matcher.feed(piece)
        if hit:
          self.reason = "stop_string"
      self.pieces.append(piece)
      if self.on_text and piece:
        self.on_text(piece)
    return self.reason == "stop_string" or len(self.out) >= self.max_new_tokens

  def finish(self) -> None:
    """Flushes the detokenizer's tail (unless a stop string already cut the text)."""
    if self.stream is None or self.reason == "stop_string":
      return
    tail = self.stream.flush()
    if self.matcher is not None:
      tail = self.matcher.feed(tail)[0] + self.matcher.flush()
    self.pieces.append(tail)
    if self.on_text and tail:
      self.on_text(tail)


def new_request(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                repetition_penalty: float = 1.0, stop_ids=None, stop=(), on_token=None,
                on_text=None, logprobs: int | None = None, presence_penalty: float = 0.0,
                frequency_penalty: float = 0.0, on_score=None) -> Request:
  """Validates one request's sampling and stop settings (before any compute)."""
  from glmjax.decoding import sampling, text
  if temperature < 0:  # also checked by SamplingParams; kept for a plain message
    raise InputError(f"temperature must be ≥ 0, got {temperature}")
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < MAX_SEED:
    raise InputError(f"seed must be an integer in [0, 2**63), got {seed!r}")
  if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
    raise InputError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
  params = sampling.SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty,
                                  presence_penalty, frequency_penalty)
  if stop and model.tokenizer is None:
    raise InputError("stop strings need a tokenizer")
  picker = sampling.TokenPicker(params, model.config.vocab_size, prompt_ids, seed)
  tok = model.tokenizer
  return Request(
      max_new_tokens=max_new_tokens, picker=picker, seed=seed,
      stops=model.default_stop_ids() if stop_ids is None else set(stop_ids),
      stream=text.StreamDecoder(tok) if tok is not None else None,
      matcher=text.StopMatcher(stop) if stop else None, on_token=on_token, on_text=on_text,
      logprobs=logprobs, on_score=on_score)


def chunk_plan(n: int, chunk: int) -> list[tuple[int, int, int]]:
  """How a prompt of `n` tokens is prefilled: (offset, real tokens, padded width) per chunk.
  Chunks of `chunk` tokens (0: one piece), only the last padded (to a power of two ≥ 16)."""
  if not chunk or n <= chunk:
    width = bucket(n, MIN_BUCKET)
    return [(0, n, min(width, chunk) if chunk else width)]
  full, rest = divmod(n, chunk)
  plan = [(j * chunk, chunk, chunk) for j in range(full)]
  if rest:
    plan.append((full * chunk, rest, min(bucket(rest, MIN_BUCKET), chunk)))
  return plan


class Runner:
  """A model's forward steps over a paged KV cache (glmjax.model.kvcache): resident weights
  one jit per step (compiled ahead, once per shape, so timings leave compilation out), or the
  offload engine's layer steps. Lengths are host ints; every step returns the cache advanced."""

  def __init__(self, model):
    self.model = model
    self.cfg, self.weights, self.engine = model.config, model.weights, model.engine
    self.offloaded = model.offloaded
    self.kernel = model.options.moe_kernel
    self.impl = model.options.attention
    self.chunk = model.options.prefill_chunk
    self.progress = model.options.progress  # a bar over a chunked prefill's chunks
    self.mesh = model.mesh
    self._compiled: dict = {}

  def put(self, x, dtype=None, batch: bool = False) -> jax.Array:
    """A host input (ids, lengths, page tables) as a device array: on the model's device, or
    replicated over its mesh (with `batch`, split along `data` when that axis divides it)."""
    if self.mesh is None:
      return jnp.asarray(x, dtype)
    from glmjax import sharding
    x = np.asarray(x, dtype)
    n = sharding.axis_size(self.mesh, "data")
    split = batch and n > 1 and x.shape[0] % n == 0
    return sharding.put(x, sharding.batch_split(self.mesh) if split else
                        sharding.replicated(self.mesh))

  def _compile(self, fn, args: tuple, static: dict, dynamic: dict | None = None):
    """`fn` compiled ahead (once per static arguments and argument shapes), so that a step's
    timing leaves its compilation out; `dynamic` are keyword arrays of the call."""
    dynamic = dynamic or {}
    leaves = jax.tree_util.tree_leaves((args, dynamic))
    key = (fn, tuple(sorted(static.items())), tuple(sorted(dynamic)),
           tuple((a.shape, a.dtype) for a in leaves))
    if key not in self._compiled:
      self._compiled[key] = fn.lower(*args, **dynamic, **static).compile()
    return self._compiled[key]

  def _at(self, cache: KVCache, length) -> KVCache:
    return KVCache(cache.layers, cache.pages, self.put(length, jnp.int32))

  # --- prefill ------------------------------------------------------------------------------
  def prefill(self, cache: KVCache, ids: np.ndarray, start: int, hidden: bool = False,
              recorder=None):
    """Writes `ids` `[S]` at positions start.. of a batch-1 cache, chunk by chunk.

    Returns (logits `[V]` at the last token, hidden states `[S, D]` as numpy with `hidden`
    (else None), the cache at length start + S). A `recorder` gets the routing of the whole
    prompt as one step."""
    plan = chunk_plan(len(ids), self.chunk)
    pieces = [np.pad(ids[o:o + n], (0, w - n))[None].astype(np.int32) for o, n, w in plan]
    if self.offloaded:
      return self._engine_prefill(cache, ids, pieces, plan, start, hidden, recorder)
    record = RecordOptions() if recorder is not None else None
    records, xs, logits = [], [], None
    bar = tqdm(total=len(ids), desc="prefill", unit="tok", leave=False,
               disable=not self.progress or len(plan) == 1)
    for (o, n, _), toks in zip(plan, pieces):
      cache = self._at(cache, start + o)
      toks = self.put(toks)
      args = (self.weights, cache, toks, self.put(n, jnp.int32))
      fn = self._compile(prefill_fn, args, dict(
          cfg=self.cfg, kernel=self.kernel, record=record, mesh=self.mesh, impl=self.impl,
          hidden="all" if hidden else "last"))
      out = fn(*args)
      logits, x, cache = out[:3]
      if hidden:
        xs.append(np.asarray(x[0, :n]))
      if record is not None:
        records.append(jax.tree_util.tree_map(lambda a, n=n: np.asarray(a)[:, :n], out[3]))
      if not bar.disable:
        logits.block_until_ready()  # the bar moves as chunks finish, not as they are queued
      bar.update(n)
    bar.close()
    if recorder is not None:
      recorder.add(ids, {k: np.concatenate([r[k] for r in records], axis=1) for k in records[0]},
                   slice(0, len(ids)))
    return logits[0], np.concatenate(xs) if hidden else None, cache

  def _engine_prefill(self, cache, ids, pieces, plan, start, hidden, recorder):
    """The engine's prefill: layer-major over the chunks (each expert read once per layer).
    Only the last chunk is padded, so the real rows of its records are the first len(ids)."""
    rec = [] if recorder is not None else None
    n_last = plan[-1][1]
    xs, cache = self.engine.prefill([jnp.asarray(p) for p in pieces], self._at(cache, start),
                                    n_last, record=rec)
    logits = JITTED.logits(self.weights, xs[-1][:, n_last - 1:n_last], cfg=self.cfg)
    if recorder is not None:
      recorder.add(ids, stack_records(rec), slice(0, len(ids)))
    out = None
    if hidden:
      out = np.concatenate([np.asarray(x[0, :r]) for x, (_, r, _) in zip(xs, plan)])
    return logits[0, 0], out, self._at(cache, start + len(ids))

  # --- decode, verify, score ----------------------------------------------------------------
  def step(self, cache: KVCache, tokens, length, absorbed: bool = True, n_valid=None,
           recorder=None, expert_cap=None):
    """Feeds `tokens` `[B, S]` at `length` (int, or `[B]` per row): (logits `[B, S, V]`, hidden
    `[B, S, D]`, cache advanced by S). `n_valid` `[B]` marks a batch's empty rows (0)."""
    cache = self._at(cache, length)
    toks = jnp.asarray(tokens, jnp.int32) if self.mesh is None else self.put(tokens, jnp.int32)
    rec = [] if recorder is not None else None
    if self.offloaded:
      logits, x, new = self.engine.forward(toks, cache, absorbed=absorbed, n_valid=n_valid,
                                           record=rec, expert_cap=expert_cap)
      new = KVCache(new.layers, new.pages, new.length + toks.shape[1])
      records = stack_records(rec) if rec is not None else None
    else:
      record = RecordOptions() if recorder is not None else None
      nv = {} if n_valid is None else {"n_valid": self.put(n_valid, jnp.int32)}
      args = (self.weights, cache, toks)
      fn = self._compile(decode_fn, args, dict(
          cfg=self.cfg, kernel=self.kernel, absorbed=absorbed, record=record, mesh=self.mesh,
          impl=self.impl), nv)
      out = fn(*args, **nv)
      logits, x, new = out[:3]
      records = out[3] if record is not None else None
    if recorder is not None:
      toks_np = np.asarray(tokens)
      n = toks_np.shape[1] if n_valid is None else int(np.max(n_valid))
      recorder.add(toks_np[0, :n], records, slice(0, n))
    return logits, x, new

  def mtp(self, h, next_tokens, cache: KVCache, start: int):
    """MTP step(s) at positions start.. over (h `[1, S, D]`, next tokens `[1, S]`):
    (logits, block output, the MTP cache)."""
    if self.offloaded:
      return self.engine.mtp_forward(h, next_tokens, cache, start)
    return mtp_fn(self.weights, h, next_tokens, cache, self.put(start, jnp.int32), cfg=self.cfg,
                  kernel=self.kernel, mesh=self.mesh, impl=self.impl)


# --- the decode loop ---------------------------------------------------------------------------

class CompileClock:
  """Seconds JAX spends tracing, lowering and compiling while it is open (its monitoring
  events, from any thread). Steps first met mid-run (a verify width per draft length, the
  engine's fused step) compile there; their time is reported apart from decoding.

  The events nest (a jit traced inside another's trace reports its own duration within the
  outer one), so the clock counts the union of their intervals, not the sum of their
  durations: a sum could exceed the wall time and make a prefill time negative."""

  EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
            "/jax/core/compile/jaxpr_to_mlir_module_duration",
            "/jax/core/compile/backend_compile_duration")

  def __init__(self):
    self._spans: list[tuple[float, float]] = []  # (start, end), perf_counter seconds

  def _listen(self, event, duration, **_):
    if event in self.EVENTS:  # called as the event ends
      end = time.perf_counter()
      self._spans.append((end - duration, end))

  @property
  def seconds(self) -> float:
    """The length of the union of the events' intervals so far."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(self._spans):
      if end > reach:
        total += end - max(start, reach)
        reach = end
    return total

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listen)


def decode_loop(runner: Runner, cache: KVCache, start: int, prefilled, req: Request):
  """Plain decoding (gpt-fast's loop): pick → emit → step per token, after the prefill's
  `prefilled` = (logits, prefill seconds, compile seconds). Returns (stats, cache)."""
  logits, prefill_s, compile_s = prefilled
  length = start
  tok = req.pick(logits) if req.max_new_tokens else None
  first_step_s = None  # the first decode step may include tracing/compilation
  # Shapes first met mid-decode compile there (the engine's fused step once the tiers hold a
  # whole step's experts, a kernel call over a new number of cached experts): that time is
  # left out of the steady-state rate too, and reported in decode_compile_s.
  t0, c0 = time.perf_counter(), 0.0
  with CompileClock() as clock:
    while req.max_new_tokens and not req.emit(tok):
      logits, _, cache = runner.step(cache, [[tok]], length, recorder=req.recorder)
      length += 1
      tok = req.pick(logits[0, 0])
      if first_step_s is None:
        first_step_s, c0 = time.perf_counter() - t0, clock.seconds
  decode_s = time.perf_counter() - t0
  steps = max(len(req.out) - 1, 0)  # decode steps run (the first token comes from the prefill)
  if steps >= 2:  # steady state: from the second decode step on
    rate = (steps - 1) / max(decode_s - first_step_s - (clock.seconds - c0), 1e-9)
  else:
    rate = steps / decode_s if steps and decode_s > 0 else 0.0
  return dict(compile_s=compile_s, prefill_s=prefill_s, decode_s=decode_s,
              first_step_s=first_step_s or 0.0, decode_compile_s=clock.seconds,
              decode_tok_s=rate), cache


def run_request(model, pool, pages, start: int, prompt_ids: np.ndarray, req: Request,
                draft=0, on_round=None) -> GenerationResult:
  """Prefills `prompt_ids` at `start` of the row owning `pages` of `pool` (a
  glmjax.decoding.pages.KVPool), then decodes `req` (speculatively with `draft`): the one run
  behind `Model.generate` and each chat turn.

  A failure part-way leaves the pool's arrays donated: they are made anew (`pool.reset`), and
  holders of other pages (chat sessions) rebuild theirs from their history."""
  from glmjax.decoding import speculative
  runner, engine, n = model.runner, model.engine, len(prompt_ids)
  table = pool.table(pages)
  before = engine.telemetry() if engine else {}
  speculate = bool(draft) and req.max_new_tokens > 0
  try:
    cache = pool.cache([table], start, runner.put)
    t0 = time.perf_counter()
    with CompileClock() as clock:
      logits, hidden, cache = runner.prefill(cache, prompt_ids, start, hidden=speculate,
                                             recorder=req.recorder)
      logits = np.asarray(logits)
    compile_s = clock.seconds
    prefill_s = time.perf_counter() - t0 - compile_s
    read = engine.telemetry() if engine else {}
    if speculate:
      t0 = time.perf_counter()
      stats, cache, mcache = speculative.run(runner, pool, table, cache, start,
                                             (logits, hidden, prompt_ids), req, draft, on_round)
      pool.update(mcache, mtp=True)
      decode_s = time.perf_counter() - t0
      run_s = decode_s - stats["decode_compile_s"]
      steps = max(len(req.out) - 1, 0)  # tokens after the prefill's first
      stats.update(compile_s=compile_s, prefill_s=prefill_s, decode_s=decode_s,
                   first_step_s=0.0, decode_tok_s=steps / run_s if steps and run_s > 0 else 0.0)
    else:
      stats, cache = decode_loop(runner, cache, start + n, (logits, prefill_s, compile_s), req)
    pool.update(cache)
  except BaseException:
    pool.reset()
    raise
  req.finish()
  stats.update(prompt_tokens=float(req.cached_tokens + n), cached_tokens=float(req.cached_tokens),
               new_tokens=float(len(req.out)),
               prefill_chunks=float(len(chunk_plan(n, runner.chunk))),
               kv_pages=float(len(pages)), kv_bytes=float(len(pages) * pool.layout.page_bytes()))
  if model.memory is not None:
    stats["dense_bytes"] = float(model.memory.dense)
  if engine is not None:
    stats.update(engine_stats(engine, before, model.config.num_experts_per_tok))
    stats["prefill_expert_bytes"] = (read.get("expert_bytes_read", 0.0)
                                     - before.get("expert_bytes_read", 0.0))
    engine.settle()  # this call's deferred bookkeeping, before its caller reads the tiers
    model.persist_stats()
  return GenerationResult(tokens=req.out, stats=stats, stop_reason=req.reason,
                          text="".join(req.pieces) if req.stream is not None else None)


def engine_stats(engine, before: dict, top_k: int) -> dict:
  """The offload telemetry's growth since `before` (gauges as they stand), with derived rates."""
  after = engine.telemetry()
  gauges = ("all_resident", "prefetch_unused", "prefetch_inflight")
  stats = {k: v if k in gauges else v - before.get(k, 0.0) for k, v in after.items()}
  if stats.get("route_tokens"):
    tokens = stats["route_tokens"]
    stats["route_swap_rate"] = stats["route_swaps"] / (tokens * top_k)
    stats["route_overlap"] = stats["route_overlap_sum"] / tokens
    stats["route_kl"] = stats["route_kl_sum"] / tokens
  if stats.get("pilot_actual"):
    stats["pilot_recall"] = stats["pilot_hits"] / stats["pilot_actual"]
    stats["pilot_precision"] = stats["pilot_hits"] / max(stats["pilot_predicted"], 1.0)
  return stats
