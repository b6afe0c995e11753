"""JAX's persistent compilation cache for every entry point users run: `glmjax.load`, the
scripts and the server. A second process then loads compiled steps instead of compiling them.

The cache is process-wide JAX state, so it is only turned on where nobody set it: a directory
already configured (by the user, or `JAX_COMPILATION_CACHE_DIR`, as the test suite does) is
left alone. Every executable is kept, however fast it compiled: JAX's default keeps only those
over 1 s, and a decode step is made of many small ones (the embedded model's take 0.05-0.5 s).
"""

from __future__ import annotations

import os

ENV = "GLMJAX_CACHE"  # where the cache lives, else ~/.cache/glmjax/xla


def default_dir() -> str:
  return os.environ.get(ENV) or os.path.join(os.path.expanduser("~"), ".cache", "glmjax", "xla")


def enable(path: str | None = None) -> str | None:
  """Turns the persistent cache on at `path` (default: `default_dir()`) unless a directory is
  already set. Returns the directory in use, or None when it cannot be created (the cache
  then stays off: compiling is slower, never wrong)."""
  import jax
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  path = path or default_dir()
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path
