"""The offload engine across processes (scripts/launch_local.py) on a tiny synthetic store of
16 experts per layer that needs offload, at three budget pairs per launch, against one process
without a mesh: scoring, and generation with MTP speculative decoding. Two launches of the
driver: 2 processes × 1 CPU device (mesh `expert:2`) and 2 processes × 2 devices (`expert:4`);
and scripts/generate.py as the README gives it. Each process opens its own copy of the store
(`{process}` in the path) that holds only the chunks of the experts it owns.

Ownership: expert e belongs to the process whose devices hold expert index e // (16 / n), so in
both launches process 0 owns experts 0-7 and process 1 experts 8-15 of every MoE layer. The
driver is tests/offload_processes.py; each process writes its own record.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, SUITE_XLA_FLAGS

BUDGETS = "3:4,0:0,2:16"  # pins per device and layer : host-cache chunks, per process
DRIVER = os.path.join(ROOT, "tests", "offload_processes.py")


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = SUITE_XLA_FLAGS  # launch_local.py adds the device count
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


def _launch(devices: int, script: str, *flags: str) -> subprocess.Popen:
  """scripts/launch_local.py: 2 processes × `devices` CPU devices running `script`."""
  return subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "scripts", "launch_local.py"), "--processes=2",
       f"--devices_per_process={devices}", "--timeout_s=500", "--", script, *flags],
      env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(proc: subprocess.Popen, what: str) -> None:
  out = proc.communicate(timeout=560)[0]
  assert proc.returncode == 0, (what, out[-3000:])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(one-process record, its logits, {launch: ([each process's record], [[its logits per
  budget]])}, {"one" | "two": generate.py's --json}). The three driver runs go at once, then
  the two of generate.py, each on its own store copies (a run rewrites its stores' usage
  statistics)."""
  from glmjax.formats.synthetic import make_synthetic_store
  base = tmp_path_factory.mktemp("mp_offload")
  # The reference's store, and per launch one copy per process holding only the chunks that
  # process owns (a read of another's expert would fail: the chunk is not there).
  manifest = make_synthetic_store(str(base / "one"), geometry="tiny", moe_layers=2, experts=16,
                                  seed=3)
  host_gb = 4 * manifest["experts"]["main"]["layout"]["nbytes"] / (1 << 30)  # four chunks
  shutil.copytree(base / "one", base / "gen_one")
  for launch in ("2x1", "2x2", "gen"):
    for p in range(2):
      copy = base / f"{launch}_{p}"
      shutil.copytree(base / "one", copy)
      _keep_share(str(copy), range(8 * p, 8 * p + 8))
  out = {k: str(base / f"out_{k}") for k in ("one", "2x1", "2x2")}
  procs = {
      "one": subprocess.Popen([sys.executable, DRIVER, f"--store={base / 'one'}",
                               f"--out={out['one']}", "--budgets=0:0", "--draft=2"], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
      # 2 processes × 1 device (expert:2), and × 2 devices (expert:4: each process's two
      # devices own its half), at the three budget pairs.
      "2x1": _launch(1, DRIVER, f"--store={base / '2x1_{process}'}", f"--out={out['2x1']}",
                     f"--budgets={BUDGETS}", "--mesh=expert:2", "--draft=2"),
      "2x2": _launch(2, DRIVER, f"--store={base / '2x2_{process}'}", f"--out={out['2x2']}",
                     f"--budgets={BUDGETS}", "--mesh=expert:4", "--draft=2"),
  }
  # The command as a user types it (default sampling flags: the store's generation
  # config, seeded), host caches of 4 chunks: the store needs offload. One process on the
  # whole store against two on their shares.
  gen = [os.path.join(ROOT, "scripts", "generate.py"), f"--host_cache_gb={host_gb}",
         "--prompt_ids=5,6,7", "--max_new_tokens=6"]
  for name, proc in procs.items():
    _wait(proc, name)
  # After the drivers, whose steps (the suite's persistent cache) these two then load instead
  # of compiling them again: the two processes of a launch compile the same programs at the
  # same moment, so neither finds the other's.
  procs = {"gen_one": subprocess.Popen(
      [sys.executable, gen[0], f"--model={base / 'gen_one'}", *gen[1:],
       f"--json={base / 'gen_one.json'}"], env=_env(), stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True),
           "gen_two": _launch(1, gen[0], f"--model={base / 'gen_{process}'}", *gen[1:],
                              "--mesh=expert:2", f"--json={base / 'gen_two.json'}")}
  for name, proc in procs.items():
    _wait(proc, name)
  with open(os.path.join(out["one"], "p0.json"), encoding="utf-8") as f:
    ref_rec = json.load(f)["runs"][0]

  def launch(path):
    records = []
    for p in range(2):
      with open(os.path.join(path, f"p{p}.json"), encoding="utf-8") as f:
        records.append(json.load(f))
    logits = [[np.load(os.path.join(path, f"p{p}_{i}.npy")) for i in range(3)] for p in range(2)]
    return records, logits

  generated = {}
  for k in ("one", "two"):
    with open(base / f"gen_{k}.json", encoding="utf-8") as f:
      generated[k] = json.load(f)
  return (ref_rec, np.load(os.path.join(out["one"], "p0_0.npy")),
          {k: launch(out[k]) for k in ("2x1", "2x2")}, generated)


LAUNCHES = ["2x1", "2x2"]  # processes × devices per process


@pytest.mark.parametrize("launch", LAUNCHES)
def test_logits_and_tokens_equal_one_process(runs, launch):
  """Scored logits bitwise; the greedy tokens of speculative decoding (2 MTP drafts a step, the
  MTP layer's experts owned like the others) equal, with the same drafts accepted."""
  ref, ref_logits, launches, _ = runs
  procs, logits = launches[launch]
  assert ref["counts"]["draft_proposed"] > 0
  for p in range(2):
    assert procs[p]["processes"] == 2
    for i, rec in enumerate(procs[p]["runs"]):
      assert np.array_equal(logits[p][i], ref_logits), (p, i)  # bitwise, at every budget
      assert rec["tokens"] == ref["tokens"], (p, i)
      for k in ("draft_proposed", "draft_accepted"):
        assert rec["counts"][k] == ref["counts"][k], (p, i, k)


@pytest.mark.parametrize("launch", LAUNCHES)
def test_each_process_owns_and_reads_its_half(runs, launch):
  procs, _ = runs[2][launch]
  assert [procs[p]["runs"][0]["owned"] for p in range(2)] == [list(range(8)),
                                                              list(range(8, 16))]
  for p in range(2):
    for rec in procs[p]["runs"]:
      experts = {e for _, e in rec["reads"]}
      assert experts and experts <= set(rec["owned"]), (p, sorted(experts))


@pytest.mark.parametrize("launch", LAUNCHES)
def test_no_expert_held_twice_and_host_within_budget(runs, launch):
  procs, _ = runs[2][launch]
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


@pytest.mark.parametrize("launch", LAUNCHES)
def test_counters_add_up_to_one_process(runs, launch):
  ref, _, launches, _ = runs
  procs, _ = launches[launch]
  for i in range(3):
    used = 0
    for p in range(2):
      c = procs[p]["runs"][i]["counts"]
      assert c["expert_pin_hits"] + c["expert_host_hits"] + c["expert_misses"] == c["experts_used"]
      used += c["experts_used"]
    assert used == ref["counts"]["experts_used"]  # the same routing, split by owner


def test_generate_script_on_two_processes_gives_the_one_process_tokens(runs):
  """The README's command for several hosts (launch_local.py, generate.py --mesh=expert:2 with
  a host-cache budget, each process on the share of the store it owns): the tokens of one
  process on the whole store, sampled with the store's own settings. The store needs offload
  (misses, and host-cache hits, in both runs), and the experts used add up to the same."""
  gen = runs[3]
  assert gen["two"]["mesh"] and gen["one"]["tokens"] and len(gen["one"]["tokens"]) == 6
  assert gen["two"]["tokens"] == gen["one"]["tokens"]
  for k in ("one", "two"):
    st = gen[k]["stats"]
    assert st["expert_misses"] > 0 and st["expert_host_hits"] > 0, (k, st)
  assert gen["two"]["stats"]["experts_used"] == gen["one"]["stats"]["experts_used"]


def test_a_dead_process_fails_the_other_naming_it(tmp_path):
  """Process 1 is killed (SIGKILL) after both processes scored a batch: process 0's next
  (compiled) step finds its gloo connection closed at its first psum and fails at once with a
  PeerError naming process 1, well within the bound (the coordination service's heartbeat, 10 s
  here, bounds what the sockets do not show)."""
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
