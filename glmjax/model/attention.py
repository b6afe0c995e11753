"""MLA attention with the DSA lightning indexer, over a paged latent KV cache.

Letters: B batch, S queries, T key slots, H heads, Q q_lora, C kv_lora, N qk_nope, R qk_rope,
V v_head, G indexer heads, I indexer head dim, K index_topk, PS positions per page.

Keys are read through a page table (glmjax.model.kvcache): a cache's pools, or, without a cache,
the fresh keys seen as a pool. Three ways to attend compute the same function:
- `sparse` (the default wherever a query can see more than K keys, on DSA layers): the indexer
  scores keys block by block and keeps a running top-K; each query gathers its K selected
  latents (C + R values per key) and attends over them in the absorbed form, in query blocks,
  so no array holds more than about `block × K × (C + R)` gathered values;
- `dense` over every key slot, with the selection as a mask (the reference, `impl="dense"`, and
  the path wherever a layer sees at most K key slots): expanded (kv_b rebuilds per-head keys
  and values) or absorbed (kv_b folded into the query and the output);
- `blocked`: dense attention with an online softmax over key blocks, stopping at the last
  visible key: layers without DSA (the MTP block) over a long cache.
Training runs the dense reference and asks it, through `Taps`, for what inference never
computes: the dense attention distribution that distils the indexer, and no selection at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from glmjax.errors import InputError
from glmjax.model import kvcache
from glmjax.model.config import Config, Runtime
from glmjax.model.kvcache import PagedLayer
from glmjax.model.layers import (F32, LATENT_NORM_EPS, as_f32, layer_norm, linear, per_head,
                                 per_head_kernel, rms_norm, rope_angles, rope_interleaved)
from glmjax.model.weights import Attention, Indexer

IMPLS = ("sparse", "dense")
# Query blocks of the sparse path gather at most this many key values (128 MB in float32).
GATHER_ELEMS = 1 << 25
# The indexer's logits of one key block `[B, Sq, G, Tb]` hold at most this many values.
INDEX_ELEMS = 1 << 24
MAX_INDEX_BLOCK = 16384  # key slots per indexer block at most
# Non-DSA layers attend densely in one piece up to this many key slots, then in key blocks
# with an online softmax (whose scores `[B, S, H, Tb]` hold at most BLOCKED_ELEMS values).
DENSE_MAX_SLOTS = 4096
BLOCKED_ELEMS = 1 << 25
FRESH_PAGE = 2048  # a cache-less forward's keys are seen as pages of this many positions


@dataclasses.dataclass(frozen=True)
class KvB:
  """kv_b `[H·(N+V), C]` in its two roles: key rows w_uk `[H, N, C]` and value rows w_uv
  `[H, V, C]`. A float kv_b (or a QArray off the CPU) is made float32 and split, as always. A
  QArray on the CPU platform is applied per head by the numba kernel in the absorbed form
  (`layers.per_head`), never dequantized whole (58 MB of float32 per layer and call at
  GLM-5); the expanded form still splits the float32 matrix."""
  w: Any
  heads: int
  n: int  # N, the per-head no-rope key width

  def split(self):
    """(w_uk `[H, N, C]`, w_uv `[H, V, C]`) in float32."""
    kv = as_f32(self.w)
    kv = kv.reshape(self.heads, -1, kv.shape[-1])
    return kv[:, :self.n], kv[:, self.n:]

  def absorb_query(self, q_nope):
    """`[B, S, H, N]` -> `[B, S, H, C]` (the query in latent space)."""
    if per_head_kernel(self.w):
      return per_head(q_nope, self.w, self.heads, self.n, keys=True)
    return jnp.einsum("bshn,hnc->bshc", q_nope, self.split()[0])

  def absorb_output(self, ctx):
    """`[B, S, H, C]` latent context -> `[B, S, H, V]` values."""
    if per_head_kernel(self.w):
      return per_head(ctx, self.w, self.heads, self.n, keys=False)
    return jnp.einsum("bshc,hvc->bshv", ctx, self.split()[1])


@dataclasses.dataclass(frozen=True)
class KeyView:
  """The keys one attention call sees, through a page table: pools `[P, PS, X]`, `pages`
  `[B, W]`; key slot t of row b is position t of that row (a cache), or fresh token t."""
  latent: Any
  k_rope: Any
  index_k: Any  # or None
  pages: Any

  @property
  def page_size(self) -> int:
    return next(p for p in (self.latent, self.index_k) if p is not None).shape[1]

  @property
  def slots(self) -> int:
    return self.pages.shape[1] * self.page_size

  def dense(self, name: str):
    """Every slot of pool `name`, in float32: `[B, T, X]`."""
    pool = getattr(self, name)
    return kvcache.read_pages(pool, self.pages, 0, self.pages.shape[1]).astype(F32)


def _pow2_floor(n: int) -> int:
  return 1 << max(0, int(n).bit_length() - 1)


# --- the indexer -------------------------------------------------------------------------------

def indexer_keys(ix: Indexer, x, cfg: Config, cos, sin):
  """Indexer keys `[B, S, I]` of the current tokens: LayerNorm(wk x), roped on the first R dims."""
  r = cfg.qk_rope_head_dim
  k = layer_norm(linear(x, ix.wk), ix.k_norm_w, ix.k_norm_b, LATENT_NORM_EPS)
  return jnp.concatenate([rope_interleaved(k[..., :r], cos, sin), k[..., r:]], axis=-1)


def indexer_queries(ix: Indexer, x, q_lat, cfg: Config, cos, sin):
  """The indexer's queries `[B, S, G, I]` (roped on the first R dims) and head weights
  `[B, S, G]` (including the 1/√G of the score)."""
  b, s, _ = x.shape
  g, i, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
  q = linear(q_lat, ix.wq_b).reshape(b, s, g, i)
  q = jnp.concatenate([rope_interleaved(q[..., :r], cos[:, :, None], sin[:, :, None]),
                       q[..., r:]], axis=-1)
  return q, linear(x, ix.weights_proj) * g ** -0.5


def index_scores(q, w, keys):
  """I[s, t] = Σ_g w[s, g] · relu(q[s, g]·k[t] / √I): `[B, S, T]` for keys `[B, T, I]`. The
  reference and the blocked indexer both score through this, so their scores agree bitwise."""
  logits = jnp.einsum("bsgi,bti->bsgt", q, keys) * q.shape[-1] ** -0.5
  return jnp.einsum("bsg,bsgt->bst", w, jax.nn.relu(logits))


def visible_scores(q, w, keys, visible):
  """`index_scores` of the `visible` `[B|1, S, T]` keys, -inf elsewhere: `[B, S, T]`."""
  return jnp.where(visible, index_scores(q, w, keys), -jnp.inf)


def top_visible(score, k: int):
  """The top `k` slots of `visible_scores` per query, ties toward the earliest slot
  (`lax.top_k` is stable): `[B, S, k]`, -1 where a query sees fewer than `k` keys."""
  vals, top = jax.lax.top_k(score, k)
  return jnp.where(vals > -jnp.inf, top, -1)


def select_dense(q, w, keys, visible, k: int):
  """The reference selection: the top `k` visible keys of every query by index score
  (`top_visible` of `visible_scores`)."""
  return top_visible(visible_scores(q, w, keys, visible), k)


def index_block_pages(view: KeyView, q_shape) -> int:
  """Pages per key block of `select_blocked` for queries `[B, Sq, G, I]`: logits of at most
  INDEX_ELEMS values and MAX_INDEX_BLOCK slots, at most the table."""
  b, sq, g = q_shape[:3]
  slots = min(MAX_INDEX_BLOCK, _pow2_floor(max(1, INDEX_ELEMS // (b * sq * g))))
  return max(1, min(view.pages.shape[1], slots // view.page_size))


def select_blocked(view: KeyView, q, w, q_slots, k: int, block_pages: int):
  """`select_dense` without ever holding a query's scores over every key: key blocks of
  `block_pages` pages are scored in turn and merged into a running top-`k`, stopping after
  the last block a query of this call can see.

  The merge keeps `select_dense`'s order: the running entries (sorted, ties by slot) come
  before the block's (ascending slots) in the array `top_k` reads, so a tie goes to the
  earlier slot exactly as in one top-k over all keys."""
  b, sq = q.shape[:2]
  block = block_pages * view.page_size
  n_blocks = jnp.minimum(jnp.max(q_slots) // block + 1, -(-view.pages.shape[1] // block_pages))

  def merge(j, carry):
    vals, top = carry
    keys = kvcache.read_pages(view.index_k, view.pages, j * block_pages, block_pages)
    slots = j * block + jnp.arange(block, dtype=jnp.int32)
    score = index_scores(q, w, keys.astype(F32))  # [B, Sq, Tb]
    score = jnp.where(slots[None, None, :] <= q_slots[:, :, None], score, -jnp.inf)
    vals, at = jax.lax.top_k(jnp.concatenate([vals, score], axis=-1), k)
    kept = jnp.take_along_axis(top, jnp.minimum(at, k - 1), axis=-1)
    return vals, jnp.where(at < k, kept, j * block + at - k)

  init = (jnp.full((b, sq, k), -jnp.inf, F32), jnp.full((b, sq, k), -1, jnp.int32))
  vals, top = jax.lax.fori_loop(0, n_blocks, merge, init)
  return jnp.where(vals > -jnp.inf, top, -1)


def selection_mask(selection, slots: int):
  """A selection `[B, S, K]` (-1: none) as a `[B, S, T]` mask, by a scatter of the kept slots
  (comparing every kept slot with every key instead builds `[B, S, K, T]`: 3.3× slower for
  1024 queries, 92 against 28 ms on 2 cores)."""
  b, s, _ = selection.shape
  rows = (jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None])
  at = jnp.where(selection >= 0, selection, slots)  # out of range: dropped
  return jnp.zeros((b, s, slots), bool).at[(*rows, at)].set(True, mode="drop")


# --- attending ---------------------------------------------------------------------------------

def _attend_selected(view: KeyView, q_abs, q_rope, selection, scale: float):
  """Absorbed attention of queries `[B, Sq, H, C|R]` over their selected slots `[B, Sq, K]`:
  the context `[B, Sq, H, C]`."""
  rows = kvcache.slot_rows(view.pages, jnp.maximum(selection, 0), view.page_size)
  lat = kvcache.gather(view.latent, rows).astype(F32)  # [B, Sq, K, C]
  rope = kvcache.gather(view.k_rope, rows).astype(F32)  # [B, Sq, K, R]
  score = (jnp.einsum("bshc,bskc->bshk", q_abs, lat)
           + jnp.einsum("bshr,bskr->bshk", q_rope, rope))
  ok = (selection >= 0)[:, :, None]  # [B, Sq, 1, K]
  p = jnp.where(ok, jax.nn.softmax(jnp.where(ok, score * scale, -jnp.inf), axis=-1), 0.0)
  return jnp.einsum("bshk,bskc->bshc", p, lat)


def _in_query_blocks(fn, block: int, *arrays):
  """`fn` over query blocks of `block` positions (axis 1 of every array, padded to whole
  blocks), results concatenated back: bounds the temporaries of one call by the block."""
  s = arrays[0].shape[1]
  n = -(-s // block)
  if n == 1:
    return fn(*arrays)

  def split(a):
    a = jnp.pad(a, [(0, 0), (0, n * block - s)] + [(0, 0)] * (a.ndim - 2))
    return jnp.moveaxis(a.reshape(a.shape[0], n, block, *a.shape[2:]), 1, 0)

  out = jax.lax.map(lambda xs: fn(*xs), tuple(split(a) for a in arrays))

  def join(o):
    o = jnp.moveaxis(o, 0, 1)
    return o.reshape(o.shape[0], n * block, *o.shape[3:])[:, :s]
  return jax.tree_util.tree_map(join, out)


def sparse_attend(view: KeyView, q_nope, q_rope, q_slots, kv_b: KvB, cfg: Config,
                  selection=None, index_q=None):
  """DSA attention over a view with more key slots than K: each query's top-K keys (from
  `index_q` = (queries, head weights) of this layer's indexer, or the given `selection`),
  gathered and attended in the absorbed form, query block by query block: the absorbed
  query `[Sq, H, C]` and context of a block exist only while it runs (at a 2048-token chunk
  of GLM-5 the whole chunk's would take 0.5 GB). Returns (`[B, S, H, V]`, selection)."""
  b, s, h, _ = q_nope.shape
  k, c = cfg.index_topk, cfg.kv_lora_rank
  q_slots = jnp.broadcast_to(q_slots, (b, s))
  block = int(max(1, min(s, _pow2_floor(GATHER_ELEMS // (b * k * (c + q_rope.shape[-1]))))))

  def one(q_nope, q_rope, q_slots, *rest):
    if selection is None:
      q, w = rest
      sel = select_blocked(view, q, w, q_slots, k, index_block_pages(view, q.shape))
    else:
      (sel,) = rest
    q_abs = kv_b.absorb_query(q_nope)  # [B, Sq, H, C]
    ctx = _attend_selected(view, q_abs, q_rope, sel, cfg.attn_scale)
    return kv_b.absorb_output(ctx), sel

  rest = index_q if selection is None else (selection,)
  return _in_query_blocks(one, block, q_nope, q_rope, q_slots, *rest)


def blocked_attend(view: KeyView, q_abs, q_rope, q_slots, scale: float):
  """Dense absorbed attention with an online softmax over key blocks, up to the last key
  slot a query here can see: `[B, S, H, C]` context, temporaries bounded by the block."""
  b, s, h, c = q_abs.shape
  q_slots = jnp.broadcast_to(q_slots, (b, s))
  ps = view.page_size
  block_pages = max(1, min(view.pages.shape[1],
                           _pow2_floor(max(1, BLOCKED_ELEMS // (b * s * h))) // ps))
  block = block_pages * ps
  n_blocks = jnp.minimum(jnp.max(q_slots) // block + 1, -(-view.pages.shape[1] // block_pages))

  def step(j, carry):
    m, l, acc = carry
    lat = kvcache.read_pages(view.latent, view.pages, j * block_pages, block_pages).astype(F32)
    rope = kvcache.read_pages(view.k_rope, view.pages, j * block_pages, block_pages).astype(F32)
    slots = j * block + jnp.arange(block, dtype=jnp.int32)
    score = jnp.einsum("bshc,btc->bsht", q_abs, lat) + jnp.einsum("bshr,btr->bsht", q_rope, rope)
    seen = (slots[None, None, :] <= q_slots[:, :, None])[:, :, None]  # [B, S, 1, Tb]
    score = jnp.where(seen, score * scale, -jnp.inf)
    m_new = jnp.maximum(m, score.max(-1))
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a query with nothing seen yet
    p = jnp.where(seen, jnp.exp(score - safe[..., None]), 0.0)
    corr = jnp.where(jnp.isfinite(m), jnp.exp(m - safe), 0.0)
    return (m_new, l * corr + p.sum(-1),
            acc * corr[..., None] + jnp.einsum("bsht,btc->bshc", p, lat))

  init = (jnp.full((b, s, h), -jnp.inf, F32), jnp.zeros((b, s, h), F32),
          jnp.zeros((b, s, h, c), F32))
  _, l, acc = jax.lax.fori_loop(0, n_blocks, step, init)
  return acc / jnp.maximum(l, 1e-30)[..., None]


def dense_scores(view: KeyView, q_nope, q_rope, kv_b: KvB, scale: float, absorbed: bool):
  """Scaled scores `[B, H, S, T]` of the queries against every key slot of the view, and the
  latent keys `[B, T, C]`: expanded (kv_b rebuilds per-head keys) or absorbed."""
  latent, k_rope = view.dense("latent"), view.dense("k_rope")  # [B, T, C], [B, T, R]
  rope_score = jnp.einsum("bshr,btr->bhst", q_rope, k_rope)
  if absorbed:
    q_abs = kv_b.absorb_query(q_nope)  # [B, S, H, C]
    score = jnp.einsum("bshc,btc->bhst", q_abs, latent) + rope_score
  else:
    k_nope = jnp.einsum("btc,hnc->bthn", latent, kv_b.split()[0])  # [B, T, H, N]
    score = jnp.einsum("bshn,bthn->bhst", q_nope, k_nope) + rope_score
  return score * scale, latent


def absorbing_pays(queries: int, slots: int, cfg: Config) -> bool:
  """Whether dense attention of `queries` over `slots` key slots costs fewer multiply-adds
  absorbed (kv_b folded into each query and output) than expanded (kv_b rebuilding every
  slot's keys and values). Absorbed wins when the queries are few against the slots: a
  4-token prefill chunk over a 512-slot page pool costs 38x fewer multiply-adds absorbed; a
  fresh prompt attending only to itself is cheaper expanded."""
  h, c, n, r, v = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                   cfg.qk_rope_head_dim, cfg.v_head_dim)
  absorbed = queries * h * c * (n + v) + queries * slots * h * (2 * c + r)
  expanded = slots * h * c * (n + v) + queries * slots * h * (n + r + v)
  return absorbed <= expanded


def dense_output(score, mask, latent, kv_b: KvB, absorbed: bool):
  """Attention of `dense_scores`' `score` over the key slots in `mask` `[B|1, S, T]`:
  `[B, S, H, V]`."""
  p = jax.nn.softmax(jnp.where(mask[:, None], score, -jnp.inf), axis=-1)  # [B, H, S, T]
  if absorbed:
    ctx = jnp.einsum("bhst,btc->bshc", p, latent)  # [B, S, H, C]
    return kv_b.absorb_output(ctx)
  vals = jnp.einsum("btc,hvc->bthv", latent, kv_b.split()[1])  # [B, T, H, V]
  return jnp.einsum("bhst,bthv->bshv", p, vals)


def head_mean_probs(score, visible):
  """The dense attention distribution over the `visible` `[B|1, S, T]` keys of `dense_scores`'
  `score`, averaged over heads, gradient stopped: `[B, S, T]` (the indexer's distillation
  target)."""
  score = jnp.where(visible[:, None], jax.lax.stop_gradient(score), -jnp.inf)
  return jnp.mean(jax.nn.softmax(score, axis=-1), axis=1)


# --- what training asks of attention -----------------------------------------------------------

@dataclasses.dataclass
class Taps:
  """What training asks of the attention layers beyond their output (None in inference, which
  computes none of it). Needs `impl="dense"`: the masked reference is the path that has
  every key's score.

  `select` False attends to every causal key (no DSA selection: the indexer's warm-up).
  `index` collects, per layer with an indexer in order, (the mean-over-heads dense attention
  probabilities over the causal keys, before any selection `[B, S, T]`, gradient stopped;
  the index scores `[B, S, T]`, -inf past the causal keys): what the indexer is distilled
  from. With taps the indexer's inputs carry no gradient, so it learns from that loss only.
  Inside a jit the collected values are traced: the caller returns them."""
  select: bool = True
  index: list = dataclasses.field(default_factory=list)


# --- one attention block -----------------------------------------------------------------------

def attention(w: Attention, x, start, cfg: Config, kv: PagedLayer | None = None,
              selection=None, absorbed: bool | None = None, runtime: Runtime = Runtime()):
  """One MLA attention block.

  Args:
    x: `[B, S, D]` input-normed hidden states.
    start: the first query's position, int32 `[]`, or `[B]` (one row per sequence, each at its
      own length: batched decoding).
    kv: this layer's pool and page table, written at `start` and attended over; None attends
      only to the S fresh tokens (a full teacher-forced forward).
    selection: the previous full indexer layer's selection `[B, S, K]` (slots, -1 none),
      reused by "shared" layers.
    absorbed: the absorbed (latent-space) form where attention is dense (the sparse and blocked
      paths are always absorbed); None picks the form with fewer multiply-adds at these shapes
      (`absorbing_pays`).
    runtime: its `impl`, "sparse" (DSA attends to the selected keys only) or "dense" (the
      masked reference), and training's `taps` (`Taps`; with `impl="dense"` only).

  Returns:
    (out `[B, S, D]`, new layer cache (None without `kv`), selection `[B, S, K]` or None where
    attention is dense).
  """
  impl, taps = runtime.impl, runtime.taps
  if taps is not None and impl != "dense":
    raise InputError(f"attention taps need impl='dense' (the masked reference), got {impl!r}")
  b, s, _ = x.shape
  h, n, r, c = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                cfg.kv_lora_rank)
  steps = jnp.arange(s, dtype=jnp.int32)
  positions = start[:, None] + steps if jnp.ndim(start) == 1 else start + steps  # [B, S] | [S]
  cos, sin = rope_angles(positions, r, cfg.rope_theta)  # [S, R/2] or [B, S, R/2]
  if positions.ndim == 1:
    cos, sin = cos[None], sin[None]  # [1, S, R/2]

  with jax.named_scope("q_proj"):
    q_lat = rms_norm(linear(x, w.q_a), w.q_a_norm, LATENT_NORM_EPS)  # [B, S, Q]
    q = linear(q_lat, w.q_b).reshape(b, s, h, n + r)
    q_nope = q[..., :n]  # [B, S, H, N]
    q_rope = rope_interleaved(q[..., n:], cos[:, :, None], sin[:, :, None])  # [B, S, H, R]
  # The indexer's inputs: under training's taps they carry no gradient (see `Taps`).
  ix_x, ix_q = (x, q_lat) if taps is None else jax.lax.stop_gradient((x, q_lat))

  with jax.named_scope("kv_proj"):
    kv_a = linear(x, w.kv_a)  # [B, S, C+R]
    latent = rms_norm(kv_a[..., :c], w.kv_a_norm, LATENT_NORM_EPS)  # [B, S, C]
    k_rope = rope_interleaved(kv_a[..., c:], cos, sin)  # [B, S, R]
    index_k = indexer_keys(w.indexer, ix_x, cfg, cos, sin) if w.indexer is not None else None

  cache = None
  if kv is None:  # the fresh tokens are the keys: slot t is token t
    page = min(FRESH_PAGE, s)
    pools = [kvcache.as_pool(a, page) if a is not None else (None, None)
             for a in (latent, k_rope, index_k)]
    view = KeyView(pools[0][0], pools[1][0], pools[2][0], pools[0][1])
    q_slots = jnp.arange(s, dtype=jnp.int32)[None]  # [1, S]
  else:
    pages, old = kv.pages, kv.cache
    new = kvcache.LayerCache(latent, k_rope, None if old.index_k is None else index_k)
    cache = kvcache.write(old, new, pages, start)
    # The writes land in the (donated) pools before anything reads them: without the barrier
    # XLA fuses each write into the reads that follow and copies every pool to keep the old
    # contents for them (three 269 MB copies of a 131k-position latent pool per decode step).
    cache = jax.lax.optimization_barrier(cache)
    view = KeyView(cache.latent, cache.k_rope, cache.index_k, pages)
    q_slots = positions if positions.ndim == 2 else positions[None]  # [B|1, S]

  kv_b = KvB(w.kv_b, h, n)
  dsa = w.indexer is not None or selection is not None
  sparse = dsa and impl == "sparse" and view.slots > cfg.index_topk
  with jax.named_scope("attend"):
    if sparse:
      index_q = None
      if w.indexer is not None:
        with jax.named_scope("indexer"):
          index_q = indexer_queries(w.indexer, x, q_lat, cfg, cos, sin)
        selection = None
      out, selection = sparse_attend(view, q_nope, q_rope, q_slots, kv_b, cfg, selection,
                                     index_q)
    elif not dsa and view.slots > DENSE_MAX_SLOTS:
      q_abs = kv_b.absorb_query(q_nope)  # [B, S, H, C]
      ctx = blocked_attend(view, q_abs, q_rope, q_slots, cfg.attn_scale)
      out = kv_b.absorb_output(ctx)
    else:
      slots = jnp.arange(view.slots, dtype=jnp.int32)
      visible = slots[None, None, :] <= q_slots[:, :, None]  # [B|1, S, T]
      select = (w.indexer is not None and view.slots > cfg.index_topk
                and (taps is None or taps.select))
      if w.indexer is not None and (select or taps is not None):
        with jax.named_scope("indexer"):
          q_idx, w_idx = indexer_queries(w.indexer, ix_x, ix_q, cfg, cos, sin)
          index_score = visible_scores(q_idx, w_idx, view.dense("index_k"), visible)
          if select:
            selection = top_visible(index_score, cfg.index_topk)
      if w.indexer is not None and not select:
        selection = None  # a query that sees no more than K keys keeps them all
      mask = visible if selection is None else visible & selection_mask(selection, view.slots)
      if absorbed is None:
        absorbed = absorbing_pays(s, view.slots, cfg)
      score, latent = dense_scores(view, q_nope, q_rope, kv_b, cfg.attn_scale, absorbed)
      if taps is not None and w.indexer is not None:
        taps.index.append((head_mean_probs(score, visible), index_score))
      out = dense_output(score, mask, latent, kv_b, absorbed)
  return linear(out.reshape(b, s, h * cfg.v_head_dim), w.o), cache, selection
