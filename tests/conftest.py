"""Suite-wide setup: a private model cache so the suite never touches ~/.cache, and one XLA
compilation cache per run shared by its workers and the scripts it starts."""

import functools
import json
import os
import shutil
import tempfile

import pytest


# How XLA:CPU compiles in the suite (its workers, and every script it starts, through the
# environment): LLVM at level 1 in one piece instead of level 2 split for parallel codegen.
# Compiling is ~80% of the suite's CPU time; this takes ~15% off compiling, ~9% off the CPU.
# The executables compute the same bits as the default flags' (tests/test_suite_flags.py
# checks it on the model's steps); level 0 does not (see DESIGN.md §28).
SUITE_XLA_FLAGS = "--xla_backend_optimization_level=1 --xla_cpu_parallel_codegen_split_count=1"


def pytest_configure(config):
  """JAX's persistent compilation cache in a directory made for this run (empty at the start)
  and shared, through the environment, by both xdist workers and every script the suite starts.
  Dozens of subprocesses (README commands, scripts, the notebook) and several test files compile
  the same embedded-model steps, compiled once each. The executables are the same either way;
  a torn entry read by another worker is a cache miss (JAX warns and compiles). The process
  that made the directory (xdist's controller, which starts the workers after this hook)
  removes it at the end."""
  config.addinivalue_line("markers", "fast: the fast tier (FAST_TIER), a developer's inner loop")
  if getattr(config.option, "maxworkerrestart", "") is None:
    # A worker that dies (a segfault) fails its test and ends the run at once. With restarts
    # (xdist's default) `--dist loadfile` can wait forever for the replacement worker
    # (pytest-xdist #784, #1323, #1327: still so in 3.8.0), and CI would only time out.
    config.option.maxworkerrestart = 0
  if hasattr(config.option, "loadscopereorder"):
    # xdist would hand out files by their number of tests, most first (its default); the
    # suite's own order (HEAVY_FIRST, below) is the one that keeps a long file off the end.
    config.option.loadscopereorder = False
  if "GLMJAX_TEST_XLA_CACHE" not in os.environ:
    os.environ["GLMJAX_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="glmjax-test-xla-")
    config.glmjax_owns_xla_cache = True
  path = os.environ["GLMJAX_TEST_XLA_CACHE"]
  if SUITE_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + SUITE_XLA_FLAGS).strip()
  os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  # Every executable kept, as `glmjax.load` does for users (compile_cache.enable): the scripts
  # the suite starts share the small ones too (0.2 s before: 3-8% more CPU on script-heavy
  # files, docs/measurements/suite.md).
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  _collect_like_the_scripts()
  import jax
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  if getattr(config, "glmjax_owns_xla_cache", False) and not _fast_tier_only(config):
    _start_kernel_warmup()  # the fast tier loads no model: its few kernels compile on demand


def _collect_like_the_scripts() -> None:
  """The workers' cycle collector at the scripts' thresholds (scripts/_startup.py): tracing
  allocates as much here as in a script (DESIGN.md §28)."""
  import gc
  import sys
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  import _startup  # pylint: disable=import-outside-toplevel
  gc.set_threshold(*_startup.GC_THRESHOLDS)


# Compiles the CPU kernels' Python entry points for both decoders (int4 and int8, odd sizes),
# their decode (matvec) and grouped variants.
_WARM_EXPERT_KERNELS = """
import numpy as np
from glmjax.formats.quantize import quantize_expert
from glmjax.model import quant
from pallas_kernels import cpu
rng = np.random.default_rng(0)
for bits, group, d, i in ((4, 64, 199, 96), (8, 32, 101, 72)):
  pool = quant.stack_experts([quantize_expert(
      rng.standard_normal((i, d)), rng.standard_normal((i, d)), rng.standard_normal((d, i)),
      bits, group) for _ in range(2)])
  arrs = (pool.gate_up.packed, pool.gate_up.scales, pool.down.packed, pool.down.scales)
  kw = dict(bits=bits, group_size=group, hidden=d, intermediate=i)
  for t in (1, 3, 17):
    x = rng.standard_normal((t, d)).astype(np.float32)
    cpu.expert_ffn(x, *(a[0] for a in arrs), **kw)
    cpu.pool_terms(x, *arrs, np.zeros((t, 2), np.int64), None, **kw)
from pallas_kernels import cpu_ffi
# Builds the custom call's handler (it reuses what compiled above) through its first-use check;
# whether the check passes is tests/test_cpu_ffi.py's business.
cpu_ffi.self_test()
"""

# The dense kernels and their two custom calls (`self_test()` builds both targets: bf16, and
# int4/int8; matmul and kv_b heads), and the quantizer for the weight dtypes the converters read
# (float64 compiles above).
_WARM_DENSE_KERNELS = """
import ml_dtypes
import numpy as np
from glmjax.formats.quantize import quantize
from pallas_kernels import cpu_dense_ffi
cpu_dense_ffi.self_test()
rng = np.random.default_rng(0)
for dtype in (np.float32, ml_dtypes.bfloat16):
  quantize(rng.standard_normal((4, 64)).astype(dtype), 4, 32)
"""


