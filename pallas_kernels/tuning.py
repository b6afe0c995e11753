"""Block sizes for the grouped MoE kernels, looked up by problem shape.

Table key: ``(rows_bucket, D, I, bits, group_size)`` where ``rows_bucket`` is
the number of token rows R rounded up to a power of two and capped at 32
(1, 2, 4, 8, 16, 32 = "more than 16"). A missing key falls back to a default
chosen by rows bucket alone. ``resolve`` then fits the entry to the actual
shape (powers of two, not larger than the matrix, chunks that divide Kp), so
table entries are upper bounds and never have to be exact.

The GLM-5 entries are first guesses from the memory-bound model (decode reads
~19.5 MB per expert, so arithmetic must stay well below the DRAM time); rerun
scripts/bench_kernels.py on the target and edit them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Kernel tiling and code-shape choices.

  block_n: weight rows per program in the gate/up kernel (over I).
  block_n_down: weight rows per program in the down kernel (over D).
  block_k: input features consumed per inner-loop step (a multiple of G).
  mode: "fma" unrolls the (few) token rows and multiplies elementwise, so no
    work is spent on padding rows; "dot" pads rows to >= 16 and uses a matrix
    unit dot (better once there are many rows).
  precision: dot mode only, "highest" (exact f32 products) or "tf32x3"
    (three tensor-core passes, ~f32 accurate; GPU only).
  num_warps / num_stages: Triton launch parameters (ignored elsewhere).
  """

  block_n: int = 64
  block_n_down: int = 64
  block_k: int = 256
  mode: str = "fma"
  precision: str = "highest"
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if self.mode not in ("fma", "dot"):
      raise ValueError(f"mode must be 'fma' or 'dot', got {self.mode!r}")
    if self.precision not in ("highest", "tf32x3"):
      raise ValueError(
          f"precision must be 'highest' or 'tf32x3', got {self.precision!r}")
    for name in ("block_n", "block_n_down", "block_k"):
      v = getattr(self, name)
      if v <= 0 or v & (v - 1):
        raise ValueError(f"{name} must be a positive power of two, got {v}")


def rows_bucket(rows: int) -> int:
  """R rounded up to a power of two, capped at 32."""
  b = 1
  while b < rows and b < 32:
    b *= 2
  return b


_DEFAULTS = {
    1: BlockConfig(block_n=32, block_n_down=32, block_k=128, mode="fma"),
    2: BlockConfig(block_n=32, block_n_down=32, block_k=128, mode="fma"),
    4: BlockConfig(block_n=32, block_n_down=32, block_k=128, mode="fma"),
    8: BlockConfig(block_n=64, block_n_down=64, block_k=128, mode="dot"),
    16: BlockConfig(block_n=64, block_n_down=64, block_k=128, mode="dot"),
    32: BlockConfig(block_n=64, block_n_down=64, block_k=128, mode="dot"),
}

# (rows_bucket, D, I, bits, group_size) -> BlockConfig
TABLE: dict[tuple[int, int, int, int, int], BlockConfig] = {}


def lookup(rows: int, d: int, i: int, bits: int, group: int) -> BlockConfig:
  """The table entry for this shape, else the rows-bucket default."""
  b = rows_bucket(rows)
  return TABLE.get((b, d, i, bits, group), _DEFAULTS[b])


def _pow2_floor(n: int) -> int:
  return 1 << (max(n, 1).bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class Tiling:
  """A BlockConfig fitted to one matrix: ``block_n`` rows, ``groups`` groups per step."""

  block_n: int
  groups: int


def fit(block_n: int, block_k: int, n: int, k_groups: int, group_size: int,
        platform: str = "gpu") -> Tiling:
  """Fits block sizes to an ``[n, k_groups * group_size]`` matrix.

  GPU/interpreter: block_n is capped at the largest power of two <= n, so a
  block never exceeds the matrix (the edge block is shifted back to overlap
  instead of reading past the end). TPU: the output's minor block dim must be
  a multiple of 128 lanes or the whole dim; Pallas masks partial edge blocks.

  The per-step group count is the largest power of two that divides k_groups
  and keeps the step within block_k, so the contraction never needs a mask.
  """
  if platform == "tpu":
    lanes = max(128, -(-block_n // 128) * 128)
    bn = n if n <= lanes else lanes
  else:
    bn = min(block_n, _pow2_floor(n))
  g = 1
  while (k_groups % (2 * g) == 0) and (2 * g * group_size <= block_k):
    g *= 2
  return Tiling(block_n=bn, groups=g)
