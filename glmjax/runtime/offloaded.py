"""The offloaded executor: the offload engine's layer steps (glmjax.offload.engine), its routed
experts in the device/host/disk tiers. Prefill is layer-major over a prompt's chunks, so each
MoE layer reads its experts once per prompt."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from glmjax.model.forward import JITTED, KVCache
from glmjax.model.records import stack_records
from glmjax.runtime.executor import Steps, add_records, chunk_plan


class OffloadExecutor(Steps):
  """`Executor` over an `OffloadEngine` (`self.engine`)."""

  stateless = False  # the engine's tiers change with every step, driven from this thread

  def prefill(self, cache, ids, start, hidden=False, recorder=None):
    plan = chunk_plan(len(ids), self.chunk)
    pieces = [self.ids(np.pad(ids[o:o + n], (0, w - n))[None]) for o, n, w in plan]
    rec = [] if recorder is not None else None
    n_last = plan[-1][1]
    xs, cache = self.engine.prefill(pieces, self._at(cache, start), n_last, record=rec)
    logits = JITTED.logits(self.weights, xs[-1][:, n_last - 1:n_last], cfg=self.cfg)
    if recorder is not None:  # only the last chunk is padded: the real rows come first
      recorder.add(ids, stack_records(rec), slice(0, len(ids)))
    out = None
    if hidden:
      out = np.concatenate([np.asarray(x[0, :r]) for x, (_, r, _) in zip(xs, plan)])
    return logits[0, 0], out, self._at(cache, start + len(ids))

  def prefill_rows(self, cache, arr):
    plan = chunk_plan(arr.shape[1], self.chunk)
    pieces = [self.ids(np.pad(arr[:, o:o + n], ((0, 0), (0, w - n)))) for o, n, w in plan]
    xs, cache = self.engine.prefill(pieces, cache, plan[-1][1])
    for x in xs:
      yield JITTED.logits(self.weights, x, cfg=self.cfg), cache

  def step(self, cache, tokens, length, absorbed=True, n_valid=None, recorder=None,
           expert_cap=None):
    cache = self._at(cache, length)
    toks = self.put(tokens, jnp.int32)
    rec = [] if recorder is not None else None
    logits, x, new = self.engine.forward(toks, cache, absorbed=absorbed, n_valid=n_valid,
                                         record=rec, expert_cap=expert_cap)
    new = KVCache(new.layers, new.pages, new.length + toks.shape[1])
    if recorder is not None:
      add_records(recorder, tokens, n_valid, stack_records(rec))
    return logits, x, new

  def mtp(self, h, next_tokens, cache, start):
    return self.engine.mtp_forward(h, next_tokens, cache, start)

  def score(self, arr, n_valid):
    return self.engine.forward(arr, n_valid=n_valid)[0]

  def record(self, arr, opts, fetch=True):
    rec: list = []
    self.engine.forward(arr, record=rec, record_opts=opts)
    out = stack_records(rec)
    return {k: np.asarray(v) for k, v in out.items()} if fetch else out

  def warm_batch(self, cache, tokens, lengths):
    del lengths  # the engine's precompile steps at the cache's own lengths
    return self.engine.precompile(self.put(tokens), cache)

  def warm_prefill(self, cache, width):
    # one chunk goes through `engine.forward` with its real count as an int (absorbed: auto)
    return self.engine.precompile(self.ids(np.zeros((1, width))), self._at(cache, 0),
                                  absorbed=None, n_valid=0)

  def with_attention(self, impl: str):
    raise NotImplementedError("the offload engine's attention is fixed at load: "
                              f"glmjax.load(..., attention={impl!r})")

  def tier_state(self) -> dict:
    return self.engine.tier_state()
