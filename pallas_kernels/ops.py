"""The public grouped int4/int8 MoE op, the dense quantized matmul built on the same kernel,
and their backend choice."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import backend as _backend
from pallas_kernels import common, xla, tuning

_BACKENDS = ("auto", "pallas", "xla")


def _check_args(x, pool, slot_ids, weights) -> None:
  pool.check()
  if x.ndim != 2 or x.shape[1] != pool.hidden:
    raise ValueError(
        f"x: expected [R, D] with D={pool.hidden}, got shape {tuple(x.shape)}")
  if slot_ids.ndim != 2 or slot_ids.shape[0] != x.shape[0]:
    raise ValueError(
        f"slot_ids: expected [R, K] with R={x.shape[0]}, got shape "
        f"{tuple(slot_ids.shape)}")
  if not jnp.issubdtype(slot_ids.dtype, jnp.integer):
    raise ValueError(f"slot_ids: expected an integer dtype, got {slot_ids.dtype}")
  if tuple(weights.shape) != tuple(slot_ids.shape):
    raise ValueError(
        f"weights: expected shape {tuple(slot_ids.shape)} (same as slot_ids), "
        f"got {tuple(weights.shape)}")


dedupe_slots = xla.dedupe_slots


def _split_halves(a, k_padded: int, group: int, halves: int):
  """a [A, Rx, K] -> per-half [A, Rx, KG, W], zero-padding K to k_padded."""
  a = jnp.pad(a, ((0, 0), (0, 0), (0, k_padded - a.shape[-1])))
  a = a.reshape(*a.shape[:2], k_padded // group, halves, group // halves)
  return tuple(a[..., h, :] for h in range(halves))


def _weights_view(q, parts: int):
  """QArray [S, parts*N, Kp(/2)] -> packed [S, P, N, KG, W], scales [S, P, N, KG]."""
  s, rows = q.packed.shape[:2]
  kg = q.padded_in_features // q.group_size
  w = q.packed.reshape(s, parts, rows // parts, kg, -1)
  return w, q.scales.reshape(s, parts, rows // parts, kg)


def _pow2_ceil(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _matmul_spec(parts: int, n: int, k_groups: int, block_n: int, group: int, bits: int,
                 rows: int, config: tuning.BlockConfig, platform: str) -> _backend.MatmulSpec:
  """One launch's spec: the config's tiling fitted to an `[n, k_groups · group]` matrix."""
  halves = 2 if bits == 4 else 1
  tiling = tuning.fit(block_n, config.block_k, n, k_groups, group, platform)
  mode = config.mode
  if min(tiling.block_n, tiling.groups * group // halves) < 16:
    mode = "fma"  # GPU dots need every dim >= 16; fma handles any rows
  return _backend.MatmulSpec(
      parts=parts, n=n, k_groups=k_groups, width=group // halves, bits=bits, rows=rows,
      tiling=tiling, mode=mode, precision=config.precision,
      num_warps=config.num_warps, num_stages=config.num_stages)


@functools.partial(jax.jit, static_argnames=(
    "interpret", "flavour", "config", "platform"))
def _pallas_moe(x, pool, slot_ids, weights, *, interpret,
                flavour, config: tuning.BlockConfig, platform):
  terms = _pallas_terms(x, pool, slot_ids, interpret=interpret, flavour=flavour, config=config,
                        platform=platform)
  with jax.named_scope("combine"):
    return xla.combine_in_order(terms, weights)


def _pallas_terms(x, pool, slot_ids, *, interpret, flavour,
                  config: tuning.BlockConfig, platform):
  """Unweighted per-(row, rank) terms [R, K, D] from the two grouped Pallas matmuls."""
  r, d = x.shape
  i, g, bits = pool.intermediate, pool.gate_up.group_size, pool.gate_up.bits
  halves = 2 if bits == 4 else 1
  # Dot mode needs >= 16 rows for the GPU matrix units; fma mode unrolls
  # exactly the rows present.
  rx = r if config.mode == "fma" else max(16, _pow2_ceil(r))
  call = functools.partial(_backend.FLAVOURS[flavour], interpret=interpret,
                           platform=platform)

  def spec(parts, n, k_padded, block_n):
    return _matmul_spec(parts, n, k_padded // g, block_n, g, bits, rx, config, platform)

  slot_ids = jnp.clip(slot_ids, 0, pool.num_slots - 1)
  with jax.named_scope("dedupe"):
    uniq, n_unique, inv = dedupe_slots(slot_ids)
  with jax.named_scope("gate_up"):
    xf = jnp.pad(x.astype(jnp.float32), ((0, rx - r), (0, 0)))  # [Rx, D]
    kp_d = pool.gate_up.padded_in_features
    xs = _split_halves(xf[None], kp_d, g, halves)  # [1, Rx, KG, W] each
    w, s = _weights_view(pool.gate_up, 2)
    h = call(spec(2, i, kp_d, config.block_n), xs, w, s, uniq, n_unique)
  with jax.named_scope("down"):
    kp_i = pool.down.padded_in_features
    hs = _split_halves(h, kp_i, g, halves)  # [U, Rx, IG, W] each
    w, s = _weights_view(pool.down, 1)
    y = call(spec(1, d, kp_i, config.block_n_down), hs, w, s, uniq, n_unique)
  return y[inv, jnp.arange(r)[:, None]]  # [R, K, D] terms


@jax.jit
def _reference_jit(x, pool, slot_ids, weights):
  slot_ids = jnp.clip(slot_ids, 0, pool.num_slots - 1)
  return xla.grouped_moe_reference(x, pool, slot_ids, weights)


def _interpret_flavour(plat: str, interpret: bool | None, flavour: str | None):
  """(interpret, flavour): interpreted on CPU, "pointer" compiled on GPU, else "prefetch"."""
  if interpret is None:
    interpret = plat == "cpu"
  if not interpret and plat == "cpu":
    raise ValueError("backend='pallas' on CPU needs interpret=True")
  if flavour is None:
    flavour = "pointer" if (plat == "gpu" and not interpret) else "prefetch"
  if flavour not in _backend.FLAVOURS:
    raise ValueError(
        f"flavour: expected one of {tuple(_backend.FLAVOURS)}, got {flavour!r}")
  return interpret, flavour


def _pallas_settings(x, pool, plat, interpret, flavour, config):
  """Resolves (interpret, flavour, config) for the Pallas path and checks what it needs."""
  interpret, flavour = _interpret_flavour(plat, interpret, flavour)
  g = pool.gate_up.group_size
  if not interpret and (g & (g - 1) or g < 4):
    # Triton tensors must have power-of-two sizes; groups are loaded whole.
    raise ValueError(
        f"pool: group_size must be a power of two >= 4 for compiled Pallas "
        f"kernels, got {g}")
  if not interpret and flavour == "pointer":
    for name, q in (("gate_up", pool.gate_up), ("down", pool.down)):
      if q.packed.size >= 2**31:
        # Triton-Pallas addresses whole-array refs with int32 offsets.
        raise ValueError(
            f"pool.{name}: {q.packed.size} packed elements overflow the "
            "int32 offsets of the GPU kernel; use a pool of fewer slots "
            f"(< {2**31 // (q.packed.size // pool.num_slots)})")
  if config is None:
    config = tuning.lookup(x.shape[0], pool.hidden, pool.intermediate,
                           pool.gate_up.bits, g)
  return interpret, flavour, config


def grouped_terms(x, pool, slot_ids, active=None):
  """Per-(row, rank) unweighted terms [R, K, D] through the Pallas kernels (traceable inside a
  caller's jit). Pairs where ``active`` [R, K] is False are 0."""
  _check_args(x, pool, slot_ids, jnp.zeros(slot_ids.shape))
  plat = common.platform()
  interpret, flavour, config = _pallas_settings(x, pool, plat, None, None, None)
  slot_ids = jnp.clip(slot_ids, 0, pool.num_slots - 1)
  terms = _pallas_terms(x, pool, slot_ids, interpret=interpret, flavour=flavour, config=config,
                        platform=plat)
  return terms if active is None else jnp.where(active[..., None], terms, 0.0)


def resolve_backend(backend: str, platform: str) -> str:
  """"auto" is the XLA path on CPU (Pallas only interprets there) and Pallas elsewhere."""
  if backend == "auto":
    return "xla" if platform == "cpu" else "pallas"
  return backend


def grouped_moe(x, pool, slot_ids, weights, *,
                backend: str = "auto", interpret: bool | None = None,
                flavour: str | None = None,
                config: tuning.BlockConfig | None = None):
  """Routed-expert FFN for a few token rows over a pool of quantized experts.

  ``out[r] = sum_{k=0..K-1} weights[r, k] * down_e(silu(gate_e x[r]) * up_e x[r])``
  with ``e = slot_ids[r, k]``, summed in rank order k = 0..K-1.

  Args:
    x: [R, D] activations (any float dtype).
    pool: ExpertPool with gate_up [S, 2I, D] and down [S, D, I].
    slot_ids: [R, K] int pool slots. Out-of-range ids are clamped (there is
      no bounds check on device).
    weights: [R, K] routing weights.
    backend: "pallas", "xla", or "auto" (pallas on GPU/TPU, xla on CPU).
    interpret: run the Pallas kernels in interpret mode (default: on CPU).
    flavour: "pointer" (GPU) or "prefetch" (TPU; scalar-prefetched
      BlockSpecs); default by platform, "prefetch" when interpreting on CPU.
    config: override the tuning-table BlockConfig.

  Returns:
    [R, D] float32. Each (r, k) term is independent of which slot an expert
    occupies and of the other selections, so results are bitwise identical
    under any permutation of the pool.
  """
  if backend not in _BACKENDS:
    raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
  _check_args(x, pool, slot_ids, weights)
  plat = common.platform()
  backend = resolve_backend(backend, plat)
  if backend == "xla":
    return _reference_jit(x, pool, slot_ids, weights)
  interpret, flavour, config = _pallas_settings(x, pool, plat, interpret, flavour, config)
  return _pallas_moe(x, pool, slot_ids, weights, interpret=interpret,
                     flavour=flavour, config=config, platform=plat)


# Rows at most this many go through the Pallas kernel (decode and MTP verify): every row of a
# block is held at once, as for the experts. More rows (prefill chunks) are compute-bound, so
# XLA dequantizes and dots: the weight is read once for all of them.
DENSE_PALLAS_ROWS = 32


def dense_backend(backend: str, platform: str, rows: int, q) -> str:
  """"auto": XLA on CPU (Pallas only interprets there), for more than ``DENSE_PALLAS_ROWS``
  rows, and for matrices the compiled kernel cannot address (a group size that is not a power
  of two, or 2³¹ packed elements and more: Triton's int32 offsets); Pallas otherwise."""
  if backend not in _BACKENDS:
    raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
  if backend == "auto":
    g = q.group_size
    fits = g >= 4 and not g & (g - 1) and q.packed.size < 2**31
    return "pallas" if platform != "cpu" and rows <= DENSE_PALLAS_ROWS and fits else "xla"
  return backend


def _dense_xla(x, q):
  """x @ dequantize(q)ᵀ: XLA dequantizes the whole matrix, then dots in float32."""
  w = xla.dequantize(q)  # [O, K]
  return jnp.einsum("ri,oi->ro", x, w)  # default precision, as for float32 weights


def _dense_pallas(x, q, *, interpret, flavour, config, platform):
  """The grouped kernel with one expert of one part: the dense matrix as slot 0."""
  r, o = x.shape[0], q.packed.shape[0]
  g, bits = q.group_size, q.bits
  halves = 2 if bits == 4 else 1
  kg = q.scales.shape[-1]
  kp = kg * g
  rx = r if config.mode == "fma" else max(16, _pow2_ceil(r))
  spec = _matmul_spec(1, o, kg, config.block_n_down, g, bits, rx, config, platform)
  xf = jnp.pad(x, ((0, rx - r), (0, 0)))  # [Rx, K]
  xs = _split_halves(xf[None], kp, g, halves)  # [1, Rx, KG, W] each
  w = q.packed.reshape(1, 1, o, kg, -1)
  s = q.scales.reshape(1, 1, o, kg)
  one = jnp.zeros((1,), jnp.int32)
  call = _backend.FLAVOURS[flavour]
  y = call(spec, xs, w, s, one, one + 1, interpret=interpret, platform=platform)
  return y[0, :r]


def dense_matmul(x, q, *, backend: str = "auto", interpret: bool | None = None,
                 flavour: str | None = None, config: tuning.BlockConfig | None = None):
  """``x @ wᵀ`` for a quantized dense matrix ``q`` (a QArray-like with packed ``[O, Kp(/2)]``,
  scales ``[O, KG]``, bits, group_size, in_features): ``x [..., K]`` -> ``[..., O]`` float32.

  Pallas: the grouped MoE kernel's body with the matrix as the only expert of one part
  (dequantized in registers one step of groups at a time, float32 accumulation). XLA:
  dequantize, then a float32 dot. ``backend="auto"`` picks by platform and rows
  (`dense_backend`). Traceable inside a caller's jit."""
  lead, k = x.shape[:-1], x.shape[-1]
  if q.packed.ndim != 2 or k != q.in_features:
    raise ValueError(f"dense_matmul: x [..., {k}] against a [O, {q.in_features}] matrix with "
                     f"packed shape {tuple(q.packed.shape)}")
  x2 = x.reshape(-1, k).astype(jnp.float32)
  plat = common.platform()
  if dense_backend(backend, plat, x2.shape[0], q) == "xla":
    y = _dense_xla(x2, q)
  else:
    interpret, flavour = _interpret_flavour(plat, interpret, flavour)
    if config is None:
      config = tuning.lookup(x2.shape[0], k, q.packed.shape[0], q.bits, q.group_size)
    y = _dense_pallas(x2, q, interpret=interpret, flavour=flavour, config=config, platform=plat)
  return y.reshape(*lead, q.packed.shape[0])
