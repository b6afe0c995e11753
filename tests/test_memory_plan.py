"""load()'s memory plan (glmjax.offload.budget) and dtype="auto".

The plan is checked against sizes computed here independently (from the safetensors header and
GLM-5's published shapes), and refusals against memory made small on purpose.
"""

import collections
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

import glmjax
from glmjax import options as options_mod
from glmjax.formats.safetensors_io import SafetensorsFile
from glmjax.model import weights
from glmjax.model.config import Config
from glmjax.offload import budget
from glmjax.options import Options

from test_config import GLM5

GiB = 1 << 30
EMBEDDED = os.path.join(os.path.dirname(glmjax.__file__), "embedded_model")


def test_dtype_auto_is_the_default_and_resolves_by_platform():
  o = Options()
  assert o.dtype == "auto"
  # On a CPU: bfloat16 weights stay bfloat16 (exact, the faster kernel); others are float32.
  for stored, want in (("bfloat16", "bfloat16"), ("float32", "float32"), ("float16", "float32")):
    cpu = o.resolve_dtype(stored, "cpu")
    assert (cpu.dtype, cpu.kv_dtype_name, cpu.index_dtype_name) == (want, "float32", "float32")
  gpu = o.resolve_dtype("bfloat16", "gpu")
  assert (gpu.dtype, gpu.kv_dtype_name) == ("bfloat16", "bfloat16")
  assert o.resolve_dtype("float16", "tpu").dtype == "float16"
  assert o.resolve_dtype("float32", "gpu").kv_dtype_name == "float32"
  assert Options(dtype="bfloat16").resolve_dtype("float32", "cpu").dtype == "bfloat16"
  assert Options(kv_dtype="bfloat16").resolve_dtype("bfloat16", "cpu").kv_dtype == "bfloat16"
  with pytest.raises(glmjax.InputError, match="dtype must be one of auto"):
    Options(dtype="int3")


class _Memory(collections.namedtuple("_Memory", "available total")):
  pass


def _machine(monkeypatch, available: int, total: int, rss: int = 0, margin: bool = False):
  """Host memory as `budget` sees it: psutil's figures, no cgroup or GLMJAX_MEMORY_GB limit,
  this process's RSS `rss`, and no host margin unless `margin`."""
  monkeypatch.setattr(budget.psutil, "virtual_memory", lambda: _Memory(available, total))
  monkeypatch.setattr(budget, "PROC_CGROUP", "/nonexistent/cgroup")
  monkeypatch.setattr(budget, "CGROUP_ROOT", "/nonexistent")
  monkeypatch.delenv(budget.MEMORY_ENV, raising=False)
  monkeypatch.setattr(budget, "_process_rss", lambda: rss)
  if not margin:
    monkeypatch.setattr(budget, "HOST_MARGIN_MIN", 0)
    monkeypatch.setattr(budget, "HOST_MARGIN_FRACTION", 0)
    monkeypatch.setattr(budget, "HOST_FLOOR_MIN", 0)
    monkeypatch.setattr(budget, "HOST_FLOOR_FRACTION", 0)


def _embedded_sizes():
  """Elements of the embedded checkpoint's routed-expert tensors, and the bytes of all others in
  their stored dtypes, from its safetensors header (independent of the weight declaration)."""
  f = SafetensorsFile(os.path.join(EMBEDDED, "model.safetensors"))
  experts = other_bytes = 0
  for name in f.keys():
    dtype, shape = f.info(name)
    n = int(np.prod(shape))
    if re.search(r"\.mlp\.experts\.\d+\.", name):
      experts += n
    else:
      other_bytes += n * np.dtype(dtype).itemsize
  return experts, other_bytes


