"""The public API: `load()`, `Model` (`score`, `generate`, `chat`, `close`) and `ChatSession`.

The generation core they run on (requests, the steps over a paged KV cache, the decode loop)
is glmjax.decoding.generation; the server uses the same core.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.decoding.generation import GenerationResult, new_request, run_request
from glmjax.decoding.grammar import GrammarSpec
from glmjax.decoding.pages import KVLayout, KVPool
from glmjax.errors import CheckpointError, GlmjaxError, InputError
from glmjax.formats import checkpoint, embedded, store
from glmjax.model.config import Config
from glmjax.model.forward import bucket
from glmjax.model.records import RecordOptions
from glmjax.model.weights import Weights
from glmjax.options import Options
from glmjax.runtime.executor import Executor, chunk_plan, executor_for

__all__ = ["load", "Model", "ChatSession", "GenerationResult"]


@functools.partial(jax.jit, static_argnames="top_k")
def _target_logprobs(logits, targets, top_k: int = 0):
  """log p(targets) under `logits` `[B, S, V]`: `[B, S]`; with `top_k`, also the top_k ids and
  their logprobs at each position, `[B, S, top_k]` each."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  target = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  if not top_k:
    return target
  top_lp, top_ids = jax.lax.top_k(logp, top_k)
  return target, top_ids, top_lp


