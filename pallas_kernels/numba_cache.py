"""A file lock around numba's on-disk cache, so processes that compile at once stay consistent.

numba (0.68 and earlier) saves a new overload of a ``cache=True`` function by reading the
function's index, picking the first free data-file number, writing the index, then writing the
data file, with no lock between processes. Two processes that compile different overloads of one
function at the same moment can both pick number N; when the writes interleave as index A,
index B, data B, data A, the index maps B's signature to A's machine code, and every later
process that loads B runs code built for other argument types (numba #4807 and #10128, both open
in 2026). glmjax starts such processes itself: the suite's two workers, ``launch_local.py``'s
ranks, a server beside a converter, all on a fresh install with an empty cache.

``install()`` wraps ``IndexDataCacheFile.save`` in an exclusive ``flock`` and ``load`` in a
shared one, on a ``<index>.lock`` file beside each function's index, so an index and the data
it names are always written together. It is idempotent, and a no-op where ``fcntl`` is missing.
"""

from __future__ import annotations

import contextlib
import os

_installed = []


@contextlib.contextmanager
def _locked(index_path: str, exclusive: bool):
  """Holds a flock on ``index_path + '.lock'``; without a writable directory, no lock (numba's
  own behaviour, which then cannot save anything either)."""
  import fcntl
  try:
    fd = os.open(index_path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
  except OSError:
    yield
    return
  try:
    fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    yield
  finally:
    os.close(fd)  # closing the descriptor releases the lock


def lock_path(cache_file) -> str:
  """The lock file that guards ``cache_file`` (a numba ``IndexDataCacheFile``)."""
  return cache_file._index_path + ".lock"  # pylint: disable=protected-access


def install() -> bool:
  """Makes numba's cache saves and loads take the lock (once per process). Returns whether
  the lock is in force."""
  if _installed:
    return _installed[0]
  try:
    import fcntl  # noqa: F401  pylint: disable=unused-import
    from numba.core import caching
  except ImportError:
    _installed.append(False)
    return False
  cls = caching.IndexDataCacheFile
  save, load = cls.save, cls.load

  def locked_save(self, key, data):
    with _locked(self._index_path, exclusive=True):  # pylint: disable=protected-access
      return save(self, key, data)

  def locked_load(self, key):
    with _locked(self._index_path, exclusive=False):  # pylint: disable=protected-access
      return load(self, key)

  cls.save, cls.load = locked_save, locked_load
  _installed.append(True)
  return True
