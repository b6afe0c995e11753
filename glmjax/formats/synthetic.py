"""Synthetic expert stores: random weights written straight into the store format, no source
checkpoint. They exist for benchmarks and tests at real expert sizes (a GLM-5 expert chunk is
20 MB) without downloading or converting a 750 GB model.

The store is what `glmjax.formats.convert.convert` writes (same directory layout, chunk layout,
orbax dense parts, crcs and manifest keys) plus a `"synthetic"` manifest entry holding the
settings, so `glmjax.load(dst)` runs it with any options.

Weights are random but scaled so activations stay near unit variance through the layers:

- Routed experts are produced directly as packed codes and bf16 group scales (never as floats
  then quantized: measured ~40× slower per GLM-5 chunk). int4 codes are the difference of two
  uniform 3-bit draws (triangular on [-7, 7], mean 0), int8 codes of two uniform 7-bit draws
  (triangular on [-127, 127]); that bell shape is close to what round-to-nearest makes of real
  weights.
  Group scales are uniform in ±25% around a base chosen so that an expert's gate/up
  pre-activations, and then its output, have unit variance for unit-variance input.
- Dense matrices are bf16 with standard deviation 1/sqrt(fan_in) (1 for the embedding,
  SwiGLU down projections scaled up for silu's variance loss), drawn as a random sign times a
  uniform magnitude in [s, 2s): bit-twiddled from raw generator output at GB/s. s is a power
  of two, so a matrix's deviation is within a factor √2 of its target. Norm weights are 1;
  router rows (float32) are Gaussian scaled to norm 1.
- `zipf` skews routing through `e_score_correction_bias`: the bias is fitted (as aux-loss-free
  balancing fits it, but toward a Zipf target instead of a uniform one) so that, for router
  logits distributed as in this store (independent N(0, 1)), expert of popularity rank r is
  picked with probability ∝ (r + 1)^-zipf, capped at one pick per token. Each layer draws its
  own ranking. zipf = 0 leaves the bias at zero.

Every chunk and dense array comes from its own generator stream, seeded by (seed, stream,
layer, expert), so the bytes do not depend on thread scheduling or worker count.

Tokenizer: a synthetic store ships the embedded model's tokenizer (tokenizer.json,
tokenizer_config.json, generation_config.json; 4096 ids, `<|endoftext|>` = 6 is the eos) so
that `load(dst).generate("text")` works. `vocab_size` must therefore be at least the
tokenizer's size; ids beyond it have embedding rows like any other but no text, and decode to
nothing (the tokenizer skips unknown ids). GLM-5's own eos ids (154820...) would mean nothing
to this tokenizer, so the config's eos is the tokenizer's.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
import os
import shutil
import threading

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from glmjax.errors import CheckpointError, InputError
from glmjax.formats import durable, embedded, store
from glmjax.model.config import Config
from glmjax.formats.quantize import quantize
from glmjax.model.weights import DENSE_BITS, DENSE_GROUP_SIZES, MoE, abstract, dense_settings

GROUP_SIZE = 64
EXPERT_BITS, MTP_BITS = 4, 8
# Streams of the per-item generators: (seed, stream, a, b).
_EXPERTS, _DENSE, _ZIPF = 0, 1, 2
# E[silu(g)^2] for g ~ N(0, 1): a SwiGLU hidden a = silu(g)·u has this variance for unit g, u.
_SILU_VAR = 0.3553
_SCALE_SPREAD = 0.25  # group scales are uniform in base · [1 - spread, 1 + spread]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# GLM-5's architecture (shared/reference/glm5-architecture.md §1; [R] read in colibri's guards,
# [X] public config.json copies). Layer count, experts and vocabulary come from the caller.
_GLM5 = {
    "hidden_size": 6144,                # [R]
    "intermediate_size": 12288,         # [X] the dense layers' MLP
    "moe_intermediate_size": 2048,      # [R]
    "num_attention_heads": 64,          # [R]
    "q_lora_rank": 2048,                # [R]
    "kv_lora_rank": 512,                # [R]
    "qk_nope_head_dim": 192,            # [R]
    "qk_rope_head_dim": 64,             # [R]
    "v_head_dim": 256,                  # [R]
    "num_experts_per_tok": 8,           # [R]
    "n_shared_experts": 1,              # [R]
    "n_group": 1, "topk_group": 1,      # [X] (colibri refuses n_group != 1)
    "norm_topk_prob": True,             # [X]
    "routed_scaling_factor": 2.5,       # [X]
    "rms_norm_eps": 1e-5,               # colibri's default; the reference gives no value
    "rope_parameters": {"rope_type": "default", "rope_theta": 8_000_000.0},  # [X]
    "index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128,          # [X]
    "index_topk_freq": 4, "index_skip_topk_offset": 3,  # [X] full layers 0, 1, 2, 6, 10, ...
    "max_position_embeddings": 1_048_576,  # [X]
    "tie_word_embeddings": False,       # [R] lm_head is its own tensor
}
# Small dims with GLM-5's structure (same ratios where they matter, G-aligned widths), for tests.
_TINY = {
    **_GLM5, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
    "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16, "v_head_dim": 16, "num_experts_per_tok": 2, "index_topk": 16,
    "index_n_heads": 4, "index_head_dim": 32, "max_position_embeddings": 4096,
}


@dataclasses.dataclass(frozen=True)
class Geometry:
  config: dict
  experts: int  # default routed experts per layer
  vocab_size: int  # default vocabulary


GEOMETRIES = {
    "glm5": Geometry(_GLM5, experts=256, vocab_size=154_880),  # [R] 256 experts, [C] vocab
    "tiny": Geometry(_TINY, experts=8, vocab_size=4096),
}
DENSE_LAYERS = 1  # GLM-5 has 3 (first_k_dense_replace); one keeps the layout at little cost


def synthetic_config(geometry: str = "glm5", moe_layers: int = 2, experts: int | None = None,
                     vocab_size: int | None = None, mtp: bool = True) -> dict:
  """The HF `config.json` dict of a synthetic store (validated by `Config.from_dict`)."""
  if geometry not in GEOMETRIES:
    raise InputError(f"geometry must be one of {sorted(GEOMETRIES)}, got {geometry!r}")
  geo = GEOMETRIES[geometry]
  experts = geo.experts if experts is None else experts
  vocab_size = geo.vocab_size if vocab_size is None else vocab_size
  for name, v in (("moe_layers", moe_layers), ("experts", experts), ("vocab_size", vocab_size)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise InputError(f"{name} must be a positive integer, got {v!r}")
  top_k = geo.config["num_experts_per_tok"]
  if experts < top_k:
    raise InputError(f"experts={experts} is below the {geometry} geometry's top-k ({top_k}): "
                     "every token needs that many experts")
  tok_vocab, eos = _tokenizer_info()
  if vocab_size < tok_vocab:
    raise InputError(f"vocab_size={vocab_size} is below the shipped tokenizer's {tok_vocab} ids "
                     f"({embedded.PATH}/tokenizer.json); text prompts would reach missing rows")
  raw = {"model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"],
         "hidden_act": "silu", "attention_bias": False, **geo.config,
         "vocab_size": vocab_size, "n_routed_experts": experts,
         "num_hidden_layers": DENSE_LAYERS + moe_layers, "first_k_dense_replace": DENSE_LAYERS,
         "num_nextn_predict_layers": int(bool(mtp)), "eos_token_id": eos}
  Config.from_dict(raw, source=f"synthetic {geometry} config")
  return raw


def _tokenizer_info() -> tuple[int, int]:
  """(vocabulary size, eos id) of the embedded tokenizer that synthetic stores ship."""
  import tokenizers
  tok = tokenizers.Tokenizer.from_file(os.path.join(embedded.PATH, "tokenizer.json"))
  return tok.get_vocab_size(with_added_tokens=True), tok.token_to_id("<|endoftext|>")


# --- random bytes ----------------------------------------------------------------------------

def _rng(seed: int, *stream: int) -> np.random.Generator:
  return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *stream])))


def _raw_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
  """n random bytes: the bit generator's raw 64-bit output (several GB/s, unlike rng.bytes)."""
  return rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]


