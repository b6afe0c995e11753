"""The public API: `load()` and `Model` (`score`, `generate`)."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glmjax import checkpoint, embedded, store
from glmjax.config import Config
from glmjax.errors import CheckpointError, InputError
from glmjax.model import KVCache, decode_fn, init_cache, prefill_fn, score_fn
from glmjax.options import Options
from glmjax.weights import Weights

_MIN_BUCKET = 16


def _bucket(n: int) -> int:
  """Next power of two ≥ n (≥ 16): bounds how many shapes get compiled."""
  return max(_MIN_BUCKET, 1 << (n - 1).bit_length())


@dataclasses.dataclass
class GenerationResult:
  """What `Model.generate` returns.

  Attributes:
    tokens: the new token ids (a stop token that ended generation is not included).
    stats: flat dict of numbers: prompt_tokens, new_tokens, compile_s, prefill_s, decode_s,
      decode_tok_s, and for expert stores the offload telemetry (expert_pin_hits,
      expert_host_hits, expert_misses, expert_bytes_read, io_service_s, io_wait_s,
      misses_layer_N, ...), counted over this call.
    stop_reason: "stop_token" or "max_new_tokens".
  """
  tokens: list[int]
  stats: dict[str, float]
  stop_reason: str = "max_new_tokens"


class Model:
  """A loaded GLM-5 model: `config`, `weights` and the steps that run them.

  Models loaded from an expert store run through `engine` (glmjax.engine.OffloadEngine), whose
  routed experts live in the device/host/disk tiers; HF checkpoints run fully resident.
  """

  def __init__(self, config: Config, weights: Weights, options: Options, path: str | None = None,
               engine=None):
    self.config = config
    self.weights = weights
    self.options = options
    self.path = path
    self.engine = engine
    self._compiled: dict = {}

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

  def _compile(self, name, fn, *args, **static):
    """AOT-compiles `fn` once per argument shape so timings exclude compilation."""
    key = (name, tuple((a.shape, a.dtype) for a in jax.tree_util.tree_leaves(args)))
    if key not in self._compiled:
      self._compiled[key] = fn.lower(*args, **static).compile()
    return self._compiled[key]

  def _steps(self, cache: KVCache, toks):
    """(prefill, decode) callables for this model: (cache, tokens[, n_valid]) → (logits, cache)."""
    if self.engine is not None:
      eng = self.engine

      def prefill(cache, toks, n_valid):
        logits, _, cache = eng.forward(toks, cache)
        return logits[:, n_valid - 1], KVCache(cache.layers, cache.length + n_valid)

      def decode(cache, tok):
        logits, _, cache = eng.forward(tok, cache, absorbed=True)
        return logits[:, 0], KVCache(cache.layers, cache.length + 1)

      return prefill, decode
    cfg, w, kernel = self.config, self.weights, self.options.resolved_moe_kernel
    n = jnp.asarray(1, jnp.int32)
    pre = self._compile("prefill", prefill_fn, w, cache, toks, n, cfg=cfg, kernel=kernel)
    step = self._compile("decode", decode_fn, w, cache, toks[:, :1], cfg=cfg, kernel=kernel)

    def prefill(cache, toks, n_valid):
      logits, _, cache = pre(w, cache, toks, jnp.asarray(n_valid, jnp.int32))
      return logits, cache

    def decode(cache, tok):
      logits, _, cache = step(w, cache, tok)
      return logits[:, 0], cache

    return prefill, decode

  # --- public ----------------------------------------------------------------------------
  def score(self, tokens) -> np.ndarray:
    """Teacher-forced logits: int tokens `[B, S]` → float32 numpy `[B, S, V]`."""
    arr = self._tokens(tokens, 2)
    if arr.shape[1] > self._max_context():
      raise InputError(f"sequence length {arr.shape[1]} exceeds max_context {self._max_context()}")
    if self.engine is not None:
      return np.asarray(self.engine.forward(arr)[0], np.float32)
    return np.asarray(score_fn(self.weights, jnp.asarray(arr), cfg=self.config,
                               kernel=self.options.resolved_moe_kernel), np.float32)

  def generate(self, prompt_tokens: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
               stop_ids: Sequence[int] | None = None,
               on_token: Callable[[int], None] | None = None) -> GenerationResult:
    """Generates up to `max_new_tokens` after `prompt_tokens` (1-D ids).

    temperature 0 is greedy. Generation stops early at any of `stop_ids` (default: the
    config's eos ids). `on_token` is called with each new id as soon as it is known.
    """
    prompt = self._tokens(prompt_tokens, 1)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
      raise InputError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if temperature < 0:
      raise InputError(f"temperature must be ≥ 0, got {temperature}")
    n = len(prompt)
    if n + max_new_tokens > self._max_context():
      raise InputError(f"prompt ({n}) + max_new_tokens ({max_new_tokens}) exceeds max_context "
                       f"{self._max_context()}")
    stops = set(self.config.eos_token_ids if stop_ids is None else stop_ids)
    from glmjax import sampling
    if temperature > 0:
      sampling.SamplingParams(temperature, top_k, top_p, min_p)  # validates up front

    padded = _bucket(n)
    cache = init_cache(self.config, 1, _bucket(max(padded, n + max_new_tokens)))
    toks = jnp.asarray(np.pad(prompt, (0, padded - n))[None])  # [1, S]
    before = self.engine.telemetry() if self.engine else {}

    t0 = time.perf_counter()
    prefill, decode = self._steps(cache, toks)
    compile_s = time.perf_counter() - t0
    key = jax.random.PRNGKey(seed)

    def pick(logits):  # [V]
      nonlocal key
      if temperature == 0:
        return int(jnp.argmax(logits))
      key, sub = jax.random.split(key)
      return int(sampling.sample(sub, logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                 min_p=min_p))

    t0 = time.perf_counter()
    logits, cache = prefill(cache, toks, n)
    out, reason = [], "max_new_tokens"
    tok = pick(logits[0]) if max_new_tokens else None
    prefill_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    while len(out) < max_new_tokens:
      if tok in stops:
        reason = "stop_token"
        break
      out.append(tok)
      if on_token:
        on_token(tok)
      if len(out) == max_new_tokens:
        break
      logits, cache = decode(cache, jnp.asarray([[tok]], jnp.int32))
      tok = pick(logits[0])
    decode_s = time.perf_counter() - t0
    steps = max(len(out) - 1, 0)  # the first token comes from the prefill
    stats = dict(prompt_tokens=float(n), new_tokens=float(len(out)), compile_s=compile_s,
                 prefill_s=prefill_s, decode_s=decode_s,
                 decode_tok_s=steps / decode_s if steps and decode_s > 0 else 0.0)
    if self.engine is not None:
      after = self.engine.telemetry()
      stats.update({k: v - before.get(k, 0.0) for k, v in after.items()})
      self.engine.close()
    return GenerationResult(tokens=out, stats=stats, stop_reason=reason)


def load(path: str | os.PathLike | None = None, **options) -> Model:
  """Loads a model: an HF `glm_moe_dsa` checkpoint directory, a converted expert store
  (`scripts/convert.py`), or, with no path, the embedded default.

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
      raise InputError(f"{path}: offload options (device_cache_gb, host_cache_gb, io_workers, "
                       "cold) need an expert store; convert it with scripts/convert.py")
    cfg, weights = checkpoint.load_hf(path, dtype=opts.jnp_dtype, progress=opts.progress)
    return Model(cfg, weights, opts, path)

  from glmjax import budget
  from glmjax.engine import OffloadEngine
  from glmjax.weights import nbytes
  cfg, dense = store.load_dense(path, dtype=opts.jnp_dtype, progress=opts.progress)
  experts = store.ExpertStore(path)
  moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
  budgets = budget.resolve(opts.device_cache_gb, opts.host_cache_gb,
                           dense_bytes=nbytes(dense), chunk_bytes=experts.layout(moe_layers[0]).nbytes,
                           n_moe_layers=len(moe_layers), n_experts=cfg.n_routed_experts,
                           top_k=cfg.num_experts_per_tok)
  engine = OffloadEngine(cfg, dense, experts, budgets, io_workers=opts.io_workers,
                         io_timeout_s=opts.io_timeout_s, cold=opts.cold, progress=opts.progress,
                         kernel="pallas" if opts.moe_kernel == "pallas" else "xla")
  return Model(cfg, dense, opts, path, engine)
