"""glmjax's compute kernels. Standalone: nothing here imports ``glmjax``
(tests/test_architecture.py); weights arrive as arrays plus their format, or as objects with a
quantized matrix's fields (packed, scales, bits, group_size, in_features).

Four families:

* numba CPU kernels, deterministic (an output row's bits do not depend on the batch, the code
  path or the thread count): ``cpu_vec`` (the 16-lane vector operations they compute with),
  ``cpu_rows`` (group-wise int4/int8 row kernels), ``cpu`` (MoE experts: one expert, or a
  pool's terms), ``cpu_dense`` (dense int4/int8/bf16 matmuls and an MLA kv_b per head);
  ``cpu_stream`` (the memory roof they are measured against) and ``numba_cache`` (a lock
  around numba's on-disk cache).
* The same kernels as XLA custom calls inside ``jax.jit``, zero-copy: ``cpu_ffi`` (expert
  terms), ``cpu_dense_ffi`` (dense matmuls, kv_b heads), ``ffi_common`` (reading the call
  frame, the first-use self-test and the ``jax.pure_callback`` fallback).
* Pallas GPU/TPU kernels: ``ops`` (grouped MoE terms, quantized dense matmuls, their backend
  choice; ``ops.grouped_moe`` is the standalone MoE op the benchmarks measure), ``backend``
  (the kernel bodies), ``tuning`` (block configs), ``common`` (platform and device queries).
* XLA fallbacks in pure JAX: ``xla`` (the format's ``dequantize``, per-pair expert terms, the
  rank-ordered combine).

Which kernel a model runs is glmjax's choice (``glmjax/model/kernels.py``, the only model
module that imports this package); the names exported here are the ones it calls. They are
looked up on use, so ``import pallas_kernels`` loads no numba until a CPU kernel is asked for.
"""

import importlib

# name -> the module that defines it: what glmjax runs.
_EXPORTS = {
    # numba CPU kernels: one host-held expert (numpy in, numpy out).
    "expert_ffn": "cpu",
    # ... inside jax.jit as custom calls: a pool's expert terms, dense matmuls, kv_b heads.
    "pool_terms_xla": "cpu_ffi",
    "matmul_xla": "cpu_dense_ffi",
    "heads_xla": "cpu_dense_ffi",
    "BF16": "cpu_dense",  # the `bits` code of a bfloat16 weight
    "KEYS": "cpu_dense",  # heads_xla's two uses of a kv_b
    "VALUES": "cpu_dense",
    # Pallas (accelerators): a pool's expert terms, quantized dense matmuls.
    "grouped_terms": "ops",
    "dense_matmul": "ops",
    # XLA: the format's definition, per-pair expert terms, the ordered combine.
    "dequantize": "xla",
    "unpack_int4": "xla",
    "take_experts": "xla",
    "expert_terms": "xla",
    "combine_in_order": "xla",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  """An exported name, looked up in its module at each access (so a test's stand-in for the
  module's function is what callers get)."""
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")
  return getattr(importlib.import_module(f"pallas_kernels.{module}"), name)