# Codes are made this many bytes at a time: the random draws of a block then come from reused
# heap memory instead of fresh pages (a 40 MB draw is a new mmap, page-faulted on every chunk).
_BLOCK = 1 << 20


def _int4_codes(rng: np.random.Generator, out: np.ndarray) -> None:
  """Fills uint8 `out` with packed int4 codes q = a - b (a, b uniform on 0..7) per nibble.

  Works on both nibbles at once: (a | 8) - b stays in 1..15 in each nibble, so nothing borrows
  across them, and the stored nibble is q + 8 as the packing wants.
  """
  flat = out.reshape(-1)
  for i in range(0, flat.size, _BLOCK):
    o = flat[i:i + _BLOCK]
    r = _raw_bytes(rng, 2 * o.size).reshape(2, o.size)
    np.bitwise_and(r[0], 0x77, out=o)
    np.bitwise_or(o, 0x88, out=o)
    np.bitwise_and(r[1], 0x77, out=r[1])
    np.subtract(o, r[1], out=o)


def _int8_codes(rng: np.random.Generator, out: np.ndarray) -> None:
  """Fills int8 `out` with q = a - b (a, b uniform on 0..127): uint8 wrap-around is int8's
  two's complement, so the difference is stored as is."""
  flat = out.reshape(-1).view(np.uint8)
  for i in range(0, flat.size, _BLOCK):
    o = flat[i:i + _BLOCK]
    r = _raw_bytes(rng, 2 * o.size).reshape(2, o.size)
    np.right_shift(r, 1, out=r)
    np.subtract(r[0], r[1], out=o)


