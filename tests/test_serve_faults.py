"""Faults in the offload engine, per request (issue 47, item 5): a read of one expert of a
middle layer fails, stalls or returns a corrupt chunk while four clients stream. The rows whose
tokens routed to that expert in that step fail with an error naming the layer and expert; the
other rows resume from the KV cache the failed step left and finish with their solo output
(`Model.generate` of the same prompt, no fault); the server goes on serving.

The store is a small synthetic one (three MoE layers of 64 experts, so prompts route
differently) with no device tier and no host cache, so every expert a step routes to is read:
the engine's read log of a solo run is exactly the (layer, expert) pairs that run routed to,
before and after its first token. The faulty expert is picked from those logs, never
hard-coded: one that some prompts route to only while decoding and the others never do.
Faults are keyed by (layer, expert) in the read function, so nothing depends on timing; the
stalled read is released by an event at the end of its case.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import os
import threading

import pytest

import glmjax
from glmjax.formats import synthetic
from glmjax.serving.app import create_app
from glmjax.serving.scheduler import HeapTrim
from tests.test_serve import _until, serving

N = 10  # tokens per request
STALL_S = 5.0  # io_timeout_s: a read not back by then is stalled (the reads here take ms)
# 5 to 8 tokens each: one prefill shape for all of them
PROMPTS = ["def parse(line):", "import os\nimport sys", "for i in range(10):", "class Point:",
           "print('hello')", "if x is None:", "with open(path) as f:", "self.name = name"]


@dataclasses.dataclass
class Solo:
  """A prompt served alone: its text, and the (layer, expert) pairs its prefill and its
  decode steps read (= routed to: no tier holds an expert)."""
  prompt: str
  text: str
  prefill: set
  decode: set


def _solo(model, prompt: str) -> Solo:
  log = model.engine.read_log  # a deque far from its bound here
  start, marks = len(log), []
  text = model.generate(prompt, N, on_token=lambda _: marks.append(len(log))).text
  reads = list(log)
  return Solo(prompt, text, set(reads[start:marks[0]]), set(reads[marks[0]:]))


def _pick(solos: list[Solo], layer: int, experts: int) -> list[tuple[int, list[Solo]]]:
  """Experts of `layer` (with their four prompts) that one to three of four prompts route to
  while decoding only, and none in its prefill: every row is live when the fault hits."""
  out = []
  for e in range(experts):
    for first in range(len(solos) - 3):
      four = solos[first:first + 4]
      hit = [s for s in four if (layer, e) in s.decode]
      if 1 <= len(hit) <= 3 and not any((layer, e) in s.prefill for s in four):
        out.append((e, four))
        break
  return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("faults") / "store")
  synthetic.make_synthetic_store(path, geometry="tiny", moe_layers=3, experts=64, mtp=False,
                                 progress=False)
  model = glmjax.load(path, progress=False, device_cache_gb=0, host_cache_gb=0, prefetch=False,
                      io_timeout_s=STALL_S, max_context=64)
  layer = model.engine.moe_layers[1]  # the middle MoE layer
  solos = [_solo(model, p) for p in PROMPTS]
  picks = _pick(solos, layer, model.config.n_routed_experts)
  assert len(picks) >= 3, "no expert of the middle layer splits the prompts: change PROMPTS"
  app = create_app(model, max_batch=4, max_queue=4, warm_prefill=False)
  with serving(app) as port:
    yield dict(model=model, app=app, port=port, layer=layer, picks=picks, path=path)
  model.close()


def _http(port, method, path, body=None):
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
  try:
    conn.request(method, path, None if body is None else json.dumps(body),
                 {"content-type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())
  finally:
    conn.close()


def _stream(port, name, prompt) -> dict:
  """One streamed completion: its text, and the error event's message if one came."""
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
  text, error = [], None
  try:
    conn.request("POST", "/v1/completions", json.dumps(dict(
        model=name, prompt=prompt, max_tokens=N, temperature=0, stream=True)),
        {"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    for raw in r:
      line = raw.decode().strip()
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      event = json.loads(line[6:])
      if "error" in event:
        error = event["error"]["message"]
      else:
        text += [c["text"] for c in event["choices"]]
  finally:
    conn.close()
  return dict(text="".join(text), error=error)


@contextlib.contextmanager
def _fault(served, kind: str, expert: int):
  """Expert `expert` of the middle layer fails to read ("error"), never returns ("stall", until
  the case ends) or has a damaged chunk on disk ("corrupt": its crc32c fails)."""
  model, layer = served["model"], served["layer"]
  reader = model.engine.reader
  read, release = reader.read_fn, threading.Event()
  chunk = None

  def faulty(l, e):
    if (l, e) == (layer, expert):
      if kind == "error":
        raise OSError(5, "Input/output error")
      release.wait()  # "stall": a read that does not come back while the case runs
    return read(l, e)
  if kind == "corrupt":
    row = model.engine.store.where[layer][1]
    chunk = os.path.join(served["path"], "experts", "main", "c", str(row), str(expert), "0")
    good = open(chunk, "rb").read()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    open(chunk, "wb").write(bytes(bad))
  else:
    reader.read_fn = faulty
  try:
    yield
  finally:
    reader.read_fn = read
    release.set()
    if chunk is not None:
      open(chunk, "wb").write(good)


@pytest.mark.parametrize("kind,pick", [("error", 0), ("stall", 1), ("corrupt", 2)])
def test_an_expert_fault_fails_the_rows_that_routed_to_it_only(served, kind, pick):
  port, layer, sched = served["port"], served["layer"], served["app"].state.scheduler
  name = served["app"].state.model_name
  expert, four = served["picks"][pick]
  hit = [(layer, expert) in s.decode for s in four]
  before = _http(port, "GET", "/health")[1]
  with _fault(served, kind, expert):
    sched.hold(True)  # the four are admitted (prefilled) first: the fault hits a full batch
    try:
      with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_stream, port, name, s.prompt) for s in four]
        _until(lambda: _http(port, "GET", "/health")[1]["live"] == 4, "four live rows")
        sched.hold(False)
        got = [f.result(timeout=300) for f in futures]
    finally:
      sched.hold(False)
  for s, routed, g in zip(four, hit, got):
    if routed:  # failed mid-stream, naming the layer and expert; what came before is solo's
      assert g["error"] is not None and f"layer {layer} expert {expert}" in g["error"], g
      assert s.text.startswith(g["text"])
    else:
      assert g["error"] is None and g["text"] == s.text, (s.prompt, g)
  if kind == "corrupt":
    assert all("crc32c" in g["error"] for g, routed in zip(got, hit) if routed)
  after = _http(port, "GET", "/health")[1]
  assert after["status"] == "ok" and after["live"] == 0
  assert after["failed"] - before["failed"] == sum(hit)
  assert after["faults"] - before["faults"] >= 1
  # the server goes on: a prompt that failed now gives its solo output
  again = _stream(port, name, four[hit.index(True)].prompt)
  assert again == dict(text=four[hit.index(True)].text, error=None)
  assert _http(port, "GET", "/health")[0] == 200


def test_heap_trim_runs_when_due():
  trim = HeapTrim(busy_s=0.0, idle_s=0.0)
  if trim.fn is None:
    pytest.skip("not glibc")
  trim.tick(idle=True)
  trim.tick(idle=False)
  assert trim.state()["trims"] == 2
  never = HeapTrim(busy_s=1e9, idle_s=1e9)
  never.tick(idle=True)
  assert never.state()["trims"] == 0
