"""Weight pytrees, declared once abstractly.

`abstract(cfg)` returns a `Weights` tree whose leaves are `ArrayInfo` (shape, dtype, logical
axes, HF tensor name, init). That single declaration drives random init (`init`), checkpoint
loading (`glmjax.formats.checkpoint`), checkpoint writing and the sharding plan
(`glmjax.sharding`; "experts" is the routed experts' leading axis, "router" the router's expert
scores, which every device keeps whole). Matrices keep the HF orientation `[out, in]`, so
loading never transposes; gate and up projections are fused into one `[2F, D]` matrix
(rows 0..F-1 gate, F..2F-1 up), the layout the MoE kernels consume.

The dense format is part of the declaration too: `abstract(cfg, dense_bits=8 | 4)` declares
every `quantizable` leaf (dense matmul weights, heads, the embedding) as a group-wise `QArray`
at the width `DENSE_RECIPES` gives its kind, so the converter, the store's reader, the memory
plan (`nbytes`, `shapes`, `dense_plan`) and the mesh placement follow from the one tree.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.model.config import Config
from glmjax.model.quant import check_bits_group, qarray_shapes


def _pytree(cls):
  """Registers a dataclass as a pytree whose fields are all children."""
  cls = dataclasses.dataclass(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
  """Abstract description of one weight.

  `hf_names` are the checkpoint tensors concatenated (axis 0) to form it; a name containing
  `{e}` is read once per routed expert and stacked on a new leading axis.
  """

  shape: tuple[int, ...]
  dtype: Any
  axes: tuple[str, ...]
  hf_names: tuple[str, ...]
  init: str = "normal"  # normal | ones | zeros
  # "matmul" (a dense matmul weight), "head" (the lm head, the MTP's own head) or "embedding":
  # a quantized dense format stores it as a QArray at its `DENSE_RECIPES` width. "": never
  # quantized (norms, biases, the router and its bias, the indexer's head weights, routed
  # experts).
  quantizable: str = ""
  bits: int = 0  # 0: a float array of `dtype`; 4 | 8: a group-wise QArray (`quant.py`)
  group_size: int = 64

  @property
  def per_expert(self) -> bool:
    return "{e}" in self.hf_names[0]

  @property
  def quantized(self) -> bool:
    return self.bits != 0

  def shape_struct(self):
    """The leaf without data: a `jax.ShapeDtypeStruct`, or a QArray of them when quantized."""
    if self.quantized:
      return qarray_shapes(self.shape[-2], self.shape[-1], self.bits, self.group_size,
                           lead=self.shape[:-2])
    return jax.ShapeDtypeStruct(self.shape, jnp.dtype(self.dtype))

  @property
  def nbytes(self) -> int:
    """Bytes this leaf takes when allocated (packed weights and scales when quantized)."""
    if self.quantized:
      return self.shape_struct().nbytes
    return int(np.prod(self.shape)) * jnp.dtype(self.dtype).itemsize


def is_info(x) -> bool:
  return isinstance(x, ArrayInfo)


@_pytree
class MLP:
  gate_up: Any  # [2F, D]
  down: Any  # [D, F]


@_pytree
class Experts:
  gate_up: Any  # [E, 2I, D]
  down: Any  # [E, D, I]


@_pytree
class MoE:
  router: Any  # [E, D] float32
  bias: Any  # [E] float32, e_score_correction_bias
  experts: Any  # Experts (float, resident) or an offloaded stand-in
  shared: Any  # MLP | None


@_pytree
class Indexer:
  wq_b: Any  # [Hi*Di, Q]
  wk: Any  # [Di, D]
  k_norm_w: Any  # [Di]
  k_norm_b: Any  # [Di]
  weights_proj: Any  # [Hi, D] float32


@_pytree
class Attention:
  q_a: Any  # [Q, D]
  q_a_norm: Any  # [Q]
  q_b: Any  # [H*(Dn+Dr), Q]
  kv_a: Any  # [C+Dr, D]
  kv_a_norm: Any  # [C]
  kv_b: Any  # [H*(Dn+Dv), C]
  o: Any  # [D, H*Dv]
  indexer: Any  # Indexer | None ("shared" layers and the MTP layer have none)


@_pytree
class Layer:
  attn_norm: Any  # [D]
  attn: Any  # Attention
  mlp_norm: Any  # [D]
  mlp: Any  # MLP | MoE


@_pytree
class MTP:
  enorm: Any  # [D]
  hnorm: Any  # [D]
  eh_proj: Any  # [D, 2D]
  head_norm: Any  # [D], shared_head.norm
  head: Any  # [V, D] shared_head.head, or None to reuse lm_head
  layer: Any  # Layer


@_pytree
class Weights:
  embed: Any  # [V, D]
  layers: Any  # list[Layer]
  norm: Any  # [D]
  lm_head: Any  # [V, D], or None when tied to embed
  mtp: Any  # list[MTP] (empty when the checkpoint has no MTP layer)


# --- the declaration ------------------------------------------------------------------------

DENSE_BITS = (0, 4, 8)  # 0: float dense weights (the default)


def abstract(cfg: Config, dtype=jnp.float32, with_mtp: bool = True, dense_bits: int = 0,
             dense_group_size: int | None = None, dense_first_layer_bits: int | None = None
             ) -> Weights:
  """The abstract weight tree of `cfg`; `dtype` is the storage dtype of non-router weights.

  `dense_bits` 8 or 4 declares the quantizable leaves (`ArrayInfo.quantizable`: attention and
  indexer projections, shared experts, dense MLPs, the MTP's `eh_proj`, the lm head and the
  embedding) as group-wise QArrays with `dense_group_size` (None: the recipe's,
  `DENSE_GROUP_SIZES`), at `DENSE_RECIPES[dense_bits]`'s
  widths (`dense_format`; `dense_first_layer_bits` overrides the first decoder layer's); routed
  experts are never part of the dense format (the expert store holds them).
  """
  d, f32 = cfg.hidden_size, jnp.float32

  def info(shape, axes, *names, init="normal", dt=None, q=""):
    return ArrayInfo(tuple(shape), dt or dtype, tuple(axes), tuple(names), init, quantizable=q)

  def mat(shape, axes, *names, q="matmul"):
    return info(shape, axes, *names, q=q)

  def norm(n, name):
    return info((n,), ("norm",), name, init="ones")

  def mlp(p, f, q):
    return MLP(
        gate_up=mat((2 * f, d), ("mlp", "embed"), f"{p}.gate_proj.weight", f"{p}.up_proj.weight",
                    q=q),
        down=mat((d, f), ("embed", "mlp"), f"{p}.down_proj.weight", q=q))

  def layer(i):
    p = f"model.layers.{i}"
    a = f"{p}.self_attn"
    # The first decoder layer's matrices are a kind of their own: the most sensitive to
    # quantization (DENSE_RECIPES), so they can be kept wider (`dense_first_layer_bits`).
    kind = "first_layer" if i == 0 else "matmul"
    h, q, c, r = cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    indexer = None
    if cfg.has_indexer(i):
      hi, di = cfg.index_n_heads, cfg.index_head_dim
      indexer = Indexer(
          wq_b=mat((hi * di, q), ("index_heads", "q_lora"), f"{a}.indexer.wq_b.weight", q=kind),
          wk=mat((di, d), ("index_head_dim", "embed"), f"{a}.indexer.wk.weight", q=kind),
          k_norm_w=info((di,), ("norm",), f"{a}.indexer.k_norm.weight", init="ones"),
          k_norm_b=info((di,), ("norm",), f"{a}.indexer.k_norm.bias", init="zeros"),
          weights_proj=info((hi, d), ("index_heads", "embed"), f"{a}.indexer.weights_proj.weight",
                            dt=f32))
    attn = Attention(
        q_a=mat((q, d), ("q_lora", "embed"), f"{a}.q_a_proj.weight", q=kind),
        q_a_norm=norm(q, f"{a}.q_a_layernorm.weight"),
        q_b=mat((h * cfg.qk_head_dim, q), ("heads", "q_lora"), f"{a}.q_b_proj.weight", q=kind),
        kv_a=mat((c + r, d), ("kv_lora", "embed"), f"{a}.kv_a_proj_with_mqa.weight", q=kind),
        kv_a_norm=norm(c, f"{a}.kv_a_layernorm.weight"),
        kv_b=mat((h * (cfg.qk_nope_head_dim + cfg.v_head_dim), c), ("heads", "kv_lora"),
                  f"{a}.kv_b_proj.weight", q=kind),
        o=mat((d, h * cfg.v_head_dim), ("embed", "heads"), f"{a}.o_proj.weight", q=kind),
        indexer=indexer)
    if cfg.is_moe(i):
      e, m = cfg.n_routed_experts, cfg.moe_intermediate_size
      ep = f"{p}.mlp.experts.{{e}}"
      ffn = MoE(
          router=info((e, d), ("router", "embed"), f"{p}.mlp.gate.weight", dt=f32),
          bias=info((e,), ("router",), f"{p}.mlp.gate.e_score_correction_bias", init="zeros",
                    dt=f32),
          experts=Experts(
              gate_up=info((e, 2 * m, d), ("experts", "moe_mlp", "embed"),
                           f"{ep}.gate_proj.weight", f"{ep}.up_proj.weight"),
              down=info((e, d, m), ("experts", "embed", "moe_mlp"), f"{ep}.down_proj.weight")),
          shared=(mlp(f"{p}.mlp.shared_experts", cfg.shared_intermediate_size, kind)
                  if cfg.n_shared_experts else None))
    else:
      ffn = mlp(f"{p}.mlp", cfg.intermediate_size, kind)
    return Layer(attn_norm=norm(d, f"{p}.input_layernorm.weight"), attn=attn,
                 mlp_norm=norm(d, f"{p}.post_attention_layernorm.weight"), mlp=ffn)

  def mtp(i):
    p = f"model.layers.{i}"
    return MTP(enorm=norm(d, f"{p}.enorm.weight"), hnorm=norm(d, f"{p}.hnorm.weight"),
               eh_proj=mat((d, 2 * d), ("embed", "embed2"), f"{p}.eh_proj.weight"),
               head_norm=norm(d, f"{p}.shared_head.norm.weight"), head=None, layer=layer(i))

  n = cfg.num_hidden_layers
  return dense_format(Weights(
      embed=info((cfg.vocab_size, d), ("vocab", "embed"), "model.embed_tokens.weight",
                 q="embedding"),
      layers=[layer(i) for i in range(n)],
      norm=norm(d, "model.norm.weight"),
      lm_head=None if cfg.tie_word_embeddings else info(
          (cfg.vocab_size, d), ("vocab", "embed"), "lm_head.weight", q="head"),
      mtp=[mtp(n + j) for j in range(cfg.num_nextn_predict_layers)] if with_mtp else []),
      dense_bits, dense_group_size, dense_first_layer_bits)


# Each dense format's widths per kind of quantizable leaf (0: kept float, in the store's dense
# dtype). Measured on the embedded model (scripts/dense_kl.py, KL against the float model, and
# what each store adds to the default int4-expert store's KL on 10 held-out files):
# - int8: the embedding stays bfloat16 (a gather: it costs no compute, and int8 rows alone add
#   4.4e-4 nats/token); GLM-5's int8 dense part still plans at 19.34 GB.
# - int4: the head int8 and the embedding int4 (1.37e-2 against 2.09e-2 all int4, and 1.82e-2
#   the other way round, at the same bytes): the head is the most sensitive matrix (int4 head
#   alone 7.1e-3), and GLM-5's int4 dense part has no room for both.
# - The first decoder layer is its own kind. Under int8 it stays float: int8 there is what
#   makes int8 add 2.45e-4 (kept float: -1.59e-4 at group 128, -6.9e-5 at 64), and GLM-5's
#   plan fits 19.5 GiB with it only at group 128 (19.45 GiB; 19.70 at 64), where group size
#   measured no difference to the added KL (64, 128, 256, one scale per row: all within the
#   metric's noise). Under int4 it stays int4: int8 there cuts the added KL by 37% (1.27e-2 to
#   8.1e-3) for 0.20e9 bytes (10.38 GiB), an option (`first_layer_bits`), not "most" of it.
DENSE_RECIPES = {8: {"first_layer": 0, "matmul": 8, "head": 8, "embedding": 0},
                 4: {"first_layer": 4, "matmul": 4, "head": 8, "embedding": 4}}
DENSE_GROUP_SIZES = {8: 128, 4: 64}  # each recipe's input features per scale (above)
FIRST_LAYER_BITS = (0, 4, 8)  # 0: the first decoder layer's matrices stay float


def dense_group(bits: int, group_size: int | None = None) -> int:
  """The group size of a quantized dense format: `group_size`, or None for the recipe's
  (`DENSE_GROUP_SIZES`)."""
  return DENSE_GROUP_SIZES[bits] if group_size is None else group_size


def dense_format(tree: Weights, bits: int, group_size: int | None = None,
                 first_layer_bits: int | None = None) -> Weights:
  """`tree` with its quantizable leaves declared as QArrays at the widths `DENSE_RECIPES[bits]`
  gives their kind, in groups of `group_size` (None: the recipe's); `first_layer_bits` (None:
  the recipe's) overrides the first decoder layer's. `bits` 0 leaves the tree unchanged."""
  if bits not in DENSE_BITS:
    raise ValueError(f"dense_bits must be one of {DENSE_BITS}, got {bits}")
  if first_layer_bits is not None and first_layer_bits not in FIRST_LAYER_BITS:
    raise ValueError(f"dense_first_layer_bits must be one of {FIRST_LAYER_BITS}, "
                     f"got {first_layer_bits}")
  if not bits:
    return tree
  group_size = dense_group(bits, group_size)
  check_bits_group(bits, group_size)
  width = dict(DENSE_RECIPES[bits])
  if first_layer_bits is not None:
    width["first_layer"] = first_layer_bits
  return map_infos(lambda i: dataclasses.replace(i, bits=width[i.quantizable],
                                                 group_size=group_size)
                   if i.quantizable else i, tree)


def dense_settings(bits: int, group_size: int | None = None,
                   first_layer_bits: int | None = None) -> dict[str, int]:
  """A quantized dense format as a store's manifest records it (under "quant"); {} for float
  dense weights. `group_size` and `first_layer_bits` None are the recipe's, written as
  resolved. The first layer's width is always written, so a store converted before that
  kind existed (no key: its first layer at `bits`) still reads as written
  (`store.dense_abstract`). Raises ValueError for a first-layer width out of range or without
  `bits`, or a group size that is not an even number ≥ 2 (the writers' one check)."""
  if bits in DENSE_GROUP_SIZES:
    group_size = dense_group(bits, group_size)
  if bits and (isinstance(group_size, bool) or not isinstance(group_size, int)
               or group_size < 2 or group_size % 2):
    raise ValueError(f"dense_group_size must be an even number ≥ 2, got {group_size!r}")
  if first_layer_bits is not None and (first_layer_bits not in FIRST_LAYER_BITS or not bits):
    raise ValueError(f"dense_first_layer_bits needs dense_bits 8 or 4 and must be one of "
                     f"{FIRST_LAYER_BITS}; got {first_layer_bits} (dense_bits {bits})")
  if not bits:
    return {}
  first = DENSE_RECIPES[bits]["first_layer"] if first_layer_bits is None else first_layer_bits
  return {"dense_bits": bits, "dense_group_size": group_size, "dense_first_layer_bits": first}


def strip_routed(layer: Layer) -> Layer:
  """`layer` with its routed experts left out (None): what the dense part of a store holds."""
  if isinstance(layer.mlp, MoE):
    layer = dataclasses.replace(layer, mlp=dataclasses.replace(layer.mlp, experts=None))
  return layer


def dense_only(tree: Weights) -> Weights:
  """The tree without routed experts: the resident dense part of an expert store."""
  return dataclasses.replace(
      tree, layers=[strip_routed(l) for l in tree.layers],
      mtp=[dataclasses.replace(m, layer=strip_routed(m.layer)) for m in tree.mtp])


def shapes(tree: Weights) -> Weights:
  """The tree with data-free leaves (`ArrayInfo.shape_struct`), for `jax.eval_shape`."""
  return map_infos(lambda i: i.shape_struct(), tree)


def leaves_with_info(tree: Weights) -> list[ArrayInfo]:
  return jax.tree_util.tree_leaves(tree, is_leaf=is_info)


def map_infos(fn: Callable[[ArrayInfo], Any], tree: Weights) -> Weights:
  """Maps `fn` over the ArrayInfo leaves, keeping the tree structure."""
  return jax.tree_util.tree_map(fn, tree, is_leaf=is_info)


def init(cfg: Config, seed: int = 0, dtype=jnp.float32, std: float = 0.02,
         with_mtp: bool = True) -> Weights:
  """Deterministic random weights (numpy PCG64, identical on every machine).

  Norm weights and router biases are randomised too, so tests are not blind to them.
  """
  rng = np.random.default_rng(seed)

  def make(info: ArrayInfo):
    if info.init == "ones":
      x = 1.0 + 0.1 * rng.standard_normal(info.shape)
    elif info.init == "zeros":
      x = 0.1 * rng.standard_normal(info.shape)
    else:
      x = std * rng.standard_normal(info.shape)
    return jnp.asarray(x, dtype=info.dtype)

  return map_infos(make, abstract(cfg, dtype, with_mtp))


def to_device(x, dtype) -> jax.Array:
  """A host array on the default device as `dtype`, converted on the host: `jnp.asarray(x,
  dtype)` compiles one conversion per distinct shape (about 20 of them loading the embedded
  model, a quarter of a cold start's compile time). Committed to the device, as every input
  of a step is (`Executor.put`): a jit compiles once per mix of committed and uncommitted
  arguments (a layer step fed the embedding of uncommitted weights compiled twice)."""
  return jax.device_put(np.asarray(x).astype(np.dtype(dtype), copy=False),
                        jax.local_devices()[0])


def nbytes(tree) -> int:
  """Bytes of a tree of arrays, shape structs or `ArrayInfo`s (quantized ones as QArrays)."""
  return sum(x.nbytes if is_info(x) else int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(tree, is_leaf=is_info))


DENSE_FORMATS = {"float32": (jnp.float32, 0), "bfloat16": (jnp.bfloat16, 0),
                 "int8": (jnp.float32, 8), "int4": (jnp.float32, 4)}


def dense_plan(cfg: Config, fmt: str, group_size: int | None = None, with_mtp: bool = True,
               first_layer_bits: int | None = None) -> dict[str, int]:
  """Resident bytes of the dense part (everything but the routed experts) in the dense format
  `fmt` ("float32" | "bfloat16" | "int8" | "int4"), from the declaration alone: nothing is
  allocated.

  Under int8/int4 the quantized leaves are QArrays (packed weights + bf16 group scales, in
  groups of `group_size`, None: the recipe's; the first decoder layer at `first_layer_bits`,
  None: the recipe's), the quantizable leaves the recipe keeps float (int8: the embedding and
  the first decoder layer) bfloat16 (the converter's dense dtype, which
  `dtype="auto"` keeps; `store.dense_abstract` keeps the embedding so under any dtype), and the
  rest (norms, router and its bias, the indexer's head weights) float32. Returns
  {"quantized": ..., "float": ..., "total": ...} in bytes.
  """
  if fmt not in DENSE_FORMATS:
    raise ValueError(f"dense format must be one of {sorted(DENSE_FORMATS)}, got {fmt!r}")
  dtype, bits = DENSE_FORMATS[fmt]
  tree = dense_only(abstract(cfg, dtype, with_mtp, dense_bits=bits, dense_group_size=group_size,
                             dense_first_layer_bits=first_layer_bits))
  if bits:
    tree = map_infos(lambda i: dataclasses.replace(i, dtype=jnp.bfloat16)
                     if i.quantizable and not i.quantized else i, tree)
  quantized = sum(i.nbytes for i in leaves_with_info(tree) if i.quantized)
  total = nbytes(tree)
  return {"quantized": quantized, "float": total - quantized, "total": total}


def format_name(tree: Weights) -> str:
  """The dense format of an abstract tree in words: "bfloat16", or "int8 G64 + bfloat16" (the
  quantized widths, then the float dtype of the largest float leaves)."""
  quantized = sorted({(i.bits, i.group_size) for i in leaves_with_info(tree) if i.quantized},
                     reverse=True)
  floats: dict[str, int] = {}
  for i in leaves_with_info(dense_only(tree)):
    if not i.quantized:
      name = jnp.dtype(i.dtype).name
      floats[name] = floats.get(name, 0) + i.nbytes
  words = [f"int{b} G{g}" for b, g in quantized]
  if floats:
    words.append(max(floats, key=floats.get))
  return " + ".join(words)