# E[q^2] of the codes above: twice the variance of a uniform draw on 0..n-1, (n^2 - 1) / 12.
_CODE_VAR = {4: 2 * (8 ** 2 - 1) / 12, 8: 2 * (128 ** 2 - 1) / 12}


def _scales(rng: np.random.Generator, out: np.ndarray, base: float) -> None:
  """bf16 group scales uniform in base · [1 - spread, 1 + spread], normalised so that the mean
  square of the scale is base²."""
  u = rng.uniform(1 - _SCALE_SPREAD, 1 + _SCALE_SPREAD, out.shape).astype(np.float32)
  norm = math.sqrt(1 + _SCALE_SPREAD ** 2 / 3)  # E[u²] of that uniform
  out[...] = (u * np.float32(base / norm)).astype(ml_dtypes.bfloat16)


def expert_chunk(layout: store.ExpertLayout, rng: np.random.Generator,
                 out: np.ndarray | None = None) -> np.ndarray:
  """The chunk bytes `[B]` of one random expert in `layout` (the same bytes `layout.pack` would
  give for these codes and scales; padding is zero), written into `out` if given."""
  blob = np.zeros(layout.nbytes, np.uint8) if out is None else out
  if out is not None:
    out.fill(0)  # the alignment padding
  f = {x.name: x for x in layout.fields}

  def view(name):
    x = f[name]
    return blob[x.offset:x.offset + x.nbytes].view(np.dtype(x.dtype)).reshape(x.shape)

  codes = _int4_codes if layout.bits == 4 else _int8_codes
  var = _CODE_VAR[layout.bits]
  # gate/up: unit-variance pre-activations for unit-variance input over D features; down: unit
  # output over I features whose variance is silu's loss.
  for name, fan_in, act_var in (("gate_up", layout.hidden, 1.0),
                                ("down", layout.intermediate, _SILU_VAR)):
    codes(rng, view(f"{name}.packed"))
    _scales(rng, view(f"{name}.scales"), 1.0 / math.sqrt(var * fan_in * act_var))
  return blob


def _bf16_noise(rng: np.random.Generator, shape, std: float) -> np.ndarray:
  """bf16 values: random sign times a uniform magnitude in [s, 2s), s = 2^k, with k chosen so
  the deviation (√(7/3)·s) is within √2 of `std`. Built from raw bits: sign and 7 mantissa
  bits random, exponent fixed."""
  k = round(math.log2(std / math.sqrt(7 / 3)))
  n = int(np.prod(shape))
  bits = _raw_bytes(rng, 2 * n).view(np.uint16)
  np.bitwise_and(bits, 0x807F, out=bits)
  np.bitwise_or(bits, np.uint16((127 + k) << 7), out=bits)
  return bits.view(ml_dtypes.bfloat16).reshape(shape)


