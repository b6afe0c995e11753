"""The one rule every writer follows, so that a kill at any point leaves nothing that loads as
complete and nothing a rerun trips over (DESIGN.md §10):

1. An output is complete exactly when its marker exists: a store's `manifest.json`, a directory
   renamed into place whole (calibration statistics, a routing trace). The marker comes last,
   by one atomic rename (`write_file`, `publish_dir`); readers refuse anything without it.
2. Everything before the marker is either resumable (a store's `.progress.json` log) or
   written where no reader looks: a temporary sibling, named by `temp_path`.
3. Temporaries carry their writer's host and pid; the next writer of the same name removes
   those whose process is gone (`clear_stale`), so no temporary outlives a rerun.

Test hook (for tests only): `GLMJAX_KILL_AT=point` or `point:n` makes the process SIGKILL itself
the n-th time (default: the first) it reaches `kill_point(point)`. A named point is
deterministic where a kill by elapsed time or bytes written depends on I/O and thread timing.
The points: convert.dense_part, convert.expert_chunk, store.manifest, store.finish,
synthetic.progress, synthetic.expert_chunk, synthetic.dense_part, calibration.array,
calibration.publish, trace.created, trace.flush, trace.publish, stats.write
(tests/test_kill_writers.py).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import threading

from glmjax.errors import InputError

KILL_ENV = "GLMJAX_KILL_AT"
_TEMP_TAG = ".tmp-"
_reached: dict[str, int] = {}
_lock = threading.Lock()


def kill_point(name: str) -> None:
  """SIGKILLs this process here when `GLMJAX_KILL_AT` names this point (and its count)."""
  want = os.environ.get(KILL_ENV)
  if not want:
    return
  point, _, count = want.partition(":")
  if point != name:
    return
  with _lock:
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == int(count or 1):
      os.kill(os.getpid(), signal.SIGKILL)


def _host() -> str:
  return socket.gethostname().replace("-", "_") or "host"


def temp_path(path: str) -> str:
  """A fresh temporary sibling of `path`: `.<name>.tmp-<host>-<pid>-<random>`, hidden from
  readers and recognizable by `clear_stale` (anything a library writes under this name, e.g.
  orbax's own temporary beside it, starts with it too)."""
  d, base = os.path.split(os.path.abspath(path))
  return os.path.join(d, f".{base}{_TEMP_TAG}{_host()}-{os.getpid()}-{secrets.token_hex(4)}")


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def clear_stale(path: str) -> list[str]:
  """Removes the temporaries of `path` (see `temp_path`) left by dead processes of this host;
  returns their paths. A live writer's, and other hosts' (a shared filesystem), are kept."""
  d, base = os.path.split(os.path.abspath(path))
  prefix = f".{base}{_TEMP_TAG}"
  try:
    names = os.listdir(d)
  except OSError:
    return []
  host, removed = _host(), []
  for name in names:
    if not name.startswith(prefix):
      continue
    parts = name[len(prefix):].split("-")
    if len(parts) < 3 or parts[0] != host or not parts[1].isdigit() or _alive(int(parts[1])):
      continue
    stale = os.path.join(d, name)
    if os.path.isdir(stale) and not os.path.islink(stale):
      shutil.rmtree(stale, ignore_errors=True)
    else:
      try:
        os.unlink(stale)
      except OSError:
        pass
    removed.append(stale)
  return removed


def write_file(path: str, data: str | bytes, point: str | None = None) -> None:
  """Writes `path` whole or not at all: a temporary sibling, fsync'd, renamed over `path`.
  `point`: the kill point between the temporary being written and the rename."""
  clear_stale(path)
  tmp = temp_path(path)
  try:
    with open(tmp, "wb") as f:
      f.write(data.encode() if isinstance(data, str) else data)
      f.flush()
      os.fsync(f.fileno())
    if point:
      kill_point(point)
    os.replace(tmp, path)
  except BaseException:
    if os.path.lexists(tmp):
      os.unlink(tmp)
    raise
  _sync_dir(os.path.dirname(os.path.abspath(path)))


def staging_dir(path: str) -> str:
  """A new empty temporary sibling directory in which to build `path` (stale ones removed)."""
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  clear_stale(path)
  tmp = temp_path(path)
  os.mkdir(tmp)
  return tmp


def publish_dir(tmp: str, path: str, point: str | None = None) -> None:
  """Renames the finished directory `tmp` (from `staging_dir`) to `path`, which must not
  exist: the one step that makes it visible. `point`: the kill point just before."""
  if point:
    kill_point(point)
  if os.path.lexists(path):
    raise InputError(f"{path}: appeared while it was being written; nothing was written over it")
  os.rename(tmp, path)
  _sync_dir(os.path.dirname(os.path.abspath(path)))


def _sync_dir(d: str) -> None:
  """fsyncs a directory so a rename in it survives a power loss (not only a kill)."""
  try:
    fd = os.open(d, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)
