"""Trains the embedded default model: a small GLM-5 (glm_moe_dsa) on the Python stdlib's source.

  nice -n 15 python scripts/train_embedded.py --work_dir=/tmp/embedded_run \
      --out_dir=/tmp/embedded_run/model --seed=0 --phases=256:700,512:300,1024:64 \
      --time_limit_min=80      # then copy /tmp/embedded_run/model/* to glmjax/embedded_model/

(the command that produced the shipped model: 1064 steps × 4096 tokens, 59 min on 2 shared CPU
cores; the time limit did not trigger).

Pipeline: corpus split (glmjax.formats.corpus) → byte-level BPE tokenizer (glmjax.decoding.text) → token stream →
AdamW training of every architectural part → bf16 HF checkpoint (glmjax.formats.checkpoint.save_hf).

What the training forward does differently from inference (and why):
- MoE: routing is glmjax's own `moe.route` (sigmoid + correction bias + group limit), but the
  expert compute is a capacity-bucketed dispatch ([E, C, D] batched matmuls), ~14× faster than
  the ragged-dot path on CPU for fwd+bwd. Pairs past an expert's capacity are dropped (counted).
- Auxiliary-loss-free balancing: the correction bias is excluded from the optimizer; after each
  step, bias_e += γ · sign(mean_load − load_e) per MoE layer (MTP layer included).
- DSA indexer: its input is stop-gradiented, and it learns only from
  KL(mean-over-heads dense attention probs ‖ softmax(index scores)) over causal keys. The main
  attention is dense for the first `--dense_attn_steps` steps (the indexer warms up on the KL),
  then uses the indexer's top-k selection (as inference does) with the KL still applied.
- MTP: glmjax.model.mtp.mtp_logits with the training block; loss weight `--mtp_weight`.
Evaluation (`--eval_only` or after training) uses the real `glmjax.load` + `score_fn` path.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import sys
import time

from absl import app, flags

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glmjax.formats import corpus  # noqa: E402
from glmjax.model.attention import indexer_keys  # noqa: E402
from glmjax.model.config import Config  # noqa: E402
from glmjax.model.layers import F32, LATENT_NORM_EPS, linear, rms_norm, rope_angles, rope_interleaved, swiglu  # noqa: E402
from glmjax.model.moe import route  # noqa: E402
from glmjax.model.mtp import mtp_logits  # noqa: E402
from glmjax.model.weights import MoE, Weights, abstract, map_infos  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("work_dir", "/tmp/glmjax_embedded_run", "Checkpoints, tokenizer, logs.")
flags.DEFINE_string("out_dir", None, "Where to write the shipped HF model (default: none).")
flags.DEFINE_integer("seed", 0, "Seed for init and data order.")
flags.DEFINE_integer("vocab_size", 4096, "BPE vocabulary size.")
flags.DEFINE_string("size", "embedded", "Config preset: embedded | tiny.")
flags.DEFINE_string("phases", "256:700,512:300,1024:64",
                    "Context-length curriculum: comma-separated seq:steps phases, in order.")
flags.DEFINE_integer("batch_tokens", 4096, "Tokens per step (batch = batch_tokens // seq).")
flags.DEFINE_integer("dense_attn_steps", 150, "Steps of dense main attention (indexer warm-up).")
flags.DEFINE_float("lr", 2e-3, "Peak learning rate.")
flags.DEFINE_integer("warmup", 50, "Warm-up steps.")
flags.DEFINE_float("weight_decay", 0.05, "AdamW weight decay (matrices only).")
flags.DEFINE_float("mtp_weight", 0.3, "Weight of the MTP next-next-token loss.")
flags.DEFINE_float("index_weight", 1.0, "Weight of the indexer KL loss.")
flags.DEFINE_float("gamma", 0.01, "Aux-loss-free bias update speed.")
flags.DEFINE_float("capacity", 2.0, "Expert capacity factor in training.")
flags.DEFINE_integer("log_every", 10, "Steps between log lines.")
flags.DEFINE_integer("ckpt_every", 50, "Steps between checkpoints.")
flags.DEFINE_float("time_limit_min", 0, "Stop (and export) after this many minutes; 0 = none.")
flags.DEFINE_bool("eval_only", False, "Only evaluate --out_dir (or the embedded model).")
flags.DEFINE_integer("eval_stride", 512, "Stride of the bits/byte scoring windows.")


# --- configs ----------------------------------------------------------------------------------

def make_config(size: str = "embedded", vocab_size: int = 4096, eos_id: int = 6) -> Config:
  """The architecture of the shipped model (or a tiny one for tests)."""
  if size == "tiny":
    raw = dict(hidden_size=48, intermediate_size=96, moe_intermediate_size=16,
               num_hidden_layers=3, num_attention_heads=2, q_lora_rank=24, kv_lora_rank=16,
               qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8,
               num_experts_per_tok=2, n_group=2, topk_group=2, index_topk=8, index_head_dim=16,
               index_n_heads=4, indexer_types=["full", "shared", "full"],
               mlp_layer_types=["dense", "sparse", "sparse"], max_position_embeddings=256)
  else:
    raw = dict(hidden_size=192, intermediate_size=512, moe_intermediate_size=64,
               num_hidden_layers=6, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64,
               qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32,
               num_experts_per_tok=4, n_group=4, topk_group=2, index_topk=128,
               index_head_dim=32, index_n_heads=8,
               indexer_types=["full", "shared", "full", "shared", "full", "shared"],
               mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
               max_position_embeddings=1024)
  raw.update(model_type="glm_moe_dsa", vocab_size=vocab_size, n_shared_experts=1,
             norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             eos_token_id=eos_id, num_nextn_predict_layers=1, tie_word_embeddings=False)
  return Config.from_dict(raw, source=f"{size} training config")


def init_params(cfg: Config, seed: int, std: float = 0.02) -> Weights:
  """Fresh weights: N(0, std) matrices (output projections scaled by 1/√(2L)), unit norms,
  zero biases. Deterministic in `seed` (numpy PCG64)."""
  rng = np.random.default_rng(seed)
  out_scale = 1.0 / math.sqrt(2 * (cfg.num_hidden_layers + 1))

  def make(info):
    if info.init == "ones":
      x = np.ones(info.shape)
    elif info.init == "zeros":
      x = np.zeros(info.shape)
    else:
      s = std
      name = info.hf_names[-1]
      if name.endswith(("o_proj.weight", "down_proj.weight")):
        s *= out_scale
      x = s * rng.standard_normal(info.shape)
    return jnp.asarray(x, jnp.float32)

  return map_infos(make, abstract(cfg, jnp.float32, with_mtp=True))


# --- training forward -------------------------------------------------------------------------

def index_scores(ix, x, q_lat, index_k, cfg: Config, cos, sin):
  """DSA index scores `[B, S, T]` (the same formula as glmjax.model.attention.indexer_select)."""
  b, s, _ = x.shape
  g, i, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
  q = linear(q_lat, ix.wq_b).reshape(b, s, g, i)
  q = jnp.concatenate([rope_interleaved(q[..., :r], cos[:, :, None], sin[:, :, None]),
                       q[..., r:]], axis=-1)
  logits = jnp.einsum("bsgi,bti->bsgt", q, index_k) * i ** -0.5
  w = linear(x, ix.weights_proj) * g ** -0.5
  return jnp.einsum("bsg,bsgt->bst", w, jax.nn.relu(logits))


def attention_train(a, x, positions, cfg: Config, selection, sparse: bool):
  """MLA attention (expanded path) plus the indexer's distillation loss.

  Returns (out `[B, S, D]`, selection `[B, S, T]` bool or None, kl scalar or None).
  """
  b, s, _ = x.shape
  h, n, r, v, c = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                   cfg.v_head_dim, cfg.kv_lora_rank)
  cos, sin = rope_angles(positions, r, cfg.rope_theta)
  cos, sin = cos[None], sin[None]
  q_lat = rms_norm(linear(x, a.q_a), a.q_a_norm, LATENT_NORM_EPS)
  q = linear(q_lat, a.q_b).reshape(b, s, h, n + r)
  q_nope = q[..., :n]
  q_rope = rope_interleaved(q[..., n:], cos[:, :, None], sin[:, :, None])
  kv = linear(x, a.kv_a)
  latent = rms_norm(kv[..., :c], a.kv_a_norm, LATENT_NORM_EPS)
  k_rope = rope_interleaved(kv[..., c:], cos, sin)
  kv_b = a.kv_b.reshape(h, n + v, c)
  k_nope = jnp.einsum("btc,hnc->bthn", latent, kv_b[:, :n])
  vals = jnp.einsum("btc,hvc->bthv", latent, kv_b[:, n:])
  score = (jnp.einsum("bshn,bthn->bhst", q_nope, k_nope)
           + jnp.einsum("bshr,btr->bhst", q_rope, k_rope)) * cfg.attn_scale
  causal = positions[None, :] <= positions[:, None]  # [S, T]
  kl = None
  if a.indexer is not None:
    xs, qs = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_lat)
    ik = indexer_keys(a.indexer, xs, cfg, cos, sin)
    iscore = index_scores(a.indexer, xs, qs, ik, cfg, cos, sin)  # [B, S, T]
    iscore = jnp.where(causal, iscore, -jnp.inf)
    dense_p = jax.nn.softmax(jnp.where(causal, jax.lax.stop_gradient(score), -jnp.inf), axis=-1)
    target = jnp.mean(dense_p, axis=1)  # [B, S, T]
    logq = jax.nn.log_softmax(iscore, axis=-1)
    plogp = jnp.where(target > 0, target * jnp.log(jnp.maximum(target, 1e-30)), 0.0)
    kl = jnp.mean(jnp.sum(plogp - jnp.where(causal, target * logq, 0.0), axis=-1))
    selection = None
    if sparse and cfg.index_topk < s:
      kth = jax.lax.top_k(jax.lax.stop_gradient(iscore), cfg.index_topk)[0][..., -1:]
      selection = iscore >= kth  # ties at the threshold may keep a few extra keys
  mask = causal[None] if (selection is None or not sparse) else causal[None] & selection
  p = jax.nn.softmax(jnp.where(mask[:, None], score, -jnp.inf), axis=-1)
  out = jnp.einsum("bhst,bthv->bshv", p, vals)
  return linear(out.reshape(b, s, h * v), a.o), selection, kl


def moe_train(m: MoE, x, cfg: Config, capacity: float):
  """Routed experts (capacity-bucketed dispatch) + shared expert. Returns (out, load, dropped)."""
  shape = x.shape
  x = x.reshape(-1, shape[-1])
  t, d = x.shape
  e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
  ids, w = route(x, m.router, jax.lax.stop_gradient(m.bias), cfg)  # [T, K]
  cap = max(int(math.ceil(t * k / e * capacity)), 1)
  flat = ids.reshape(-1)  # [P], token-major
  onehot = jax.nn.one_hot(flat, e, dtype=jnp.int32)  # [P, E]
  pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # slot within expert
  keep = pos < cap
  slot = jnp.where(keep, flat * cap + pos, e * cap)  # overflow → a discarded row
  xs = jnp.repeat(x, k, axis=0)
  buf = jnp.zeros((e * cap + 1, d), x.dtype).at[slot].set(xs)[:-1].reshape(e, cap, d)
  hgu = jnp.einsum("ecd,efd->ecf", buf, m.experts.gate_up)
  g, u = jnp.split(hgu, 2, axis=-1)
  y = jnp.einsum("ecf,edf->ecd", jax.nn.silu(g) * u, m.experts.down).reshape(e * cap, d)
  y = jnp.concatenate([y, jnp.zeros((1, d), y.dtype)])[slot].reshape(t, k, d)
  out = jnp.einsum("tkd,tk->td", y, w)
  if m.shared is not None:
    out = out + swiglu(x, m.shared.gate_up, m.shared.down)
  load = jnp.sum(onehot, axis=0).astype(F32) / (t * k)  # fraction of pairs per expert
  dropped = 1.0 - jnp.mean(keep.astype(F32))
  return out.reshape(shape), load, dropped


def block_train(lw, x, positions, cfg: Config, selection, sparse: bool, capacity: float):
  """One decoder layer for training. Returns (x, selection, kl, load, dropped)."""
  hn = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)
  a, selection, kl = attention_train(lw.attn, hn, positions, cfg, selection, sparse)
  x = x + a
  hn = rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps)
  if isinstance(lw.mlp, MoE):
    y, load, dropped = moe_train(lw.mlp, hn, cfg, capacity)
  else:
    y, load, dropped = swiglu(hn, lw.mlp.gate_up, lw.mlp.down), None, None
  return x + y, selection, kl, load, dropped


def _xent(logits, targets):
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def loss_fn(w: Weights, tokens, cfg: Config, sparse: bool, capacity: float, mtp_weight: float,
            index_weight: float):
  """tokens `[B, S+2]` → (total loss, metrics). Main loss predicts t_{i+1}, MTP t_{i+2}."""
  s = tokens.shape[1] - 2
  inp, tgt = tokens[:, :s], tokens[:, 1:s + 1]
  positions = jnp.arange(s, dtype=jnp.int32)
  x = w.embed[inp]
  selection, kls, loads, drops = None, [], [], []
  for lw in w.layers:
    x, selection, kl, load, dropped = block_train(lw, x, positions, cfg, selection, sparse,
                                                  capacity)
    if kl is not None:
      kls.append(kl)
    if load is not None:
      loads.append(load)
      drops.append(dropped)
  head = w.embed if w.lm_head is None else w.lm_head
  ce = _xent(linear(rms_norm(x, w.norm, cfg.rms_norm_eps), head), tgt)

  mtp_aux = {}

  def block(lw, u, pos):
    y, _, _, load, dropped = block_train(lw, u, pos, cfg, None, False, capacity)
    mtp_aux["load"], mtp_aux["dropped"] = load, dropped
    return y

  mlog, _ = mtp_logits(w, x, tgt, cfg, positions, block=block)
  mtp_ce = _xent(mlog, tokens[:, 2:s + 2])
  loads.append(mtp_aux["load"])
  drops.append(mtp_aux["dropped"])
  kl = jnp.mean(jnp.stack(kls)) if kls else jnp.zeros(())
  total = ce + mtp_weight * mtp_ce + index_weight * kl
  metrics = dict(loss=total, ce=ce, mtp_ce=mtp_ce, index_kl=kl,
                 dropped=jnp.mean(jnp.stack(drops)))
  return total, (metrics, jnp.stack(loads))


def moe_blocks(w: Weights) -> list:
  """The MoE modules whose bias the balancer updates, in order (main layers, then MTP)."""
  return [lw.mlp for lw in w.layers if isinstance(lw.mlp, MoE)] + [
      m.layer.mlp for m in w.mtp]


def update_bias(w: Weights, loads, gamma: float) -> Weights:
  """Aux-loss-free balancing: bias_e += γ·sign(mean load − load_e) for each MoE layer."""
  w = jax.tree_util.tree_map(lambda x: x, w)  # fresh containers; the caller's tree is untouched
  for m, load in zip(moe_blocks(w), loads):
    m.bias = m.bias + gamma * jnp.sign(jnp.mean(load) - load)
  return w


def _labels(w: Weights):
  """'freeze' for the correction biases (never trained by gradient), 'train' elsewhere."""
  def label(path, _):
    return "freeze" if getattr(path[-1], "name", None) == "bias" else "train"
  return jax.tree_util.tree_map_with_path(label, w)


def make_optimizer(w: Weights, lr_schedule, weight_decay: float):
  def decay_mask(params):
    return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)

  train = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(lr_schedule, b1=0.9, b2=0.95, weight_decay=weight_decay,
                                  mask=decay_mask))
  return optax.multi_transform({"train": train, "freeze": optax.set_to_zero()}, _labels(w))


def make_step(cfg: Config, opt, sparse: bool, capacity: float, mtp_weight: float,
              index_weight: float, gamma: float):
  """The jitted training step (w, opt_state, tokens) → (w, opt_state, metrics)."""
  def step(w, opt_state, tokens):
    grads, (metrics, loads) = jax.grad(loss_fn, has_aux=True)(
        w, tokens, cfg, sparse, capacity, mtp_weight, index_weight)
    updates, opt_state = opt.update(grads, opt_state, w)
    w = optax.apply_updates(w, updates)
    w = update_bias(w, loads, gamma)
    metrics["load_cv"] = jnp.mean(jnp.std(loads, axis=-1) / jnp.mean(loads, axis=-1))
    metrics["load_max"] = jnp.max(loads) * cfg.n_routed_experts
    return w, opt_state, metrics
  return jax.jit(step, donate_argnums=(0, 1))


# --- data -------------------------------------------------------------------------------------

def build_tokenizer(work_dir: str, vocab_size: int, train_files):
  from glmjax.decoding.text import Tokenizer, train_bpe_tokenizer
  tok_dir = os.path.join(work_dir, "tokenizer")
  if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
    return Tokenizer.from_dir(tok_dir)
  texts = [t for t in (corpus.read(f) for f in train_files) if t]
  tmp = train_bpe_tokenizer(texts, vocab_size, tok_dir + ".tmp")
  eos = tmp.token_id("<|endoftext|>")
  gen = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "eos_token_id": eos,
         "pad_token_id": eos}
  tok = train_bpe_tokenizer(texts, vocab_size, tok_dir + ".tmp", generation_config=gen)
  os.rename(tok_dir + ".tmp", tok_dir)
  return tok


def token_stream(tok, files, eos: int) -> np.ndarray:
  """All files' tokens, each file preceded by the document separator `eos`."""
  texts = [t for t in (corpus.read(f) for f in files) if t]
  encs = tok._tok.encode_batch(texts)
  parts = []
  for e in encs:
    parts.append(np.asarray([eos] + e.ids, np.int32))
  return np.concatenate(parts)


