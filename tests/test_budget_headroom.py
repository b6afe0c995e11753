"""Automatic memory budgets leave room for the rest of the machine (glmjax.offload.budget).

The host margin is max(4 GiB, 25% of the memory total); the total is physical RAM unless
GLMJAX_MEMORY_GB or the process's cgroup sets a lower one, and then what is available is that
limit less what is already used under it. Checked against memory figures made up here (psutil,
the cgroup files and this process's RSS replaced), and once on a real store: the peak RSS of a
process that loads it with default budgets and generates stays within the plan's total + 10%.
"""

import collections
import json
import os
import subprocess
import sys

import jax
import pytest

import glmjax
from glmjax.decoding import pages
from glmjax.formats import synthetic
from glmjax.offload import budget

GiB = 1 << 30
MiB = 1 << 20
V1_UNLIMITED = 9223372036854771712  # what cgroup v1 reports when no limit is set

_Memory = collections.namedtuple("_Memory", "available total")

# A store's figures for budget.resolve: 75 MoE layers of 2048 experts of 4 MiB (600 GiB of
# experts: more than any machine here, so automatic budgets take all the room there is).
STORE = dict(dense_bytes=GiB, dense_format="bfloat16", kv_bytes=GiB // 4, chunk_bytes=4 * MiB,
             n_moe_layers=75, n_experts=2048, top_k=1)
# 2 × min(E, 64 rows · K) chunks, and the prefetched reads (MAX_HINTS chunks)
WORKING = 2 * 64 * 4 * MiB + 64 * 4 * MiB


