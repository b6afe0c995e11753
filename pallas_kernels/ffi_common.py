"""What the numba custom calls (``cpu_ffi``: expert terms; ``cpu_dense_ffi``: dense matmuls
and kv_b heads, one target per weight family) share: reading XLA's typed-FFI call frame from a
numba ``cfunc``, and the checked first use (``CheckedCall``) with its ``jax.pure_callback``
fallback.

Zero-copy operands. XLA hands a custom call its buffers' addresses through the typed FFI
(``jax.ffi``); a numba ``cfunc`` handler reads them from the call frame (a C struct, see
``FrameLayout``) and views them as arrays. numba is the only compiler here: no C++ extension to
build at install time. A ``jax.pure_callback`` of the same kernel copies every operand (the
whole weight) on each call, which is why it is only the fallback.

Safety. A handler knows the call frame only as word offsets into XLA's C structs, which a
jaxlib release may change. So:

* at first use (``CheckedCall.backend``), ``CheckedCall.self_test`` checks that jaxlib's FFI
  API version (``XLA_FFI_API_MAJOR/MINOR`` in the ``c_api.h`` that ``jax.ffi.include_dir()``
  ships) is one the layout was checked against, then runs the custom call and the direct
  kernel on small fresh random problems and compares them bit for bit. On a mismatch, an
  error, or an unknown API version every later call takes the ``jax.pure_callback`` path,
  after a ``RuntimeWarning`` naming the reason: never silently;
* a handler reads no pointer before the frame's self-described sizes and counts (struct
  sizes, argument and result counts, each buffer's rank) match (``result_buffer``,
  ``arg_buffers``); otherwise it computes nothing (and fills the result with NaN where the
  result can still be found: ``poison``), which the self-test sees as a mismatch;
* numba's thread pool is started through its public ``numba.get_num_threads()`` (a cached
  handler links against the pool's symbols), inside the checked first use.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from typing import Any, Callable, Iterable, NamedTuple

import jax
import numba
import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic


class FrameLayout(NamedTuple):
  """Word (8-byte) offsets into XLA's FFI structs, from xla/ffi/api/c_api.h (LP64: x86-64,
  aarch64). XLA_FFI_CallFrame is {size, ext*, api*, ctx*, stage (+pad), args, rets, attrs,
  future*}; XLA_FFI_Args and XLA_FFI_Rets are {size, ext*, n, types*, pointers**} (40 bytes);
  an XLA_FFI_Buffer is {size, ext*, dtype (+pad), data*, rank, dims*} (48 bytes)."""
  args: int = 5  # where XLA_FFI_Args starts in the call frame
  rets: int = 10  # where XLA_FFI_Rets starts in the call frame
  buffer_data: int = 3  # the data pointer in an XLA_FFI_Buffer
  buffer_rank: int = 4
  buffer_dims: int = 5


FRAME_LAYOUT = FrameLayout()
# XLA FFI API versions (major, minor) FRAME_LAYOUT was checked against: jax/jaxlib 0.10.2.
# Read at each self-test (tests replace it).
TESTED_API_VERSIONS = frozenset({(0, 3)})
_API_MAJOR, _API_MINOR = 0, 3  # the version the handlers declare to XLA
_EXT_METADATA = 1
_LIST_BYTES, _BUFFER_BYTES = 40, 48  # struct sizes of XLA_FFI_Args/Rets and XLA_FFI_Buffer
_LOW_ADDRESS = 1 << 16  # no valid data pointer lies below Linux's mmap_min_addr


# --- reading the call frame (numba, inside the handlers) ---------------------------------------

@intrinsic
def address(typingctx, addr):
  """An int64 address as a void pointer (to view C structs with carray)."""
  def codegen(context, builder, sig, args):
    return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
  return types.voidptr(types.int64), codegen


@intrinsic
def readonly(typingctx, arr):
  """The same array typed read-only. The kernels' inputs then have the types the Python entry
  points give them (`cpu_rows.readonly`), so a handler and the direct kernel share one compiled
  specialization of every kernel function instead of compiling each twice."""
  def codegen(context, builder, sig, args):
    # Imported here: a numba without it fails the handler's build, inside the self-test.
    from numba.core.imputils import impl_ret_borrowed
    return impl_ret_borrowed(context, builder, sig.return_type, args[0])
  return arr.copy(readonly=True)(arr), codegen


@njit(cache=True)
def words(addr, n):
  """The `n` int64 words at `addr`."""
  return carray(address(addr), (n,), np.int64)


@njit(cache=True)
def _list_ok(frame_words, at, n):
  """Whether an XLA_FFI_Args/Rets at word `at` holds `n` entries and a pointer array."""
  return (frame_words[at] == _LIST_BYTES and frame_words[at + 2] == n
          and frame_words[at + 4] != 0)


@njit(cache=True)
def _buffer_ok(buffer_addr, rank, data_at, rank_at):
  """Whether an XLA_FFI_Buffer pointer looks like one of `rank` dimensions with data."""
  if buffer_addr < _LOW_ADDRESS:
    return False
  b = words(buffer_addr, 6)
  return b[0] == _BUFFER_BYTES and b[rank_at] == rank and b[data_at] >= _LOW_ADDRESS


@njit(cache=True)
def data(buffer_addr, data_at):
  """The data pointer of an XLA_FFI_Buffer."""
  return address(words(buffer_addr, 6)[data_at])


@njit(cache=True)
def answered_metadata(ext_addr):
  """Whether the call frame's extension `ext_addr` (0: none) is XLA's request for the
  handler's metadata, answered here with the API version the handler declares."""
  if ext_addr == 0:
    return False
  ext = words(ext_addr, 4)  # {size, type (+pad), next*, metadata*}
  if (ext[1] & 0xFFFFFFFF) != _EXT_METADATA:
    return False
  md = carray(address(ext[3]), (10,), np.int32)  # {size; api_version{size, ext*, major,
  md[6] = _API_MAJOR                              #  minor}; traits}
  md[7] = _API_MINOR
  md[8] = 0
  return True


