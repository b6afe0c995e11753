"""Side-by-side generation benchmarks (scripts/bench_vs_transformers.py): a per-token clock that
times every side the same way, alternating timed runs with medians, and greedy agreement.

    calls = {"glmjax": ours, "transformers": theirs}  # each: () -> (tokens, timing, stats)
    sides = measure(calls, runs=5)
    agreement(sides["glmjax"]["tokens"], sides["transformers"]["tokens"])
"""

from __future__ import annotations

import statistics
import time


class TokenClock:
  """Timestamps of each new token of one call, so both sides are measured identically."""

  def __init__(self):
    self.start = time.perf_counter()
    self.stamps: list[float] = []

  def tick(self, _=None):
    """Marks a new token now (usable as a per-token callback)."""
    self.stamps.append(time.perf_counter())

  def timing(self, end: float) -> dict:
    """wall_s, ttft_s, decode_s, new_tokens, tok_s, decode_tok_s of the call ended at `end`."""
    n = len(self.stamps)
    first = self.stamps[0] if n else end
    decode_s = (self.stamps[-1] - first) if n > 1 else 0.0
    return {"wall_s": end - self.start, "ttft_s": first - self.start, "decode_s": decode_s,
            "new_tokens": n, "tok_s": n / (end - self.start),
            "decode_tok_s": (n - 1) / decode_s if decode_s > 0 else 0.0}


def measure(calls: dict, runs: int) -> dict:
  """Per side of `calls` (name → call): one warm-up call, then `runs` timed ones, the sides
  taking turns so that both see the same machine conditions. Every run, medians, the tokens."""
  warm, timed = {}, {name: [] for name in calls}
  for name, call in calls.items():
    t0 = time.perf_counter()
    warm[name] = (call()[0], time.perf_counter() - t0)
  for _ in range(runs):
    for name, call in calls.items():
      timed[name].append(call())
  keys = ("wall_s", "ttft_s", "decode_s", "tok_s", "decode_tok_s")
  out = {}
  for name, done in timed.items():
    side = {"warmup_s": warm[name][1],
            **{k: statistics.median(t[k] for _, t, _ in done) for k in keys},
            "runs": [t for _, t, _ in done], "tokens": done[-1][0],
            # Greedy decoding must repeat itself; if it did not, agreement would mean little.
            "deterministic": all(toks == warm[name][0] for toks, _, _ in done)}
    stats = done[-1][2]
    if stats:  # glmjax's own accounting of its last run, for comparison with the clock's
      side["own_stats_last_run"] = {k: stats[k] for k in ("compile_s", "prefill_s", "decode_s",
                                                          "first_step_s", "decode_tok_s")}
    out[name] = side
  return out


def agreement(a: list[int], b: list[int]) -> dict:
  """Position-by-position equality of two greedy continuations."""
  n = min(len(a), len(b))
  equal = sum(x == y for x, y in zip(a, b))
  first = next((i for i in range(n) if a[i] != b[i]), None)
  if first is None and len(a) != len(b):
    first = n
  return {"equal": equal, "compared": max(len(a), len(b)),
          "fraction": equal / max(len(a), len(b), 1), "first_divergence": first}
