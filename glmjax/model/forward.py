"""The GLM-5 forward pass as pure functions over a `Weights` pytree and a `KVCache`.

Letters: B batch, S sequence (queries), T cache capacity, D hidden, V vocabulary.

The forward pass is written once (`forward`, and `mtp_forward` for the MTP block), from three
pure pieces per layer: attention + route, routed experts through an expert provider, and
combine + shared expert + residual. Resident models run each layer as two jitted halves
(`layer_step`: attention, then MLP; the entry points at the bottom), inlined into one program
for a shallow model; the offload engine drives the same pieces jitted one by one (`JITTED`)
with its tiered provider and host work between them. Decoder layers are a Python loop, so each
layer keeps its own structure (dense or MoE, full or shared indexer).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from glmjax.model.attention import attention
from glmjax.model.config import Config, Runtime
from glmjax.model.kvcache import KVCache, LayerCache, PagedLayer, init_cache  # noqa: F401
from glmjax.model.layers import F32, embed_rows, linear, rms_norm, swiglu
from glmjax.model.moe import (combine, expert_outputs, pool_terms, route, route_cache_aware,
                              route_capped)
from glmjax.model.mtp import mtp_input, mtp_output_logits
from glmjax.model.quant import ExpertPool
from glmjax.model.records import RecordOptions, next_moe, recording, stack_records
from glmjax.model.weights import MoE, Weights


def bucket(n: int, minimum: int = 1) -> int:
  """Next power of two ≥ max(n, minimum): pads lengths so few shapes get compiled."""
  return max(minimum, 1 << max(0, (n - 1).bit_length()))


@functools.partial(jax.tree_util.register_dataclass, data_fields=("resident", "n_valid"),
                   meta_fields=("keep", "rank", "cap"))
@dataclasses.dataclass(frozen=True)
class Routing:
  """How a MoE layer picks its experts when not each token's exact top-k (both opt-in, lossy):

  * cache-aware (`keep`, `rank` set): each token keeps its true top-`keep` experts and fills
    the other slots with `resident` (`[E]` bool) experts among its top-`rank` by biased score;
  * capped (`cap` set): the step's tokens, its first `n_valid` rows real, are routed within
    its `cap` most chosen experts (a verify pass's expert budget).

  The ints are static (part of a jitted step's signature); the arrays are traced."""
  resident: Any = None
  n_valid: Any = None
  keep: int | None = None
  rank: int | None = None
  cap: int | None = None

  def for_rows(self, n_valid) -> "Routing":
    """This routing for a chunk whose first `n_valid` rows are real."""
    return dataclasses.replace(self, n_valid=n_valid) if self.cap is not None else self


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerHead:
  """A layer up to its experts (`attn_route`): the post-attention residual `x` `[B, S, D]`
  (a dense layer's whole output), the layer's `cache` and DSA `selection`; at MoE layers the
  normed rows `flat` `[T, D]` routed to `ids` `[T, K]` with `weights` `[T, K]`, and under a
  lossy `Routing` its per-token `route_stats` ([swaps, overlap, kl] sums)."""
  x: Any
  cache: Any
  selection: Any
  flat: Any = None
  ids: Any = None
  weights: Any = None
  route_stats: Any = None


def attend(lw, chunk: "Chunk", cfg: Config, kv: PagedLayer | None = None,
           absorbed: bool | None = None, runtime: Runtime = Runtime()):
  """A layer's attention half for the `chunk`'s `x` `[B, S, D]` at positions start..start+S-1
  (its `selection` the last full indexer layer's): norm, attention, residual. Returns (x, the
  layer's cache, the selection). `kv` is this layer's pool and page table (`kvcache`)."""
  with jax.named_scope("attention"):
    h = rms_norm(chunk.x, lw.attn_norm, cfg.rms_norm_eps)
    a, cache, selection = attention(lw.attn, h, chunk.start, cfg, kv, chunk.selection,
                                    absorbed, runtime)
    return chunk.x + a, cache, selection


def mlp_head(lw, x, cfg: Config, routing: Routing | None = None) -> LayerHead:
  """A layer's MLP half up to its experts for the post-attention residual `x`: the MLP norm;
  MoE layers route (`routing`: exact top-k when None), dense layers finish their MLP."""
  hm = rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps)
  if not isinstance(lw.mlp, MoE):
    with jax.named_scope("mlp"):
      return LayerHead(x + swiglu(hm, lw.mlp.gate_up, lw.mlp.down), None, None)
  flat = hm.reshape(-1, hm.shape[-1])  # [T, D]
  m, stats = lw.mlp, None
  with jax.named_scope("route"):
    if routing is not None and routing.cap is not None:
      valid = valid_rows(x.shape, routing.n_valid, jnp)
      ids, w, stats = route_capped(flat, m.router, m.bias, cfg, valid, routing.cap)
    elif routing is not None and routing.keep is not None:
      ids, w, stats = route_cache_aware(flat, m.router, m.bias, cfg, routing.resident,
                                        routing.keep, routing.rank)
    else:
      ids, w = route(flat, m.router, m.bias, cfg)
  return LayerHead(x, None, None, flat, ids, w, stats)


def attn_route(lw, chunk: "Chunk", cfg: Config, kv: PagedLayer | None = None,
               absorbed: bool | None = None, routing: Routing | None = None,
               runtime: Runtime = Runtime()) -> LayerHead:
  """A layer up to its experts: `attend`, then `mlp_head`."""
  x, cache, selection = attend(lw, chunk, cfg, kv, absorbed, runtime)
  return dataclasses.replace(mlp_head(lw, x, cfg, routing), cache=cache, selection=selection)


def moe_finish(m: MoE, x, flat, ys, w):
  """Rank-ordered combine of the expert terms `ys` `[T, K, D]`, the shared expert, residual."""
  with jax.named_scope("combine"):
    out = combine(ys, w)
  if m.shared is not None:
    with jax.named_scope("shared_expert"):
      out = out + swiglu(flat, m.shared.gate_up, m.shared.down)
  return x + out.reshape(x.shape)


def embed(w: Weights, tokens):
  return embed_rows(w.embed, tokens)


def logits_of(w: Weights, x, cfg: Config):
  """Final norm and lm_head (tied to the embedding when the checkpoint says so)."""
  head = w.embed if w.lm_head is None else w.lm_head
  return linear(rms_norm(x, w.norm, cfg.rms_norm_eps), head)


@dataclasses.dataclass(frozen=True)
class Steps:
  """The pieces the forward pass is made of: plain functions inside one jit (`PURE`), or each
  jitted on its own (`JITTED`) for the offload engine, which does host work between them."""
  embed: Callable
  attn_route: Callable
  finish: Callable
  logits: Callable
  mtp_input: Callable
  mtp_logits: Callable


def _attn_route_step(lw, x, start, cfg, cache=None, pages=None, selection=None, absorbed=None,
                     routing=None, runtime=Runtime()):
  """`attn_route` in the steps' calling form (the pool and page table apart): `PURE`'s, inside
  the caller's jit; the engine runs it as two jits (`_attn_route_halves`)."""
  kv = None if cache is None else PagedLayer(cache, pages)
  return attn_route(lw, Chunk(x, start, selection=selection), cfg, kv, absorbed, routing, runtime)


def _attn_route_halves(lw, x, start, cfg, cache=None, pages=None, selection=None,
                       absorbed=None, routing=None, runtime=Runtime()):
  """`_attn_route_step` in two jits: `attention_step`, which dense and full MoE layers share
  (DESIGN.md §4), then the MLP head's."""
  selection = None if lw.attn.indexer is not None else selection  # as in `layer_step`
  chunk = Chunk(x, start, selection=selection, pages=pages)
  x, selection, cache = attention_step(attention_half(lw), chunk, cache, cfg=cfg,
                                       absorbed=absorbed, runtime=runtime)
  head = _mlp_head_step(mlp_half(lw), x, cfg=cfg, routing=routing)
  return dataclasses.replace(head, cache=cache, selection=selection)


_mlp_head_step = jax.jit(mlp_head, static_argnames=("cfg",))
PURE = Steps(embed, _attn_route_step, moe_finish, logits_of, mtp_input, mtp_output_logits)
JITTED = Steps(
    jax.jit(embed), _attn_route_halves, jax.jit(moe_finish),
    jax.jit(logits_of, static_argnames=("cfg",)),
    jax.jit(mtp_input, static_argnames=("cfg",)),
    jax.jit(mtp_output_logits, static_argnames=("cfg",)))


@dataclasses.dataclass
class Routed:
  """One chunk's routing at a MoE layer: what an expert provider is given.

  `x` is the post-attention residual `[B, S, D]` (the engine predicts the next layer's experts
  from it); `flat` `[T = B·S, D]` the normed hidden states routed to `ids` `[T, K]`; positions
  at or past `n_valid` in each sequence are padding, which never selects experts
  (`valid_rows`); `route_stats` is cache-aware routing's per-token [swaps, overlap, kl] (None
  when routing is exact)."""
  x: Any
  flat: Any
  ids: Any
  n_valid: Any = None
  route_stats: Any = None


class ExpertProvider(Protocol):
  """Supplies a MoE layer's routed-expert terms: where the experts live is its business."""

  def __call__(self, layer: int, m: MoE, chunks: list[Routed]) -> Iterator:
    """Unweighted terms `[T, K, D]` of each chunk, in order.

    A step is one chunk; a layer-major prefill gives every chunk of the prompt at once (so a
    provider can read each expert once for all of them) and combines a chunk's terms before
    asking for the next one's, so one chunk's terms are held at a time."""


def resident_experts(runtime: Runtime = Runtime()) -> ExpertProvider:
  """The provider for weights held in the pytree: float `Experts` (HF checkpoints) or a layer's
  quantized `ExpertPool` in slot = expert id order (a store that fits), computed inside the
  caller's jit by the runtime's `kernel` ("cpu" numba, "xla", "pallas"; "auto" by platform).
  On a `mesh` with an `expert` axis the experts are sharded along it (`sharded_terms`)."""
  kernel, mesh = runtime.kernel, runtime.mesh

  def provide(layer, m, chunks):
    for r in chunks:
      active = valid_rows(r.x.shape, r.n_valid, jnp)[:, None]
      if mesh is not None and "expert" in mesh.axis_names and mesh.shape["expert"] > 1:
        yield sharded_terms(r.flat, r.ids, active, m.experts, mesh, kernel)
      else:
        yield _terms(r.flat, r.ids, active, m.experts, kernel)
  return provide


def _terms(flat, ids, active, experts, kernel):
  """Unweighted terms `[T, K, D]` of experts held here (float, or a quantized pool)."""
  if isinstance(experts, ExpertPool):
    return pool_terms(flat, experts, ids, active, kernel)
  return expert_outputs(flat, ids, experts)


def sharded_terms(flat, ids, active, experts, mesh, kernel: str = "auto"):
  """`_terms` with the experts' leading axis `[E, ...]` split over the mesh's `expert` axis.

  Each device sees every token (`flat` `[T, D]` and `ids` `[T, K]` are replicated), computes
  the pairs routed to its E/n local experts (the others are sent to local expert 0 and zeroed),
  and one psum over `expert` sums the partial `[T, K, D]`. Every pair has exactly one owner, so
  the sum adds a term to exact zeros: the term is unchanged, and the combine afterwards keeps
  its fixed rank order. Any `tensor`/`data` axes see replicated experts and inputs here.
  """
  n_experts = jax.tree_util.tree_leaves(experts)[0].shape[0]
  local_n = n_experts // mesh.shape["expert"]

  def local(experts, flat, ids, active):
    with jax.named_scope("local_experts"):
      lo = jax.lax.axis_index("expert") * local_n
      mine = (ids >= lo) & (ids < lo + local_n)  # [T, K]
      ys = _terms(flat, jnp.where(mine, ids - lo, 0), active & mine, experts, kernel)
      ys = jnp.where(mine[..., None], ys, 0.0)
    with jax.named_scope("psum_experts"):
      return jax.lax.psum(ys, "expert")

  e_spec = jax.tree_util.tree_map(lambda _: P("expert"), experts)
  return jax.shard_map(local, mesh=mesh, in_specs=(e_spec, P(), P(), P()),
                       out_specs=P())(experts, flat, ids, active)


def moe_block(m: MoE, x, cfg: Config, kernel: str = "auto"):
  """The routed + shared experts of one MoE layer for `x` `[..., D]` (no residual): route,
  the resident provider, combine; the same pieces as `forward`."""
  flat = x.reshape(-1, x.shape[-1]).astype(F32)  # [T, D]
  ids, w = route(flat, m.router, m.bias, cfg)
  (ys,) = resident_experts(Runtime(kernel))(0, m, [Routed(flat[None], flat, ids)])
  return moe_finish(m, jnp.zeros(x.shape, F32), flat, ys, w)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Chunk:
  """A piece of the token sequence going through the layers: its hidden states `[B, S, D]`,
  first position (int32 `[]`, or `[B]` per row), real positions (`n_valid`, None: all), the
  selection the last full indexer layer made for it and, for the jitted steps, the page table
  `[B, W]` its rows' keys live in (None without a cache)."""
  x: Any
  start: Any
  n_valid: Any = None
  selection: Any = None
  pages: Any = None


@dataclasses.dataclass(frozen=True)
class Drive:
  """How a pass goes through the layers (what it computes is the weights' and the config's):

  `experts` supplies the routed-expert terms (None: the resident provider for `runtime`);
  `steps` are the pieces, `PURE` inside the caller's jit or `JITTED` one by one (the offload
  engine); `routing(layer)` gives a MoE layer's lossy `Routing` (None: exact top-k); `runtime`
  is the static `Runtime` (its kernel and mesh serve the resident provider)."""
  experts: ExpertProvider | None = None
  steps: Steps = PURE
  routing: Callable | None = None
  runtime: Runtime = Runtime()

  @property
  def provider(self) -> ExpertProvider:
    return self.experts or resident_experts(self.runtime)


def _layer(i: int, lw, chunks: list[Chunk], cfg: Config, cache: PagedLayer | None, absorbed,
           drive: Drive, experts: ExpertProvider):
  """One decoder layer through `drive.steps` for every chunk in order, its routed experts from
  `experts` (given all the chunks' routing at once). Returns the layer's cache."""
  how = drive.routing(i) if drive.routing is not None else None  # this layer's Routing, or None
  lc, pages = (None, None) if cache is None else (cache.cache, cache.pages)
  heads = []
  for c in chunks:
    head = drive.steps.attn_route(
        lw, c.x, c.start, cfg=cfg, cache=lc, pages=pages, selection=c.selection,
        absorbed=absorbed, routing=None if how is None else how.for_rows(c.n_valid),
        runtime=drive.runtime)
    c.x, lc, c.selection = head.x, head.cache, head.selection
    heads.append(head)
  if heads[0].ids is not None:
    _experts_finish(i, lw.mlp, chunks, heads, experts, drive.steps.finish)
  return lc


def _experts_finish(i: int, m: MoE, chunks: list[Chunk], heads: list[LayerHead],
                    experts: ExpertProvider, finish: Callable):
  """MoE layer `i`'s routed experts for every chunk's `head` (`experts` given them at once),
  then each chunk's combine, shared expert and residual (`finish`), in order."""
  routed = [Routed(h.x, h.flat, h.ids, c.n_valid, h.route_stats) for c, h in zip(chunks, heads)]
  with jax.named_scope("experts"):
    # Run the provider to its end (a zip would stop before the work after its last chunk).
    for j, ys in enumerate(experts(i, m, routed)):
      chunks[j].x = finish(m, heads[j].x, routed[j].flat, ys, heads[j].weights)


def valid_rows(shape, n_valid, xp=np):
  """`[B·S]` bool for a `[B, S, ...]` batch: position < n_valid (all true without padding).
  `n_valid` is one count for every row, or `[B]` counts (a batch's empty rows count 0)."""
  b, s = shape[:2]
  if n_valid is None:
    return xp.ones((b * s,), bool)
  if xp.ndim(n_valid) == 1:
    return (xp.arange(s)[None, :] < xp.asarray(n_valid)[:, None]).reshape(-1)
  return xp.broadcast_to(xp.arange(s) < n_valid, (b, s)).reshape(-1)


def layers(w: Weights, chunks: list[Chunk], cfg: Config, cache: KVCache | None = None,
           absorbed=None, drive: Drive = Drive()):
  """The decoder layers over `chunks` (updated in place to the final pre-norm hidden states),
  layer-major: every chunk through layer L, then layer L + 1. Returns the new cache's layers."""
  experts = drive.provider
  return [_layer(i, lw, chunks, cfg, None if cache is None else cache.layer(i), absorbed, drive,
                 experts) for i, lw in enumerate(w.layers)]


def hidden_states(w: Weights, tokens, cfg: Config, cache: KVCache | None = None, absorbed=None,
                  n_valid=None, start=0, drive: Drive = Drive()):
  """The final pre-norm hidden states `[B, S, D]` of `tokens` `[B, S]` and the new cache:
  `forward` without its head."""
  start = start if cache is None else cache.length
  chunk = Chunk(drive.steps.embed(w, tokens), start, n_valid)  # [B, S, D]
  new_layers = layers(w, [chunk], cfg, cache, absorbed, drive)
  return chunk.x, None if cache is None else KVCache(new_layers, cache.pages, cache.length)


def forward(w: Weights, tokens, cfg: Config, cache: KVCache | None = None, absorbed=None,
            n_valid=None, start=0, drive: Drive = Drive()):
  """Logits `[B, S, V]` for `tokens` `[B, S]` placed after the cache's `length` positions.

  The one forward pass: in a caller's jit with `PURE` steps (training, the tests' reference),
  or step by step by the offload engine (`JITTED` steps, its tiered experts: `Drive`). Also
  returns the final pre-norm hidden states (the MTP head's input) and the new cache. Positions
  at or past `n_valid` are padding: they select no expert. Without a cache the tokens sit at
  `start`..; inside a jit pass a traced int32 zero (`fresh_start()`): a constant start lets XLA
  specialise the softmax on the causal mask, off the engine's bits. Training differentiates
  this pass (glmjax.train): `impl="dense"`, its own provider and `taps` in the `Runtime`.
  """
  x, new_cache = hidden_states(w, tokens, cfg, cache, absorbed, n_valid, start, drive)
  return drive.steps.logits(w, x, cfg=cfg), x, new_cache


def mtp_forward(w: Weights, h, next_tokens, cfg: Config, cache: KVCache | None = None,
                absorbed: bool | None = None, drive: Drive = Drive(), depth: int = 0):
  """The MTP block at positions cache.length.. (0.. without a cache) over the main model's
  hidden states h `[B, S, D]` and the tokens after them `[B, S]`: the one MTP step, for
  training (no cache), drafting (`cache` holds the MTP layer's pool, addressed by the main
  page table) and the engine. Returns (logits `[B, S, V]` predicting t_{i+2}, the block's
  output `[B, S, D]`, the MTP cache). Its experts are layer `num_hidden_layers + depth`."""
  m = w.mtp[depth]
  u = drive.steps.mtp_input(w, m, h, next_tokens, cfg=cfg)
  chunk = Chunk(u, 0 if cache is None else cache.length)
  lc = _layer(cfg.num_hidden_layers + depth, m.layer, [chunk], cfg,
              None if cache is None else cache.layer(0), absorbed, drive, drive.provider)
  new = None if cache is None else KVCache([lc], cache.pages, cache.length)
  return drive.steps.mtp_logits(w, m, chunk.x, cfg=cfg), chunk.x, new


# --- entry points of resident models -------------------------------------------------------

# A resident pass runs each decoder layer as two jitted halves (`layer_step`), each shared by
# the layers whose half has its structure and shapes, so compile time does not grow with depth
# (a shallow model: one program, `entry_points`). `cfg` and `runtime` are static: they select
# different code, not shapes. A jit compiles once per mix of committed and uncommitted
# arguments: the executor commits every input (`Executor.put`).

def fresh_start():
  """A cache-less forward's start position as a run-time int32 zero (see `forward`)."""
  return jnp.zeros((), jnp.int32)


def through_layers(w: Weights, chunk: Chunk, cache: KVCache | None, step: Callable):
  """`chunk` through `w`'s decoder layers, one `step(i, lw, chunk, pool)` → (chunk, new pool,
  record or None) at a time, each a jitted call that layers of one structure and shape share:
  (the chunk, the new cache or None, the records)."""
  pools, records = [], []
  for i, lw in enumerate(w.layers):
    chunk, pool, rec = step(i, lw, chunk, None if cache is None else cache.layers[i])
    pools.append(pool)
    if rec is not None:
      records.append(rec)
  return chunk, None if cache is None else KVCache(pools, cache.pages, cache.length), records


def attention_half(lw):
  """Layer `lw`'s attention half (its MLP's weights None): what `attention_step` takes."""
  return dataclasses.replace(lw, mlp_norm=None, mlp=None)


def mlp_half(lw):
  """Layer `lw`'s MLP half (its attention's weights None): what `mlp_step` takes."""
  return dataclasses.replace(lw, attn_norm=None, attn=None)


@functools.partial(jax.jit, static_argnames=("cfg", "absorbed", "runtime"),
                   donate_argnames=("pool",))
def attention_step(lw, chunk: Chunk, pool, cfg: Config, absorbed=None,
                   runtime: Runtime = Runtime()):
  """`attend` for the `chunk` as one jitted step, its `pool` donated (None without a cache):
  (x, the selection, the new pool)."""
  kv = None if pool is None else PagedLayer(pool, chunk.pages)
  x, pool, selection = attend(lw, chunk, cfg, kv, absorbed, runtime)
  return x, selection, pool


def mlp_through(lw, chunk: Chunk, cfg: Config, experts: ExpertProvider):
  """A layer's MLP half for the `chunk` (`mlp_head`; at a MoE layer its experts from
  `experts`, given the layer as index 0, and `moe_finish`): x after it."""
  head = mlp_head(lw, chunk.x, cfg)
  chunk = dataclasses.replace(chunk, x=head.x)
  if head.ids is not None:
    _experts_finish(0, lw.mlp, [chunk], [head], experts, moe_finish)
  return chunk.x


@functools.partial(jax.jit, static_argnames=("cfg", "runtime", "record"))
def mlp_step(lw, chunk: Chunk, next_lw, cfg: Config, runtime: Runtime = Runtime(),
             record: RecordOptions | None = None):
  """`mlp_through` of resident weights as one jitted step: (x after it, with `record` a MoE
  layer's routing record (`next_lw`: the next MoE layer's weights, for the pilot), else
  None)."""
  records: list = []
  experts = resident_experts(runtime)
  if record is not None:
    experts = recording(experts, lambda _: next_lw, cfg, records, record)
  return mlp_through(lw, chunk, cfg, experts), records[0] if records else None


def layer_step(lw, chunk: Chunk, pool, cfg: Config, absorbed=None, runtime: Runtime = Runtime(),
               mlp: Callable | None = None):
  """One decoder layer for the `chunk` as two jitted halves: `attention_step`, then `mlp(the
  MLP half, chunk)` → (x, extra) (`mlp_step` of resident weights by default). Layers share a
  half's program wherever its structure and shapes agree, a dense layer's attention the MoE
  layers' too (DESIGN.md §4). The steps return only what they change, so every layer gets the
  caller's start, `n_valid` and pages: one signature. Returns (chunk, new pool, the extra)."""
  if lw.attn.indexer is not None:  # a full layer makes its own selection: the last one is no
    chunk = dataclasses.replace(chunk, selection=None)  # input (and no second program)
  x, selection, pool = attention_step(attention_half(lw), chunk, pool, cfg=cfg,
                                      absorbed=absorbed, runtime=runtime)
  chunk = dataclasses.replace(chunk, x=x, selection=selection)
  mlp = mlp or (lambda m, c: mlp_step(m, c, None, cfg=cfg, runtime=runtime))
  x, extra = mlp(mlp_half(lw), chunk)
  return dataclasses.replace(chunk, x=x), pool, extra


def _stepped(w: Weights, tokens, cfg: Config, cache: KVCache | None = None, absorbed=None,
             n_valid=None, start=None, runtime: Runtime = Runtime(),
             record: RecordOptions | None = None):
  """`hidden_states` of resident weights through `layer_step`s: (x `[B, S, D]`, the new cache
  or None, each MoE layer's record when `record`). `start` (no cache): a run-time int32,
  `fresh_start()` by default."""
  start = (fresh_start() if start is None else start) if cache is None else cache.length
  chunk = Chunk(JITTED.embed(w, tokens), start, n_valid,  # [B, S, D]
                pages=None if cache is None else cache.pages)
  step = lambda i, lw, chunk, pool: layer_step(
      lw, chunk, pool, cfg, absorbed, runtime, lambda m, c: mlp_step(
          m, c, next_moe(w, i) if record is not None else None, cfg=cfg, runtime=runtime,
          record=record))
  chunk, cache, records = through_layers(w, chunk, cache, step)
  return chunk.x, cache, records


def score_fn(w: Weights, tokens, start, cfg: Config, runtime: Runtime = Runtime(), n_valid=None):
  """Teacher-forced logits `[B, S, V]` of a whole sequence, no cache (`start`: `fresh_start()`;
  positions at or past `n_valid` are padding: they route no expert)."""
  x, _, _ = _stepped(w, tokens, cfg, n_valid=n_valid, start=start, runtime=runtime)
  return JITTED.logits(w, x, cfg=cfg)


def record_fn(w: Weights, tokens, start, cfg: Config, runtime: Runtime = Runtime(),
              opts: RecordOptions = RecordOptions()):
  """Teacher-forced routing records of `tokens` `[B, S]` (no cache, no logits; `start`:
  `fresh_start()`): per MoE layer (in order), `route_record`'s arrays stacked to
  `[L, B·S, ...]`."""
  return stack_records(_stepped(w, tokens, cfg, start=start, runtime=runtime, record=opts)[2])


class StepOut(NamedTuple):
  """What a cached step (`prefill_fn`, `decode_fn`) returns, whatever it was asked."""
  logits: Any  # prefill: [B, V] at the last real token; decode: [B, S, V]
  hidden: Any  # prefill: [B, D] there ("all": [B, S, D]); decode: [B, S, D]
  cache: KVCache  # advanced past the step's tokens
  records: dict | None = None  # `record_fn`'s routing records (padding rows included) if asked


@functools.partial(jax.jit, static_argnames=("cfg", "hidden"))
def _prefill_head(w: Weights, x, n_valid, length, cfg: Config, hidden: str):
  """The head at a chunk's last real token: (logits `[B, V]`, hidden, the advanced length)."""
  last = n_valid - 1
  logits = logits_of(w, jax.lax.dynamic_slice_in_dim(x, last, 1, axis=1), cfg)  # [B, 1, V]
  x = x if hidden == "all" else jax.lax.dynamic_index_in_dim(x, last, axis=1, keepdims=False)
  return logits[:, 0], x, length + n_valid


def prefill_fn(w: Weights, cache: KVCache, tokens, n_valid, cfg: Config,
               runtime: Runtime = Runtime(), record: RecordOptions | None = None,
               hidden: str = "last"):
  """Writes `tokens` `[B, S]` (right-padded; the first `n_valid` are real) into the cache (its
  pools donated): one prefill chunk.

  Returns a `StepOut` (`hidden="all"`: the hidden state at every position, the MTP head's
  inputs; records when `record` is given). The head runs at the last real token only. Padding
  positions land beyond `length` and are overwritten before any query can see them.
  """
  x, cache, records = _stepped(w, tokens, cfg, cache, n_valid=n_valid, runtime=runtime,
                              record=record)
  logits, x, length = _prefill_head(w, x, n_valid, cache.length, cfg=cfg, hidden=hidden)
  return StepOut(logits, x, KVCache(cache.layers, cache.pages, length),
                 stack_records(records) if record is not None else None)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _decode_head(w: Weights, x, length, cfg: Config):
  """Logits `[B, S, V]` at every position and the length advanced by S."""
  return logits_of(w, x, cfg), length + x.shape[1]


def decode_fn(w: Weights, cache: KVCache, tokens, cfg: Config, runtime: Runtime = Runtime(),
              absorbed: bool = True, record: RecordOptions | None = None, n_valid=None):
  """Steps `tokens` `[B, S]` (S = 1, or 1 + drafts; the cache's pools donated): a `StepOut`
  (records when `record` is given). Batched decoding passes a cache with per-row `length`
  `[B]` and `n_valid` `[B]` (0 for an empty row: it routes no experts)."""
  x, cache, records = _stepped(w, tokens, cfg, cache, absorbed, n_valid, runtime=runtime,
                              record=record)
  logits, length = _decode_head(w, x, cache.length, cfg=cfg)
  return StepOut(logits, x, KVCache(cache.layers, cache.pages, length),
                 stack_records(records) if record is not None else None)


def distinct_layers(w: Weights) -> int:
  """How many different decoder layers (structure and shapes) `w` has."""
  kind = lambda lw: (jax.tree_util.tree_structure(lw),
                     tuple((a.shape, a.dtype) for a in jax.tree_util.tree_leaves(lw)))
  return len({kind(lw) for lw in w.layers})


# The entry points as one program each, the layer steps inlined: XLA emits a kernel once per
# program, so the layers inside one share kernels the halves alone emit again; one program
# compiles about as fast up to two layers per distinct layer (DESIGN.md §4).
ONE_PROGRAM_LAYERS_PER_KIND = 2
ONE_PROGRAM = {
    "prefill": jax.jit(prefill_fn, static_argnames=("cfg", "runtime", "record", "hidden"),
                       donate_argnames=("cache",)),
    "decode": jax.jit(decode_fn, static_argnames=("cfg", "runtime", "absorbed", "record"),
                      donate_argnames=("cache",)),
    "score": jax.jit(score_fn, static_argnames=("cfg", "runtime")),
    "record": jax.jit(record_fn, static_argnames=("cfg", "runtime", "opts"))}
LAYER_STEPS = {"prefill": prefill_fn, "decode": decode_fn, "score": score_fn, "record": record_fn}


def entry_points(w: Weights, unit: str = "auto") -> dict:
  """The resident entry points for compile `unit` ("layer": `LAYER_STEPS`, "step":
  `ONE_PROGRAM`); "auto": the faster to compile for `w`'s depth, `ONE_PROGRAM` for at most
  ONE_PROGRAM_LAYERS_PER_KIND layers per distinct layer."""
  if unit == "auto":
    shallow = len(w.layers) <= ONE_PROGRAM_LAYERS_PER_KIND * distinct_layers(w)
    unit = "step" if shallow else "layer"
  return ONE_PROGRAM if unit == "step" else LAYER_STEPS


@functools.partial(jax.jit, static_argnames=("cfg", "runtime"), donate_argnames=("cache",))
def mtp_fn(w: Weights, h, next_tokens, cache, start, cfg: Config, runtime: Runtime = Runtime()):
  """Cached MTP step(s) at positions start..: (logits `[B, S, V]`, output `[B, S, D]`, cache)."""
  return mtp_forward(w, h, next_tokens, cfg, KVCache(cache.layers, cache.pages, start),
                     absorbed=h.shape[1] <= 4, drive=Drive(runtime=runtime))
