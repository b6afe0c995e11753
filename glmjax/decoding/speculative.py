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

from glmjax.model.forward import bucket
from glmjax.runtime.clock import CompileClock


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

def run(executor, pool, table, cache, start: int, prefilled, req, draft, on_round=None):
  """Speculative generation after a prompt prefilled into `cache` (batch 1, page `table`
  `[W]` of `pool`, a glmjax.decoding.pages.KVPool) at positions start.. (the cache's length
  is now start + the prompt's length).

  `prefilled` = (logits `[V]` at the prompt's last token, its hidden states `[n, D]` numpy,
  the prompt's ids). `req` (glmjax.decoding.generation.Request) records the new tokens; `draft`
  is an int k ≥ 1 or "auto". Returns (stats dict: decode_compile_s, draft_proposed,
  draft_accepted, tokens_per_forward, verify_forwards; the main cache; the MTP cache).
  """
  with CompileClock() as clock:
    return _run(executor, pool, table, cache, start, prefilled, req, draft, on_round, clock)


def _run(executor, pool, table, cache, start, prefilled, req, draft, on_round, clock):
  logits, hidden, prompt = prefilled
  n = len(prompt)
  picker, emit, max_new = req.picker, req.emit, req.max_new_tokens
  tok = picker.pick(logits)
  pool.ensure_mtp()
  mcache = pool.cache([table], 0, executor.put, mtp=True)
  chunk = executor.chunk or max(n, 1)
  # MTP inputs not yet absorbed into its cache: hidden states and the tokens after them (one
  # fewer: the last hidden's is `tok`). They are absorbed in one batched step only when a draft
  # is next needed, so k = 0 rounds cost exactly a plain decode step.
  # Hidden states stay on the host as a list of `[L, D]` pieces: appending device arrays of a
  # new length every round would compile a concatenation per length.
  pending_h, pending_t, pending_at = [hidden], list(prompt[1:]), start
  ctrl = DraftController() if draft == "auto" else None
  rng = np.random.default_rng(req.seed + 1)
  st = dict(draft_proposed=0, draft_accepted=0, verify_forwards=0, emitted=0)
  p = start + n  # main cache length; `tok` sits at position p
  while True:
    st["emitted"] += 1
    if emit(tok):
      break
    remaining = max_new - st["emitted"]
    k = ctrl.choose() if ctrl else int(draft)
    k = max(0, min(k, remaining - 1))
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
      # Absorbed in prefill-sized pieces (a long prompt's first draft absorbs all of it).
      for o in range(0, len(hs), chunk):
        m = min(chunk, len(hs) - o)
        width = bucket(m)  # padded: fewer shapes to compile; padding lands past the length
        hp = executor.put(np.pad(hs[o:o + m], ((0, width - m), (0, 0)))[None])
        tp = executor.put([ts[o:o + m] + [0] * (width - m)], jnp.int32)
        mlog, mx, mcache = executor.mtp(hp, tp, mcache, pending_at + o)
      drafts.append(int(jnp.argmax(mlog[0, m - 1])))
      h = mx[:, m - 1:m]
      pending_h, pending_t, pending_at = [], [], p
      for g in range(1, k):
        nxt = executor.put([[drafts[-1]]], jnp.int32)
        mlog, h, mcache = executor.mtp(h, nxt, mcache, p + g - 1)
        drafts.append(int(jnp.argmax(mlog[0, 0])))
    else:
      pending_t = pending_t + [tok]  # the last pending hidden's next token
    # A verify pass may be capped to `expert_budget` experts a layer (opt-in, lossy).
    cap = executor.expert_budget if k else None
    logits, xv, cache = executor.step(cache, [[tok] + drafts], p, recorder=req.recorder,
                                    expert_cap=cap)
    a, nxt = accept(logits[0], drafts, picker, rng, emit)
    if req.recorder is not None:  # the trace's step: which positions were drafts
      req.recorder.mark(drafts=k, accepted=a)
    st["emitted"] += a
    if on_round is not None:
      on_round(dict(position=p, tokens=[tok] + drafts, logits=np.asarray(logits[0]), accepted=a))
    st["draft_proposed"] += k
    st["draft_accepted"] += a
    st["verify_forwards"] += 1
    # Hidden states of tok and the accepted drafts feed the MTP head next time it drafts; each
    # pairs with the token after it (the last one with `nxt`, added when drafting). The main
    # cache keeps p + 1 + a positions: the rest is rolled back by the next step's length.
    pending_h.append(np.asarray(xv[0, :a + 1]))
    pending_t = pending_t + drafts[:a]
    if ctrl:
      ctrl.update(k, a + 1, time.perf_counter() - t0)
    if nxt is None:  # an accepted draft ended generation
      break
    p += 1 + a
    tok = nxt
  fwd = max(st["verify_forwards"], 1)
  stats = {"decode_compile_s": clock.seconds,
           "draft_proposed": float(st["draft_proposed"]),
           "draft_accepted": float(st["draft_accepted"]),
           "verify_forwards": float(st["verify_forwards"]),
           "tokens_per_forward": (st["draft_accepted"] + st["verify_forwards"]) / fwd}
  return stats, cache, mcache