def _start_kernel_warmup():
  """Compiles the numba CPU kernels into numba's on-disk cache (`cache=True`) once per run, in
  two background processes (expert and dense kernels, one per core) that xdist's workers start
  and collect beside; each worker waits for them before its first test
  (`_cpu_kernels_compiled`). On a fresh clone both workers and the first scripts would otherwise
  each compile them (~30 s of a core for the expert kernels, ~45 s for the dense ones) at the
  same time. The two share helper functions; `pallas_kernels.numba_cache`'s lock keeps the
  cache consistent. The outcome is a file in GLMJAX_TEST_WARMUP: `ready`, or `failed` holding
  the processes' errors."""
  import subprocess
  import sys
  import threading
  marks = tempfile.mkdtemp(prefix="glmjax-test-warmup-")
  os.environ["GLMJAX_TEST_WARMUP"] = marks
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  procs = [subprocess.Popen([sys.executable, "-c", script], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
           for script in (_WARM_EXPERT_KERNELS, _WARM_DENSE_KERNELS)]

  def wait():
    errs = [p.communicate()[1] for p in procs]
    failed = any(p.returncode for p in procs)
    name = "failed" if failed else "ready"
    with open(os.path.join(marks, name + ".tmp"), "w") as f:
      f.write("\n".join(e for p, e in zip(procs, errs) if p.returncode) if failed else "")
    os.replace(os.path.join(marks, name + ".tmp"), os.path.join(marks, name))

  threading.Thread(target=wait, daemon=True).start()


@pytest.fixture(scope="session", autouse=True)
def _cpu_kernels_compiled():
  """Waits for the run's kernel warm-up (`_start_kernel_warmup`) before this process's first
  test; it fails the test, with the compiler's error, if the warm-up failed."""
  import time
  marks = os.environ.get("GLMJAX_TEST_WARMUP")
  if marks is None:  # no warm-up in this run (the suite's controller did not start one)
    return
  deadline = time.monotonic() + 900
  while not os.path.exists(os.path.join(marks, "ready")):
    failed = os.path.join(marks, "failed")
    if os.path.exists(failed):
      pytest.fail("compiling the numba CPU kernels failed:\n" + open(failed).read())
    if time.monotonic() > deadline:
      pytest.fail("the numba CPU kernels' warm-up did not finish within 900 s")
    time.sleep(0.05)


# Files in order of the CPU seconds each took in full runs (tests/file_seconds.json, written by
# tests/file_seconds.py), most first; a file not listed yet goes first. xdist's `--dist loadfile`
# hands whole files to the workers in collection order (its reordering by test count is off,
# above): a long file collected late would run alone at the end, and with the heaviest first
# the last files to start are the shortest, so the two workers finish together (a 100 s gap
# between them with only the 16 heaviest ordered).
def _file_seconds() -> dict:
  with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_seconds.json"),
            encoding="utf-8") as f:
    return json.load(f)


# The fast tier (`pytest -m fast tests`, README): the files that load no model and compile no
# forward pass (rules, sampling, quantizers, text, the cost model and the simulator, the
# architecture's boundaries, the flags), for a developer's inner loop.
FAST_TIER = ("test_sampling.py", "test_quant.py", "test_config.py", "test_cost_model.py",
             "test_replay_sim.py", "test_text.py", "test_cli.py", "test_architecture.py",
             "test_hugepages.py", "test_chat_format.py", "test_grammar.py")


def _fast_tier_only(config) -> bool:
  return (config.getoption("markexpr", "") or "").strip() == "fast"


def pytest_ignore_collect(collection_path, config):
  """`-m fast` does not import the other test files (transformers, the SDKs, lm-eval) and
  starts no numba warm-up: the tier's time is its own tests' (DESIGN.md §28)."""
  name = collection_path.name
  is_test_file = name.startswith("test_") and name.endswith(".py")
  if _fast_tier_only(config) and is_test_file and name not in FAST_TIER:
    return True
  return None  # pytest's own rules decide


def pytest_collection_modifyitems(config, items):
  seconds = _file_seconds()
  items.sort(key=lambda item: -seconds.get(item.path.name, float("inf")))  # stable: in a file,
  # the tests keep their order
  for item in items:
    if item.path.name in FAST_TIER:
      item.add_marker(pytest.mark.fast)