@njit(cache=True)
def result_buffer(frame_words, rets_at, out_rank, data_at, rank_at):
  """The XLA_FFI_Buffer address of the call's one result, or 0 when the frame's size, result
  count or the buffer's rank do not match the layout (then nothing may be written)."""
  if (frame_words[0] < (rets_at + 5) * 8 or not _list_ok(frame_words, rets_at, 1)
      or not _buffer_ok(words(frame_words[rets_at + 4], 1)[0], out_rank, data_at, rank_at)):
    return 0
  return words(frame_words[rets_at + 4], 1)[0]


@njit(cache=True)
def arg_buffers(frame_words, args_at, ranks, data_at, rank_at):
  """The XLA_FFI_Buffer addresses of the call's arguments (one per entry of `ranks`, each of
  that rank), or an empty array when the frame does not match."""
  n = len(ranks)
  if not _list_ok(frame_words, args_at, n):
    return np.empty(0, np.int64)
  args = words(frame_words[args_at + 4], n)
  for i in range(n):
    if not _buffer_ok(args[i], ranks[i], data_at, rank_at):
      return np.empty(0, np.int64)
  return args


@njit(cache=True)
def result_dims(ret, dims_at, rank):
  """The dimensions of the result buffer `ret` (int64 [rank])."""
  return words(words(ret, 6)[dims_at], rank)


@njit(cache=True)
def poison(ret, data_at, dims_at, rank):
  """Fills the float32 result buffer `ret` with NaN: what a handler leaves when it cannot read
  its arguments (the self-test then sees a mismatch)."""
  dims = result_dims(ret, dims_at, rank)
  n = 1
  for i in range(rank):
    n *= dims[i]
  carray(data(ret, data_at), (n,), np.float32)[:] = np.nan


def ffi_api_version() -> tuple[int, int] | None:
  """(major, minor) of the XLA FFI C API in the c_api.h jaxlib ships; None if unreadable."""
  path = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
  try:
    with open(path, encoding="utf-8") as f:
      found = dict(re.findall(r"#define XLA_FFI_API_(MAJOR|MINOR) (\d+)", f.read()))
  except OSError:
    return None
  if set(found) != {"MAJOR", "MINOR"}:
    return None
  return int(found["MAJOR"]), int(found["MINOR"])


# --- the checked first use and the fallback (Python) ------------------------------------------

class Case(NamedTuple):
  """One self-test problem: `run(target, *args, **statics)` (the custom call, jitted) must give
  `want` (the direct kernel's result) bit for bit; `label` names it in a mismatch."""
  run: Callable
  args: tuple
  statics: dict
  want: np.ndarray
  label: str


def host_callback(kernel, result, *args, **statics):
  """``kernel(*numpy operands, **statics)`` on the host through ``jax.pure_callback`` (the
  fallback: same bits as the custom call, but every operand is copied on each call); None
  operands stay None. `result`: the output's ``jax.ShapeDtypeStruct``."""
  def host(*a):
    return kernel(*(None if v is None else np.asarray(v) for v in a), **statics)
  return jax.pure_callback(host, result, *args, vmap_method="sequential")


