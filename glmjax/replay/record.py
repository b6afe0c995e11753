"""Routing records → traces: the glue between the model's in-jit recording
(`glmjax.model.records.recording`) and the trace format (`glmjax.replay.trace`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from glmjax.model.records import RecordOptions
from glmjax.replay.trace import Trace, TraceWriter


def positions_first(records: dict, rows=None) -> dict:
  """Records `[L, T, ...]` (numpy or device arrays) → trace arrays `[T, L, ...]` for `rows`
  (all by default). The pilot moves to the layer it predicts: a record's pilot at layer j
  predicts layer j+1, a trace's pilot at j was predicted at j-1 (row 0: -1)."""
  out = {}
  for k, v in records.items():
    v = np.asarray(v)
    v = v if rows is None else v[:, rows]
    out[k] = np.ascontiguousarray(np.swapaxes(v, 0, 1))
  for k, fill in (("pilot", -1), ("pilot_scores", 0.0)):
    shifted = np.full_like(out[k], fill)
    shifted[:, 1:] = out[k][:, :-1]
    out[k] = shifted
  return out


def manifest(cfg, moe_layers, expert_bytes: int, opts: RecordOptions, **options) -> dict:
  """The manifest fields a trace writer needs, for a model with config `cfg`."""
  return {"config": dataclasses.asdict(cfg), "moe_layers": list(moe_layers),
          "n_experts": cfg.n_routed_experts, "top_k": cfg.num_experts_per_tok,
          "expert_bytes": int(expert_bytes),
          "options": {"top_m": min(opts.top_m, cfg.n_routed_experts),
                      "pilot_p": min(opts.pilot_p, cfg.n_routed_experts), **options}}


class LiveRecorder:
  """Collects a live run's steps (each forward pass: its real positions' tokens and routing
  records) and writes them as one trace."""

  def __init__(self, path: str, meta: dict, initial: dict | None):
    self.path, self.meta, self.initial = path, meta, initial
    self.parts: list[dict] = []
    self.tokens: list[np.ndarray] = []
    self.steps: list[np.ndarray] = []
    self.verify: list[dict] = []  # speculative runs: each verify step's drafts and acceptance

  def add(self, tokens, records: dict, rows) -> None:
    """One forward pass: `tokens` of its real positions and `records` `[L, T, ...]`."""
    step = len(self.tokens)
    self.parts.append(positions_first(records, rows))
    self.tokens.append(np.asarray(tokens, np.int32).reshape(-1))
    self.steps.append(np.full(len(self.tokens[-1]), step, np.int64))

  def mark(self, **info) -> None:
    """Notes of the last step (a verify pass: `drafts` positions after its first, `accepted`)."""
    self.verify.append({"step": len(self.tokens) - 1, **info})

  def save(self) -> Trace:
    cat = {k: np.concatenate([p[k] for p in self.parts]) for k in self.parts[0]}
    live = {"initial": self.initial} if self.initial is not None else {}
    if self.verify:
      live["verify"] = self.verify
    trace = Trace.from_ids(
        cat["ids"], weights=cat["weights"], tokens=np.concatenate(self.tokens),
        steps=np.concatenate(self.steps), scores=cat["scores"], score_ids=cat["score_ids"],
        pilot=cat["pilot"], pilot_scores=cat["pilot_scores"], live=live,
        n_experts=self.meta["n_experts"], expert_bytes=self.meta["expert_bytes"],
        moe_layers=self.meta["moe_layers"], config=self.meta["config"],
        options=self.meta["options"])
    trace.save(self.path)
    return trace


def writer(path: str, meta: dict, capacity: int, opts_cap: tuple[int, int]) -> TraceWriter:
  """A streaming writer for a replay of up to `capacity` positions."""
  m, p = opts_cap
  return TraceWriter(path, {**meta, "format": 1}, capacity, M=m, P=p)
