"""The offload engine across processes (scripts/launch_local.py, 2 processes × 1 CPU device, mesh
`expert:2`) on a tiny synthetic store of 16 experts per layer that needs offload, at three
budget pairs in one launch, against one process without a mesh: scoring, and generation with
MTP speculative decoding. Each process opens its own copy of the store (`{process}` in the
path) that holds only the chunks of the experts it owns.

Ownership: expert e belongs to the process whose device sits at expert index e // 8, so
process 0 owns experts 0-7 and process 1 experts 8-15 of every MoE layer. The driver is
tests/offload_processes.py; each process writes its own record.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

BUDGETS = "3:4,0:0,2:16"  # pins per device and layer : host-cache chunks, per process
DRIVER = os.path.join(ROOT, "tests", "offload_processes.py")


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.pop("XLA_FLAGS", None)
  return env


def _keep_share(store: str, experts) -> None:
  """Deletes every expert chunk of `store` (main and MTP groups) but those of `experts`."""
  keep = {str(e) for e in experts}
  for group in ("main", "mtp"):
    root = os.path.join(store, "experts", group, "c")
    for row in os.listdir(root):
      for e in os.listdir(os.path.join(root, row)):
        if e not in keep:
          shutil.rmtree(os.path.join(root, row, e))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(one-process record, its logits, [each process's record], [[its logits per budget]])."""
  from glmjax.formats.synthetic import make_synthetic_store
  base = tmp_path_factory.mktemp("mp_offload")
  # The reference's store, and one copy per process holding only the chunks that process owns
  # (a read of another's expert would fail: the chunk is not there).
  stores = [str(base / name) for name in ("one", "two0", "two1")]
  for s in stores:
    make_synthetic_store(s, geometry="tiny", moe_layers=2, experts=16, seed=3)
  for p, s in enumerate(stores[1:]):
    _keep_share(s, range(8 * p, 8 * p + 8))
  one, two = str(base / "out1"), str(base / "out2")
  ref = subprocess.Popen([sys.executable, DRIVER, f"--store={stores[0]}", f"--out={one}",
                          "--budgets=0:0", "--draft=2"], env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
  multi = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "launch_local.py"), "--processes=2",
       "--devices_per_process=1", "--timeout_s=400", "--", DRIVER,
       f"--store={base / 'two{process}'}",
       f"--out={two}", f"--budgets={BUDGETS}", "--mesh=expert:2", "--draft=2"],
      capture_output=True, text=True, timeout=450, env=_env())
  ref_out = ref.communicate(timeout=450)[0]
  assert ref.returncode == 0, ref_out[-3000:]
  assert multi.returncode == 0, multi.stderr[-3000:]
  with open(os.path.join(one, "p0.json"), encoding="utf-8") as f:
    ref_rec = json.load(f)["runs"][0]
  procs = []
  for p in range(2):
    with open(os.path.join(two, f"p{p}.json"), encoding="utf-8") as f:
      procs.append(json.load(f))
  logits = [[np.load(os.path.join(two, f"p{p}_{i}.npy")) for i in range(3)] for p in range(2)]
  return ref_rec, np.load(os.path.join(one, "p0_0.npy")), procs, logits


def test_logits_and_tokens_equal_one_process(runs):
  """Scored logits bitwise; the greedy tokens of speculative decoding (2 MTP drafts a step, the
  MTP layer's experts owned like the others) equal, with the same drafts accepted."""
  ref, ref_logits, procs, logits = runs
  assert ref["counts"]["draft_proposed"] > 0
  for p in range(2):
    assert procs[p]["processes"] == 2
    for i, rec in enumerate(procs[p]["runs"]):
      assert np.array_equal(logits[p][i], ref_logits), (p, i)  # bitwise, at every budget
      assert rec["tokens"] == ref["tokens"], (p, i)
      for k in ("draft_proposed", "draft_accepted"):
        assert rec["counts"][k] == ref["counts"][k], (p, i, k)


def test_each_process_owns_and_reads_its_half(runs):
  _, _, procs, _ = runs
  assert [procs[p]["runs"][0]["owned"] for p in range(2)] == [list(range(8)),
                                                              list(range(8, 16))]
  for p in range(2):
    for rec in procs[p]["runs"]:
      experts = {e for _, e in rec["reads"]}
      assert experts and experts <= set(rec["owned"]), (p, sorted(experts))


def test_no_expert_held_twice_and_host_within_budget(runs):
  _, _, procs, _ = runs
  for i in range(3):
    held = []
    for p in range(2):
      rec = procs[p]["runs"][i]
      mine = {(int(l), e) for l, es in rec["pins"].items() for e in es}
      mine |= {tuple(k) for k in rec["host"]}
      assert all(e in rec["owned"] for _, e in mine)
      assert rec["host_used"] <= rec["host_budget"]
      held.append(mine)
    assert not held[0] & held[1]
  assert procs[0]["runs"][0]["pins"]["1"] and procs[1]["runs"][0]["host"]  # the tiers work


def test_counters_add_up_to_one_process(runs):
  ref, _, procs, _ = runs
  for i in range(3):
    used = 0
    for p in range(2):
      c = procs[p]["runs"][i]["counts"]
      assert c["expert_pin_hits"] + c["expert_host_hits"] + c["expert_misses"] == c["experts_used"]
      used += c["experts_used"]
    assert used == ref["counts"]["experts_used"]  # the same routing, split by owner


def test_a_dead_process_fails_the_other_naming_it(tmp_path):
  """Process 1 is killed (SIGKILL) once loaded: process 0's next psum finds its gloo connection
  closed and fails at once with a PeerError naming process 1, well within the bound (the
  coordination service's heartbeat, 10 s here, bounds what the sockets do not show)."""
  from glmjax.formats.synthetic import make_synthetic_store
  store = str(tmp_path / "store")
  make_synthetic_store(store, geometry="tiny", moe_layers=2, experts=16, seed=3)
  r = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "launch_local.py"), "--processes=2",
       "--devices_per_process=1", "--timeout_s=300", "--", DRIVER, f"--store={store}",
       f"--out={tmp_path / 'out'}", "--budgets=3:4", "--mesh=expert:2", "--die=1",
       "--heartbeat_timeout_s=10"],
      capture_output=True, text=True, timeout=320, env=_env())
  assert r.returncode == 1, r.stderr[-3000:]  # process 0's own exit status: the error
  assert "process 1 of this 2-process run died or left" in r.stderr, r.stderr[-3000:]
  assert store in r.stderr
  assert "process 1 exited -9" in r.stderr  # launch_local's account of the killed one
