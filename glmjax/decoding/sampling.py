"""Token sampling: temperature, top-k, top-p (nucleus), min-p and repetition penalty.

Everything here is pure JAX and jittable. Knobs may be Python numbers (a stage that is off then
costs nothing) or arrays, scalar or one value per row (`[B]`), so one compiled step can serve a
batch of requests with different settings.

Filters apply in a fixed order: temperature -> top-k -> top-p -> min-p. Each later stage sees the
distribution left by the earlier ones (renormalised), which is what a sort-based implementation
does. Entries that are -inf on input are never kept.

Top-p never sorts the whole vocabulary in the common case: `lax.top_k` pre-selects a few hundred
candidates and the nucleus is found among them. Only when the nucleus is larger than the
pre-selection (a flat distribution) does an exact fallback run, behind `lax.cond`: a bisection over
float32 bit patterns for the threshold logit, which gives the same kept set as a full sort in
~32 masked reductions, several times cheaper than sorting 154,880 entries.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from glmjax.errors import InputError

# Candidates pre-selected for top-k/top-p. Peaked LLM distributions put p=0.9 of the mass on far
# fewer tokens than this; `lax.top_k` of this size costs ~1% of a full 154,880-entry sort on CPU.
PRESELECT = 256
# A static top_k up to this size is served by the pre-selection alone (top_k of k is still far
# cheaper than the bisection fallback).
_MAX_STATIC_PRESELECT = 4096

_SIGN = np.uint32(0x80000000)  # float32 sign bit


class SamplingError(InputError, ValueError):
  """Bad sampling parameters (a ValueError, and a glmjax InputError)."""


# --- parameter plumbing ---------------------------------------------------------------------

def _is_static(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _rows(v, batch: int, dtype) -> jax.Array:
  """A scalar or per-row knob as a `[B, 1]` array, so it broadcasts against `[B, V]`."""
  a = jnp.asarray(v, dtype)
  if a.ndim == 0:
    return jnp.broadcast_to(a, (batch, 1))
  if a.shape != (batch,):
    raise SamplingError(
        f"per-row sampling parameter has shape {a.shape}; expected () or ({batch},)")
  return a[:, None]


def _check_static(temperature, top_k, top_p, min_p) -> None:
  if _is_static(temperature) and not (temperature > 0 and math.isfinite(temperature)):
    raise SamplingError(f"temperature must be a finite number > 0 here (greedy is handled by "
                        f"sample()), got {temperature!r}")
  if _is_static(top_k) and (int(top_k) != top_k or top_k < 0):
    raise SamplingError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
  if _is_static(top_p) and not 0.0 < top_p <= 1.0:
    raise SamplingError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
  if _is_static(min_p) and not 0.0 <= min_p <= 1.0:
    raise SamplingError(f"min_p must be in [0, 1] (0 = off), got {min_p!r}")


# --- exact threshold search ----------------------------------------------------------------

def _order_keys(x: jax.Array) -> jax.Array:
  """uint32 keys whose unsigned order is the float order of `x` (-0.0 folded onto +0.0)."""
  x = jnp.where(x == 0, jnp.float32(0), x)
  b = lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(b >= _SIGN, ~b, b | _SIGN)


def _key_to_float(k: jax.Array) -> jax.Array:
  b = jnp.where(k >= _SIGN, k ^ _SIGN, ~k)
  return lax.bitcast_convert_type(b, jnp.float32)


def _largest_threshold(x: jax.Array, weight: jax.Array, target: jax.Array) -> jax.Array:
  """Largest float t with sum(weight[x >= t]) >= target, per row; `[B, 1]`.

  This is the sort-based threshold without the sort: the weighted mass of `x >= t` only grows as t
  falls, so bisecting t over the 2^32 float bit patterns finishes in 32 masked reductions. If even
  the whole row falls short (rounding, p ~ 1), the row minimum is returned: everything is kept.
  """
  finite = x > -jnp.inf
  keys = _order_keys(x)                                                   # [B, V]
  lo = jnp.min(jnp.where(finite, keys, jnp.uint32(0xFFFFFFFF)), -1, keepdims=True)  # [B, 1]
  hi = jnp.max(jnp.where(finite, keys, jnp.uint32(0)), -1, keepdims=True)           # [B, 1]
  hi = jnp.maximum(hi, lo)  # an all -inf row: any threshold keeps nothing anyway
  w = jnp.where(finite, weight, 0.0)

  def step(_, bounds):
    lo, hi = bounds
    span = hi - lo
    mid = lo + (span - span // 2)  # upper midpoint, so `lo = mid` always makes progress
    ok = jnp.sum(jnp.where(keys >= mid, w, 0.0), -1, keepdims=True) >= target
    live = span > 0
    return jnp.where(live & ok, mid, lo), jnp.where(live & ~ok, mid - 1, hi)

  lo, _ = lax.fori_loop(0, 32, step, (lo, hi))
  return _key_to_float(lo)


# --- the filters ---------------------------------------------------------------------------

def _top_k_top_p(x: jax.Array, top_k, top_p) -> jax.Array:
  """Applies top-k then top-p to tempered logits `x` `[B, V]`; off stages are skipped."""
  b, v = x.shape
  k_on = not (_is_static(top_k) and (top_k == 0 or top_k >= v))
  p_on = not (_is_static(top_p) and top_p >= 1.0)
  if not (k_on or p_on):
    return x

  n = min(v, PRESELECT)
  if _is_static(top_k) and k_on and top_k <= _MAX_STATIC_PRESELECT:
    n = max(n, int(top_k))
  with jax.named_scope("preselect"):
    cand, _ = lax.top_k(x, n)                                             # [B, N], descending
    # XLA's CPU backend lowers top_k to sort + slice and recovers its fast partial-select
    # kernel only if that slice is left intact; without the barrier, slicing `cand` below gets
    # folded into it and the whole vocabulary is sorted (~80x slower at V = 154,880).
    cand = lax.optimization_barrier(cand)

  if k_on:
    with jax.named_scope("top_k"):
      k = _rows(top_k, b, jnp.int32)                                      # [B, 1]
      k = jnp.where((k <= 0) | (k >= v), v, k)  # 0 or >= V: keep all
      kth = jnp.take_along_axis(cand, jnp.minimum(k, n) - 1, -1)          # [B, 1]
      if n < v and not (_is_static(top_k) and top_k <= n):
        beyond = k > n
        # k-th largest = largest t with count(x >= t) >= k: the same search, unit weights.
        kth = lax.cond(
            jnp.any(beyond),
            lambda: jnp.where(
                beyond, _largest_threshold(x, jnp.ones_like(x), k.astype(jnp.float32)), kth),
            lambda: kth)
      kth = jnp.where(k >= v, -jnp.inf, kth)
      x = jnp.where(x >= kth, x, -jnp.inf)
      cand = jnp.where(cand >= kth, cand, -jnp.inf)

  if p_on:
    with jax.named_scope("top_p"):
      p = _rows(top_p, b, jnp.float32)                                    # [B, 1]
      top = cand[:, :1]                                                   # [B, 1] row max
      top = jnp.where(top > -jnp.inf, top, 0.0)  # all -inf row: avoid inf - inf
      # The normaliser is over the whole (top-k filtered) vocabulary, so candidate probabilities
      # are the true ones and their running sum is the sort-based cumulative mass.
      z = jnp.sum(jnp.exp(x - top), -1, keepdims=True)                    # [B, 1]
      cum = jnp.cumsum(jnp.exp(cand - top) / z, -1)                       # [B, N]
      reached = cum >= p                                                  # [B, N]
      hit = jnp.any(reached, -1, keepdims=True)                           # [B, 1]
      # Never reached (only rounding can do that when N = V): the whole row is the nucleus.
      first = jnp.where(hit, jnp.argmax(reached, -1)[:, None], n - 1)     # [B, 1]
      thr = jnp.take_along_axis(cand, first, -1)                          # [B, 1]
      if n < v:
        outside = ~hit & (p < 1.0)
        thr = lax.cond(
            jnp.any(outside),
            lambda: jnp.where(outside, _largest_threshold(x, jnp.exp(x - top) / z, p), thr),
            lambda: thr)
      thr = jnp.where(p >= 1.0, -jnp.inf, thr)
      x = jnp.where(x >= thr, x, -jnp.inf)
  return x


def _min_p(x: jax.Array, min_p) -> jax.Array:
  if _is_static(min_p) and min_p <= 0.0:
    return x
  with jax.named_scope("min_p"):
    mp = _rows(min_p, x.shape[0], jnp.float32)                            # [B, 1]
    top = jnp.max(x, -1, keepdims=True)                                   # [B, 1]
    top = jnp.where(top > -jnp.inf, top, 0.0)
    # prob / max_prob = exp(x - max): the softmax normaliser cancels.
    return jnp.where(jnp.exp(x - top) >= mp, x, -jnp.inf)


def filter_logits(logits: jax.Array, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> jax.Array:
  """Tempered float32 logits with -inf outside the kept set; `[V]` or `[B, V]` in and out.

  Applied in order temperature -> top_k -> top_p -> min_p:
    temperature: divides the logits; must be > 0 (greedy decoding is `sample`'s business).
    top_k: keeps logits >= the k-th largest (ties with it included); 0 = off.
    top_p: keeps the shortest prefix of the probability-sorted tokens whose mass reaches top_p,
      plus every token tied with the last one kept; 1 = off.
    min_p: keeps tokens with prob >= min_p * max prob; 0 = off.
  Each knob is a Python number or an array of shape () or [B]. -inf inputs are never kept.
  """
  _check_static(temperature, top_k, top_p, min_p)
  x = jnp.asarray(logits).astype(jnp.float32)
  if x.ndim not in (1, 2):
    raise SamplingError(f"logits must be [V] or [B, V], got shape {x.shape}")
  single = x.ndim == 1
  x = x[None] if single else x                                            # [B, V]
  with jax.named_scope("temperature"):
    if not (_is_static(temperature) and temperature == 1.0):
      # Multiply by the reciprocal: XLA's CPU backend turns division by a broadcast scalar into
      # this anyway, and spelling it out makes the tempered logits identical on every backend.
      x = x * (1.0 / _rows(temperature, x.shape[0], jnp.float32))
  x = _top_k_top_p(x, top_k, top_p)
  x = _min_p(x, min_p)
  return x[0] if single else x


def _split_greedy(temperature):
  """(static greedy?, temperature safe to divide by, per-row greedy mask or None)."""
  if _is_static(temperature):
    return temperature <= 0, temperature, None
  t = jnp.asarray(temperature, jnp.float32)
  return False, jnp.where(t > 0, t, 1.0), t <= 0


def sample(key: jax.Array, logits: jax.Array, temperature=1.0, top_k=0, top_p=1.0,
           min_p=0.0) -> jax.Array:
  """Draws token ids (int32, `[]` or `[B]`) from the filtered distribution.

  temperature <= 0 means greedy argmax (per row when temperature is a `[B]` array).
  """
  x = jnp.asarray(logits).astype(jnp.float32)
  greedy_ids = jnp.argmax(x, -1).astype(jnp.int32)
  all_greedy, t, row_greedy = _split_greedy(temperature)
  if all_greedy:
    return greedy_ids
  with jax.named_scope("sample"):
    filtered = filter_logits(x, t, top_k, top_p, min_p)
    ids = jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
  if row_greedy is not None:
    ids = jnp.where(row_greedy, greedy_ids, ids)
  return ids


def probs(logits: jax.Array, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> jax.Array:
  """The distribution `sample` draws from, float32 `[V]` or `[B, V]`.

  Greedy rows (temperature <= 0) are one-hot on the argmax, so speculative decoding can accept
  or reject drafts against exactly what would have been sampled.
  """
  x = jnp.asarray(logits).astype(jnp.float32)
  one_hot = jax.nn.one_hot(jnp.argmax(x, -1), x.shape[-1], dtype=jnp.float32)
  all_greedy, t, row_greedy = _split_greedy(temperature)
  if all_greedy:
    return one_hot
  dist = jax.nn.softmax(filter_logits(x, t, top_k, top_p, min_p), -1)
  if row_greedy is not None:
    g = row_greedy[:, None] if row_greedy.ndim == 1 else row_greedy
    dist = jnp.where(g, one_hot, dist)
  return dist


def apply_repetition_penalty(logits: jax.Array, prev_tokens: jax.Array, penalty) -> jax.Array:
  """Penalises already-seen tokens the transformers way: positive logits / penalty, negative ones
  * penalty.

  `prev_tokens` is either a bool mask shaped like `logits` (`[V]` or `[B, V]`), or integer ids
  (`[L]` or `[B, L]`) where negative ids are padding and ignored. `penalty` is a number or `[B]`.
  """
  if _is_static(penalty):
    if not penalty > 0:
      raise SamplingError(f"repetition_penalty must be > 0, got {penalty!r}")
    if penalty == 1.0:
      return logits
  x = jnp.asarray(logits)
  single = x.ndim == 1
  x = x[None] if single else x                                            # [B, V]
  prev = jnp.asarray(prev_tokens)
  prev = prev[None] if single else prev
  b, v = x.shape
  if prev.dtype == jnp.bool_:
    if prev.shape != x.shape:
      raise SamplingError(f"prev_tokens mask has shape {prev.shape}; expected {x.shape}")
    seen = prev
  else:
    if not jnp.issubdtype(prev.dtype, jnp.integer) or prev.ndim != 2 or prev.shape[0] != b:
      raise SamplingError(f"prev_tokens must be a bool mask or int ids [B, L], got "
                          f"{prev.dtype} {prev.shape}")
    ids = jnp.where(prev < 0, v, prev)  # padding -> out of range, dropped by the scatter
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)            # [B, L]
    seen = jnp.zeros((b, v), jnp.bool_).at[rows, ids].set(True, mode="drop")
  pen = _rows(penalty, b, x.dtype)                                        # [B, 1]
  # x * (1 / pen) rather than x / pen: XLA rewrites some divisions this way and not others, and
  # one rounding everywhere keeps eager, jitted, mask and id paths bit-identical.
  out = jnp.where(seen, jnp.where(x < 0, x * pen, x * (1.0 / pen)), x)
  return out[0] if single else out


# --- parameters ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling settings. temperature 0 means greedy; other knobs as in filter_logits."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
  frequency_penalty: float = 0.0  # ... and this much per time it was generated

  def __post_init__(self):
    def number(name, lo, hi, lo_open=False):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise SamplingError(f"{name} must be a finite number, got {v!r}")
      if (v <= lo if lo_open else v < lo) or v > hi:
        raise SamplingError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}")
      object.__setattr__(self, name, float(v))

    number("temperature", 0.0, math.inf)
    number("top_p", 0.0, 1.0, lo_open=True)
    number("min_p", 0.0, 1.0)
    number("repetition_penalty", 0.0, math.inf, lo_open=True)
    number("presence_penalty", -2.0, 2.0)
    number("frequency_penalty", -2.0, 2.0)
    k = self.top_k
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
      raise SamplingError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @classmethod
  def from_generation_config(cls, cfg: Mapping[str, Any] | None) -> "SamplingParams":
    """Reads HF `generation_config.json` keys the way transformers' `generate` would.

    Missing keys take transformers' defaults (do_sample=False, temperature=1, top_k=50, top_p=1),
    so a config without `do_sample: true` decodes greedily, as it does under transformers. A null
    or 0 top_k means off.
    """
    cfg = dict(cfg or {})

    def get(key, default):
      v = cfg.get(key)
      return default if v is None else v

    if not bool(get("do_sample", False)):
      return cls(temperature=0.0, repetition_penalty=get("repetition_penalty", 1.0))
    return cls(temperature=get("temperature", 1.0), top_k=get("top_k", 50), top_p=get("top_p", 1.0),
               min_p=get("min_p", 0.0), repetition_penalty=get("repetition_penalty", 1.0))


def sample_with(key: jax.Array, logits: jax.Array, params: SamplingParams,
                prev_tokens: jax.Array | None = None) -> jax.Array:
  """`sample` driven by a SamplingParams, applying its repetition penalty first (as HF does)."""
  if prev_tokens is not None:
    logits = apply_repetition_penalty(logits, prev_tokens, params.repetition_penalty)
  return sample(key, logits, params.temperature, params.top_k, params.top_p, params.min_p)


# --- the per-request token picker ------------------------------------------------------------

# The picker's sampler is one jitted call per token (eager execution of the same ops cost
# ~200 ms per token on CPU). Its knobs are run-time values, so a request with any temperature,
# top-p, min-p or penalty reuses the compiled call: a server's clients choose them freely.
# Only `stages` is static: which filters are on (one that is off costs nothing) and a top-k
# beyond the pre-selection, which sets the candidates' shape.
# `allowed` is a grammar's mask (glmjax.decoding.grammar) packed 8 tokens to a byte (uint8
# `[ceil(V/8)]`, little-endian bits, as llguidance writes it: 19 kB a step for GLM-5 rather than
# 155 kB of bools), all ones without a grammar, so constrained and free requests share the
# compiled call. Disallowed logits become -inf before the temperature and every filter, so each
# filter sees only the tokens the grammar allows.
def allow(logits, allowed):
  x = jnp.asarray(logits, jnp.float32)
  keep = jnp.unpackbits(allowed, bitorder="little")[:x.shape[-1]].astype(bool)
  return jnp.where(keep, x, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("stages",))
def _sample_jit(key, logits, allowed, knobs, stages):
  return sample(key, allow(logits, allowed), *_knob_args(knobs, stages))


@functools.partial(jax.jit, static_argnames=("stages",))
def _probs_jit(logits, allowed, knobs, stages):
  return probs(allow(logits, allowed), *_knob_args(knobs, stages))


@jax.jit
def _argmax_jit(logits, allowed):
  return jnp.argmax(allow(logits, allowed))


@jax.jit
def _log_softmax_jit(logits, allowed):
  return jax.nn.log_softmax(allow(logits, allowed))


@functools.lru_cache(maxsize=8)
def everything(vocab_size: int) -> jax.Array:
  """The packed mask of a request without a grammar (on the device once)."""
  return jnp.full(((vocab_size + 7) // 8,), 0xFF, jnp.uint8)


@jax.jit
def _penalize_jit(logits, seen, penalty):
  return apply_repetition_penalty(logits[None], seen[None], penalty)[0]


@jax.jit
def _additive_penalties_jit(logits, counts, presence, frequency):
  """OpenAI's presence and frequency penalties over the generated tokens' `counts` `[V]`."""
  counts = counts.astype(jnp.float32)
  return logits - presence * (counts > 0) - frequency * counts


def _stages(params: SamplingParams) -> tuple:
  """(top_k: 0 off, None run-time, or a static k > PRESELECT; top_p on; min_p on)."""
  k = params.top_k
  return (0 if k == 0 else None if k <= PRESELECT else k), params.top_p < 1.0, params.min_p > 0.0


def _knob_args(knobs, stages):
  """(temperature, top_k, top_p, min_p) for `sample`/`probs`: run-time scalars, with the off
  filters as their static off values."""
  temperature, top_k, top_p, min_p = knobs
  k, p_on, m_on = stages
  return temperature, top_k if k is None else k, top_p if p_on else 1.0, min_p if m_on else 0.0


class TokenPicker:
  """Next-token choice for one request under one `SamplingParams`.

  It owns the history the repetition penalty sees (`observe` each token as it joins the
  sequence) and the PRNG key, so plain and speculative decoding apply exactly the same rule:
  `pick` samples (or takes the argmax at temperature 0) and `probs` returns the distribution
  `pick` samples from, both after the penalty.
  """

  def __init__(self, params: SamplingParams, vocab_size: int, seen=(), seed: int = 0):
    self.params = params
    self.key = jax.random.PRNGKey(seed)
    self.seen = np.zeros((vocab_size,), bool)
    self.seen[np.asarray(list(seen), np.int64)] = True
    self.counts = np.zeros((vocab_size,), np.int32)  # generated tokens only (OpenAI's rule)

  @property
  def greedy(self) -> bool:
    return self.params.temperature == 0

  def observe(self, tok: int) -> None:
    self.seen[tok] = True
    self.counts[tok] += 1

  def _adjusted(self, logits):
    p = self.params
    if p.repetition_penalty != 1.0:
      logits = _penalize_jit(logits, jnp.asarray(self.seen), np.float32(p.repetition_penalty))
    if p.presence_penalty or p.frequency_penalty:
      logits = _additive_penalties_jit(logits, jnp.asarray(self.counts),
                                       np.float32(p.presence_penalty),
                                       np.float32(p.frequency_penalty))
    return logits

  def _knobs(self):
    p = self.params
    return (np.float32(p.temperature), np.int32(p.top_k), np.float32(p.top_p),
            np.float32(p.min_p)), _stages(p)

  def _allowed(self, allowed):
    return everything(self.seen.shape[0]) if allowed is None else allowed

  def pick(self, logits, allowed=None) -> int:
    """The next token from logits `[V]`, among the `allowed` ones (packed bits, uint8
    `[ceil(V/8)]`; None: all)."""
    logits = self._adjusted(logits)
    allowed = self._allowed(allowed)
    if self.greedy:
      return int(_argmax_jit(logits, allowed))
    self.key, sub = jax.random.split(self.key)
    knobs, stages = self._knobs()
    return int(_sample_jit(sub, logits, allowed, knobs, stages))

  def logprobs(self, logits, allowed=None) -> np.ndarray:
    """float32 `[V]`: the log of the distribution `pick` samples from, after the penalty, the
    temperature and the top-k/top-p/min-p filters (-inf where filtered out). At temperature 0,
    the model's log-softmax after the penalty (the argmax's one-hot would say nothing)."""
    logits, allowed = self._adjusted(logits), self._allowed(allowed)
    if self.greedy:
      return np.asarray(_log_softmax_jit(logits, allowed), np.float32)
    with np.errstate(divide="ignore"):
      return np.log(self._sampled_probs(logits, allowed)).astype(np.float32)

  def _sampled_probs(self, logits, allowed=None) -> np.ndarray:
    """The sampling distribution of logits the penalty has already adjusted."""
    knobs, stages = self._knobs()
    return np.asarray(_probs_jit(logits, self._allowed(allowed), knobs, stages), np.float64)

  def probs(self, logits) -> np.ndarray:
    """float64 `[V]`: the distribution `pick` samples from (one-hot at the argmax if greedy)."""
    logits = self._adjusted(logits)
    if self.greedy:
      out = np.zeros(logits.shape[-1])
      out[int(jnp.argmax(logits))] = 1.0
      return out
    return self._sampled_probs(logits)
