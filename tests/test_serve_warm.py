"""The scheduler compiles every prefill width ahead (Scheduler `warm`, the server's default):
one width per idle turn from the start, so that a request of any length meets compiled steps.

Resident: once /health's `warming` is 0, prompts of every length compile nothing (after the
first request, which compiles the sampler's few small programs; a prompt's tail after a prefix
hit is the same program, its start a traced length),
and each greedy output equals a scheduler's without the warm-up, on the same model afterwards
(the warm-up's writes go to the null page only). Offloaded: the warm-up reads no expert and
changes no engine counter, outputs equal those without it too, and serving the same prompts
again compiles nothing whatever the tiers now hold (a jit compiles anew for each mix of
committed and uncommitted inputs: the executors commit every input they make).
"""

from __future__ import annotations

import asyncio

import numpy as np

import glmjax
from glmjax.formats import synthetic
from glmjax.runtime import compile_cache
from glmjax.serving.batch import prefill_widths
from glmjax.serving.scheduler import Job, Scheduler
from tests.test_serve import _until

N = 3  # tokens per request
CONTEXT = 16  # prefill widths 1, 2, 4, 8, 16: five compilations ahead


def _serve(sched: Scheduler, prompts: list[np.ndarray]) -> tuple[list[list[int]], list[int]]:
  """Each prompt served alone, in order: (its tokens, the compilations it caused)."""
  loop = asyncio.new_event_loop()
  outs, compiled = [], []
  try:
    for ids in prompts:
      before = compile_cache.compilations()
      job = Job(ids, dict(max_new_tokens=N, stop_ids=[]), loop)
      sched.submit(job)
      while (event := loop.run_until_complete(job.queue.get()))[0] not in ("done", "error"):
        pass
      assert event[0] == "done", event
      outs.append(event[1]["tokens"])
      compiled.append(compile_cache.compilations() - before)
  finally:
    loop.close()
  return outs, compiled


def _warmed(model) -> Scheduler:
  sched = Scheduler(model, max_batch=2, max_queue=4, prefix_cache=True)
  _until(lambda: sched.state()["warming"] == 0, "the warm-up", timeout=600)
  return sched


def _unwarmed_outputs(model, prompts) -> list[list[int]]:
  sched = Scheduler(model, max_batch=2, max_queue=4, prefix_cache=True, warm=False)
  try:
    assert "warming" not in sched.state()
    return _serve(sched, prompts)[0]
  finally:
    sched.close()


def _prompts(vocab: int, lengths) -> list[np.ndarray]:
  rng = np.random.default_rng(0)
  return [rng.integers(10, vocab, n).astype(np.int32) for n in lengths]


def test_a_warm_resident_server_compiles_no_prefill():
  model = glmjax.load(progress=False, max_context=CONTEXT)
  try:
    sched = _warmed(model)
    widths = prefill_widths(CONTEXT, model.options.prefill_chunk)
    assert widths == [1, 2, 4, 8, 16]
    assert model.executor.compiled().count("prefill_fn") == len(widths)
    prompts = _prompts(model.config.vocab_size, (1, 2, 3, 5, 9, CONTEXT - N, 6))  # every width
    outs, compiled = _serve(sched, prompts)
    sched.close()
    assert compiled[1:] == [0] * (len(prompts) - 1), compiled
    assert outs == _unwarmed_outputs(model, prompts)
  finally:
    model.close()


def test_an_offloaded_warm_up_reads_nothing_and_changes_no_answer(tmp_path):
  path = str(tmp_path / "store")
  synthetic.make_synthetic_store(path, geometry="tiny", moe_layers=2, experts=16, mtp=False,
                                 progress=False)
  model = glmjax.load(path, progress=False, device_cache_gb=0, host_cache_gb=0.001,
                      max_context=CONTEXT // 2)  # widths 1, 2, 4, 8 (each compiles its steps)
  try:
    before = model.executor.telemetry()
    sched = _warmed(model)
    assert model.executor.telemetry() == before  # no read, no counter
    assert len(model.engine.read_log) == 0
    prompts = _prompts(model.config.vocab_size, (3, 5, 2))  # widths 4, 8, 2
    outs, _ = _serve(sched, prompts)
    again, compiled = _serve(sched, prompts)  # the host cache and fused state differ now
    sched.close()
    assert again == outs and compiled == [0, 0, 0], compiled
    assert outs == _unwarmed_outputs(model, prompts)
  finally:
    model.close()
