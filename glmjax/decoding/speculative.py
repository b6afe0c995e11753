"""MTP speculative decoding: draft with the MTP head, verify in one main forward, roll back.

Positions: the main model has processed positions 0..p-1 (cache length p) and `tok` (position p)
is sampled but not yet fed. MTP position i consumes (h_i, t_{i+1}) — the main model's pre-norm
hidden state at i and the token after it — and predicts t_{i+2} (the DeepSeek-V3 recurrence;
later draft steps feed the MTP block's own output instead of h).

One round:
  1. drafts d1..dk: d1 comes from the MTP step at position p-1 (done when the previous round was
     absorbed); d_g (g ≥ 2) from a step at p+g-2 on the previous MTP output and d_{g-1};
  2. verify [tok, d1..dk] at positions p..p+k in one main forward;
  3. accept a prefix (greedy: argmax match; sampling: accept d with probability p(d), else
     resample from p without d — the output distribution is exactly the plain sampler's);
  4. roll back: the main cache keeps p+1+a positions; MTP positions p..p+a are recomputed from
     the true hidden states (their draft-time entries are overwritten; later ones are never
     visible before being rewritten, as attention masks keys by position).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.model.config import Config
from glmjax.model.forward import KVCache, RecordOptions, bucket, decode_fn, mtp_fn, stack_records
from glmjax.model.mtp import init_mtp_cache


# --- backends: the resident jitted forward, or the offload engine ---------------------------

class ResidentBackend:
  recorder = None  # glmjax.replay.record.LiveRecorder when the run is traced

  def __init__(self, model):
    self.w, self.cfg = model.weights, model.config
    self.kernel = model.options.moe_kernel
    self.mesh = model.mesh
    self.put = model._put  # host ids and lengths onto the model's device(s)

  def main(self, cache, tokens, absorbed, n_valid=None):
    """All logits `[B, S, V]` and hidden states `[B, S, D]`; the cache advances by S."""
    record = RecordOptions() if self.recorder is not None else None
    out = decode_fn(self.w, cache, tokens, cfg=self.cfg, kernel=self.kernel, absorbed=absorbed,
                    record=record, mesh=self.mesh)
    if record is not None:
      n = tokens.shape[1] if n_valid is None else n_valid
      self.recorder.add(np.asarray(tokens)[0, :n], out[3], slice(0, n))
    return out[:3]

  def mtp(self, h, next_tokens, cache, start):
    return mtp_fn(self.w, h, next_tokens, cache, self.put(start, jnp.int32), cfg=self.cfg,
                  kernel=self.kernel, mesh=self.mesh)

  def mtp_cache(self, capacity: int):
    from glmjax import sharding
    where = None if self.mesh is None else sharding.replicated(self.mesh)
    return init_mtp_cache(self.cfg, 1, capacity, sharding=where)


class EngineBackend:
  recorder = None
  put = staticmethod(jnp.asarray)

  def __init__(self, model):
    self.engine = model.engine
    self.cfg = model.config

  def mtp_cache(self, capacity: int):
    return init_mtp_cache(self.cfg, 1, capacity)

  def main(self, cache, tokens, absorbed, n_valid=None):
    # A verify pass (absorbed, with drafts after the token; the prefill is not absorbed) may
    # be capped to `expert_budget` experts a layer. The prefill's padding never routes.
    cap = self.engine.expert_budget if absorbed and tokens.shape[1] > 1 else None
    rec = [] if self.recorder is not None else None
    logits, x, cache = self.engine.forward(tokens, cache, absorbed=absorbed, expert_cap=cap,
                                           n_valid=n_valid, record=rec)
    if rec is not None:
      n = tokens.shape[1] if n_valid is None else n_valid
      self.recorder.add(np.asarray(tokens)[0, :n], stack_records(rec), slice(0, n))
    return logits, x, KVCache(cache.layers, cache.length + tokens.shape[1])

  def mtp(self, h, next_tokens, cache, start):
    return self.engine.mtp_forward(h, next_tokens, cache, start)


# --- draft length control --------------------------------------------------------------------

@dataclasses.dataclass
class DraftController:
  """Chooses the draft length k per round from live throughput, never trusting stale numbers.

  It starts from k = 0 (plain decoding). Every `probe_every` rounds it probes one candidate k
  against the current choice in alternating rounds (c, best, c, best, ...), so both see the same
  cache state and acceptance regime, and switches only if the candidate's tokens/second beat
  the current choice by `margin`. Everything that costs time (acceptance, the extra misses of a
  wider expert union, MTP steps) enters through the measured seconds. With little to gain,
  "auto" stays at plain decoding apart from the short probes.
  """
  k_max: int = 4
  margin: float = 0.05
  first_probe: int = 4
  probe_every: int = 32
  probe_pairs: int = 2

  def __post_init__(self):
    self.best = 0
    self.rounds = 0
    self.queue: list[int] = []
    self.samples: dict[int, list[float]] = {}
    self.next_probe = self.first_probe
    self.order = [k for k in range(1, self.k_max + 1)] + [0]
    self.cursor = 0

  def _candidate(self) -> int:
    for _ in range(len(self.order)):
      c = self.order[self.cursor % len(self.order)]
      self.cursor += 1
      if c != self.best:
        return c
    return self.best

  def choose(self) -> int:
    self.rounds += 1
    if not self.queue and self.rounds >= self.next_probe and self.k_max > 0:
      c = self._candidate()
      self.queue = [c, self.best] * self.probe_pairs
      self.samples = {c: [0.0, 0.0], self.best: [0.0, 0.0]}
    return self.queue[0] if self.queue else self.best

  def update(self, k: int, tokens: int, seconds: float) -> None:
    if not self.queue or k != self.queue[0]:
      return
    self.queue.pop(0)
    self.samples[k][0] += tokens
    self.samples[k][1] += seconds
    if self.queue:
      return
    rate = {j: t / max(sec, 1e-9) for j, (t, sec) in self.samples.items()}
    c = next(j for j in rate if j != self.best) if len(rate) > 1 else self.best
    if rate.get(c, 0.0) > (1 + self.margin) * rate[self.best]:
      self.best = c
    self.next_probe = self.rounds + self.probe_every


# --- acceptance -------------------------------------------------------------------------------

def accept(logits, drafts, picker, rng: np.random.Generator, emit=lambda tok: False):
  """Verifies `drafts` against main logits `[k+1, V]`, emitting each accepted draft.

  Each position is judged under the picker's rule with the history as it stands at that
  position: `emit(d)` adds an accepted draft to the history (and may ask to stop) before the
  next position is judged. Greedy: accept while the (penalised) argmax equals the draft.
  Sampling: accept d with probability p(d) (the draft is a point mass), and on rejection sample
  from p with d removed and renormalised, which reproduces p exactly.

  Returns (accepted count a, next token or None when `emit` asked to stop).
  """
  for j, d in enumerate(drafts):
    if picker.greedy:
      top = picker.pick(logits[j])
      if top != d:
        return j, top
    else:
      p = picker.probs(logits[j])
      if not rng.random() < p[d]:
        p[d] = 0.0
        return j, int(rng.choice(len(p), p=p / p.sum()))
    if emit(d):
      return j + 1, None
  return len(drafts), picker.pick(logits[len(drafts)])


# Most positions absorbed into the MTP cache when drafting resumes after plain rounds.
ABSORB_WINDOW = 8


# --- the loop ------------------------------------------------------------------------------

class CompileClock:
  """Seconds JAX spends tracing, lowering and compiling while it is open (its monitoring
  events, from any thread). Speculative rounds meet new shapes (a verify width per draft
  length, MTP absorb widths) mid-run; their compile time is reported apart from decoding."""

  EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
            "/jax/core/compile/jaxpr_to_mlir_module_duration",
            "/jax/core/compile/backend_compile_duration")

  def __init__(self):
    self.seconds = 0.0

  def _listen(self, event, duration, **_):
    if event in self.EVENTS:
      self.seconds += duration

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listen)


def run(backend, cfg: Config, cache: KVCache, toks, n: int, max_new: int, emit, picker,
        draft, seed: int = 0, on_round=None):
  """Speculative generation after the prompt `toks` `[1, S]` (first `n` real).

  `emit(token) -> bool` records a new token (and shows it to `picker`, a
  `sampling.TokenPicker`) and says whether to stop. `draft` is an int k ≥ 1 or "auto".
  Returns a stats dict (prefill_s, compile_s, decode_compile_s, draft_proposed,
  draft_accepted, tokens_per_forward, verify_forwards); prefill_s and the caller's decode time
  include compilation, which compile_s (prefill) and decode_compile_s (rounds) measure.
  """
  with CompileClock() as clock:
    return _run(backend, cfg, cache, toks, n, max_new, emit, picker, draft, seed, on_round,
                clock)


def _run(backend, cfg, cache, toks, n, max_new, emit, picker, draft, seed, on_round, clock):
  start = int(cache.length)
  cap = cache.layers[0].latent.shape[1]
  t0 = time.perf_counter()
  logits, x, cache = backend.main(cache, toks, absorbed=False, n_valid=n)
  put = backend.put
  cache = KVCache(cache.layers, put(start + n, jnp.int32))
  prompt = np.asarray(toks[0, :n])
  tok = picker.pick(logits[0, n - 1])
  prefill_s = time.perf_counter() - t0
  prefill_compile_s = clock.seconds
  mcache = backend.mtp_cache(cap)
  # MTP inputs not yet absorbed into its cache: hidden states and the tokens after them (one
  # fewer: the last hidden's is `tok`). They are absorbed in one batched step only when a draft
  # is next needed, so k = 0 rounds cost exactly a plain decode step.
  # Hidden states stay on the host as a list of `[L, D]` pieces: appending device arrays of a
  # new length every round would compile a concatenation per length.
  pending_h, pending_t, pending_at = [np.asarray(x[0, :n])], list(prompt[1:]), start
  ctrl = DraftController() if draft == "auto" else None
  rng = np.random.default_rng(seed + 1)
  st = dict(draft_proposed=0, draft_accepted=0, verify_forwards=0, emitted=0)
  p = start + n  # main cache length; `tok` sits at position p
  while True:
    st["emitted"] += 1
    if emit(tok):
      break
    remaining = max_new - st["emitted"]
    k = ctrl.choose() if ctrl else int(draft)
    k = max(0, min(k, remaining - 1, cap - p - 1))
    t0 = time.perf_counter()
    drafts = []
    if k:
      hs = np.concatenate(pending_h)  # [m, D]
      ts = pending_t + [tok]
      if len(hs) > ABSORB_WINDOW and pending_at > start:
        # After a long stretch of plain decoding, absorb only the most recent positions: the
        # MTP block then attends to a thinner history, which can only cost acceptance, never
        # correctness (every draft is verified), and keeps probes from auto cheap.
        skip = len(hs) - ABSORB_WINDOW
        hs, ts, pending_at = hs[skip:], ts[skip:], pending_at + skip
      m = hs.shape[0]
      width = min(bucket(m), cap - pending_at)  # padded: fewer shapes to compile
      hp = put(np.pad(hs, ((0, width - m), (0, 0)))[None])
      tp = put([ts + [0] * (width - m)], jnp.int32)
      mlog, mx, mcache = backend.mtp(hp, tp, mcache, pending_at)
      drafts.append(int(jnp.argmax(mlog[0, m - 1])))
      h = mx[:, m - 1:m]
      pending_h, pending_t, pending_at = [], [], p
      for g in range(1, k):
        mlog, h, mcache = backend.mtp(h, put([[drafts[-1]]], jnp.int32), mcache, p + g - 1)
        drafts.append(int(jnp.argmax(mlog[0, 0])))
    else:
      pending_t = pending_t + [tok]  # the last pending hidden's next token
    verify = put([[tok] + drafts], jnp.int32)
    logits, xv, cache = backend.main(cache, verify, absorbed=True)
    a, nxt = accept(logits[0], drafts, picker, rng, emit)
    if backend.recorder is not None:  # the trace's step: which positions were drafts
      backend.recorder.mark(drafts=k, accepted=a)
    st["emitted"] += a
    if on_round is not None:
      on_round(dict(position=p, tokens=[tok] + drafts, logits=np.asarray(logits[0]), accepted=a))
    cache = KVCache(cache.layers, put(p + 1 + a, jnp.int32))  # roll back the rest
    st["draft_proposed"] += k
    st["draft_accepted"] += a
    st["verify_forwards"] += 1
    # Hidden states of tok and the accepted drafts feed the MTP head next time it drafts; each
    # pairs with the token after it (the last one with `nxt`, added when drafting).
    pending_h.append(np.asarray(xv[0, :a + 1]))
    pending_t = pending_t + drafts[:a]
    if ctrl:
      ctrl.update(k, a + 1, time.perf_counter() - t0)
    if nxt is None:  # an accepted draft ended generation
      break
    p += 1 + a
    tok = nxt
  fwd = max(st["verify_forwards"], 1)
  return {"prefill_s": prefill_s, "compile_s": prefill_compile_s,
          "decode_compile_s": clock.seconds - prefill_compile_s,
          "draft_proposed": float(st["draft_proposed"]),
          "draft_accepted": float(st["draft_accepted"]),
          "verify_forwards": float(st["verify_forwards"]),
          "tokens_per_forward": (st["draft_accepted"] + st["verify_forwards"]) / fwd}
