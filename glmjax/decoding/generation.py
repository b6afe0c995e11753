"""The generation core: a request, the run of one request, the decode loop.

They run on an executor (glmjax.runtime: resident jitted steps or the offload engine's layer
steps) and never ask which. `Model.generate`, `ChatSession` and the server's batch all run
through it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np

from glmjax.decoding.logprobs import MAX_LOGPROBS, TokenLogprob
from glmjax.errors import InputError
from glmjax.decoding import speculative
from glmjax.model.forward import KVCache
from glmjax.runtime.clock import CompileClock
from glmjax.runtime.executor import Executor, chunk_plan



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
    reasoning, content: a chat turn's text apart (`ChatSession.send`): the reasoning before
      `</think>` (None when thinking is off) and the answer after it.
  """
  tokens: list[int]
  stats: dict[str, float]
  stop_reason: str = "max_new_tokens"
  text: str | None = None
  reasoning: str | None = None
  content: str | None = None


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
  constraint: Any = None  # glmjax.decoding.grammar.Constraint: the tokens allowed next
  _pending: Any = None

  def pick(self, logits) -> int:
    """The next token from logits `[V]` (the picker's choice, among those the grammar allows),
    noting its logprob and the top `logprobs` alternatives under the distribution sampled from
    when asked to."""
    allowed = self.constraint.bits() if self.constraint is not None else None
    tok = self.picker.pick(logits, allowed)
    if self.logprobs is not None:
      self._pending = (tok, TokenLogprob.of(self.picker.logprobs(logits, allowed), tok,
                                            self.logprobs))
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
    if self.constraint is not None:
      self.constraint.observe(tok)
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
                frequency_penalty: float = 0.0, on_score=None, grammar=None) -> Request:
  """Validates one request's sampling and stop settings (before any compute). `grammar`: a
  glmjax.decoding.grammar.GrammarSpec (or its JSON) that constrains the output."""
  from glmjax.decoding import grammar as grammars, sampling, text
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
  stops = model.default_stop_ids() if stop_ids is None else set(stop_ids)
  constraint = None
  if grammar is not None:
    if tok is None:
      raise InputError("a grammar needs a tokenizer")
    constraint = grammars.Constraint(grammars.GrammarSpec.of(grammar), tok,
                                     model.config.vocab_size, stops)
  return Request(
      max_new_tokens=max_new_tokens, picker=picker, seed=seed, stops=stops,
      constraint=constraint,
      stream=text.StreamDecoder(tok) if tok is not None else None,
      matcher=text.StopMatcher(stop) if stop else None, on_token=on_token, on_text=on_text,
      logprobs=logprobs, on_score=on_score)


# --- the decode loop ---------------------------------------------------------------------------

def decode_loop(executor: Executor, cache: KVCache, start: int, prefilled, req: Request):
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
      logits, _, cache = executor.step(cache, [[tok]], length, recorder=req.recorder)
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


def run_request(executor: Executor, pool, pages, start: int, prompt_ids: np.ndarray,
                req: Request, draft=0, on_round=None) -> GenerationResult:
  """Prefills `prompt_ids` at `start` of the row owning `pages` of `pool` (a
  glmjax.decoding.pages.KVPool), then decodes `req` (speculatively with `draft`): the one run
  behind `Model.generate` and each chat turn.

  A failure part-way leaves the pool's arrays donated: they are made anew (`pool.reset`), and
  holders of other pages (chat sessions) rebuild theirs from their history."""
  n = len(prompt_ids)
  table = pool.table(pages)
  before = executor.telemetry()
  # A constrained request never drafts: a draft would have to be checked against the grammar
  # token by token, and the server (the one place grammars come from) does not speculate.
  speculate = bool(draft) and req.max_new_tokens > 0 and req.constraint is None
  try:
    cache = pool.cache([table], start, executor.put)
    t0 = time.perf_counter()
    with CompileClock() as clock:
      logits, hidden, cache = executor.prefill(cache, prompt_ids, start, hidden=speculate,
                                               recorder=req.recorder)
      logits = np.asarray(logits)
    compile_s = clock.seconds
    prefill_s = time.perf_counter() - t0 - compile_s
    read = executor.telemetry()
    if speculate:
      t0 = time.perf_counter()
      stats, cache, mcache = speculative.run(executor, pool, table, cache, start,
                                             (logits, hidden, prompt_ids), req, draft, on_round)
      pool.update(mcache, mtp=True)
      decode_s = time.perf_counter() - t0
      run_s = decode_s - stats["decode_compile_s"]
      steps = max(len(req.out) - 1, 0)  # tokens after the prefill's first
      stats.update(compile_s=compile_s, prefill_s=prefill_s, decode_s=decode_s,
                   first_step_s=0.0, decode_tok_s=steps / run_s if steps and run_s > 0 else 0.0)
    else:
      stats, cache = decode_loop(executor, cache, start + n, (logits, prefill_s, compile_s), req)
    pool.update(cache)
  except BaseException:
    pool.reset()
    raise
  req.finish()
  stats.update(prompt_tokens=float(req.cached_tokens + n), cached_tokens=float(req.cached_tokens),
               new_tokens=float(len(req.out)),
               prefill_chunks=float(len(chunk_plan(n, executor.chunk))),
               kv_pages=float(len(pages)), kv_bytes=float(len(pages) * pool.layout.page_bytes()))
  if executor.dense_bytes is not None:
    stats["dense_bytes"] = float(executor.dense_bytes)
  if before is not None:
    stats.update(engine_stats(executor.telemetry(), before, executor.cfg.num_experts_per_tok))
    stats["prefill_expert_bytes"] = (read.get("expert_bytes_read", 0.0)
                                     - before.get("expert_bytes_read", 0.0))
    executor.save_stats()
  return GenerationResult(tokens=req.out, stats=stats, stop_reason=req.reason,
                          text="".join(req.pieces) if req.stream is not None else None)


def engine_stats(after: dict, before: dict, top_k: int) -> dict:
  """The offload telemetry's growth from `before` to `after` (gauges as they stand), with
  derived rates."""
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
