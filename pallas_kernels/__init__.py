"""Pallas kernels for glmjax: one grouped quantized MoE op."""

from pallas_kernels.ops import grouped_moe

__all__ = ["grouped_moe"]