# --- routing skew ----------------------------------------------------------------------------

def zipf_target(n_experts: int, top_k: int, s: float) -> np.ndarray:
  """Per-token pick probabilities by popularity rank: ∝ (r + 1)^-s, summing to top_k, none
  above 1 (an expert is picked at most once per token; the excess goes to the others)."""
  w = np.arange(1, n_experts + 1, dtype=np.float64) ** -s
  q, free = np.zeros(n_experts), np.ones(n_experts, bool)
  while True:
    q[free] = (top_k - (~free).sum()) * w[free] / w[free].sum()
    over = free & (q > 1)
    if not over.any():
      return q
    q[over], free = 1.0, free & ~over


def zipf_bias(n_experts: int, top_k: int, s: float, rng: np.random.Generator,
              samples: int = 8192, iters: int = 200) -> np.ndarray:
  """Correction bias by popularity rank (rank 0 first) that makes sigmoid routing over
  independent N(0, 1) logits pick experts with `zipf_target` probabilities.

  Fitted on fixed samples by steps proportional to log(target load / measured load), the way
  aux-loss-free balancing nudges the bias toward uniform load.
  """
  if s == 0:
    return np.zeros(n_experts, np.float32)
  scores = 1 / (1 + np.exp(-rng.standard_normal((samples, n_experts), np.float32)))
  log_q = np.log(np.maximum(zipf_target(n_experts, top_k, s), 1e-4))
  b = np.zeros(n_experts, np.float32)
  kth = n_experts - top_k
  for _ in range(iters):
    x = scores + b
    thresh = np.partition(x, kth, axis=1)[:, kth:kth + 1]
    load = (x >= thresh).mean(0)
    b += (0.02 * (log_q - np.log(np.maximum(load, 1e-4)))).astype(np.float32)
    b -= b.max()  # only differences matter; keep the favourite at 0
  return b


# --- dense weights ---------------------------------------------------------------------------

def _dense_array(info, rng: np.random.Generator, rank_bias: np.ndarray | None) -> np.ndarray:
  """One dense leaf as the converter stores it: float32 for the router, routing bias and
  indexer head weights (declared float32), bf16 for everything else."""
  name = info.hf_names[0]
  f32 = np.dtype(info.dtype) == np.float32
  if name.endswith("e_score_correction_bias"):
    if rank_bias is None:
      return np.zeros(info.shape, np.float32)
    return rank_bias[rng.permutation(info.shape[0])]  # this layer's own popularity order
  if info.init in ("ones", "zeros"):
    return np.full(info.shape, 1.0 if info.init == "ones" else 0.0,
                   np.float32 if f32 else ml_dtypes.bfloat16)
  if name.endswith("mlp.gate.weight"):
    # Router rows of norm exactly 1: every expert's logit then has the same N(0, 1) spread
    # for unit-rms isotropic input, the premise `zipf_bias` is fitted on.
    w = rng.standard_normal(info.shape, np.float32)
    return w / np.sqrt(np.square(w).sum(axis=1, keepdims=True))
  if name == "model.embed_tokens.weight":
    std = 1.0  # the residual stream starts at unit variance
  else:
    std = 1 / math.sqrt(info.shape[-1])
    if name.endswith("down_proj.weight"):
      std /= math.sqrt(_SILU_VAR)  # a SwiGLU hidden has silu's smaller variance
  if f32:
    return rng.standard_normal(info.shape, np.float32) * np.float32(std)
  return _bf16_noise(rng, info.shape, std)


# --- the store -------------------------------------------------------------------------------