class CheckedCall:
  """One custom-call target: its handler registered per frame layout, checked once per process
  against the direct kernel at first use, with the ``jax.pure_callback`` fallback after a
  failed check.

  name: the target's prefix (one target per layout). handler_for(*layout) -> the handler's
  Python body (numba compiles it as a ``cfunc``, cached). cases() -> the self-test's ``Case``s,
  with fresh random contents (a stale result buffer cannot match by chance). reference: the
  direct kernel as named in a mismatch. owner: the module named in the warning. copies: what
  the fallback copies on each call, for the warning.
  """

  def __init__(self, name: str, handler_for: Callable, cases: Callable[[], Iterable[Case]], *,
               reference: str, owner: str, copies: str):
    self.name, self.reference, self.owner, self.copies = name, reference, owner, copies
    self._handler_for, self._cases = handler_for, cases
    self.layout = FRAME_LAYOUT  # the layout first use registers (tests set a wrong one)
    self._lock = threading.RLock()
    self._handlers: dict[str, Any] = {}  # target -> compiled cfunc (XLA holds its address)
    self.choice: str | None = None  # "ffi" or "callback", decided at first use
    self.target: str | None = None  # the target that passed the self-test

  def target_name(self, layout: FrameLayout) -> str:
    """The target registered for a frame layout (one handler build per layout)."""
    return self.name + "_" + "_".join(str(w) for w in layout)

  def register(self, layout: FrameLayout) -> str:
    """Builds (or loads from numba's cache) the handler for `layout` and registers it with
    XLA's CPU platform; returns its target name."""
    target = self.target_name(layout)
    with self._lock:
      if target not in self._handlers:
        # Starts numba's thread pool (public API): the cached handler links against its
        # symbols (allocate_sched, ...), which exist only once the threading layer runs.
        numba.get_num_threads()
        handler = cfunc(types.int64(types.voidptr), cache=True)(self._handler_for(*layout))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler.ctypes), platform="cpu")
        self._handlers[target] = handler
    return target

  def self_test(self, layout: FrameLayout | None = None) -> str | None:
    """Runs the custom call built for `layout` (default ``self.layout``) against the direct
    kernel on every case. Returns None when every value agrees bit for bit, else the reason:
    an unknown FFI API version, a mismatch, or the error raised."""
    layout = self.layout if layout is None else layout
    version = ffi_api_version()
    if version not in TESTED_API_VERSIONS:
      return (f"jaxlib's XLA FFI API version is {version}; the frame layout was checked "
              f"against {sorted(TESTED_API_VERSIONS)}")
    try:
      target = self.register(layout)
      for case in self._cases():
        # Evaluated now even when the first use is inside a jit trace.
        with jax.ensure_compile_time_eval():
          got = np.asarray(jax.jit(lambda *a, c=case: c.run(target, *a, **c.statics))(
              *case.args))
        if not np.array_equal(got, case.want):
          bad = int(np.sum(~(got == case.want)))
          return f"{case.label}: {bad} of {case.want.size} values differ from {self.reference}"
    except Exception as e:  # pylint: disable=broad-except
      return f"{type(e).__name__}: {e}"
    return None

  def backend(self) -> str:
    """"ffi" (the custom call) or "callback" (``jax.pure_callback``), decided once per process
    by ``self_test`` at first use; choosing "callback" issues a RuntimeWarning with the
    reason."""
    with self._lock:
      if self.choice is None:
        layout = self.layout
        reason = self.self_test(layout)
        if reason is not None:
          warnings.warn(f"{self.owner}: the XLA custom call failed its self-test ({reason}); "
                        f"falling back to jax.pure_callback, which copies {self.copies} on "
                        "each call", RuntimeWarning, stacklevel=4)
        self.choice = "ffi" if reason is None else "callback"
        self.target = self.target_name(layout) if reason is None else None
      return self.choice

  def call(self, ffi_fn: Callable, callback_fn: Callable, *args, **statics):
    """``ffi_fn(target, *args, **statics)`` (the custom call), or ``callback_fn(*args,
    **statics)`` (the ``jax.pure_callback`` path, same bits) once the self-test failed."""
    if self.backend() == "callback":
      return callback_fn(*args, **statics)
    return ffi_fn(self.target, *args, **statics)