class Model:
  """A loaded GLM-5 model: its `config`, `tokenizer`, `executor` and KV pool (`kv`).

  The executor (glmjax.runtime) runs the steps: one jit per step over resident weights (HF
  checkpoints, stores whose experts all fit), or the offload engine's layer steps, whose routed
  experts live in the device/host/disk tiers. `kv` is the paged KV cache that generate and
  chat sessions take their pages from. `weights` are the resident weights (the dense ones of
  an offloaded store); `engine` is the offload engine or None, for tests and debugging.
  """

  def __init__(self, config: Config, weights: Weights, options: Options, path: str | None = None,
               engine=None, mesh=None, memory=None):
    self.config = config
    self.memory = memory  # the offload.budget.MemoryPlan load() made (None if built directly)
    self.weights = weights
    self.options = options
    self.path = path
    self.mesh = mesh  # the jax.sharding.Mesh the weights are sharded over, or None
    self.executor: Executor = executor_for(config, weights, options, mesh, engine,
                                           None if memory is None else memory.dense)
    self._kv: KVPool | None = None
    self._closed = False
    self.tokenizer = _tokenizer(path)

  def __repr__(self):
    c = self.config
    return (f"Model({self.path!r}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
            f"{c.n_routed_experts} experts top-{c.num_experts_per_tok}, vocab {c.vocab_size})")

  # --- checks ----------------------------------------------------------------------------
  def check_tokens(self, tokens, ndim: int = 1) -> np.ndarray:
    """`tokens` as an int32 array of `ndim` dimensions (`[S]` or `[B, S]`), non-empty and within
    the vocabulary, else an InputError saying which id or shape is wrong."""
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

  @property
  def max_context(self) -> int:
    """Prompt + generated tokens at most (the `max_context` option, else the config's)."""
    return self.options.max_context or self.config.max_position_embeddings

  @property
  def kv(self) -> KVPool:
    """The paged KV cache of this model's batch-1 calls (made on first use, grown on demand)."""
    if self._kv is None:
      from glmjax import sharding
      where = None if self.mesh is None else sharding.replicated(self.mesh)
      self._kv = KVPool(self.kv_layout(), sharding=where,
                        prefix_cache=self.options.prefix_cache)
    return self._kv

  def kv_layout(self) -> KVLayout:
    o = self.options
    return KVLayout(self.config, o.kv_dtype_name, o.index_dtype_name)

  def record_routing(self, tokens, opts: RecordOptions = RecordOptions(),
                     fetch: bool = True) -> dict:
    """Teacher-forced routing of int tokens `[B, S]`: per MoE layer, each position's top-k ids
    and weights, the top-M selection scores and the pilot's prediction of the next MoE layer,
    as numpy arrays `[L, B·S, ...]` (`glmjax.model.records.route_record`). Recorded inside the
    jit for resident models; through the engine's layer steps for offloaded ones.
    `fetch=False` returns device arrays without waiting for them (pipelined replays)."""
    self._check_open()
    return self.executor.record(self.check_tokens(tokens, 2), opts, fetch)

  @property
  def moe_layers(self) -> list[int]:
    """Indices of the main model's MoE layers (a trace's layer axis)."""
    from glmjax.model.weights import MoE
    return [i for i, l in enumerate(self.weights.layers) if isinstance(l.mlp, MoE)]

  # --- public ----------------------------------------------------------------------------
  def score(self, tokens, targets=None, top_k: int = 0):
    """Teacher-forced logits: int tokens `[B, S]` → float32 numpy `[B, S, V]`.

    With `targets` (int `[B, S]`), only log p(targets[b, s] | tokens[b, :s+1]) comes back, as
    float32 `[B, S]`: a long sequence's scores without its `[S, V]` logits. With `targets` and
    `top_k` > 0, a tuple: those scores, then the `top_k` most likely ids at each position
    (int32 `[B, S, top_k]`) and their logprobs (float32 `[B, S, top_k]`). Sequences longer
    than `prefill_chunk` go through the KV cache chunk by chunk, so no step's temporaries grow
    with the sequence."""
    self._check_open()
    arr = self.check_tokens(tokens, 2)
    if arr.shape[1] > self.max_context:
      raise InputError(f"sequence length {arr.shape[1]} exceeds max_context {self.max_context}")
    tgt = None
    if top_k and (targets is None or not 0 < top_k <= self.config.vocab_size):
      raise InputError(f"top_k={top_k} needs targets and must be in [1, vocab size]")
    if targets is not None:
      tgt = self.check_tokens(targets, 2)
      if tgt.shape != arr.shape:
        raise InputError(f"targets {tgt.shape} must have the shape of tokens {arr.shape}")
    chunk = self.options.prefill_chunk
    if chunk and arr.shape[1] > chunk:
      return self._score_cached(arr, tgt, top_k)
    # Right-padded to a power of two, so sequences of many lengths share a few compiled shapes:
    # causal attention keeps padding out of every real position, and padding routes no expert.
    s = arr.shape[1]
    pad = ((0, 0), (0, max(s, min(bucket(s), self.max_context)) - s))
    logits = self.executor.score(np.pad(arr, pad), s)
    if tgt is not None:
      out = _target_logprobs(logits, jnp.asarray(np.pad(tgt, pad)), top_k)
      return jax.tree.map(lambda a: np.asarray(a)[:, :s], out)
    return np.asarray(logits, np.float32)[:, :s]

  def _score_cached(self, arr: np.ndarray, tgt, top_k: int = 0):
    """`score` through the KV cache: each row its pages, chunk by chunk."""
    b, s = arr.shape
    pool, ex = self.kv, self.executor
    pages = [pool.alloc(pool.layout.pages_for(s), f"score ({s} tokens)") for _ in range(b)]
    out = np.zeros((b, s) if tgt is not None else (b, s, self.config.vocab_size), np.float32)
    tops = (np.zeros((b, s, top_k), np.int32), np.zeros((b, s, top_k), np.float32))
    try:
      cache = pool.cache([pool.table(p) for p in pages], 0, ex.put)
      chunks = ex.prefill_rows(cache, arr)  # chunk by chunk: (logits [B, w, V], cache)
      for (o, n, w), (logits, cache) in zip(chunk_plan(s, ex.chunk), chunks):
        if tgt is not None:
          t = np.pad(tgt[:, o:o + n], ((0, 0), (0, w - n)))
          got = jax.tree.leaves(_target_logprobs(logits, jnp.asarray(t), top_k))
          for dst, src in zip((out,) + tops, got):
            dst[:, o:o + n] = np.asarray(src)[:, :n]
        else:
          out[:, o:o + n] = np.asarray(logits[:, :n], np.float32)
      pool.update(cache)
    except BaseException:
      pool.reset()
      raise
    finally:
      for p in pages:
        pool.release(p)
    return (out,) + tops if top_k else out

  def generate(self, prompt_tokens: Sequence[int] | str, max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
               repetition_penalty: float = 1.0, stop_ids: Sequence[int] | None = None,
               stop: Sequence[str] = (), on_token: Callable[[int], None] | None = None,
               on_text: Callable[[str], None] | None = None, draft: int | str = 0,
               on_round: Callable[[dict], None] | None = None,
               trace: str | None = None, json_schema: dict | None = None) -> GenerationResult:
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

    `json_schema` constrains the output to JSON valid under that schema (bounds included), by a
    grammar's token mask (glmjax.decoding.grammar); a schema it cannot take is an InputError
    naming the field. Such a request does not draft.

    The request takes the KV pages its prompt and new tokens need from `Model.kv` and gives
    them back at the end; a context that memory cannot hold is refused before anything is
    allocated.
    """
    self._check_open()
    if trace is not None and os.path.lexists(trace):
      raise InputError(f"trace {trace}: already exists; a trace is never written over another")
    ids = (self.tokenizer.encode(prompt_tokens)
           if isinstance(prompt_tokens, str) and self._need_tokenizer() else prompt_tokens)
    prompt_ids = self.check_tokens(ids, 1)
    self._check_budget(len(prompt_ids), max_new_tokens)
    if draft not in (0, "auto") and not (isinstance(draft, int) and 0 < draft <= 16):
      raise InputError(f"draft must be 0, 1..16 or 'auto', got {draft!r}")
    if draft and not self.weights.mtp:
      raise InputError(f"{self.path}: draft={draft!r} needs an MTP layer; this model has none")
    request = new_request(self, prompt_ids, max_new_tokens, temperature, seed, top_k, top_p,
                          min_p, repetition_penalty, stop_ids, stop, on_token, on_text,
                          grammar=None if json_schema is None else GrammarSpec(
                              "json", json_schema, field="json_schema"))
    pool = self.kv
    n = len(prompt_ids)
    # With the prefix cache: cached full pages of the prompt (never its last token, whose
    # logits pick the first new one); speculative runs also need the MTP layer's cache, which
    # is not cached, and traced runs record the whole prompt.
    reuse = pool.prefix is not None and not draft and trace is None
    pages = pool.prefix.lookup(prompt_ids, n - 1) if reuse else []
    start = len(pages) * pool.layout.page_size
    try:
      pages += pool.alloc(pool.layout.pages_for(n + max_new_tokens) - len(pages),
                          f"generate ({n} prompt + {max_new_tokens} new tokens)")
      if trace is not None:
        request.recorder = self._recorder(trace)
      request.cached_tokens = start
      result = run_request(self.executor, pool, pages, start, prompt_ids[start:], request,
                           draft, on_round)
      if reuse:
        pool.prefix.insert(prompt_ids, pages, n)
    finally:
      pool.release(pages)
    if trace is not None:
      request.recorder.save()
    return result

  def _recorder(self, path: str):
    from glmjax.replay import record
    ex = self.executor
    meta = record.manifest(self.config, self.moe_layers, ex.expert_bytes, RecordOptions(),
                           source="generate")
    return record.LiveRecorder(path, meta, ex.tier_state())

  def chat(self, system: str | None = None, enable_thinking: bool = False,
           max_context: int | None = None) -> "ChatSession":
    """A multi-turn chat that keeps the KV cache of the conversation between turns."""
    self._check_open()
    self._need_tokenizer()
    return ChatSession(self, system, enable_thinking, max_context)

  # --- generation ----------------------------------------------------------------------------
  def _need_tokenizer(self):
    if self.tokenizer is None:
      raise InputError(f"{self.path}: this model has no tokenizer.json; pass token ids")
    return True

  def _check_budget(self, n: int, max_new_tokens: int):
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
      raise InputError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if n + max_new_tokens > self.max_context:
      raise InputError(f"prompt ({n}) + max_new_tokens ({max_new_tokens}) exceeds max_context "
                       f"{self.max_context}")

  def default_stop_ids(self) -> set[int]:
    ids = set(self.config.eos_token_ids)
    if self.tokenizer is not None:
      ids |= self.tokenizer.stop_ids(list(self.config.eos_token_ids))
    return ids

  # --- lifetime ------------------------------------------------------------------------------
  @property
  def engine(self):
    """The offload engine (glmjax.offload.engine.OffloadEngine) of a store, else None: for
    tests and debugging; the library and the scripts go through `executor`."""
    return self.executor.engine

  def close(self) -> None:
    """Saves the offload statistics, stops the I/O threads and frees the KV cache. Idempotent;
    afterwards every call raises InputError. A model garbage-collected without close()
    releases them too."""
    self.executor.close()
    self._kv = None
    self._closed = True

  def _check_open(self):
    if self._closed:
      raise InputError(f"{self.path}: this model was closed")

  def __enter__(self) -> "Model":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class ChatSession:
  """Multi-turn chat over the model's KV cache: each turn prefills only what the cache lacks,
  and the session takes more pages as the conversation grows (up to `max_context` tokens, by
  default the model's).

  A turn that fails (any GlmjaxError, e.g. an expert read) leaves the session as it was before
  that turn: the history drops the failed user message. Since the failure may have left the
  KV arrays donated part-way through a forward, the model's pool is made anew, and the next
  turn of every session rebuilds its pages by replaying its successful turns' feeds one by one
  (the same calls as the first time), so its reply equals what a fresh session given the same
  turns returns. `close()` (or dropping the session) gives its pages back.
  """

  def __init__(self, model: Model, system: str | None, enable_thinking: bool,
               max_context: int | None):
    self.model = model
    self.messages = [{"role": "system", "content": system}] if system else []
    self.enable_thinking = enable_thinking
    self.max_context = min(max_context or model.max_context, model.max_context)
    self.pages: list[int] = []  # held in model.kv
    self.tokens: list[int] = []  # what the cache holds, position by position
    # Each successful turn as fed: (cached positions kept, prompt ids prefilled, ids decoded).
    self._feeds: list[tuple[int, np.ndarray, list[int]]] = []
    self._epoch = model.kv.epoch
    self._release = weakref.finalize(self, _give_back, weakref.ref(model), self.pages)

  def send(self, user_text: str, max_new_tokens: int = 256, **sampling) -> GenerationResult:
    """Adds a user turn, generates the reply, and keeps both in the history.

    `sampling` takes generate's keywords: temperature, seed, top_k, top_p, min_p,
    repetition_penalty, stop_ids, stop, on_token, on_text.
    """
    from glmjax.decoding import glm_format, text
    model = self.model
    model._check_open()
    known = ("temperature", "seed", "top_k", "top_p", "min_p", "repetition_penalty", "stop_ids",
             "stop", "on_token", "on_text")
    unknown = sorted(set(sampling) - set(known))
    if unknown:
      raise InputError(f"unknown argument(s) to send(): {', '.join(unknown)}")
    messages = self.messages + [{"role": "user", "content": user_text}]
    ids = text.encode_chat(messages, model.tokenizer, add_generation_prompt=True,
                           enable_thinking=self.enable_thinking)
    model._check_budget(len(ids), max_new_tokens)
    if len(ids) + max_new_tokens > self.max_context:
      raise InputError(f"this chat's context is full: {len(ids)} tokens of history + "
                       f"max_new_tokens {max_new_tokens} exceed its max_context "
                       f"{self.max_context}")
    pool = model.kv
    if pool.epoch != self._epoch:  # a failed step elsewhere lost the pool's contents
      self._rebuild()
    common = 0
    while common < min(len(ids), len(self.tokens)) and ids[common] == self.tokens[common]:
      common += 1
    common = min(common, len(ids) - 1)  # at least one token to prefill
    prompt = np.asarray(ids[common:], np.int32)
    request = new_request(model, prompt, max_new_tokens, **sampling)
    need = pool.layout.pages_for(len(ids) + max_new_tokens)
    if need > len(self.pages):
      self.pages.extend(pool.alloc(need - len(self.pages), "chat turn"))
    # Positions past `common` are stale; attention never sees them once overwritten. A failed
    # turn resets the pool (a new epoch): the next turn rebuilds from the feeds.
    result = run_request(model.executor, pool, self.pages, common, prompt, request)
    self.tokens = list(ids) + result.tokens[:-1] if result.tokens else list(ids)[:-1]
    self._feeds.append((common, prompt, result.tokens[:-1]))
    result.stats["reused_tokens"] = float(common)
    self.messages = messages + [{"role": "assistant", "content": result.text}]
    result.reasoning, result.content = glm_format.split_reasoning(result.text,
                                                                  self.enable_thinking)
    return result

  def _rebuild(self) -> None:
    """The session's pages refilled with its successful turns, fed exactly as they were."""
    model = self.model
    pool, ex = model.kv, model.executor
    cache = pool.cache([pool.table(self.pages)], 0, ex.put)
    try:
      for common, prompt, decoded in self._feeds:
        _, _, cache = ex.prefill(cache, prompt, common)
        length = common + len(prompt)
        for tok in decoded:
          _, _, cache = ex.step(cache, [[tok]], length)
          length += 1
      pool.update(cache)
    except BaseException:
      pool.reset()
      raise
    self._epoch = pool.epoch

  def close(self) -> None:
    """Gives the session's KV pages back to the model."""
    self._release()


def _give_back(model_ref, pages: list) -> None:
  model = model_ref()
  if model is not None and model._kv is not None and pages:
    model._kv.release(pages)
    pages.clear()


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
  if opts.compile_cache:  # the next process loads the compiled steps (DESIGN.md §4)
    from glmjax.runtime import compile_cache
    compile_cache.enable()
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
    opts = opts.resolve_dtype(checkpoint.stored_dtype(path), jax.default_backend())
    memory = _plan_checkpoint(path, cfg, opts)
    cfg, weights = checkpoint.load_hf(path, cfg, dtype=opts.jnp_dtype, progress=opts.progress,
                                      mesh=mesh)
    return Model(cfg, weights, opts, path, mesh=mesh, memory=memory)

  from glmjax.offload import budget
  from glmjax.offload.engine import OffloadEngine
  from glmjax.model.weights import format_name, nbytes
  # The budgets are planned before the dense weights are allocated: free memory measured
  # after loading them would count them twice (a GLM-5-geometry store's 10.4 GB of float32
  # dense weights were refused on a 23 GB machine with 12 GB free).
  opts = opts.resolve_dtype(store.stored_dtype(path), jax.default_backend())
  cfg, tree = store.dense_abstract(path, dtype=opts.jnp_dtype)
  experts = store.ExpertStore(path)
  moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
  if opts.expert_budget is not None and opts.expert_budget < cfg.num_experts_per_tok:
    raise InputError(f"expert_budget={opts.expert_budget} is below the model's top-k "
                     f"({cfg.num_experts_per_tok}): every token needs that many experts")
  if mesh is not None:
    from glmjax import sharding
    sharding.check_mesh(mesh, cfg)
  budgets, memory = budget.resolve(opts.device_cache_gb, opts.host_cache_gb,
                                   dense_bytes=nbytes(tree), dense_format=format_name(tree),
                                   kv_bytes=_kv_plan_bytes(cfg, opts),
                                   chunk_bytes=experts.layout(moe_layers[0]).nbytes,
                                   n_moe_layers=len(moe_layers), n_experts=cfg.n_routed_experts,
                                   top_k=cfg.num_experts_per_tok)
  cfg, dense = store.load_dense(path, dtype=opts.jnp_dtype, progress=opts.progress)
  if mesh is not None:
    dense = sharding.place_dense(dense, cfg, mesh)
  engine = OffloadEngine(cfg, dense, experts, budgets, opts, mesh)
  weights = engine.resident_weights() if engine.all_resident else dense
  return Model(cfg, weights, opts, path, engine, mesh=mesh, memory=memory)


def _kv_plan_bytes(cfg: Config, opts: Options) -> int:
  """The KV pages `load()` plans for: one sequence of `PLAN_KV_POSITIONS` (or max_context)."""
  from glmjax.offload.budget import PLAN_KV_POSITIONS
  layout = KVLayout(cfg, opts.kv_dtype_name, opts.index_dtype_name)
  positions = min(PLAN_KV_POSITIONS, opts.max_context or cfg.max_position_embeddings)
  return layout.pages_for(positions) * layout.page_bytes()


def _plan_checkpoint(path: str, cfg: Config, opts: Options):
  """The memory plan of an HF checkpoint held whole, from its declaration (nothing read)."""
  from glmjax.offload import budget
  from glmjax.model.weights import dense_only, format_name, nbytes
  tree = checkpoint.plan(checkpoint.HFCheckpoint(path), cfg, opts.jnp_dtype)
  dense = nbytes(dense_only(tree))
  return budget.plan_resident(dense, format_name(tree), _kv_plan_bytes(cfg, opts),
                              experts=nbytes(tree) - dense)
