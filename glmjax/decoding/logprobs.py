"""Token log-probabilities as clients ask for them: a token's logprob and its top alternatives,
for generated tokens (under the distribution sampled from) and for a prompt's own tokens (the
model's log-softmax, teacher-forced)."""

from __future__ import annotations

import dataclasses

import numpy as np


MAX_LOGPROBS = 20  # alternatives per position at most (vLLM's default --max-logprobs)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
  """A token's log-probability and the `k` most likely tokens at its position (ids, logprobs,
  most likely first; fewer when fewer than `k` can be sampled there)."""
  logprob: float
  top_ids: tuple
  top_logprobs: tuple

  @classmethod
  def of(cls, logp: np.ndarray, tok: int, k: int) -> "TokenLogprob":
    """From a position's log-distribution `[V]` and the token taken there."""
    top = np.zeros(0, np.int64)
    if k:  # the k largest, most likely first (ties by id): a partition, not a sort of all V
      part = np.argpartition(-logp, k - 1)[:k]
      top = part[np.lexsort((part, -logp[part]))]
      top = top[np.isfinite(logp[top])]  # tokens the sampler's filters removed are no choice
    return cls(float(logp[tok]), tuple(int(i) for i in top), tuple(float(logp[i]) for i in top))


def prompt_logprobs(model, ids: np.ndarray, k: int) -> list:
  """(token, TokenLogprob | None) for each of a prompt's tokens `[S]`: log p(ids[s] | ids[:s])
  and the `k` most likely tokens there, from one teacher-forced `model.score` pass. The first
  token has no logprob (None): nothing precedes it."""
  ids = np.asarray(ids, np.int32)
  out: list = [(int(ids[0]), None)]
  if len(ids) > 1:
    # (`model.score` pads to a power of two: prompts of many lengths share a few shapes)
    lp, top_ids, top_lp = model.score(ids[None, :-1], ids[None, 1:], top_k=max(k, 1))
    out += [(int(t), TokenLogprob(float(lp[0, i]), tuple(int(x) for x in top_ids[0, i, :k]),
                                  tuple(float(x) for x in top_lp[0, i, :k])))
            for i, t in enumerate(ids[1:])]
  return out
