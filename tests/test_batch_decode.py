"""Batched decoding (glmjax.serving.batch): rows at different lengths, joining and leaving at
step boundaries, each give the tokens the request gives alone."""

import numpy as np
import pytest

import glmjax
from glmjax.decoding.generation import new_request
from glmjax.serving.batch import BatchDecoder

PROMPTS = ["def ", "The quick brown", "import numpy as np\n", "x = "]  # 2, 7, 8, 3 tokens
N = 8


@pytest.fixture(scope="module")
def model():
  with glmjax.load(progress=False, max_context=64) as m:  # a short batch cache: fast steps
    yield m


@pytest.fixture(scope="module")
def batch(model):
  return BatchDecoder(model, 3)  # narrower than PROMPTS: the fourth waits for a row


def _ids(m, text):
  return np.asarray(m.tokenizer.encode(text), np.int32)


def test_rows_at_different_lengths_give_their_solo_tokens(model, batch):
  solo = [model.generate(p, N).tokens for p in PROMPTS]
  reqs = [new_request(model, _ids(model, p), N) for p in PROMPTS]
  waiting = list(range(len(PROMPTS)))
  joined_late = False
  steps = 0
  while waiting or batch.live:
    # one joins per step boundary, so rows sit at different lengths
    if waiting and batch.free():
      i = waiting.pop(0)
      joined_late |= batch.live > 0
      assert not batch.admit(_ids(model, PROMPTS[i]), reqs[i], tag=i)
    batch.step()
    steps += 1
    assert steps < 10 * N
  assert joined_late
  assert [r.out for r in reqs] == solo
  # the rows really shared steps: fewer steps than the requests run one after the other
  assert steps < len(PROMPTS) * (N - 1)


def test_dropped_row_leaves_the_others_alone(model, batch):
  solo = model.generate(PROMPTS[1], N).tokens
  keep, gone = new_request(model, _ids(model, PROMPTS[1]), N), new_request(model, _ids(model, "x"), N)
  batch.admit(_ids(model, "x"), gone, tag="gone")
  batch.admit(_ids(model, PROMPTS[1]), keep, tag="keep")
  batch.step()
  assert batch.drop("gone") and batch.live == 1
  while batch.live:
    batch.step()
  assert keep.out == solo


def test_offloaded_batch_is_compiled_ahead_and_gives_solo_tokens(embedded_store, caplog):
  """On an expert store the batch compiles its [width, 1] steps when it is built, with a step
  whose rows are all padding: nothing is read, counted or heated. Its first real steps then
  compile no layer step or fused step (jax_log_compiles), and each row gives its solo tokens."""
  import json
  import logging
  import os
  import jax
  chunk = json.load(open(os.path.join(embedded_store, "manifest.json")))[
      "experts"]["main"]["layout"]["nbytes"]
  with glmjax.load(embedded_store, progress=False, max_context=80, device_cache_gb=0,
                   host_cache_gb=40 * chunk / 2**30) as m:
    solo = [m.generate(p, N, stop_ids=[]).tokens for p in PROMPTS[:3]]
    eng = m.engine
    eng.reader.drain()  # the solo runs' prefetches finished: nothing lands during the check
    reads = []
    read = eng.reader.read_fn
    eng.reader.read_fn = lambda layer, e: reads.append((layer, e)) or read(layer, e)
    before = (eng.telemetry(), dict(eng.heat.h), eng.heat.scale, eng.host.keys(),
              eng.fused_step.ready)
    batch = BatchDecoder(m, 3, 80)  # a width no other test compiles
    assert (eng.telemetry(), dict(eng.heat.h), eng.heat.scale, eng.host.keys(),
            eng.fused_step.ready) == before
    assert reads == []
    reqs = [new_request(m, _ids(m, p), N, stop_ids=[]) for p in PROMPTS[:3]]
    for i, r in enumerate(reqs):
      assert not batch.admit(_ids(m, PROMPTS[i]), r, tag=i)
    jax.config.update("jax_log_compiles", True)
    try:
      with caplog.at_level(logging.WARNING, logger="jax"):
        while batch.live:
          batch.step()
    finally:
      jax.config.update("jax_log_compiles", False)
    compiled = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    steps = ("attention_step", "mlp_head", "fused_")  # the engine's layer and fused steps
    assert not [c for c in compiled if any(k in c for k in steps)], compiled
    assert [r.out for r in reqs] == solo
    assert eng.telemetry()["experts_used"] > before[0]["experts_used"]  # really offloaded


def test_compiling_ahead_drops_no_held_prefetch(embedded_store):
  """A finished prefetch held for want of room (in `inflight`) waits for its layer's next real
  step; the all-padding step that compiles a batch ahead must neither take nor drop it."""
  import concurrent.futures as cf
  from glmjax.offload.expert_io import PILOT
  with glmjax.load(embedded_store, progress=False, max_context=80, device_cache_gb=0,
                   host_cache_gb=0) as m:
    eng = m.engine
    eng.reader.drain()
    key = (eng.moe_layers[0], 1)
    held = cf.Future()
    held.set_result(eng.reader.read_fn(*key))
    eng.prefetcher.inflight[key] = (held, PILOT)
    before = eng.telemetry()
    BatchDecoder(m, 2, 80)
    assert eng.prefetcher.inflight.get(key) == (held, PILOT)
    assert eng.telemetry() == before
