"""Runtime options: everything that is not architecture.

Two become static arguments of the jitted steps, as fields of the one static bundle
`glmjax.model.config.Runtime` that every step takes: `moe_kernel` (its `kernel`) and `attention`
(its `impl`); changing either compiles new executables. `dtype`, `kv_dtype`, `index_dtype` and
`prefill_chunk` reach the steps only through the dtypes and shapes of their arrays. The rest
steer the host side (loading, the offload engine's tiers and threads, the KV pool).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from glmjax.errors import InputError

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DTYPES = ("auto", *_DTYPES)
# dtype="auto" on a CPU, by the weights' stored float dtype: bfloat16 weights stay bfloat16 (the
# numba kernel reads them exactly, accumulates in float32, and decoded 1.09-1.25x float32's in
# six quiet runs, at half the memory: DESIGN.md §12); anything else loads as float32 (float32
# weights are never rounded; float16 has no CPU kernel). Quantized dense leaves stay as the
# store holds them whatever the dtype.
CPU_AUTO_DTYPES = {"bfloat16": "bfloat16"}
CPU_FALLBACK_DTYPE = "float32"
MAX_PREFILL_CHUNK = 1 << 16
DEFAULT_PREFILL_CHUNK = 1024  # DESIGN.md §7: prefill speed and memory by chunk size


@dataclasses.dataclass(frozen=True)
class Options:
  """Options accepted by `glmjax.load(path, **options)`.

  Attributes:
    dtype: storage dtype of the float dense weights ("float32", "bfloat16", "float16", or
      "auto": the checkpoint's or store's own float dtype on an accelerator; on a CPU
      bfloat16 for bfloat16 weights (the measured fastest, exact) and float32 for any other,
      `CPU_AUTO_DTYPES`). Activations and accumulation are float32 regardless; a store's
      int8/int4 dense leaves stay quantized.
    moe_kernel: quantized-expert kernel: "cpu" (numba, deterministic), "pallas", "xla", or
      "auto" (cpu on a CPU-only machine, pallas on GPU/TPU).
    expert_compute: where an offload store's host-cached and missed experts are computed:
      "device" (uploaded and run by the device kernel; bitwise identical across budgets),
      "host" (the CPU kernel where the bytes already are; only hidden states cross the bus) or
      "auto" (per layer step, from measured costs; may differ by rounding from run to run).
      On a CPU-only machine every mode runs the CPU kernel and all are bitwise identical.
    progress: show progress bars while loading.
    max_context: upper bound on prompt + generated tokens (default: the config's
      max_position_embeddings).
    device_cache_gb: budget of the device-resident (pinned) expert pool; None = automatic from
      free memory, 0 = no device tier. Expert stores only.
    host_cache_gb: budget of the host-RAM LRU expert cache; None = automatic, 0 = none.
    io_workers: threads reading experts from the store.
    io_timeout_s: a read not done by then fails with an error naming the layer and expert.
    cold: drop the store's pages from the OS page cache before running (honest disk figures).
    prefetch: queue predicted experts (pilot and co-activation) for reading ahead.
    pilot_k: experts per position the pilot predicts for the next layer (colibri's default
      under real loads is 6; more floods the queue).
    couple_k: experts the co-activation table predicts for the next layer.
    cache_route: opt-in, lossy: keep the true top-`route_keep` experts and fill the other
      slots with resident experts among the top-`route_rank` by biased score (results then
      depend on cache state). Reports route_swap_rate, route_overlap, route_kl.
    route_keep: with cache_route, the true top experts always kept.
    route_rank: with cache_route, resident experts are taken from the top `route_rank` by
      biased score.
    expert_budget: opt-in, lossy (None = off): caps the experts a speculative verify pass
      reads per MoE layer. The step's most chosen experts (ties: summed router score) are kept
      and every token is routed within them; fewer experts are loaded at some cost in MTP
      acceptance. Must be ≥ the model's top-k. Expert stores only.
    attention: "sparse" (DSA: a query that sees more than index_topk keys attends to its
      selected keys only, gathered) or "dense" (every key scored, the selection applied as a
      mask: the reference, and what training distils the indexer from).
    prefill_chunk: a prompt longer than this is written into the KV cache chunk by chunk
      (0 = one piece; None = DEFAULT_PREFILL_CHUNK, chosen by measurement); bounds every
      step's temporaries.
    kv_dtype: the KV cache's latent and rope-key dtype ("float32", "bfloat16"; "auto" =
      float32 on a CPU, elsewhere the dense dtype, bfloat16 for float16 weights).
    index_dtype: the cached indexer keys' dtype ("float32", "bfloat16", "float8"; "auto" =
      the KV dtype).
    prefix_cache: `generate` reuses the KV pages of prompt prefixes an earlier call prefilled
      (full pages of 256 positions; glmjax.decoding.prefix), kept until the pool needs them.
      Off by default in the library (cached pages hold memory); the server turns it on.
    compile_cache: keep compiled steps in JAX's persistent cache (in $GLMJAX_CACHE, else
      ~/.cache/glmjax/xla; a directory already configured for JAX is kept), so the next
      process loads them instead of compiling. False leaves JAX's setting as it is.
    compile_unit: what a resident (or fused offloaded) step compiles as: "layer" (each decoder
      layer two programs, attention and MLP, each shared by the layers with that half: compile
      time flat in depth), "step" (the whole step one program: as fast to compile for a
      shallow model, fewer dispatches), or "auto" ("step" up to two layers per distinct layer,
      else "layer"; measured on a CPU, DESIGN.md §4).
  """

  dtype: str = "auto"
  moe_kernel: str = "auto"
  expert_compute: str = "device"
  progress: bool = True
  max_context: int | None = None
  device_cache_gb: float | None = None
  host_cache_gb: float | None = None
  io_workers: int = 4
  io_timeout_s: float = 60.0
  cold: bool = False
  prefetch: bool = True
  pilot_k: int = 6
  couple_k: int = 4
  cache_route: bool = False
  route_keep: int = 2
  route_rank: int = 12
  expert_budget: int | None = None
  attention: str = "sparse"
  prefill_chunk: int | None = None
  kv_dtype: str = "auto"
  index_dtype: str = "auto"
  prefix_cache: bool = False
  compile_cache: bool = True
  compile_unit: str = "auto"

  def __post_init__(self):
    if self.dtype not in DTYPES:
      raise InputError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
    if self.moe_kernel not in ("auto", "cpu", "pallas", "xla"):
      raise InputError(f"moe_kernel must be 'auto', 'cpu', 'pallas' or 'xla', got "
                       f"{self.moe_kernel!r}")
    if self.expert_compute not in ("auto", "device", "host"):
      raise InputError(f"expert_compute must be 'auto', 'device' or 'host', got "
                       f"{self.expert_compute!r}")
    if self.max_context is not None and self.max_context < 1:
      raise InputError(f"max_context must be positive, got {self.max_context}")
    if not isinstance(self.io_workers, int) or self.io_workers < 1:
      raise InputError(f"io_workers must be an integer ≥ 1, got {self.io_workers!r}")
    for name in ("pilot_k", "couple_k", "route_keep", "route_rank"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 0:
        raise InputError(f"{name} must be an integer ≥ 0, got {v!r}")
    if self.expert_budget is not None and (not isinstance(self.expert_budget, int)
                                           or self.expert_budget < 1):
      raise InputError(f"expert_budget must be a positive integer or None, got "
                       f"{self.expert_budget!r}")
    if not self.io_timeout_s > 0:
      raise InputError(f"io_timeout_s must be > 0, got {self.io_timeout_s}")
    if not isinstance(self.compile_cache, bool):
      raise InputError(f"compile_cache must be True or False, got {self.compile_cache!r}")
    if not isinstance(self.prefix_cache, bool):
      raise InputError(f"prefix_cache must be True or False, got {self.prefix_cache!r}")
    if self.compile_unit not in ("auto", "layer", "step"):
      raise InputError(f"compile_unit must be 'auto', 'layer' or 'step', got "
                       f"{self.compile_unit!r}")
    if self.attention not in ("sparse", "dense"):
      raise InputError(f"attention must be 'sparse' or 'dense', got {self.attention!r}")
    if self.prefill_chunk is None:  # frozen: the default is filled in once, here
      object.__setattr__(self, "prefill_chunk", DEFAULT_PREFILL_CHUNK)
    if (isinstance(self.prefill_chunk, bool) or not isinstance(self.prefill_chunk, int)
        or not 0 <= self.prefill_chunk <= MAX_PREFILL_CHUNK):
      raise InputError(f"prefill_chunk must be an integer in [0, {MAX_PREFILL_CHUNK}] (0 = one "
                       f"piece), got {self.prefill_chunk!r}")
    if self.kv_dtype not in ("auto", "float32", "bfloat16"):
      raise InputError(f"kv_dtype must be 'auto', 'float32' or 'bfloat16', got {self.kv_dtype!r}")
    if self.index_dtype not in ("auto", "float32", "bfloat16", "float8"):
      raise InputError(f"index_dtype must be 'auto', 'float32', 'bfloat16' or 'float8', got "
                       f"{self.index_dtype!r}")

  @property
  def offload_set(self) -> bool:
    """Whether any offload option differs from its default."""
    return (self.device_cache_gb, self.host_cache_gb, self.io_workers, self.cold,
            self.prefetch, self.pilot_k, self.couple_k, self.cache_route,
            self.expert_compute, self.expert_budget) != (None, None, 4, False, True, 6, 4,
                                                         False, "device", None)

  @classmethod
  def from_kwargs(cls, **kwargs) -> "Options":
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
      raise InputError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    return cls(**kwargs)

  def resolve_dtype(self, stored: str, platform: str) -> "Options":
    """These options with dtype="auto" made concrete for weights `stored` in that float dtype
    on `platform` ("cpu", "gpu", "tpu"); a concrete dtype is kept."""
    opts = self
    if platform == "cpu" and opts.kv_dtype == "auto":
      # float32 KV whatever the weights: a bfloat16 latent added 2.2e-4 KL (DESIGN.md §6),
      # and MLA's cache is small next to the weights.
      opts = dataclasses.replace(opts, kv_dtype="float32")
    if opts.dtype != "auto":
      return opts
    if platform == "cpu":
      name = CPU_AUTO_DTYPES.get(stored, CPU_FALLBACK_DTYPE)
    else:
      name = stored if stored in _DTYPES else "bfloat16"
    return dataclasses.replace(opts, dtype=name)

  @property
  def jnp_dtype(self):
    if self.dtype == "auto":
      raise InputError("dtype='auto' is resolved by load() against the weights' own dtype")
    return _DTYPES[self.dtype]

  @property
  def kv_dtype_name(self) -> str:
    if self.kv_dtype != "auto":
      return self.kv_dtype
    return "float32" if self.jnp_dtype == jnp.float32 else "bfloat16"

  @property
  def index_dtype_name(self) -> str:
    return self.kv_dtype_name if self.index_dtype == "auto" else self.index_dtype