def _prepare(dst: str, settings: dict, need: int) -> dict | None:
  """Makes `dst` ready to write `need` bytes. Returns the manifest if `dst` already is this very
  store; starts an interrupted synthetic store over; refuses anything else that is not empty,
  and a disk without room. Temporaries of a killed run (`durable.clear_stale`) do not count."""
  reclaim = 0
  mpath, ppath = os.path.join(dst, store.MANIFEST), os.path.join(dst, store.PROGRESS)
  for path in (mpath, ppath):
    durable.clear_stale(path)
  if os.path.isdir(dst) and os.listdir(dst):
    if os.path.exists(mpath):
      m = store.read_manifest(dst)
      if m.get("synthetic") == settings:
        store.finish(dst)  # a kill between the manifest and dropping the progress log
        return m
      raise CheckpointError(f"{dst}: already holds a complete store (with other settings); "
                            "use another --dst or delete it")
    try:
      with open(ppath, encoding="utf-8") as f:
        prior = json.loads(f.readline())["settings"]["synthetic"]
    except (OSError, ValueError, KeyError, TypeError):
      prior = None
    if prior is None:
      raise CheckpointError(f"{dst}: not empty and not an interrupted synthetic store; refusing "
                            "to write over it (use another --dst or delete it)")
    reclaim = _tree_bytes(dst)
  elif os.path.exists(dst) and not os.path.isdir(dst):
    raise CheckpointError(f"{dst}: exists and is not a directory")
  free = _free_bytes(dst) + reclaim
  if need * 1.02 + (256 << 20) > free:  # orbax metadata and filesystem slack on top
    raise CheckpointError(f"{dst}: the store needs {need / 1e9:.2f} GB and the disk has "
                          f"{free / 1e9:.2f} GB free")
  if reclaim:
    shutil.rmtree(dst)  # ours and incomplete: generation is deterministic, so start over
  try:
    os.makedirs(dst, exist_ok=True)
    # The converter's progress file (its first line, the settings, in the same shape), so
    # load() reports the store as incomplete and convert.py refuses it as another conversion;
    # the "synthetic" settings mark it as ours.
    durable.write_file(ppath, json.dumps({"settings": {"synthetic": settings}}) + "\n",
                       point="synthetic.progress")
  except OSError as e:
    raise CheckpointError(f"{dst}: destination is not writable ({e.strerror})") from None
  return None


def _tree_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _free_bytes(path: str) -> int:
  while not os.path.exists(path):
    path = os.path.dirname(os.path.abspath(path))
  return shutil.disk_usage(path).free


def _dense_tree(cfg: Config, mtp: bool, dense_bits: int, first_layer_bits: int | None = None,
                group_size: int | None = None):
  """The declared dense tree a synthetic store writes: bf16 (float32 where declared so), the
  quantizable leaves as QArrays under `dense_bits` (the converter's rule, `dense_format`)."""
  return abstract(cfg, jnp.bfloat16, with_mtp=mtp, dense_bits=dense_bits,
                  dense_group_size=group_size, dense_first_layer_bits=first_layer_bits)


def store_bytes(raw_config: dict, dense_bits: int = 0, first_layer_bits: int | None = None,
                dense_group_size: int | None = None) -> tuple[int, int, dict]:
  """(dense bytes, expert bytes, {group: (layers, layout)}) of a synthetic store's config."""
  cfg = Config.from_dict(raw_config)
  tree = _dense_tree(cfg, True, dense_bits, first_layer_bits, dense_group_size)
  dense = 0
  for part in store.dense_parts(tree).values():
    for info in store.flat_leaves(part).values():
      dense += info.nbytes
  groups = {"main": ([i for i, l in enumerate(tree.layers) if isinstance(l.mlp, MoE)],
                     EXPERT_BITS)}
  if tree.mtp:
    groups["mtp"] = ([cfg.num_hidden_layers + j for j in range(len(tree.mtp))], MTP_BITS)
  out, experts = {}, 0
  for name, (layers, bits) in groups.items():
    layout = store.ExpertLayout.make(cfg.hidden_size, cfg.moe_intermediate_size, bits, GROUP_SIZE)
    out[name] = (layers, layout)
    experts += len(layers) * cfg.n_routed_experts * layout.nbytes
  return dense, experts, out


