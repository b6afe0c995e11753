"""Reused chunk read buffers (glmjax.formats.read_buffers): memory goes back to the pool only
when nothing reaches it any more, slices and JAX's uncopied arguments included."""

import gc

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.formats.read_buffers import ALIGN, ReadBuffers

N = 3 * ALIGN


def _addr(a: np.ndarray) -> int:
  return a.ctypes.data


def test_a_dropped_buffer_is_reused_and_aligned():
  pool = ReadBuffers(keep_bytes=4 * N)
  a = pool.take(N)
  first = _addr(a)
  assert first % ALIGN == 0 and a.shape == (N,) and a.dtype == np.uint8
  del a
  b = pool.take(N)
  assert _addr(b) == first and (pool.reused, pool.fresh) == (1, 1)


def test_a_live_slice_keeps_its_buffer_out_of_the_pool():
  pool = ReadBuffers(keep_bytes=4 * N)
  a = pool.take(N)
  first = _addr(a)
  tail = a[ALIGN:].view(np.uint32)  # what read_chunk returns is such a slice
  del a
  b = pool.take(N)
  assert _addr(b) != first
  b[:] = 7  # a reused buffer would overwrite the slice
  assert not (tail == 0x07070707).all()
  del tail, b
  assert pool.free_bytes == 2 * N


def test_jax_holding_an_uncopied_argument_keeps_it():
  pool = ReadBuffers(keep_bytes=4 * N)
  a = pool.take(N)
  a[:] = 3
  x = jax.device_put(a)
  first = _addr(a)
  if jax.default_backend() == "cpu":
    assert x.unsafe_buffer_pointer() == first  # taken uncopied: the case this guards
  del a
  gc.collect()
  b = pool.take(N)
  assert _addr(b) != first
  b[:] = 9
  assert int(jnp.sum(x.astype(jnp.int32))) == 3 * N


def test_a_computation_in_flight_reads_its_own_bytes():
  """Buffers dropped right after dispatch, then taken and overwritten: every result must
  still be the sum of the bytes it was given (float64 reference)."""
  pool = ReadBuffers(keep_bytes=8 * N)
  total = jax.jit(lambda t: jnp.sum(t.astype(jnp.float32) * 2.0))
  rng = np.random.default_rng(0)
  results, want = [], []
  for _ in range(12):
    a = pool.take(N)
    a[:] = rng.integers(0, 4, N, dtype=np.uint8)
    want.append(2.0 * a.astype(np.float64).sum())
    results.append(total(a))
    del a
    scribble = pool.take(N)
    scribble[:] = 255
    del scribble
  assert [float(r) for r in results] == want
  assert pool.reused > 0


def test_free_buffers_stay_within_keep_bytes():
  pool = ReadBuffers(keep_bytes=2 * N)
  held = [pool.take(N) for _ in range(4)]
  del held
  assert pool.free_bytes == 2 * N
  assert pool.prefault(N, 5) == 0  # full already
  pool.clear()
  assert pool.free_bytes == 0 and pool.take(N) is not None and pool.reused == 0


def test_prefaulted_buffers_serve_the_first_takes():
  pool = ReadBuffers(keep_bytes=3 * N)
  assert pool.prefault(N, 5) == 3
  held = [pool.take(N) for _ in range(4)]
  assert (pool.reused, pool.fresh) == (3, 1)
  assert len({_addr(a) for a in held}) == 4


def test_an_offloaded_model_reuses_read_buffers_and_a_resident_one_keeps_none(embedded_store):
  """The engine keeps the plan's transient share (the working set's host half and the
  prefetched reads), maps buffers at load and reuses them; a model whose experts all fit reads
  only while loading and keeps nothing; close() frees what was kept."""
  import glmjax
  with glmjax.load(embedded_store, device_cache_gb=0, host_cache_gb=0, progress=False) as m:
    buffers = m.engine.store.buffers
    assert buffers.keep_bytes == m.memory.working // 2 + m.memory.prefetch > 0
    assert buffers.free_bytes > 0  # mapped at load
    m.generate([5, 6, 7], 2, stop_ids=[])
    assert buffers.reused > 0
  assert buffers.free_bytes == buffers.keep_bytes == 0
  with glmjax.load(embedded_store, progress=False) as m:
    assert m.engine.all_resident and m.engine.store.buffers.keep_bytes == 0