def batch_at(stream: np.ndarray, seed: int, step: int, batch: int, length: int) -> np.ndarray:
  """The training batch of `step`: random crops (depends only on seed and step)."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(stream) - length, size=batch)
  return np.stack([stream[s:s + length] for s in starts])


# --- checkpoints ------------------------------------------------------------------------------

def save_state(path: str, step: int, w, opt_state, history):
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    pickle.dump({"step": step, "w": jax.device_get(w), "opt": jax.device_get(opt_state),
                 "history": history}, f)
  os.replace(tmp, path)


def load_state(path: str):
  with open(path, "rb") as f:
    return pickle.load(f)


def export(w: Weights, cfg: Config, tok_dir: str, out_dir: str):
  """Writes the shipped model: bf16 HF checkpoint + tokenizer files."""
  import shutil
  from glmjax.formats.checkpoint import save_hf
  os.makedirs(out_dir, exist_ok=True)
  for f in os.listdir(out_dir):
    os.remove(os.path.join(out_dir, f))
  save_hf(jax.device_get(w), cfg, out_dir, dtype=ml_dtypes.bfloat16)
  for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(os.path.join(tok_dir, f), os.path.join(out_dir, f))


# --- evaluation (the real inference path) ------------------------------------------------------

def evaluate(model_dir: str | None, stride: int = 512, quick: bool = False) -> dict:
  import glmjax
  from glmjax.model.forward import forward
  from glmjax.decoding.text import Tokenizer

  model = glmjax.load(model_dir, progress=False)
  cfg, w = model.config, model.weights
  tok = Tokenizer.from_dir(model.path)
  eos = tok.token_id("<|endoftext|>")
  ctx = cfg.max_position_embeddings

  @jax.jit
  def logp_fn(toks):
    return jax.nn.log_softmax(forward(w, toks, cfg)[0], axis=-1)

  @jax.jit
  def mtp_fn(toks):
    logits, h, _ = forward(w, toks[:, :-1], cfg)
    mlog, _ = mtp_logits(w, h, toks[:, 1:], cfg)
    return jnp.argmax(logits, -1), jnp.argmax(mlog, -1)

  held = corpus.HELD_OUT_SMALL if quick else corpus.split()[1]
  res = {}
  t0 = time.time()
  res["stdlib_heldout"] = corpus.bits_per_byte(
      lambda x: logp_fn(jnp.asarray(x)), [corpus.read(f) for f in held], tok.encode, eos, ctx,
      stride, batch=4)
  if not quick:
    for name, files in (("repo_glmjax", corpus.non_stdlib_files()),
                        ("numpy_sample", corpus.numpy_files())):
      texts = []
      for f in files:
        with open(f, encoding="utf-8") as fh:
          texts.append(fh.read())
      res[name] = corpus.bits_per_byte(lambda x: logp_fn(jnp.asarray(x)), texts, tok.encode, eos,
                                       ctx, stride, batch=4)
    # MTP greedy acceptance on held-out stdlib windows: at position i (true prefix t_0..t_{i+1}
    # known), the draft argmax MTP_i(t_{i+2}) is accepted iff it equals the main model's greedy
    # argmax at position i+1 (what greedy verification would emit). Also MTP top-1 accuracy.
    ids = np.concatenate([[eos] + tok.encode(corpus.read(f)) for f in held]).astype(np.int32)
    n = (len(ids) - 1) // (ctx + 1)
    acc = hit = cnt = 0
    for i in range(0, min(n, 24), 4):
      chunk = np.stack([ids[j * (ctx + 1):(j + 1) * (ctx + 1)] for j in range(i, min(i + 4, n))])
      main_arg, mtp_arg = map(np.asarray, mtp_fn(jnp.asarray(chunk)))
      # main_arg[:, j] predicts t_{j+1}; mtp_arg[:, j] predicts t_{j+2}
      acc += int(np.sum(mtp_arg[:, :-1] == main_arg[:, 1:]))
      hit += int(np.sum(mtp_arg[:, :-1] == chunk[:, 2:ctx + 1]))
      cnt += mtp_arg[:, :-1].size
    res["mtp"] = {"greedy_acceptance": acc / cnt, "top1_accuracy": hit / cnt, "positions": cnt}
  res["eval_s"] = time.time() - t0
  res["context"] = ctx
  res["stride"] = stride
  return res


# --- main -------------------------------------------------------------------------------------

def train(cfg_overrides=None):
  work = FLAGS.work_dir
  os.makedirs(work, exist_ok=True)
  train_files, held = corpus.split()
  t0 = time.time()
  tok = build_tokenizer(work, FLAGS.vocab_size, train_files)
  eos = tok.token_id("<|endoftext|>")
  stream_path = os.path.join(work, "stream.npy")
  if os.path.exists(stream_path):
    stream = np.load(stream_path)
  else:
    stream = token_stream(tok, train_files, eos)
    np.save(stream_path, stream)
  print(f"tokenizer+stream {time.time() - t0:.0f}s: {len(train_files)} train files, "
        f"{len(stream):,} tokens", flush=True)

  cfg = make_config(FLAGS.size, tok.vocab_size, eos)
  phases = [tuple(int(v) for v in p.split(":")) for p in FLAGS.phases.split(",")]
  steps = sum(n for _, n in phases)
  warmup = min(FLAGS.warmup, max(steps // 10, 1))
  sched = optax.warmup_cosine_decay_schedule(0.0, FLAGS.lr, warmup, steps, FLAGS.lr * 0.1)
  ckpt = os.path.join(work, "state.pkl")
  w = init_params(cfg, FLAGS.seed)
  opt = make_optimizer(w, sched, FLAGS.weight_decay)
  opt_state = opt.init(w)
  start, history = 0, []
  if os.path.exists(ckpt):
    st = load_state(ckpt)
    start, history = st["step"], st["history"]
    w = jax.tree_util.tree_map(jnp.asarray, st["w"])
    opt_state = jax.tree_util.tree_map(jnp.asarray, st["opt"])
    print(f"resumed at step {start}", flush=True)

  steps_fns = {}

  def phase(step):
    """(seq, batch, sparse attention) of global step `step`."""
    j = step
    for seq, n in phases:
      if j < n:
        break
      j -= n
    return seq, max(FLAGS.batch_tokens // seq, 1), step >= FLAGS.dense_attn_steps

  t_start = time.time()
  tokens_done = 0
  for i in range(start, steps):
    seq, batch, sparse = phase(i)
    key = (seq, sparse)
    if key not in steps_fns:
      steps_fns[key] = make_step(cfg, opt, sparse, FLAGS.capacity, FLAGS.mtp_weight,
                                 FLAGS.index_weight, FLAGS.gamma)
    toks = jnp.asarray(batch_at(stream, FLAGS.seed, i, batch, seq + 2))
    w, opt_state, m = steps_fns[key](w, opt_state, toks)
    tokens_done += batch * seq
    if (i + 1) % FLAGS.log_every == 0 or i == start:
      m = {k: float(v) for k, v in m.items()}
      el = time.time() - t_start
      m.update(step=i + 1, seq=seq, sparse=sparse, lr=float(sched(i)), elapsed_s=el,
               tok_s=tokens_done / max(el, 1e-9))
      history.append(m)
      print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in m.items()), flush=True)
    stop = FLAGS.time_limit_min and time.time() - t_start > FLAGS.time_limit_min * 60
    if (i + 1) % FLAGS.ckpt_every == 0 or i + 1 == steps or stop:
      save_state(ckpt, i + 1, w, opt_state, history)
    if stop:
      print(f"time limit reached at step {i + 1}", flush=True)
      break
  with open(os.path.join(work, "history.json"), "w") as f:
    json.dump(history, f, indent=1)
  if FLAGS.out_dir:
    export(w, cfg, os.path.join(work, "tokenizer"), FLAGS.out_dir)
    print(f"exported to {FLAGS.out_dir}", flush=True)
  return w, cfg


def main(argv):
  del argv
  print("command: " + " ".join(sys.argv), flush=True)
  if not FLAGS.eval_only:
    train()
  if FLAGS.out_dir or FLAGS.eval_only:
    res = evaluate(FLAGS.out_dir, FLAGS.eval_stride)
    print(json.dumps(res, indent=1), flush=True)
    with open(os.path.join(FLAGS.work_dir, "eval.json"), "w") as f:
      json.dump(res, f, indent=1)


if __name__ == "__main__":
  app.run(main)
