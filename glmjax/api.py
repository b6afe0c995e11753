"""The public API: `load()` and `Model` (`score`, `generate`)."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.errors import CheckpointError, GlmjaxError, InputError
from glmjax.formats import checkpoint, embedded, store
from glmjax.model.config import Config
from glmjax.model.forward import (KVCache, RecordOptions, bucket, decode_fn, init_cache,
                                  prefill_fn, record_fn, score_fn, stack_records)
from glmjax.model.weights import Weights
from glmjax.options import Options
from glmjax.decoding.speculative import CompileClock

_MIN_BUCKET = 16


def _bucket(n: int) -> int:
  return bucket(n, _MIN_BUCKET)


def _padded(prompt_ids: np.ndarray, start: int, capacity: int):
  """`[1, S]` prompt right-padded to its bucket (within the cache's room after `start`): the
  shape every prefill of these ids compiles for, first run and replay alike."""
  n = len(prompt_ids)
  return np.pad(prompt_ids, (0, min(_bucket(n), capacity - start) - n))[None]


@dataclasses.dataclass
class GenerationResult:
  """What `Model.generate` returns.

  Attributes:
    tokens: the new token ids (a stop token that ended generation is not included).
    stats: flat dict of numbers: prompt_tokens, new_tokens, compile_s (before decoding),
      prefill_s, decode_s, decode_compile_s (shapes first met while decoding), decode_tok_s
      (from the second decode step on, compilation left out), and for expert stores the offload telemetry (expert_pin_hits,
      expert_host_hits, expert_misses, expert_bytes_read, io_service_s, io_wait_s,
      misses_layer_N, ...), counted over this call.
    stop_reason: "stop_token", "stop_string" or "max_new_tokens".
    text: the decoded new text (None without a tokenizer), cut before a matched stop string.
  """
  tokens: list[int]
  stats: dict[str, float]
  stop_reason: str = "max_new_tokens"
  text: str | None = None


class Model:
  """A loaded GLM-5 model: `config`, `weights` and the steps that run them.

  Models loaded from an expert store run through `engine` (glmjax.offload.engine's
  OffloadEngine), whose routed experts live in the device/host/disk tiers; HF checkpoints and
  stores whose experts all fit run fully resident, one jit per step.
  """

  def __init__(self, config: Config, weights: Weights, options: Options, path: str | None = None,
               engine=None, mesh=None):
    self.config = config
    self.weights = weights
    self.options = options
    self.path = path
    self.engine = engine
    self.mesh = mesh  # the jax.sharding.Mesh the weights are sharded over, or None
    # Resident models run one jit per step; a store whose experts all fit is one of them (its
    # engine stays for telemetry). Otherwise the engine drives the forward layer by layer.
    self.offloaded = engine is not None and not engine.all_resident
    self._compiled: dict = {}
    self._closed = False
    self.tokenizer = _tokenizer(path)

  def __repr__(self):
    c = self.config
    return (f"Model({self.path!r}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
            f"{c.n_routed_experts} experts top-{c.num_experts_per_tok}, vocab {c.vocab_size})")

  # --- checks ----------------------------------------------------------------------------
  def _tokens(self, tokens, ndim: int) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != ndim or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
      shape = "[B, S]" if ndim == 2 else "[S]"
      raise InputError(f"tokens must be a non-empty integer array of shape {shape}, got "
                       f"{arr.dtype} {arr.shape}")
    bad = (arr < 0) | (arr >= self.config.vocab_size)
    if bad.any():
      raise InputError(f"token id {int(arr[bad][0])} is outside the vocabulary "
                       f"(size {self.config.vocab_size})")
    return arr.astype(np.int32)

  def _max_context(self) -> int:
    return self.options.max_context or self.config.max_position_embeddings

  def _put(self, x, dtype=None, batch: bool = False) -> jax.Array:
    """A host input (ids, lengths) as a device array: `jnp.asarray` on one device; on a mesh
    built from each process's own copy (all processes pass the same), replicated, or with
    `batch` its leading axis split along `data` when that axis divides it."""
    if self.mesh is None:
      return jnp.asarray(x, dtype)
    from glmjax import sharding
    x = np.asarray(x, dtype)
    n = sharding.axis_size(self.mesh, "data")
    split = batch and n > 1 and x.shape[0] % n == 0
    return sharding.put(x, sharding.batch_split(self.mesh) if split else
                        sharding.replicated(self.mesh))

  def _new_cache(self, capacity: int) -> KVCache:
    """An empty batch-1 cache: on the first device, or replicated over the mesh."""
    from glmjax import sharding
    where = None if self.mesh is None else sharding.replicated(self.mesh)
    return init_cache(self.config, 1, capacity, sharding=where)

  def _compile(self, name, fn, *args, **static):
    """AOT-compiles `fn` once per argument shape so timings exclude compilation."""
    key = (name, tuple((a.shape, a.dtype) for a in jax.tree_util.tree_leaves(args)))
    if key not in self._compiled:
      self._compiled[key] = fn.lower(*args, **static).compile()
    return self._compiled[key]

  def _steps(self, cache: KVCache, toks, recorder=None):
    """(prefill, decode) callables for this model: (cache, tokens[, n_valid]) → (logits, cache).
    With a `recorder` (glmjax.replay.record.LiveRecorder) each forward's routing is recorded."""
    opts = RecordOptions()

    def keep(tokens, records, n):  # the real positions of one forward (batch 1)
      recorder.add(np.asarray(tokens)[0, :n], records, slice(0, n))

    if self.offloaded:
      eng = self.engine

      def prefill(cache, toks, n_valid):
        rec = [] if recorder is not None else None
        logits, _, cache = eng.forward(toks, cache, n_valid=n_valid, record=rec)
        if recorder is not None:
          keep(toks, stack_records(rec), n_valid)
        return logits[:, n_valid - 1], KVCache(cache.layers, cache.length + n_valid)

      def decode(cache, tok):
        rec = [] if recorder is not None else None
        logits, _, cache = eng.forward(tok, cache, absorbed=True, record=rec)
        if recorder is not None:
          keep(tok, stack_records(rec), 1)
        return logits[:, 0], KVCache(cache.layers, cache.length + 1)

      return prefill, decode
    cfg, w, kernel = self.config, self.weights, self.options.moe_kernel
    n = jnp.asarray(1, jnp.int32)
    record = opts if recorder is not None else None
    tag = "" if record is None else "+record"
    pre = self._compile("prefill" + tag, prefill_fn, w, cache, toks, n, cfg=cfg, kernel=kernel,
                        record=record, mesh=self.mesh)
    step = self._compile("decode" + tag, decode_fn, w, cache, toks[:, :1], cfg=cfg,
                         kernel=kernel, record=record, mesh=self.mesh)

    def prefill(cache, toks, n_valid):
      out = pre(w, cache, toks, self._put(n_valid, jnp.int32))
      if recorder is not None:
        keep(toks, out[3], n_valid)
      return out[0], out[2]

    def decode(cache, tok):
      out = step(w, cache, tok)
      if recorder is not None:
        keep(tok, out[3], 1)
      return out[0][:, 0], out[2]

    return prefill, decode

  def record_routing(self, tokens, opts: RecordOptions = RecordOptions(),
                     fetch: bool = True) -> dict:
    """Teacher-forced routing of int tokens `[B, S]`: per MoE layer, each position's top-k ids
    and weights, the top-M selection scores and the pilot's prediction of the next MoE layer,
    as numpy arrays `[L, B·S, ...]` (`glmjax.model.forward.route_record`). Recorded inside the
    jit for resident models; through the engine's layer steps for offloaded ones.
    `fetch=False` returns device arrays without waiting for them (pipelined replays)."""
    self._check_open()
    arr = self._tokens(tokens, 2)
    if self.offloaded:
      rec: list = []
      self.engine.forward(arr, record=rec, record_opts=opts)
      out = stack_records(rec)
    else:
      out = record_fn(self.weights, self._put(arr), self._put(0, jnp.int32), cfg=self.config,
                      kernel=self.options.moe_kernel, opts=opts, mesh=self.mesh)
    return {k: np.asarray(v) for k, v in out.items()} if fetch else out

  @property
  def moe_layers(self) -> list[int]:
    """Indices of the main model's MoE layers (a trace's layer axis)."""
    from glmjax.model.weights import MoE
    return [i for i, l in enumerate(self.weights.layers) if isinstance(l.mlp, MoE)]

  # --- public ----------------------------------------------------------------------------
  def score(self, tokens) -> np.ndarray:
    """Teacher-forced logits: int tokens `[B, S]` → float32 numpy `[B, S, V]`."""
    self._check_open()
    arr = self._tokens(tokens, 2)
    if arr.shape[1] > self._max_context():
      raise InputError(f"sequence length {arr.shape[1]} exceeds max_context {self._max_context()}")
    if self.offloaded:
      return np.asarray(self.engine.forward(arr)[0], np.float32)
    logits = score_fn(self.weights, self._put(arr, batch=True), self._put(0, jnp.int32),
                      cfg=self.config,
                      kernel=self.options.moe_kernel, mesh=self.mesh)
    if self.mesh is not None:  # every process gets every row (a data-split batch is gathered)
      from glmjax import sharding
      logits = sharding.gather(logits, self.mesh)
    return np.asarray(logits, np.float32)

  def generate(self, prompt_tokens: Sequence[int] | str, max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
               repetition_penalty: float = 1.0, stop_ids: Sequence[int] | None = None,
               stop: Sequence[str] = (), on_token: Callable[[int], None] | None = None,
               on_text: Callable[[str], None] | None = None, draft: int | str = 0,
               on_round: Callable[[dict], None] | None = None,
               trace: str | None = None) -> GenerationResult:
    """Generates up to `max_new_tokens` after `prompt_tokens` (ids, or text when the model has a
    tokenizer).

    temperature 0 is greedy. Generation stops at any of `stop_ids` (default: the config's eos
    ids plus the tokenizer's end-of-text and turn tokens) or user `stop` strings. `on_token`
    gets each new id, `on_text` each newly complete piece of text.

    `draft` turns on MTP speculative decoding: k drafts per verify forward, or "auto" to pick k
    (0 included) from live throughput. Greedy output is identical to plain decoding; sampled
    output keeps the plain sampler's distribution. `on_round` (debugging) receives each verify
    round's position, tokens, logits and accepted count.

    `trace` writes a routing trace of this run to that directory (glmjax.replay.Trace): every
    main forward pass is a step (with `draft`, each verify pass: its token and drafts, noted in
    `trace.live["verify"]`); offloaded models also record the tiers' starting state, so
    `glmjax.replay.simulate(trace, "engine", ...)` can replay a plain run (a speculative run's
    MTP layer shares the tiers and is not in the trace).
    """
    self._check_open()
    if trace is not None and os.path.lexists(trace):
      raise InputError(f"trace {trace}: already exists; a trace is never written over another")
    ids = (self.tokenizer.encode(prompt_tokens)
           if isinstance(prompt_tokens, str) and self._need_tokenizer() else prompt_tokens)
    prompt_ids = self._tokens(ids, 1)
    self._check_budget(len(prompt_ids), max_new_tokens)
    if draft not in (0, "auto") and not (isinstance(draft, int) and 0 < draft <= 16):
      raise InputError(f"draft must be 0, 1..16 or 'auto', got {draft!r}")
    if draft and not self.weights.mtp:
      raise InputError(f"{self.path}: draft={draft!r} needs an MTP layer; this model has none")
    request = self._request(prompt_ids, max_new_tokens, temperature, seed, top_k, top_p, min_p,
                            repetition_penalty, stop_ids, stop, on_token, on_text)
    if trace is not None:
      request.recorder = self._recorder(trace)
    cache = self._new_cache(_bucket(max(_bucket(len(prompt_ids)),
                                        len(prompt_ids) + max_new_tokens)))
    result, _ = self._run(prompt_ids, cache, request, draft, on_round)
    if trace is not None:
      request.recorder.save()
    return result

  def _recorder(self, path: str):
    from glmjax.replay import record
    eng = self.engine
    meta = record.manifest(self.config, self.moe_layers, eng.chunk_bytes if eng else 0,
                           RecordOptions(), source="generate")
    return record.LiveRecorder(path, meta, eng.tier_state() if self.offloaded else None)

  def chat(self, system: str | None = None, enable_thinking: bool = False,
           max_context: int | None = None) -> "ChatSession":
    """A multi-turn chat that keeps the KV cache of the conversation between turns."""
    self._check_open()
    self._need_tokenizer()
    return ChatSession(self, system, enable_thinking, max_context)

  # --- generation core ---------------------------------------------------------------------
  def _need_tokenizer(self):
    if self.tokenizer is None:
      raise InputError(f"{self.path}: this model has no tokenizer.json; pass token ids")
    return True

  def _check_budget(self, n: int, max_new_tokens: int):
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
      raise InputError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if n + max_new_tokens > self._max_context():
      raise InputError(f"prompt ({n}) + max_new_tokens ({max_new_tokens}) exceeds max_context "
                       f"{self._max_context()}")

  def default_stop_ids(self) -> set[int]:
    ids = set(self.config.eos_token_ids)
    if self.tokenizer is not None:
      ids |= self.tokenizer.stop_ids(list(self.config.eos_token_ids))
    return ids

  def _request(self, prompt_ids, max_new_tokens, temperature=0.0, seed=0, top_k=0, top_p=1.0,
               min_p=0.0, repetition_penalty=1.0, stop_ids=None, stop=(), on_token=None,
               on_text=None) -> "_Request":
    """Validates one request's sampling and stop settings (before any compute)."""
    from glmjax.decoding import sampling, text
    if temperature < 0:  # also checked by SamplingParams; kept for a plain message
      raise InputError(f"temperature must be ≥ 0, got {temperature}")
    params = sampling.SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty)
    if stop and self.tokenizer is None:
      raise InputError("stop strings need a tokenizer")
    picker = sampling.TokenPicker(params, self.config.vocab_size, prompt_ids, seed)
    return _Request(
        max_new_tokens=max_new_tokens, picker=picker, seed=seed,
        stops=self.default_stop_ids() if stop_ids is None else set(stop_ids),
        stream=text.StreamDecoder(self.tokenizer) if self.tokenizer is not None else None,
        matcher=text.StopMatcher(stop) if stop else None, on_token=on_token, on_text=on_text)

  def _run(self, prompt_ids: np.ndarray, cache: KVCache, req: "_Request", draft=0,
           on_round=None):
    """Prefills `prompt_ids` after the cache's contents, then decodes. Returns (result, cache)."""
    n, start = len(prompt_ids), int(cache.length)
    cap = cache.layers[0].latent.shape[1]
    if start + n + req.max_new_tokens > cap or min(_bucket(n), cap - start) < n:
      raise InputError(f"context full: {start} cached + {n} prompt + {req.max_new_tokens} new "
                       f"tokens exceed the cache capacity {cap}")
    toks = self._put(_padded(prompt_ids, start, cap))
    before = self.engine.telemetry() if self.engine else {}
    if draft and req.max_new_tokens:
      stats = self._speculate(cache, toks, n, req, draft, on_round)
      cache = None  # the speculative loop owns its caches
    else:
      stats, cache = self._decode_loop(cache, toks, n, req)
    req.finish()
    if self.engine is not None:
      stats.update(self._engine_stats(before))
      self.engine.save()
    if cache is not None:  # it holds the prompt and every emitted token but the last
      cache = KVCache(cache.layers, self._put(start + n + max(len(req.out) - 1, 0), jnp.int32))
    result = GenerationResult(tokens=req.out, stats=stats, stop_reason=req.reason,
                              text="".join(req.pieces) if req.stream is not None else None)
    return result, cache

  def _decode_loop(self, cache: KVCache, toks, n: int, req: "_Request"):
    """Plain decoding: prefill, then one token per step (gpt-fast's loop)."""
    t0 = time.perf_counter()
    prefill, decode = self._steps(cache, toks, req.recorder)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits, cache = prefill(cache, toks, n)
    tok = req.picker.pick(logits[0]) if req.max_new_tokens else None
    prefill_s = time.perf_counter() - t0
    first_step_s = None  # the first decode step may include tracing/compilation
    # Shapes first met mid-decode compile there (the engine's fused step once the tiers hold a
    # whole step's experts, a kernel call over a new number of cached experts): that time is
    # left out of the steady-state rate too, and reported in decode_compile_s.
    t0, c0 = time.perf_counter(), 0.0
    with CompileClock() as clock:
      while req.max_new_tokens and not req.emit(tok):
        logits, cache = decode(cache, self._put([[tok]], jnp.int32))
        tok = req.picker.pick(logits[0])
        if first_step_s is None:
          first_step_s, c0 = time.perf_counter() - t0, clock.seconds
    decode_s = time.perf_counter() - t0
    steps = max(len(req.out) - 1, 0)  # decode steps run (the first token comes from the prefill)
    if steps >= 2:  # steady state: from the second decode step on
      rate = (steps - 1) / max(decode_s - first_step_s - (clock.seconds - c0), 1e-9)
    else:
      rate = steps / decode_s if steps and decode_s > 0 else 0.0
    return dict(prompt_tokens=float(n), new_tokens=float(len(req.out)), compile_s=compile_s,
                prefill_s=prefill_s, decode_s=decode_s, first_step_s=first_step_s or 0.0,
                decode_compile_s=clock.seconds, decode_tok_s=rate), cache

  def _speculate(self, cache: KVCache, toks, n: int, req: "_Request", draft, on_round) -> dict:
    """MTP speculative decoding (glmjax.decoding.speculative); the stats of `_decode_loop`."""
    from glmjax.decoding import speculative
    backend = (speculative.EngineBackend(self) if self.offloaded
               else speculative.ResidentBackend(self))
    backend.recorder = req.recorder
    t0 = time.perf_counter()
    spec = speculative.run(backend, self.config, cache, toks, n, req.max_new_tokens, req.emit,
                           req.picker, draft, req.seed, on_round)
    prefill_s = spec.pop("prefill_s")
    decode_s = time.perf_counter() - t0 - prefill_s
    steps = max(len(req.out) - 1, 0)  # tokens after the prefill's first
    # New shapes compile mid-run (the first round of each draft length): left out of the rate,
    # as the plain loop's compilation is, and reported in compile_s.
    run_s = decode_s - spec["decode_compile_s"]
    return dict(prompt_tokens=float(n), new_tokens=float(len(req.out)),
                compile_s=spec.pop("compile_s"),
                prefill_s=prefill_s, decode_s=decode_s, first_step_s=0.0,
                decode_tok_s=steps / run_s if steps and run_s > 0 else 0.0, **spec)

  def _engine_stats(self, before: dict) -> dict:
    """Offload telemetry over this call, with derived rates."""
    stats = {}
    after = self.engine.telemetry()
    gauges = ("all_resident", "prefetch_unused", "prefetch_inflight")
    stats.update({k: v if k in gauges else v - before.get(k, 0.0) for k, v in after.items()})
    if stats.get("route_tokens"):
      tokens = stats["route_tokens"]
      stats["route_swap_rate"] = stats["route_swaps"] / (tokens * self.config.num_experts_per_tok)
      stats["route_overlap"] = stats["route_overlap_sum"] / tokens
      stats["route_kl"] = stats["route_kl_sum"] / tokens
    if stats.get("pilot_actual"):
      stats["pilot_recall"] = stats["pilot_hits"] / stats["pilot_actual"]
      stats["pilot_precision"] = stats["pilot_hits"] / max(stats["pilot_predicted"], 1.0)
    return stats

  # --- lifetime ------------------------------------------------------------------------------
  def close(self) -> None:
    """Saves the offload statistics and stops the I/O threads. Idempotent; afterwards every
    call raises InputError. A model garbage-collected without close() releases them too."""
    if self.engine is not None:
      self.engine.close()
    self._closed = True

  def _check_open(self):
    if self._closed:
      raise InputError(f"{self.path}: this model was closed")

  def __enter__(self) -> "Model":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