def make_synthetic_store(dst: str, geometry: str = "glm5", moe_layers: int = 2,
                         experts: int | None = None, vocab_size: int | None = None,
                         seed: int = 0, zipf: float = 0.0, mtp: bool = True, workers: int = 2,
                         progress: bool = True, dense_bits: int = 0,
                         dense_first_layer_bits: int | None = None,
                         dense_group_size: int | None = None) -> dict:
  """Writes a store of random weights at `dst`; returns its manifest.

  Args:
    dst: store directory; must be absent, empty, or an interrupted synthetic store (started
      over). A complete synthetic store with the same settings is left as is.
    geometry: "glm5" (GLM-5's dims: hidden 6144, experts 6144×2048 in int4 G=64 with bf16
      scales, 20.05 MB a chunk) or "tiny" (hidden 128, for tests).
    moe_layers: MoE layers after the one dense layer.
    experts: routed experts per layer (None: the geometry's, 256 for glm5).
    vocab_size: vocabulary (None: the geometry's, 154880 for glm5); at least the tokenizer's.
    seed: generator seed; the same seed gives byte-identical expert chunks.
    zipf: Zipf exponent of expert popularity (0: no skew); see the module docstring.
    mtp: include GLM-5's MTP layer (its experts in int8, group "mtp").
    workers: threads generating and writing expert chunks.
    dense_bits: 0 (bf16 dense weights), 8 or 4: the quantized dense format of
      `convert --dense_bits`, each quantizable leaf drawn in bf16 as for 0 and then
      quantized by the converter's quantizer.
    dense_first_layer_bits: the first decoder layer's width under `dense_bits` (None: the
      recipe's, `weights.DENSE_RECIPES`; 0: bf16), as `convert --dense_first_layer_bits`.
    dense_group_size: input features per scale of the quantized dense leaves (None: the
      recipe's), as `convert --dense_group_size` (the experts stay at group 64).
  """
  import orbax.checkpoint as ocp
  import tensorstore as ts
  from tqdm import tqdm

  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise InputError(f"seed must be an integer ≥ 0, got {seed!r}")
  if not (isinstance(zipf, (int, float)) and math.isfinite(zipf) and 0 <= zipf <= 16):
    raise InputError(f"zipf must be a number in [0, 16] (0 = no skew), got {zipf!r}")
  if dense_bits not in DENSE_BITS:
    raise InputError(f"dense_bits must be one of {DENSE_BITS} (0: bf16), got {dense_bits!r}")
  try:  # absent for bf16, so stores written before the option still match
    dense_quant = dense_settings(dense_bits, dense_group_size, dense_first_layer_bits)
  except ValueError as e:
    raise InputError(str(e)) from None
  raw = synthetic_config(geometry, moe_layers, experts, vocab_size, mtp)
  cfg = Config.from_dict(raw)
  settings = {"geometry": geometry, "moe_layers": moe_layers,
              "experts": cfg.n_routed_experts, "vocab_size": cfg.vocab_size, "seed": seed,
              "zipf": float(zipf), "mtp": bool(mtp)}
  if dense_bits:
    settings["dense_bits"] = dense_bits
    settings["dense_first_layer_bits"] = dense_quant["dense_first_layer_bits"]
    if dense_quant["dense_group_size"] != DENSE_GROUP_SIZES[dense_bits]:
      settings["dense_group_size"] = dense_group_size  # absent at the recipe's
  dense_bytes, expert_bytes, groups = store_bytes(raw, dense_bits, dense_first_layer_bits,
                                                  dense_group_size)
  need = dense_bytes + expert_bytes
  done = _prepare(dst, settings, need)
  if done is not None:
    if progress:
      print(f"{dst}: already this synthetic store; nothing to do")
    return done

  bar = tqdm(total=need, unit="B", unit_scale=True, unit_divisor=1024, desc="writing",
             disable=not progress, smoothing=0.1)
  lock = threading.Lock()

  def advance(n):
    with lock:
      bar.update(n)

  tree = _dense_tree(cfg, mtp, dense_bits, dense_first_layer_bits, dense_group_size)
  rank_bias = (zipf_bias(cfg.n_routed_experts, cfg.num_experts_per_tok, zipf,
                         _rng(seed, _ZIPF)) if zipf else None)
  # Dense parts go through orbax (compression, ~250 MB/s) in their own thread while the pool
  # writes expert chunks, so neither waits for the other.
  dense_thread = cf.ThreadPoolExecutor(1)
  dense_future = dense_thread.submit(_write_dense, dst, tree, seed, rank_bias, ocp, advance)
  group_meta = {}
  local = threading.local()
  with dense_thread, cf.ThreadPoolExecutor(max(1, workers)) as pool:
    for gname, (layers, layout) in groups.items():
      path = os.path.join("experts", gname)
      shape = (len(layers), cfg.n_routed_experts, layout.nbytes)
      arr = ts.open(store.expert_spec(os.path.join(dst, path), shape, create=True),
                    create=True).result()
      group_meta[gname] = {"path": path, "layers": layers, "layout": layout.to_json()}

      def work(row, layer, e, arr=arr, layout=layout):
        # One chunk buffer per thread and group, reused: tensorstore is done with it once the
        # write's result is in, and fresh 20-40 MB buffers would cost a page fault per 4 KB.
        bufs = local.__dict__.setdefault("bufs", {})
        if layout.nbytes not in bufs:
          bufs[layout.nbytes] = np.empty(layout.nbytes, np.uint8)
        blob = expert_chunk(layout, _rng(seed, _EXPERTS, layer, e), bufs[layout.nbytes])
        arr[row, e].write(blob).result()
        advance(layout.nbytes)

      # Bounded submission: at most 2 × workers chunks (and their random bytes) in memory.
      pending = set()
      for row, layer in enumerate(layers):
        for e in range(cfg.n_routed_experts):
          pending.add(pool.submit(work, row, layer, e))
          if len(pending) >= 2 * max(1, workers):
            finished, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
              fut.result()
              durable.kill_point("synthetic.expert_chunk")
            if dense_future.done():
              dense_future.result()  # a failed dense part stops the run now, not at the end
      for fut in cf.as_completed(pending):
        fut.result()
        durable.kill_point("synthetic.expert_chunk")
    dense_sums = dense_future.result()
  bar.close()

  for fname in _TOKENIZER_FILES:
    shutil.copyfile(os.path.join(embedded.PATH, fname), os.path.join(dst, fname))
  with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
    json.dump(raw, f, indent=2)
  manifest = store.write_manifest(
      dst, quant={"expert_bits": EXPERT_BITS, "mtp_bits": MTP_BITS, "group_size": GROUP_SIZE,
                  "scheme": "synthetic: random triangular codes, random bf16 group scales",
                  "dense_dtype": "bfloat16", **dense_quant},
      source={"path": None, "fp8_block_size": None}, source_config=raw,
      moe_layers=groups["main"][0], mtp_layers=groups["mtp"][0] if mtp else [],
      mtp_has_head=False,  # the MTP block reuses lm_head, as GLM-5's does
      experts=group_meta, dense=dense_sums, synthetic=settings)
  store.finish(dst)
  return manifest


def _write_dense(dst, tree, seed, rank_bias, ocp, advance) -> dict:
  """Every dense part as an orbax checkpoint; returns {part: {key: crc32}}. The next part is
  generated while orbax writes the previous one in the background."""
  ckptr = ocp.StandardCheckpointer()
  sums = {}
  for pi, (pname, part) in enumerate(store.dense_parts(tree).items()):
    infos = store.flat_leaves(part)
    arrays = {}
    for li, (k, i) in enumerate(infos.items()):
      a = _dense_array(i, _rng(seed, _DENSE, pi, li), rank_bias)
      arrays.update(store.stored_arrays(k, i, quantize(a, i.bits, i.group_size) if i.quantized
                                        else a))
    sums[pname] = {k: store.crc(a) for k, a in arrays.items()}
    ckptr.wait_until_finished()
    durable.kill_point("synthetic.dense_part")
    ckptr.save(os.path.abspath(os.path.join(dst, "dense", pname)), arrays)
    advance(sum(a.nbytes for a in arrays.values()))
  ckptr.wait_until_finished()
  return sums
