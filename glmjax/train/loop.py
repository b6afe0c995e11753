"""One training run: data, the curriculum of jitted steps, logs, checkpoints, the export."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from glmjax.formats import corpus
from glmjax.train import data, presets, state
from glmjax.train.optim import make_optimizer, make_step


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """A training run's settings (scripts/train_embedded.py's flags, which document them)."""
  work_dir: str
  out_dir: str | None
  seed: int
  vocab_size: int
  size: str
  phases: str
  batch_tokens: int
  dense_attn_steps: int
  lr: float
  warmup: int
  weight_decay: float
  mtp_weight: float
  index_weight: float
  gamma: float
  capacity: float
  log_every: int
  ckpt_every: int
  time_limit_min: float
  train_files: int  # 0: every training file


def prepare_data(opts: RunOptions):
  """(tokenizer, token stream) of the training split, cached in `work_dir`."""
  train_files = corpus.split()[0]
  if opts.train_files:
    train_files = train_files[:opts.train_files]
  t0 = time.time()
  tok = data.build_tokenizer(opts.work_dir, opts.vocab_size, train_files)
  stream_path = os.path.join(opts.work_dir, "stream.npy")
  if os.path.exists(stream_path):
    stream = np.load(stream_path)
  else:
    stream = data.token_stream(tok, train_files, tok.token_id(data.EOS_TOKEN))
    np.save(stream_path, stream)
  print(f"tokenizer+stream {time.time() - t0:.0f}s: {len(train_files)} train files, "
        f"{len(stream):,} tokens", flush=True)
  return tok, stream


def _log_line(m: dict) -> str:
  return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


def train(opts: RunOptions):
  """Trains from scratch, or resumes from `work_dir`/state.pkl; exports to `out_dir` if set.

  Steps follow the context-length curriculum `phases`; the first `dense_attn_steps` attend to
  every causal key (the indexer warms up on its KL), the rest through the indexer's selection
  as inference does. Returns (weights, config)."""
  os.makedirs(opts.work_dir, exist_ok=True)
  tok, stream = prepare_data(opts)
  cfg = presets.make_config(opts.size, tok.vocab_size, tok.token_id(data.EOS_TOKEN))
  phases = data.parse_phases(opts.phases)
  steps = sum(n for _, n in phases)
  warmup = min(opts.warmup, max(steps // 10, 1))
  sched = optax.warmup_cosine_decay_schedule(0.0, opts.lr, warmup, steps, opts.lr * 0.1)
  ckpt = os.path.join(opts.work_dir, "state.pkl")
  w = presets.init_params(cfg, opts.seed)
  opt = make_optimizer(w, sched, opts.weight_decay)
  opt_state = opt.init(w)
  start, history = 0, []
  if os.path.exists(ckpt):
    st = state.load_state(ckpt)
    start, history = st["step"], st["history"]
    w = jax.tree_util.tree_map(jnp.asarray, st["w"])
    opt_state = jax.tree_util.tree_map(jnp.asarray, st["opt"])
    print(f"resumed at step {start}", flush=True)

  step_fns = {}  # one jitted step per (sequence length, selection on)
  t_start = time.time()
  tokens_done = 0
  for i in range(start, steps):
    seq, batch = data.phase_at(phases, i, opts.batch_tokens)
    select = i >= opts.dense_attn_steps
    if (seq, select) not in step_fns:
      step_fns[seq, select] = make_step(cfg, opt, select, opts.capacity, opts.mtp_weight,
                                        opts.index_weight, opts.gamma)
    toks = jnp.asarray(data.batch_at(stream, opts.seed, i, batch, seq + 2))
    w, opt_state, m = step_fns[seq, select](w, opt_state, toks)
    tokens_done += batch * seq
    if (i + 1) % opts.log_every == 0 or i == start:
      m = {k: float(v) for k, v in m.items()}
      el = time.time() - t_start
      m.update(step=i + 1, seq=seq, sparse=select, lr=float(sched(i)), elapsed_s=el,
               tok_s=tokens_done / max(el, 1e-9))
      history.append(m)
      print(_log_line(m), flush=True)
    stop = opts.time_limit_min and time.time() - t_start > opts.time_limit_min * 60
    if (i + 1) % opts.ckpt_every == 0 or i + 1 == steps or stop:
      state.save_state(ckpt, i + 1, w, opt_state, history)
    if stop:
      print(f"time limit reached at step {i + 1}", flush=True)
      break
  with open(os.path.join(opts.work_dir, "history.json"), "w") as f:
    json.dump(history, f, indent=1)
  if opts.out_dir:
    state.export(w, cfg, os.path.join(opts.work_dir, "tokenizer"), opts.out_dir)
    print(f"exported to {opts.out_dir}", flush=True)
  return w, cfg