@dataclasses.dataclass
class _Request:
  """One generation request's settings and output: what `emit` records, and why it stopped."""
  max_new_tokens: int
  picker: Any  # sampling.TokenPicker
  seed: int
  stops: set
  stream: Any = None  # text.StreamDecoder
  matcher: Any = None  # text.StopMatcher
  on_token: Callable[[int], None] | None = None
  on_text: Callable[[str], None] | None = None
  recorder: Any = None  # glmjax.replay.record.LiveRecorder when the run is traced
  out: list = dataclasses.field(default_factory=list)
  pieces: list = dataclasses.field(default_factory=list)
  reason: str = "max_new_tokens"

  def emit(self, tok: int) -> bool:
    """Records `tok`; True when generation must stop (stop token/string, or length)."""
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


class ChatSession:
  """Multi-turn chat over one KV cache: each turn prefills only what the cache lacks.

  A turn that fails (any GlmjaxError, e.g. an expert read) leaves the session as it was before
  that turn: the history drops the failed user message, and since the failure may have left
  the cache's buffers donated part-way through a forward, the next turn rebuilds the cache by
  replaying the successful turns' feeds one by one (the same calls as the first time), so its
  reply equals what a fresh session given the same turns returns.
  """

  def __init__(self, model: Model, system: str | None, enable_thinking: bool,
               max_context: int | None):
    self.model = model
    self.messages = [{"role": "system", "content": system}] if system else []
    self.enable_thinking = enable_thinking
    limit = min(max_context or 4096, model._max_context())
    self.capacity = min(_bucket(limit), model._max_context())
    self.cache = model._new_cache(self.capacity)
    self.tokens: list[int] = []  # what the cache holds, position by position
    # Each successful turn as fed: (cached positions kept, prompt ids prefilled, ids decoded).
    self._feeds: list[tuple[int, np.ndarray, list[int]]] = []
    self._stale = False  # the cache may be unusable after a failed turn

  def send(self, user_text: str, max_new_tokens: int = 256, **sampling) -> GenerationResult:
    """Adds a user turn, generates the reply, and keeps both in the history.

    `sampling` takes generate's keywords: temperature, seed, top_k, top_p, min_p,
    repetition_penalty, stop_ids, stop, on_token, on_text.
    """
    from glmjax.decoding import text
    self.model._check_open()
    known = ("temperature", "seed", "top_k", "top_p", "min_p", "repetition_penalty", "stop_ids",
             "stop", "on_token", "on_text")
    unknown = sorted(set(sampling) - set(known))
    if unknown:
      raise InputError(f"unknown argument(s) to send(): {', '.join(unknown)}")
    messages = self.messages + [{"role": "user", "content": user_text}]
    ids = text.encode_chat(messages, self.model.tokenizer, add_generation_prompt=True,
                           enable_thinking=self.enable_thinking)
    self.model._check_budget(len(ids), max_new_tokens)
    if self._stale:
      self._rebuild()
    common = 0
    while common < min(len(ids), len(self.tokens)) and ids[common] == self.tokens[common]:
      common += 1
    common = min(common, len(ids) - 1)  # at least one token to prefill
    prompt = np.asarray(ids[common:], np.int32)
    request = self.model._request(prompt, max_new_tokens, **sampling)
    # Positions past `common` are stale; attention never sees them once overwritten.
    cache = KVCache(self.cache.layers, self.model._put(common, jnp.int32))
    try:
      result, cache = self.model._run(prompt, cache, request)
    except GlmjaxError:
      self._stale = True  # the forward may have consumed (donated) the cache's buffers
      raise
    self.cache = cache
    self.tokens = list(ids) + result.tokens[:-1] if result.tokens else list(ids)[:-1]
    self._feeds.append((common, prompt, result.tokens[:-1]))
    result.stats["reused_tokens"] = float(common)
    self.messages = messages + [{"role": "assistant", "content": result.text}]
    return result

  def _rebuild(self) -> None:
    """A fresh cache holding the successful turns, fed exactly as they were."""
    model = self.model
    cache = model._new_cache(self.capacity)
    for common, prompt, decoded in self._feeds:
      n = len(prompt)
      toks = model._put(_padded(prompt, common, self.capacity))
      cache = KVCache(cache.layers, model._put(common, jnp.int32))
      prefill, decode = model._steps(cache, toks)
      _, cache = prefill(cache, toks, n)
      for tok in decoded:
        _, cache = decode(cache, model._put([[tok]], jnp.int32))
    self.cache = cache
    self._stale = False


