"""Every writer survives SIGKILL at any point (issue 47, item 4; the rule: `formats/durable.py`).

Each writer script runs in a subprocess that kills itself (SIGKILL) at a named point
(`GLMJAX_KILL_AT`: deterministic, no timing involved). The kills are chained: each run resumes
or starts over what the previous killed run left, and is itself killed at the next point; a
last run completes. After each kill the partial output must fail to load with a GlmjaxError
naming what is missing; after the last run the output must equal an uninterrupted run's (every
chunk, array and manifest byte but the `created` time; dense tensors restored and compared, as
orbax names its files at random), load and score bitwise equal, and no temporary may be left.
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import glmjax
from glmjax.errors import CheckpointError, GlmjaxError, InputError
from glmjax.formats import calibration, durable, embedded, store, synthetic
from glmjax.formats.convert import convert
from glmjax.replay.trace import Trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNTHETIC = dict(geometry="tiny", moe_layers=2, experts=8)  # the script's other defaults
SMALL_RUN = ["--max_tokens=128", "--seq=64", "--batch=2"]  # calibrate.py and replay.py
TOKENS = np.array([[5, 6, 7, 8, 9, 10, 11, 12]], np.int32)


def environment(kill: str | None = None) -> dict:
  env = {k: v for k, v in os.environ.items() if k != durable.KILL_ENV}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
  env["GLMJAX_HUGEPAGES"] = "0"  # no re-exec: one process to kill
  if kill:
    env[durable.KILL_ENV] = kill
  return env


def run(script: str, *args: str, kill: str | None = None) -> subprocess.CompletedProcess:
  env = environment(kill)
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args],
                        capture_output=True, text=True, timeout=300, env=env)


def kill_chain(script: str, args: list[str], points: list[str], check_partial) -> None:
  """Runs `script` killed at each of `points` in turn, calling `check_partial(point)` after
  each kill. A point never reached fails: the run then exits 0, not by SIGKILL."""
  for point in points:
    r = run(script, *args, kill=point)
    assert r.returncode == -signal.SIGKILL, (
        f"{script} was to be killed at {point}: exit {r.returncode}\n{r.stderr[-3000:]}")
    check_partial(point)


def files(root: str) -> dict[str, bytes]:
  """{relative path: bytes} of every file under `root`."""
  out = {}
  for d, _, names in os.walk(root):
    for name in names:
      with open(os.path.join(d, name), "rb") as f:
        out[os.path.relpath(os.path.join(d, name), root)] = f.read()
  return out


def temporaries(root: str) -> list[str]:
  """Every file or directory under `root` named like a temporary (ours, orbax's, older ones)."""
  return [os.path.join(d, n) for d, dirs, names in os.walk(root) for n in dirs + names
          if ".tmp" in n or "-tmp-" in n or n == ".write-probe"]


def assert_same_store(ref: str, got: str) -> None:
  """Same files with the same bytes (the manifest's `created` aside); the dense parts, whose
  orbax file names are random, by their restored tensors."""
  a, b = files(ref), files(got)
  dense = lambda fs: {k for k in fs if k.startswith("dense" + os.sep)}
  assert sorted(set(a) - dense(a)) == sorted(set(b) - dense(b))
  parts = lambda p: sorted(os.listdir(os.path.join(p, "dense")))
  assert parts(ref) == parts(got)
  for name in set(a) - dense(a):
    if name == store.MANIFEST:
      ma, mb = json.loads(a[name]), json.loads(b[name])
      ma.pop("created"), mb.pop("created")
      assert ma == mb
    else:
      assert a[name] == b[name], name
  _, wa = store.load_dense(ref, progress=False)
  _, wb = store.load_dense(got, progress=False)
  for x, y in zip(jax_leaves(wa), jax_leaves(wb), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with glmjax.load(ref, progress=False) as m1, glmjax.load(got, progress=False) as m2:
    np.testing.assert_array_equal(m1.score(TOKENS), m2.score(TOKENS))


def jax_leaves(tree):
  import jax
  return jax.tree_util.tree_leaves(tree)


def assert_same_files(ref: str, got: str) -> None:
  a, b = files(ref), files(got)
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name] == b[name], name


def store_partial(path: str, point: str) -> None:
  """A store killed at `point`: refused as incomplete, or (killed after its manifest) complete."""
  if point == "store.finish":  # the manifest is written: complete, its progress log left over
    assert os.path.exists(os.path.join(path, store.PROGRESS))
    store.read_manifest(path)
    return
  with pytest.raises(CheckpointError, match=f"{store.MANIFEST}"):
    glmjax.load(path, progress=False)
  assert not os.path.exists(os.path.join(path, store.MANIFEST))


# --- the expert stores: resumed (convert.py) or started over (make_synthetic_store.py) --------

def test_convert_killed_at_any_point_resumes(tmp_path):
  src = embedded.ensure(progress=False)
  dst = str(tmp_path / "killed" / "store")
  kill_chain("convert.py", [f"--src={src}", f"--dst={dst}"],
             ["convert.dense_part:3", "convert.expert_chunk:20", "store.manifest",
              "store.finish"], lambda point: store_partial(dst, point))
  assert convert(src, dst, progress=False)  # the rerun after the last kill
  ref = str(tmp_path / "ref" / "store")
  convert(src, ref, progress=False)
  assert temporaries(str(tmp_path)) == [] and not os.path.exists(os.path.join(dst, store.PROGRESS))
  assert_same_store(ref, dst)


def test_synthetic_store_killed_at_any_point_starts_over(tmp_path):
  dst = str(tmp_path / "killed" / "store")
  args = [f"--dst={dst}", "--geometry=tiny", "--moe_layers=2", "--experts=8"]

  def partial(point):
    if point == "synthetic.progress":  # nothing but the temporary of its progress log
      assert os.listdir(dst) and not os.path.exists(os.path.join(dst, store.PROGRESS))
      with pytest.raises(GlmjaxError, match=f"{store.MANIFEST}|config.json"):
        glmjax.load(dst, progress=False)
      return
    store_partial(dst, point)

  kill_chain("make_synthetic_store.py", args,
             ["synthetic.progress", "synthetic.expert_chunk:5", "synthetic.dense_part:2",
              "store.finish"], partial)  # "store.manifest": the converter's chain
  synthetic.make_synthetic_store(dst, progress=False, **SYNTHETIC)  # the rerun
  ref = str(tmp_path / "ref" / "store")
  synthetic.make_synthetic_store(ref, progress=False, **SYNTHETIC)
  assert temporaries(str(tmp_path)) == [] and not os.path.exists(os.path.join(dst, store.PROGRESS))
  assert_same_store(ref, dst)


# --- directories renamed into place whole: calibration statistics, routing traces -------------

def staged(path: str) -> list[str]:
  """The temporaries of `path` beside it (`durable.temp_path`)."""
  d, base = os.path.split(path)
  return [n for n in os.listdir(d) if n.startswith(f".{base}.tmp-")]


def rerun_and_reference(script: str, out: str, ref: str, args: list, tmp_path) -> None:
  """After the kills: the rerun at `out` and an uninterrupted run at `ref` both succeed, no
  temporary is left anywhere, and every file of the two is the same (bar `created`)."""
  for path in (out, ref):
    r = run(script, f"--out={path}", *args)
    assert r.returncode == 0, r.stderr[-3000:]
  assert temporaries(str(tmp_path)) == []
  assert_same_files(ref, out)


def test_calibrate_killed_during_its_save_reruns(tmp_path):
  out, ref = str(tmp_path / "stats"), str(tmp_path / "ref" / "stats")
  args = [*SMALL_RUN, "--nosequential"]

  def partial(point):
    assert staged(out), point  # what was written is in a temporary, nothing at --out
    with pytest.raises(InputError, match=calibration.META):
      calibration.Calibration(out)

  kill_chain("calibrate.py", [f"--out={out}", *args],
             ["calibration.array:1", "calibration.array:3", "calibration.publish"], partial)
  rerun_and_reference("calibrate.py", out, ref, args, tmp_path)
  a, b = calibration.Calibration(ref), calibration.Calibration(out)
  assert a.sha256 == b.sha256 and a.meta == b.meta


def test_replay_trace_killed_at_any_point_reruns(tmp_path):
  out, ref = str(tmp_path / "trace"), str(tmp_path / "ref" / "trace")

  def partial(point):
    assert staged(out), point
    with pytest.raises(CheckpointError, match="no such trace directory"):
      Trace.open(out)

  kill_chain("replay.py", [f"--out={out}", *SMALL_RUN],
             ["trace.created", "trace.flush:1", "trace.publish"], partial)
  rerun_and_reference("replay.py", out, ref, SMALL_RUN, tmp_path)
  a, b = Trace.open(ref), Trace.open(out)
  for name in ("ids", "weights", "tokens", "steps", "seq_starts", "scores", "pilot"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


# --- the engine's statistics files: tolerant, but never a temporary left behind ---------------

def test_statistics_write_killed_leaves_no_temporary(tmp_path):
  path = str(tmp_path / "usage.json")
  code = ("import sys; from glmjax.offload.tiers import Heat; "
          "Heat({(1, 2): float(sys.argv[2])}).save(sys.argv[1])")
  env = environment("stats.write")
  r = subprocess.run([sys.executable, "-c", code, path, "3"], env=env, capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
  assert staged(path) and not os.path.exists(path)  # killed before its rename
  from glmjax.offload.tiers import Heat
  assert Heat.load(path)[(1, 2)] == 0.0  # missing: ignored, as before
  Heat({(1, 2): 4.0}).save(path)  # the next write removes the dead writer's temporary
  assert os.listdir(tmp_path) == ["usage.json"] and Heat.load(path)[(1, 2)] == 4.0


# --- the rule itself --------------------------------------------------------------------------

def test_kill_point_counts_and_stale_temporaries_of_live_writers_stay(tmp_path, monkeypatch):
  monkeypatch.setenv(durable.KILL_ENV, "elsewhere:2")
  durable.kill_point("here")  # another point: no kill
  path = str(tmp_path / "x")
  live = durable.temp_path(path)  # this (live) process's
  open(live, "w").close()
  dead = live.replace(f"-{os.getpid()}-", "-999999999-")  # no such pid
  os.mkdir(dead)
  other_host = os.path.join(str(tmp_path), ".x.tmp-otherhost-999999999-ab")
  open(other_host, "w").close()
  assert durable.clear_stale(path) == [dead]
  assert sorted(os.listdir(tmp_path)) == sorted(map(os.path.basename, (live, other_host)))
  durable.write_file(path, "done")
  assert open(path).read() == "done"
