"""JAX's persistent compilation cache for every entry point users run: `glmjax.load`, the
scripts and the server. A second process then loads compiled steps instead of compiling them.

The cache is process-wide JAX state, so it is only turned on where nobody set it: a directory
already configured (by the user, or `JAX_COMPILATION_CACHE_DIR`, as the test suite does) is
left alone. Every executable is kept, however fast it compiled: JAX's default keeps only those
over 1 s, and a decode step is made of many small ones (the embedded model's take 0.05-0.5 s).
"""

from __future__ import annotations

import functools
import gc
import os
import warnings

from glmjax.errors import GlmjaxError

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


# --- how many programs this process compiled: the end of a server's warm-up ----------------

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # a compile or a cache load
_compiled = 0


def _count(event: str, _seconds: float, **_kwargs) -> None:
  global _compiled
  _compiled += event == _COMPILE_EVENT


@functools.cache
def _listen() -> None:  # once per process
  import jax
  jax.monitoring.register_event_duration_secs_listener(_count)


def compilations() -> int:
  """XLA programs this process compiled or loaded from the persistent cache since the first
  call (every step, and every eager op at a new shape): a server has warmed up once this
  stops moving (/health `compilations`, scripts/soak.py)."""
  _listen()
  return _compiled


# --- memory mappings: what a process that compiles many shapes runs out of first -------------
#
# Each XLA:CPU executable holds about three memory mappings (code, constants, data) for as long
# as it lives, and JAX keeps every executable it compiled in its caches. Linux caps a process's
# mappings at vm.max_map_count (65,530 by default); past it, LLVM's allocation of the next
# executable fails and XLA crashes the process (a segmentation fault in compile, serialize or
# deserialize, never an exception). A notebook or a test run that compiles ~20,000 shapes gets
# there; so the steps' compile path and the test suite call `relieve_map_pressure` first.

MAP_LIMIT_FILE = "/proc/sys/vm/max_map_count"


def mappings() -> tuple[int, int] | None:
  """(mappings in use, the limit) of this process; None where /proc does not say (not Linux)."""
  try:
    with open(MAP_LIMIT_FILE) as f:
      limit = int(f.read())
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f), limit
  except (OSError, ValueError):
    return None


def relieve_map_pressure(fraction: float = 0.75) -> None:
  """Drops JAX's caches of compiled executables (they recompile, or load from the persistent
  cache, when used again) once this process holds more than `fraction` of its memory-mapping
  limit; raises a GlmjaxError if that did not bring it back under the limit's 90%, since the
  next compile could then crash the process."""
  used = mappings()
  if used is None or used[0] <= fraction * used[1]:
    return
  import jax
  jax.clear_caches()
  gc.collect()
  after = mappings() or used
  warnings.warn(f"this process held {used[0]:,} memory mappings of vm.max_map_count "
                f"{used[1]:,} (most of them compiled XLA executables); JAX's compilation "
                f"caches were cleared: {after[0]:,} now", RuntimeWarning, stacklevel=2)
  if after[0] > 0.9 * after[1]:
    raise GlmjaxError(
        f"this process holds {after[0]:,} memory mappings, near vm.max_map_count "
        f"({after[1]:,}), even after JAX's caches were cleared: compiling another step would "
        "crash it. Close models no longer in use (Model.close()), or raise the limit: "
        "sysctl -w vm.max_map_count=262144")