def _tokenizer(path):
  from glmjax.decoding import text
  if path and os.path.exists(os.path.join(path, "tokenizer.json")):
    return text.Tokenizer.from_dir(path)
  return None


def load(path: str | os.PathLike | None = None, mesh=None, **options) -> Model:
  """Loads a model: an HF `glm_moe_dsa` checkpoint directory, a converted expert store
  (`scripts/convert.py`), or, with no path, the embedded default.

  `mesh` (a `jax.sharding.Mesh` whose axes come from "expert", "tensor", "data"; None = one
  device) shards the weights by the plan of `glmjax.sharding`: routed experts along `expert`,
  attention heads and dense MLP columns along `tensor`; every call then runs on the mesh.

  Options are those of `glmjax.options.Options` (dtype, moe_kernel, progress, max_context,
  device_cache_gb, host_cache_gb, io_workers, io_timeout_s, cold).
  """
  opts = Options.from_kwargs(**options)
  if path is None:
    path = embedded.ensure(progress=opts.progress)
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: model directory not found")
  if not store.is_store(path):
    if opts.offload_set:
      raise InputError(f"{path}: offload options (device_cache_gb, host_cache_gb, "
                       "expert_compute, io_workers, cold, prefetch, pilot_k, couple_k, "
                       "cache_route, expert_budget) need an expert store; convert it with "
                       "scripts/convert.py")
    cfg = Config.from_json(path)
    if mesh is not None:
      from glmjax import sharding
      sharding.check_mesh(mesh, cfg)
    cfg, weights = checkpoint.load_hf(path, cfg, dtype=opts.jnp_dtype, progress=opts.progress,
                                      mesh=mesh)
    return Model(cfg, weights, opts, path, mesh=mesh)

  from glmjax.offload import budget
  from glmjax.offload.engine import OffloadEngine
  from glmjax.model.weights import nbytes
  cfg, dense = store.load_dense(path, dtype=opts.jnp_dtype, progress=opts.progress)
  if mesh is not None:
    from glmjax import sharding
    sharding.check_mesh(mesh, cfg)
    dense = sharding.place_dense(dense, cfg, mesh)
  experts = store.ExpertStore(path)
  moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
  if opts.expert_budget is not None and opts.expert_budget < cfg.num_experts_per_tok:
    raise InputError(f"expert_budget={opts.expert_budget} is below the model's top-k "
                     f"({cfg.num_experts_per_tok}): every token needs that many experts")
  budgets = budget.resolve(opts.device_cache_gb, opts.host_cache_gb,
                           dense_bytes=nbytes(dense), chunk_bytes=experts.layout(moe_layers[0]).nbytes,
                           n_moe_layers=len(moe_layers), n_experts=cfg.n_routed_experts,
                           top_k=cfg.num_experts_per_tok)
  engine = OffloadEngine(cfg, dense, experts, budgets, io_workers=opts.io_workers,
                         io_timeout_s=opts.io_timeout_s, cold=opts.cold, progress=opts.progress,
                         kernel=opts.moe_kernel, expert_compute=opts.expert_compute,
                         prefetch=opts.prefetch, pilot_k=opts.pilot_k, couple_k=opts.couple_k,
                         cache_route=((opts.route_keep, opts.route_rank) if opts.cache_route
                                      else None), expert_budget=opts.expert_budget, mesh=mesh)
  weights = engine.resident_weights() if engine.all_resident else dense
  return Model(cfg, weights, opts, path, engine, mesh=mesh)
