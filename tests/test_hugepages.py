"""scripts/_hugepages.py: a script re-executes itself once with glibc's huge-page malloc tunable;
scripts/_startup.py: a script's first call does that, then sets the cycle collector's thresholds."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import os, sys
sys.path.insert(0, {scripts!r})
print("run", flush=True)
import _hugepages
_hugepages.reexec()
print("tunables", os.environ.get("GLIBC_TUNABLES"))
"""


def run(tmp_path, **env):
  probe = tmp_path / "probe.py"
  probe.write_text(PROBE.format(scripts=os.path.join(ROOT, "scripts")))
  base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "GLMJAX_HUGEPAGES")}
  r = subprocess.run([sys.executable, "-u", str(probe)], capture_output=True, text=True,
                     env={**base, **env})
  assert r.returncode == 0, r.stderr
  return r.stdout.splitlines()


def test_reexecutes_once_with_the_tunable(tmp_path):
  # Two "run" lines: the process ran, re-executed itself, ran again and did not loop.
  assert run(tmp_path) == ["run", "run", "tunables glibc.malloc.hugetlb=1"]


def test_keeps_the_users_tunables(tmp_path):
  out = run(tmp_path, GLIBC_TUNABLES="glibc.malloc.arena_max=2")
  assert out == ["run", "run", "tunables glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"]


def test_respects_an_explicit_setting_and_the_opt_out(tmp_path):
  assert run(tmp_path, GLIBC_TUNABLES="glibc.malloc.hugetlb=0") == [
      "run", "tunables glibc.malloc.hugetlb=0"]
  assert run(tmp_path, GLMJAX_HUGEPAGES="0") == ["run", "tunables None"]


STARTUP = """
import gc, os, sys
sys.path.insert(0, {scripts!r})
print("run", gc.get_threshold(), flush=True)
import _startup
_startup.start()
print("after", gc.get_threshold(), os.environ.get("GLIBC_TUNABLES"))
"""


def test_start_reexecutes_then_sets_the_collectors_thresholds(tmp_path):
  import _startup  # scripts/ is on the path: conftest puts it there  # pylint: disable=import-outside-toplevel
  probe = tmp_path / "startup.py"
  probe.write_text(STARTUP.format(scripts=os.path.join(ROOT, "scripts")))
  base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "GLMJAX_HUGEPAGES")}
  r = subprocess.run([sys.executable, "-u", str(probe)], capture_output=True, text=True, env=base)
  assert r.returncode == 0, r.stderr
  first, second, after = r.stdout.splitlines()
  # Both runs (the re-execution) start at the interpreter's own thresholds; only the second goes
  # on, to the larger young generation.
  assert first == second and first != f"run {_startup.GC_THRESHOLDS}"
  assert after == f"after {_startup.GC_THRESHOLDS} glibc.malloc.hugetlb=1"
