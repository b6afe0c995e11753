"""numba's on-disk cache under pallas_kernels.numba_cache's lock: an index and the data file it
names are written under one exclusive lock, and read under a shared one."""

import fcntl
import os

import pytest
from numba.core import caching

from pallas_kernels import numba_cache


def _try_lock(path, mode):
  """Whether a separate open of ``path`` can take ``mode`` now (non-blocking)."""
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
  try:
    fcntl.flock(fd, mode | fcntl.LOCK_NB)
    return True
  except BlockingIOError:
    return False
  finally:
    os.close(fd)


@pytest.fixture
def cache_file(tmp_path):
  assert numba_cache.install()
  import pallas_kernels.cpu  # noqa: F401  installs it on import, as every kernel module does
  return caching.IndexDataCacheFile(str(tmp_path), "kernel-12.py311", (0.0, 0))


def test_the_kernels_install_the_lock():
  import pallas_kernels.cpu  # noqa: F401
  assert caching.IndexDataCacheFile.save.__name__ == "locked_save"
  assert caching.IndexDataCacheFile.load.__name__ == "locked_load"


def test_save_holds_an_exclusive_lock_over_index_and_data(cache_file):
  lock = numba_cache.lock_path(cache_file)
  seen = []
  save_index, save_data = cache_file._save_index, cache_file._save_data

  def probe(name, inner):
    def run(*args):
      # Another process could neither read nor write this function's cache entries now.
      seen.append((name, _try_lock(lock, fcntl.LOCK_EX), _try_lock(lock, fcntl.LOCK_SH)))
      return inner(*args)
    return run

  cache_file._save_index = probe("index", save_index)
  cache_file._save_data = probe("data", save_data)
  cache_file.save("sig-a", b"code for a")
  cache_file.save("sig-b", b"code for b")
  assert seen == [("index", False, False), ("data", False, False)] * 2
  # Both entries are kept, each naming its own data file, and the lock is free afterwards.
  assert cache_file.load("sig-a") == b"code for a"
  assert cache_file.load("sig-b") == b"code for b"
  assert _try_lock(lock, fcntl.LOCK_EX)


def test_load_holds_a_shared_lock(cache_file):
  cache_file.save("sig-a", b"code for a")
  lock = numba_cache.lock_path(cache_file)
  seen = []
  load_data = cache_file._load_data

  def probe(name):
    seen.append((_try_lock(lock, fcntl.LOCK_EX), _try_lock(lock, fcntl.LOCK_SH)))
    return load_data(name)

  cache_file._load_data = probe
  assert cache_file.load("sig-a") == b"code for a"
  assert seen == [(False, True)]  # no writer can interleave; other readers may share
  assert cache_file.load("sig-unknown") is None
