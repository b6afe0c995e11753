"""Offloaded decode at depth (issue 43): the work per MoE layer step does not grow with the
number of layers. Counted, never timed: the bytes an install into the host slab touches (XLA's
cost analysis), and the Python calls of a decode step per layer at 4 and 16 MoE layers."""

import os
import sys

import numpy as np
import pytest

import glmjax
from glmjax.formats.store import ExpertLayout
from glmjax.formats.synthetic import make_synthetic_store
from glmjax.offload import tiers


def _install_bytes(pool) -> float:
  """Bytes XLA's cost analysis says an install of two experts into `pool` reads and writes."""
  layout = _install_bytes.layout
  blobs = tuple(np.zeros(layout.nbytes, np.uint8) for _ in range(2))
  compiled = tiers._install_blobs.lower(pool, np.arange(2, dtype=np.int32), blobs,
                                        layout).compile()
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


_install_bytes.layout = ExpertLayout.make(128, 64, 4, 32)


def test_a_host_slab_install_touches_only_its_slots():
  """The host slab (raw bits, as `HostSlab` allocates it) is written in place: an install
  touches the same bytes whether the slab has 8 or 64 slots. A bfloat16 pool's update is a
  pass over the whole pool (the slab's cost grew with the cache, so with the depth)."""
  layout, cpu = _install_bytes.layout, tiers.cpu_device()
  raw = [_install_bytes(tiers.empty_pool(layout, n, cpu, raw=True)) for n in (8, 64)]
  assert raw[0] == raw[1]
  assert raw[0] < 2.5 * 2 * layout.nbytes  # read and write the two chunks, little else
  typed = [_install_bytes(tiers.empty_pool(layout, n, cpu)) for n in (8, 64)]
  assert typed[1] > typed[0]  # the pass this layout avoids (what the test would catch)
  slab = tiers.HostSlab(layout, 8)
  slab.alloc()
  assert all(np.issubdtype(leaf.dtype, np.unsignedinteger)
             for leaf in (slab.pool.gate_up.scales, slab.pool.down.scales))


OWN = os.path.dirname(os.path.abspath(glmjax.__file__))


def _calls(path: str) -> int:
  """Calls of the runtime's own Python code in one cold request (after one that compiled),
  prefetch off: its landings depend on read timing, the demand path does not."""
  with glmjax.load(path, progress=False, device_cache_gb=0, host_cache_gb=1e-9,
                   prefetch=False) as m:
    m.generate([5, 6, 7], 2, stop_ids=[])  # compiles every shape of the steps
    calls = [0]

    def count(frame, event, arg):
      # A weakref finalizer (a read buffer given back) runs on whichever thread drops the
      # last reference, the reader's or this one: not the request's own work.
      if (event == "call" and OWN in frame.f_code.co_filename
          and not frame.f_back.f_code.co_filename.endswith("weakref.py")):
        calls[0] += 1
    sys.setprofile(count)
    try:
      m.generate([8, 9, 10], 2, stop_ids=[])
    finally:
      sys.setprofile(None)
    assert m.engine.telemetry()["expert_misses"] > 0  # the layer path, reading
  return calls[0]


def test_host_work_per_layer_does_not_grow_with_depth(tmp_path):
  """A request's Python calls are linear in the MoE layers: each layer added between 8 and 16
  costs what one added between 4 and 8 did (give or take 2 calls), so no layer step does work
  that grows with the number of layers. Deterministic: the same code path, counted; two
  experts a layer, both chosen by every token (tiny's top-2), so every depth's layer steps
  read the same experts whatever the routing (with 8 the unions, and so the calls per layer,
  differ between the stores' random weights)."""
  total = {}
  for n in (4, 8, 16):
    path = str(tmp_path / f"d{n}")
    make_synthetic_store(path, geometry="tiny", moe_layers=n, experts=2, progress=False)
    total[n] = _calls(path)
  near, far = (total[8] - total[4]) / 4, (total[16] - total[8]) / 8
  assert far <= near + 2, total
  assert total[16] / 16 <= total[4] / 4, total  # the per-token part spreads thinner