@pytest.fixture
def machine(monkeypatch, tmp_path):
  """`set(total, available, rss=…, env=…, cgroup=…, device=…)`: the host as budget sees it.
  `cgroup` maps files under a private cgroup root (and "self" to /proc/self/cgroup's text) to
  their contents; `device` is the free accelerator memory (None: a CPU-only machine)."""
  root = tmp_path / "cgroup"
  root.mkdir()
  monkeypatch.setattr(budget, "CGROUP_ROOT", str(root))
  monkeypatch.setattr(budget, "PROC_CGROUP", str(tmp_path / "self-cgroup"))

  def set(total, available, rss=GiB // 4, env=None, cgroup=None, device=None):
    monkeypatch.setattr(budget.psutil, "virtual_memory", lambda: _Memory(available, total))
    monkeypatch.setattr(budget, "_process_rss", lambda: rss)
    monkeypatch.setattr(budget, "_device_free", lambda: device)
    if env is None:
      monkeypatch.delenv(budget.MEMORY_ENV, raising=False)
    else:
      monkeypatch.setenv(budget.MEMORY_ENV, env)
    for name, text in (cgroup or {}).items():
      path = tmp_path / "self-cgroup" if name == "self" else root / name
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(text)
  return set


def margin(total):
  return max(4 * GiB, total // 4)


def host_held(plan):
  """Host bytes a CPU plan adds to what the process holds now."""
  return plan.total - plan.runtime


@pytest.mark.parametrize("total", [8 * GiB, 24 * GiB, 64 * GiB, 512 * GiB])
def test_automatic_budgets_leave_the_margin(machine, total):
  avail = total - GiB
  machine(total, avail)
  b, plan = budget.resolve(None, None, **STORE)
  assert plan.where == "host" and b.device_bytes + b.host_bytes > 0
  left = avail - host_held(plan)
  assert left >= margin(total), (left / GiB, margin(total) / GiB)
  assert left == margin(total)  # and the budget takes the rest: the rule, not an accident
  assert plan.parts()["runtime (this process now)"] == GiB // 4
  # One figure everywhere: what resolve planned against, available(), and the KV pool's room.
  assert budget.available()[0] == budget.host_available() == avail - margin(total)
  if jax.default_backend() == "cpu":
    assert pages.free_bytes() == budget.host_available()

  # On an accelerator the host tier leaves the same margin of host RAM.
  machine(total, avail, device=80 * GiB)
  b, plan = budget.resolve(None, None, **STORE)
  assert plan.where == "device" and b.host_bytes > 0
  assert avail - (plan.growth + plan.working + plan.prefetch + plan.host_cache) == margin(total)


def test_memory_env_lowers_the_total(machine):
  # 64 GiB of RAM, 16 GiB allowed: available is the limit less this process's RSS.
  machine(64 * GiB, 60 * GiB, rss=GiB, env="16")
  mem = budget.host_memory()
  assert (mem.total, mem.available, mem.margin) == (16 * GiB, 15 * GiB, 4 * GiB)
  assert mem.source == "GLMJAX_MEMORY_GB=16"
  b, plan = budget.resolve(None, None, **STORE)
  assert plan.total == 12 * GiB  # this process's RSS included: the limit less the margin
  assert b.device_bytes + b.host_bytes == 12 * GiB - GiB - plan.growth - STORE["dense_bytes"] - \
      STORE["kv_bytes"] - WORKING

  # Never more than the machine has available, and a limit above RAM is no limit.
  machine(64 * GiB, 10 * GiB, rss=GiB, env="32.5")
  assert budget.host_memory() == budget.HostMemory(int(32.5 * GiB), 10 * GiB,
                                                   "GLMJAX_MEMORY_GB=32.5")
  machine(64 * GiB, 60 * GiB, rss=GiB, env="100")
  assert budget.host_memory() == budget.HostMemory(64 * GiB, 60 * GiB)
  # 4 GiB allowed: all of it is margin, and the plan is refused naming the limit.
  machine(64 * GiB, 60 * GiB, rss=GiB, env="4")
  with pytest.raises(glmjax.InputError, match=r"does not fit(.|\n)*GLMJAX_MEMORY_GB=4"):
    budget.resolve(None, None, **STORE)


@pytest.mark.parametrize("value", ["abc", "0", "-2", "nan", "inf", "16GB"])
def test_invalid_memory_env_is_refused(machine, value):
  machine(64 * GiB, 60 * GiB, env=value)
  with pytest.raises(glmjax.InputError, match=rf"GLMJAX_MEMORY_GB='{value}'"):
    budget.resolve(None, None, **STORE)


def test_cgroup_limit_lowers_the_total(machine):
  # cgroup v2: the process's own cgroup has no limit, its parent 12 GiB with 3 GiB in use.
  machine(64 * GiB, 60 * GiB, cgroup={
      "self": "0::/job/task\n", "job/memory.max": f"{12 * GiB}\n",
      "job/memory.current": f"{3 * GiB}\n", "job/task/memory.max": "max\n",
      "job/task/memory.current": f"{GiB}\n"})
  mem = budget.host_memory()
  assert (mem.total, mem.available, mem.margin) == (12 * GiB, 9 * GiB, 4 * GiB)
  b, plan = budget.resolve(None, None, **STORE)
  assert host_held(plan) == 5 * GiB  # 12 GiB less 3 in use less the 4 GiB margin
  assert b.device_bytes + b.host_bytes == 5 * GiB - plan.growth - STORE["dense_bytes"] - \
      STORE["kv_bytes"] - WORKING

  # A parent whose own limit is higher but nearly used up binds too.
  machine(64 * GiB, 60 * GiB, cgroup={"memory.max": f"{20 * GiB}\n",
                                      "memory.current": f"{18 * GiB}\n"})
  assert budget.host_memory() == budget.HostMemory(12 * GiB, 2 * GiB, "cgroup memory limit")
  os.remove(os.path.join(budget.CGROUP_ROOT, "memory.max"))

  # Inactive page cache (the store's pages read an hour ago) is not counted as used.
  machine(64 * GiB, 60 * GiB, cgroup={"job/memory.stat": f"anon {GiB}\ninactive_file {2 * GiB}\n"})
  assert budget.host_memory() == budget.HostMemory(12 * GiB, 11 * GiB, "cgroup memory limit")

  # cgroup v1 (here the root's limit is v1's "none", the process's cgroup sets 20 GiB), and
  # GLMJAX_MEMORY_GB beside it: the lower limit is the total, each limit's usage counts.
  v1 = {"self": "4:memory:/x\n0::/\n", "memory/memory.limit_in_bytes": f"{V1_UNLIMITED}\n",
        "memory/memory.usage_in_bytes": f"{30 * GiB}\n",
        "memory/x/memory.limit_in_bytes": f"{20 * GiB}\n",
        "memory/x/memory.usage_in_bytes": f"{3 * GiB}\n",
        "memory/x/memory.stat": f"cache {2 * GiB}\ntotal_inactive_file {GiB}\n"}
  machine(64 * GiB, 60 * GiB, cgroup=v1)
  assert budget.host_memory() == budget.HostMemory(20 * GiB, 18 * GiB, "cgroup memory limit")
  assert budget.host_available() == 18 * GiB - 5 * GiB
  machine(64 * GiB, 60 * GiB, rss=GiB, env="16", cgroup=v1)
  assert budget.host_memory() == budget.HostMemory(16 * GiB, 15 * GiB, "GLMJAX_MEMORY_GB=16")


def test_no_cgroup_limit_is_physical_ram(machine):
  machine(64 * GiB, 60 * GiB, cgroup={"self": "0::/\n", "memory.max": "max\n",
                                      "memory.current": f"{GiB}\n"})
  assert budget.host_memory() == budget.HostMemory(64 * GiB, 60 * GiB)
  machine(64 * GiB, 60 * GiB, cgroup={"memory/memory.limit_in_bytes": f"{V1_UNLIMITED}\n",
                                      "memory/memory.usage_in_bytes": f"{GiB}\n"})
  assert budget.host_memory() == budget.HostMemory(64 * GiB, 60 * GiB)


def test_explicit_budgets_that_cannot_fit_are_refused(machine):
  """An explicit budget may use the room past the automatic margin, down to the floor
  (max(2 GiB, 10%): 6.4 GiB of 64), and is refused beyond it."""
  machine(64 * GiB, 60 * GiB)
  floor = int(64 * GiB * 0.10)
  room = 60 * GiB - floor - budget.RUNTIME_GROWTH - STORE["dense_bytes"] - \
      STORE["kv_bytes"] - WORKING
  b, _ = budget.resolve(0, room / GiB, **STORE)  # exactly the room: accepted
  assert b.host_bytes == room
  auto, _ = budget.resolve(0, None, **STORE)  # automatic: the 16 GiB margin stays free
  assert auto.host_bytes == room - (16 * GiB - floor)
  with pytest.raises(glmjax.InputError) as e:
    budget.resolve(0, room / GiB + 0.5, **STORE)
  msg = str(e.value)
  assert "does not fit" in msg and "host expert cache" in msg and "runtime" in msg
  assert "memory total 64.000 GB: physical RAM; 6.400 GB left" in msg, msg
  # On an accelerator the host tier is checked against the same host figure.
  machine(64 * GiB, 60 * GiB, device=80 * GiB)
  host_room = 60 * GiB - floor - budget.RUNTIME_GROWTH - WORKING
  assert budget.resolve(None, host_room / GiB, **STORE)[0].host_bytes == host_room
  with pytest.raises(glmjax.InputError, match=r"does not fit(.|\n)*host_cache_gb="):
    budget.resolve(None, host_room / GiB + 0.5, **STORE)


# Loads a store with default budgets, generates, and prints its peak RSS and the plan. The
# peak is VmHWM, this process image's own high-water mark: ru_maxrss survives exec on Linux,
# so a child of a large pytest worker would report the worker's peak (DESIGN.md §9).
_PEAK_SCRIPT = """
import json, resource, sys
import glmjax
m = glmjax.load(sys.argv[1], progress=False)
m.generate("def parse(line):", max_new_tokens=4, temperature=0)
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print("PEAK", json.dumps({"hwm": hwm, "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                          * 1024, "total": m.memory.total, "parts": m.memory.parts(),
                          "resident": m.engine.all_resident}))
"""


def test_peak_rss_stays_within_the_plan(tmp_path):
  """A store whose dense weights and experts (66 + 40 MB) are not lost beside the runtime
  (~0.26 GB before loading): the whole process's peak is within the plan's total + 10%."""
  store = str(tmp_path / "store")
  synthetic.make_synthetic_store(store, geometry="tiny", moe_layers=2, experts=1024,
                                 vocab_size=131072, progress=False)
  env = {k: v for k, v in os.environ.items() if k != budget.MEMORY_ENV}
  r = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, store], capture_output=True, text=True,
                     timeout=300, env=env)
  assert r.returncode == 0, r.stderr
  got = json.loads(next(l for l in r.stdout.splitlines() if l.startswith("PEAK "))[5:])
  parts = got["parts"]
  print(f"peak RSS {got['hwm'] / MiB:.0f} MiB (ru_maxrss {got['maxrss'] / MiB:.0f}) against a "
        f"plan of {got['total'] / MiB:.0f} MiB: {got['hwm'] / got['total']:.2f}×; "
        + ", ".join(f"{k} {v / MiB:.1f}" for k, v in parts.items()))
  assert got["resident"] and parts["pinned experts"] > 32 * MiB  # default budgets: all of it
  assert got["hwm"] <= 1.10 * got["total"], (got["hwm"], got["total"])
