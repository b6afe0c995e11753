"""Pallas kernels for grouped (per-expert) quantized matmuls.

One kernel body, two ways of reaching the selected experts' weights:

* "prefetch" (TPU, and the interpreter): the unique slot ids are
  scalar-prefetched and each weight BlockSpec's index_map picks
  ``slots[u]``, so the pipeline DMAs only selected experts. The grid is
  ``(N blocks, U)`` with U fastest: padding entries repeat the last real slot,
  so their block index does not change and nothing is fetched again.
* "pointer" (GPU/Triton, which has no scalar prefetch): weights stay whole
  arrays in HBM; each program loads its slot id and reads only that expert's
  rows through dynamic slices.

Both compute, for unique expert ``u`` and a block of ``bn`` weight rows,
``out[u, r, n] = sum_k x[a, r, k] * W[slots[u], p, n, k]`` over all rows r,
dequantizing in registers one step of ``groups`` quantization groups at a
time and accumulating in float32. With ``parts == 2`` the two parts are gate
and up and the epilogue is ``silu(gate) * up``.

Data layout the kernels see (free reshapes of the QArray leaves)::

    w       [S, P, N, KG, W]  uint8 (int4) / int8     KG = Kp/G groups
    scales  [S, P, N, KG]     bf16                    W = G/2 (int4) or G
    x_h     [A, Rx, KG, W]    f32, one array per nibble half h
    out     [U, Rx, N]        f32

For int4, half 0 is the first G/2 features of every group (low nibbles) and
half 1 the second G/2 (high nibbles), matching glmjax.model.quant's layout, so
activations are split once outside the kernel instead of shuffling nibbles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import tuning


@dataclasses.dataclass(frozen=True)
class MatmulSpec:
  """Static description of one grouped matmul launch.

  parts: 2 = fused gate/up with SwiGLU epilogue, 1 = plain (down).
  n: weight rows per part (I for gate/up, D for down).
  k_groups: quantization groups along the contraction (Kp / G).
  width: W, bytes per group and half (G/2 for int4, G for int8).
  bits: 4 or 8.
  rows: Rx, activation rows per expert (R, or padded to >= 16 in dot mode).
  """

  parts: int
  n: int
  k_groups: int
  width: int
  bits: int
  rows: int
  tiling: tuning.Tiling
  mode: str = "fma"
  precision: str = "highest"
  num_warps: int = 4
  num_stages: int = 2

  @property
  def halves(self) -> int:
    return 2 if self.bits == 4 else 1

  @property
  def steps(self) -> int:
    return self.k_groups // self.tiling.groups

  @property
  def num_blocks(self) -> int:
    return pl.cdiv(self.n, self.tiling.block_n)


def _dot_precision(name: str):
  if name == "tf32x3":
    return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  return lax.Precision.HIGHEST


# OR-ing a 4-bit integer u into the mantissa of float32 2^23 gives exactly
# 2^23 + u; subtracting 2^23 + 8 then yields u - 8 = q. Two full-rate ALU ops
# (which ptxas can fold with the nibble mask) instead of an int->float
# conversion, which runs at a fraction of the FMA rate on NVIDIA GPUs.
_MAGIC_BITS = 0x4B000000
_MAGIC_MINUS_OFFSET = float(2**23 + 8)


def _nibble_to_f32(u):
  """int32 nibble u in [0, 15] -> float32 (u - 8), exactly."""
  return (lax.bitcast_convert_type(u | _MAGIC_BITS, jnp.float32)
          - _MAGIC_MINUS_OFFSET)


def _dequant(spec: MatmulSpec, raw, scales):
  """Raw ints [bn, g, W] -> per-half float q values; scales [bn, g] -> f32."""
  w = raw.astype(jnp.int32)  # uint8 zero-extends: nibbles stay unsigned
  if spec.bits == 4:
    qs = [_nibble_to_f32(w & 0xF), _nibble_to_f32(lax.shift_right_logical(w, 4))]
  else:
    qs = [w.astype(jnp.float32)]
  return qs, scales.astype(jnp.float32)


def _body(spec: MatmulSpec, load_x, load_w, load_s, store_row, store_all):
  """Shared compute: loop over K steps, then the epilogue and stores."""
  bn, g, rx = spec.tiling.block_n, spec.tiling.groups, spec.rows
  parts, halves = spec.parts, spec.halves

  if spec.mode == "fma":
    # Rows are unrolled: each dequantized block is reused for every row with
    # vector multiply-and-reduce, so absent rows cost nothing (a GPU dot
    # would pad a single decode row to 16).
    def step(c, acc):
      acc = list(acc)
      xs = [[load_x(h, c, r) for r in range(rx)]  # [g, W] each
            for h in range(halves)]
      for p in range(parts):
        qs, s = _dequant(spec, load_w(p, c), load_s(p, c))  # [bn, g, W]
        for r in range(rx):
          t = jnp.sum(qs[0] * xs[0][r][None], axis=-1)  # [bn, g]
          for h in range(1, halves):
            t = t + jnp.sum(qs[h] * xs[h][r][None], axis=-1)
          # Scales are per (row, group): apply after the in-group sum.
          acc[p * rx + r] = acc[p * rx + r] + jnp.sum(t * s, axis=-1)
      return tuple(acc)

    init = tuple(jnp.zeros((bn,), jnp.float32) for _ in range(parts * rx))
    acc = lax.fori_loop(0, spec.steps, step, init)
    for r in range(rx):
      y = acc[r]
      if parts == 2:
        y = jax.nn.silu(y) * acc[rx + r]
      store_row(r, y)  # [bn]
    return

  precision = _dot_precision(spec.precision)

  def step(c, acc):
    acc = list(acc)
    xs = [load_x(h, c, None).reshape(rx, g * spec.width)  # [Rx, g*W]
          for h in range(halves)]
    for p in range(parts):
      qs, s = _dequant(spec, load_w(p, c), load_s(p, c))
      for h in range(halves):
        wt = (qs[h] * s[:, :, None]).reshape(bn, g * spec.width)  # [bn, g*W]
        acc[p] = acc[p] + lax.dot_general(
            xs[h], wt, (((1,), (1,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)  # [Rx, bn]
    return tuple(acc)

  init = tuple(jnp.zeros((rx, bn), jnp.float32) for _ in range(parts))
  acc = lax.fori_loop(0, spec.steps, step, init)
  y = jax.nn.silu(acc[0]) * acc[1] if parts == 2 else acc[0]
  store_all(y)  # [Rx, bn]


def block_start(j, block_n: int, n: int):
  """First row of block j; the last block is shifted back to end at n.

  Needs block_n <= n (tuning.fit guarantees it on GPU). Overlapping rows are
  recomputed with identical inputs and code, so they store identical values
  and no mask is needed.
  """
  return jnp.minimum(j * block_n, n - block_n)


def _compiler_params(spec: MatmulSpec, platform: str):
  if platform == "gpu":
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=spec.num_warps,
                                num_stages=spec.num_stages)
  if platform == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "arbitrary"))
  return None


def grouped_matmul_pointer(spec: MatmulSpec, xs, w, s, slots, n_unique, *,
                           interpret, platform):
  """Pointer flavour (GPU): whole-array refs, per-program dynamic slices.

  xs: halves x [A, Rx, KG, W]; w [S, P, N, KG, W]; s [S, P, N, KG];
  slots [U] int32 (unique, padded); n_unique [1] int32. Returns [U, Rx, N].
  Rows of ``out`` for padding entries u >= n_unique are left unwritten.
  """
  u_total, a_total = slots.shape[0], xs[0].shape[0]
  bn, g, n = spec.tiling.block_n, spec.tiling.groups, spec.n
  halves = spec.halves

  def kernel(slots_ref, n_ref, *refs):
    x_refs, (w_ref, s_ref, o_ref) = refs[:halves], refs[halves:]
    u, j = pl.program_id(0), pl.program_id(1)

    @pl.when(u < n_ref[0])
    def _():
      slot = slots_ref[u]
      a = u if a_total > 1 else 0
      n0 = block_start(j, bn, n)

      def load_x(h, c, r):
        rows = slice(None) if r is None else r
        return x_refs[h][a, rows, pl.ds(c * g, g), :]

      def load_w(p, c):
        return w_ref[slot, p, pl.ds(n0, bn), pl.ds(c * g, g), :]

      def load_s(p, c):
        return s_ref[slot, p, pl.ds(n0, bn), pl.ds(c * g, g)]

      def store_row(r, v):
        o_ref[u, r, pl.ds(n0, bn)] = v

      def store_all(v):
        o_ref[u, :, pl.ds(n0, bn)] = v

      _body(spec, load_x, load_w, load_s, store_row, store_all)

  out_shape = jax.ShapeDtypeStruct((u_total, spec.rows, n), jnp.float32)
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=(u_total, spec.num_blocks),
      interpret=interpret, name=f"grouped_q{spec.bits}_p{spec.parts}_ptr",
      compiler_params=None if interpret else _compiler_params(spec, platform),
  )(slots, n_unique, *xs, w, s)


def grouped_matmul_prefetch(spec: MatmulSpec, xs, w, s, slots, n_unique, *,
                            interpret, platform):
  """Prefetch flavour (TPU/interpreter): slot ids drive the BlockSpecs.

  Same arguments and result as ``grouped_matmul_pointer``.
  """
  from jax.experimental.pallas import tpu as pltpu

  u_total, a_total = slots.shape[0], xs[0].shape[0]
  bn, g, rx = spec.tiling.block_n, spec.tiling.groups, spec.rows
  kg, wd, parts, halves = spec.k_groups, spec.width, spec.parts, spec.halves
  sq = pl.squeezed

  def x_map(j, u, slots_ref, n_ref):
    return (u if a_total > 1 else 0, 0, 0, 0)

  def w_map(j, u, slots_ref, n_ref):
    return (slots_ref[u], 0, j, 0, 0)

  def s_map(j, u, slots_ref, n_ref):
    return (slots_ref[u], 0, j, 0)

  def o_map(j, u, slots_ref, n_ref):
    return (u, 0, j)

  def kernel(slots_ref, n_ref, *refs):
    x_refs, (w_ref, s_ref, o_ref) = refs[:halves], refs[halves:]

    @pl.when(pl.program_id(1) < n_ref[0])
    def _():
      def load_x(h, c, r):
        rows = slice(None) if r is None else r
        return x_refs[h][rows, pl.ds(c * g, g), :]

      def load_w(p, c):
        return w_ref[p, :, pl.ds(c * g, g), :]

      def load_s(p, c):
        return s_ref[p, :, pl.ds(c * g, g)]

      def store_row(r, v):
        o_ref[r, :] = v

      def store_all(v):
        o_ref[...] = v

      _body(spec, load_x, load_w, load_s, store_row, store_all)

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(spec.num_blocks, u_total),
      in_specs=[pl.BlockSpec((sq, rx, kg, wd), x_map)] * halves + [
          pl.BlockSpec((sq, parts, bn, kg, wd), w_map),
          pl.BlockSpec((sq, parts, bn, kg), s_map),
      ],
      out_specs=pl.BlockSpec((sq, rx, bn), o_map),
  )
  out_shape = jax.ShapeDtypeStruct((u_total, rx, spec.n), jnp.float32)
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid_spec=grid_spec, interpret=interpret,
      name=f"grouped_q{spec.bits}_p{spec.parts}_pf",
      compiler_params=None if interpret else _compiler_params(spec, platform),
  )(slots, n_unique, *xs, w, s)


FLAVOURS = {
    "pointer": grouped_matmul_pointer,
    "prefetch": grouped_matmul_prefetch,
}