def pytest_runtest_teardown(item, nextitem):
  """At the end of each test file, a worker far into its memory-mapping limit drops JAX's
  compiled executables (glmjax.runtime.compile_cache.relieve_map_pressure): a worker compiles
  some 20,000 executables over a run, ~3 mappings each, and past vm.max_map_count XLA crashes
  the worker in its next compile (the segfaults of docs/measurements/suite.md)."""
  if nextitem is None or nextitem.path != item.path:
    import warnings
    from glmjax.runtime import compile_cache
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)
      compile_cache.relieve_map_pressure(fraction=0.4)


def pytest_unconfigure(config):
  if getattr(config, "glmjax_owns_xla_cache", False):
    shutil.rmtree(os.environ.pop("GLMJAX_TEST_XLA_CACHE"), ignore_errors=True)
    shutil.rmtree(os.environ.pop("GLMJAX_TEST_WARMUP", ""), ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _private_model_cache(tmp_path_factory):
  os.environ["GLMJAX_CACHE"] = str(tmp_path_factory.mktemp("glmjax_cache"))
  yield


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name: str, *args: str):
  """scripts/<name>'s `main` with the flags of `python scripts/<name> *args`, in this process:
  the script's exit code and what it printed, as a `subprocess.CompletedProcess`. A process of
  its own would import JAX, numba's kernels and the model code again (1-2 CPU-s) and trace
  again what this worker has traced; the tests that need the process (its exit on a signal,
  its memory, its devices, `_startup`) still start one. The script's flags are removed from
  absl's registry afterwards, so the next script defines its own."""
  import contextlib
  import gc
  import importlib.util
  import io
  import subprocess
  from absl import flags, logging
  path = os.path.join(ROOT, "scripts", name)
  before, verbosity = set(flags.FLAGS), logging.get_verbosity()
  out, err = io.StringIO(), io.StringIO()
  spec = importlib.util.spec_from_file_location("script_" + name[:-3], path)
  module = importlib.util.module_from_spec(spec)
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      spec.loader.exec_module(module)
      try:
        code = module.main(flags.FLAGS([path, *args])) or 0
      except SystemExit as e:  # app.UsageError's exit, or a script's own
        code = e.code if isinstance(e.code, int) else 1
  finally:
    for flag in set(flags.FLAGS) - before:
      delattr(flags.FLAGS, flag)
    flags.FLAGS.unparse_flags()
    logging.set_verbosity(verbosity)
    gc.unfreeze()  # convert.py freezes what its imports left
  return subprocess.CompletedProcess([path, *args], code, out.getvalue(), err.getvalue())


def convert_store(src: str, dst: str, *flags: str):
  """scripts/convert.py with a user's flags (its defaults unless given), in this process
  (`run_script`); test_store, test_offload and test_kill_writers start it as a process."""
  return run_script("convert.py", f"--src={src}", f"--dst={dst}", *flags)


@pytest.fixture(scope="session")
def embedded_store(tmp_path_factory):
  """The embedded model converted with the converter's default flags (what users run first)."""
  from glmjax.formats import embedded
  dst = str(tmp_path_factory.mktemp("embedded_store") / "store")
  r = convert_store(embedded.ensure(progress=False), dst)
  assert r.returncode == 0, r.stderr
  return dst


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """With GLMJAX_TEST_CPU_LOG=<dir>, appends each test's CPU seconds (this worker's and the
  processes it waited for: user + system) to <dir>/<worker>.tsv: the suite's budget is CPU, and
  a test's wall time on two busy cores says little about it. Then this worker's seconds in JAX
  tracing, lowering and XLA, and its XLA compilations (`_compile_seconds`), during the test; then
  the wall-clock time it ended (when each worker finished)."""
  log = os.environ.get("GLMJAX_TEST_CPU_LOG")
  if not log:
    yield
    return
  import resource
  import time

  def cpu():
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))
  from glmjax.runtime.compile_cache import compilations
  seen = _compile_seconds()
  start, before, compiled = cpu(), dict(seen), compilations()
  yield
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  spent = [seen[k] - before[k] for k in seen] + [compilations() - compiled]
  with open(os.path.join(log, worker + ".tsv"), "a", encoding="utf-8") as f:
    f.write(f"{item.nodeid}\t{cpu() - start:.2f}\t" + "\t".join(f"{x:.2f}" for x in spent) +
            f"\t{time.time():.1f}\n")


_COMPILE_EVENTS = {"trace": "/jax/core/compile/jaxpr_trace_duration",
                   "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "compile": "/jax/core/compile/backend_compile_duration"}


@functools.cache
def _compile_seconds() -> dict:
  """This worker's JAX seconds so far tracing, lowering and compiling (XLA; a persistent-cache
  hit counts its load), kept by a listener; the count of compilations is compile_cache's."""
  import jax
  seen = dict.fromkeys(_COMPILE_EVENTS, 0.0)
  names = {v: k for k, v in _COMPILE_EVENTS.items()}

  def listen(event, seconds, **_):
    if event in names:
      seen[names[event]] += seconds
  jax.monitoring.register_event_duration_secs_listener(listen)
  return seen