def test_checkpoint_plan_equals_the_header_and_a_small_machine_is_refused(monkeypatch):
  # The defaults: dtype auto keeps the embedded model's bfloat16 weights bfloat16 on a CPU, and
  # its float32 tensors (routers, their biases, the indexers' head weights) float32.
  m = glmjax.load(progress=False)
  assert m.options.dtype == options_mod.CPU_AUTO_DTYPES["bfloat16"] == "bfloat16"
  assert m.weights.layers[0].attn.q_a.dtype == jnp.bfloat16
  experts, other_bytes = _embedded_sizes()
  cfg = m.config
  # The main layers' KV rows of one sequence, PLAN_KV_POSITIONS or max_context positions.
  per_pos = sum((cfg.kv_lora_rank + cfg.qk_rope_head_dim + (cfg.index_head_dim
                 if cfg.has_indexer(i) else 0)) * 4 for i in range(cfg.num_hidden_layers))
  plan = m.memory
  assert (plan.experts, plan.dense_format) == (2 * experts, "bfloat16")
  positions = min(budget.PLAN_KV_POSITIONS, m.max_context)
  assert plan.dense == other_bytes and plan.kv == per_pos * positions  # a float32 KV cache
  assert plan.dense == weights.nbytes(weights.dense_only(m.weights))

  # The plan counts what the process held when it planned (its RSS then), and what it takes
  # later besides the other parts.
  assert plan.runtime > 0 and plan.parts()["runtime (this process now)"] == plan.runtime
  assert plan.growth == budget.RUNTIME_GROWTH
  assert plan.total == plan.runtime + plan.growth + plan.dense + plan.kv + plan.experts

  # A machine with less free memory than the plan: refused before anything is read, and the
  # message lists every part with its bytes and the memory there is (what the process holds
  # now and what it may still allocate).
  need = plan.dense + plan.kv + plan.experts
  avail = need // 2
  _machine(monkeypatch, avail, avail, rss=plan.runtime)
  with pytest.raises(glmjax.InputError) as e:
    glmjax.load(progress=False)
  msg = str(e.value)
  for label, value in plan.parts().items():
    assert re.search(rf"{re.escape(label)}\s+{value / GiB:.3f} GB", msg), (label, msg)
  assert re.search(rf"available\s+{(avail + plan.runtime) / GiB:.3f} GB", msg), msg


def test_store_plan_lists_the_tiers_when_they_do_not_fit(embedded_store, monkeypatch):
  with glmjax.load(embedded_store, progress=False, host_cache_gb=0.001) as m:
    plan = m.memory
    assert plan.host_cache == int(0.001 * GiB) and plan.device_cache == 0
    assert plan.dense == weights.nbytes(weights.dense_only(m.weights)) and plan.kv > 0
  # room for the rest, not for 1 GB more
  free = plan.growth + plan.dense + plan.kv + plan.working + plan.prefetch + GiB // 2
  _machine(monkeypatch, free, free, rss=plan.runtime)
  with pytest.raises(glmjax.InputError) as e:
    glmjax.load(embedded_store, progress=False, host_cache_gb=1.0)
  msg = str(e.value)
  assert re.search(r"host expert cache\s+1\.000 GB", msg), msg
  assert re.search(rf"dense weights \(bfloat16\)\s+{plan.dense / GiB:.3f} GB", msg), msg


@pytest.mark.parametrize("fmt,fits", [("float32", False), ("bfloat16", False), ("int8", True),
                                      ("int4", True)])
def test_glm5_plan_on_a_32gb_accelerator(monkeypatch, fmt, fits):
  """GLM-5's full geometry on a 32 GB card, from abstract shapes only: float32 and bfloat16
  dense weights are refused with each part listed; int8 and int4 leave room for pinned
  experts, which the automatic device budget takes."""
  cfg = Config.from_dict(GLM5)
  dense = weights.dense_plan(cfg, fmt)["total"]
  monkeypatch.setattr(budget, "_device_free", lambda: 32 * GiB)
  _machine(monkeypatch, 200 * GiB, 256 * GiB, rss=GiB, margin=True)
  chunk = 21_037_056  # one GLM-5 int4 expert chunk (20.05 MB)
  kv = 4096 * 78 * (512 + 64) * 2
  args = dict(dense_bytes=dense, dense_format=fmt, kv_bytes=kv, chunk_bytes=chunk,
              n_moe_layers=75, n_experts=256, top_k=8)
  if not fits:
    with pytest.raises(glmjax.InputError) as e:
      budget.resolve(None, None, **args)
    assert re.search(rf"dense weights \({fmt}\)\s+{dense / GiB:.3f} GB", str(e.value))
    assert "free accelerator memory" in str(e.value)
    return
  b, plan = budget.resolve(None, None, **args)
  dev_free = 32 * GiB - max(GiB, 32 * GiB // 20)
  assert b.device_bytes == dev_free - dense - kv - plan.working > 0
  assert plan.device_cache == b.device_bytes and plan.where == "device"
  # Pinned slots per MoE layer: int4 dense leaves room for several (the 64-row working set, a
  # whole layer's 256 experts twice, takes 10 GB of the card).
  assert b.device_bytes // (75 * chunk) >= (0 if fmt == "int8" else 5)
