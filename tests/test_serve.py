"""The OpenAI-compatible server (glmjax.serving.app), through the official `openai` client against
one in-process server on a free loopback port, plus scripts/serve.py as a user starts it.

No test relies on timing: outputs are compared, not speeds, and server state is awaited with
a generous bounded poll.
"""

import concurrent.futures
import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import openai
import pytest
import uvicorn

import glmjax
from glmjax.decoding import text
from glmjax.serving.app import create_app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 12  # tokens per request: short prompts + N stay in one 16-position prefill cache
PROMPTS = ["def ", "for i in", "import os\n", "x = "]  # ≤ 4 tokens each


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _until(cond, what: str, timeout: float = 60.0):
  """Polls `cond` until true (bounded, generous: never a bet on speed)."""
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if cond():
      return
    time.sleep(0.02)
  raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def serving(app, config: uvicorn.Config | None = None):
  """`app` served by uvicorn in a thread (`config`; default: a free loopback port): yields the
  port; stops the server and the app's scheduler on the way out."""
  config = config or uvicorn.Config(app, host="127.0.0.1", port=_free_port(), log_level="warning")
  port = config.port
  srv = uvicorn.Server(config)
  thread = threading.Thread(target=srv.run, daemon=True)
  thread.start()
  try:
    _until(lambda: srv.started, "the server to start")
    yield port
  finally:
    srv.should_exit = True
    thread.join(timeout=30)
    app.state.scheduler.close()


@pytest.fixture(scope="module")
def server():
  model = glmjax.load(progress=False, max_context=256)  # a short batch cache: fast steps
  # The prefill warm-up (on by default) has its own tests (test_serve_warm, test_soak and the
  # script runs below); the in-process apps skip it: every width compiled is 1-3 s of CPU.
  app = create_app(model, max_batch=4, max_queue=4, warm_prefill=False)
  with serving(app) as port:
    base = f"http://127.0.0.1:{port}"
    yield dict(model=model, app=app, base=base, port=port, name=app.state.model_name,
               client=openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0))
  model.close()


def _http(server, method, path, body=None):
  """(status, parsed JSON) of one plain HTTP call (`body`: bytes, or an object sent as JSON)."""
  if body is not None and not isinstance(body, bytes):
    body = json.dumps(body).encode()
  conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
  try:
    conn.request(method, path, body, {"content-type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())
  finally:
    conn.close()


@contextlib.contextmanager
def _stream(server, path, body):
  """An open streaming response; leaving the block drops the connection."""
  conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
  try:
    conn.request("POST", path, json.dumps(body).encode(), {"content-type": "application/json"})
    yield conn.getresponse()
  finally:
    conn.close()


def _lines(response):
  """The non-empty lines of a server-sent event stream, as they arrive."""
  for raw in response:
    line = raw.decode().strip()
    if line:
      yield line


def _state(server) -> dict:
  return _http(server, "GET", "/health")[1]


def _complete(server, prompt, **kw):
  kw = {"max_tokens": N, "temperature": 0, **kw}
  return server["client"].completions.create(model=server["name"], prompt=prompt, **kw)


def test_health_and_models(server):
  state = _state(server)
  assert state["status"] == "ok" and state["max_batch"] == 4 and state["max_queue"] == 4
  # load()'s memory plan: the dense part's format and bytes (the embedded model's bfloat16
  # weights stay bfloat16 on a CPU by default)
  mem, w = state["memory"], server["model"].weights
  assert mem["dense_format"] == "bfloat16" and mem["where"] == "host"
  size = lambda tree: sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))
  routed = [l.mlp.experts for l in w.layers + [t.layer for t in w.mtp] if hasattr(l.mlp, "experts")]
  assert mem["dense"] == size(w) - size(routed) and mem["experts"] == size(routed)
  models = server["client"].models.list()
  assert [m.id for m in models.data] == [server["name"]]


def test_an_empty_bearer_is_accepted_without_a_key(server):
  # lm-eval always sends `Authorization: Bearer $OPENAI_API_KEY`, empty by default
  conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
  try:
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": server["name"], "prompt": "def ", "max_tokens": 2}).encode(),
        {"content-type": "application/json", "authorization": "Bearer "})
    assert conn.getresponse().status == 200
  finally:
    conn.close()


def test_greedy_completion_equals_generate(server):
  r = _complete(server, PROMPTS[0])
  ref = server["model"].generate(PROMPTS[0], N)
  assert r.choices[0].text == ref.text
  assert r.choices[0].finish_reason == ("length" if ref.stop_reason == "max_new_tokens"
                                        else "stop")
  n_prompt = len(server["model"].tokenizer.encode(PROMPTS[0]))
  assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(ref.tokens))
  assert r.usage.total_tokens == n_prompt + len(ref.tokens)
  tel = r.model_extra["glmjax"]
  assert tel["ttft_s"] > 0 and tel["latency_s"] >= tel["ttft_s"] and "decode_tok_s" in tel


def test_chat_uses_the_models_template(server):
  messages = [{"role": "user", "content": "Hi"}]
  r = server["client"].chat.completions.create(model=server["name"], messages=messages,
                                               max_tokens=8, temperature=0)
  model = server["model"]
  ids = text.encode_chat(messages, model.tokenizer, add_generation_prompt=True,
                         enable_thinking=False)  # what Model.chat feeds its first turn
  ref = model.generate(ids, 8)
  assert r.choices[0].message.content == ref.text
  assert r.choices[0].message.role == "assistant"
  assert r.usage.prompt_tokens == len(ids)


def test_streams_join_to_the_whole_text(server):
  c, name = server["client"], server["name"]
  whole = _complete(server, PROMPTS[1]).choices[0].text
  chunks = list(_complete(server, PROMPTS[1], stream=True))
  assert "".join(ch.choices[0].text for ch in chunks) == whole
  assert chunks[-1].choices[0].finish_reason in ("length", "stop")
  assert chunks[-1].usage.completion_tokens >= 1
  messages = [{"role": "user", "content": "Hi"}]
  kw = dict(model=name, messages=messages, max_tokens=8, temperature=0)
  whole = c.chat.completions.create(**kw).choices[0].message.content
  chunks = list(c.chat.completions.create(**kw, stream=True))
  assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole
  assert chunks[0].choices[0].delta.role == "assistant"
  assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_raw_stream_ends_with_done(server):
  body = {"model": server["name"], "prompt": "def ", "max_tokens": 3, "stream": True,
          "temperature": 0}
  with _stream(server, "/v1/completions", body) as r:
    assert r.getheader("content-type").startswith("text/event-stream")
    lines = list(_lines(r))
  assert lines[-1] == "data: [DONE]"
  assert all(l.startswith("data: ") for l in lines)


def test_concurrent_requests_equal_their_solo_results(server):
  settings = [dict(temperature=0)] * 3 + [dict(temperature=0.8, seed=7)]  # one sampled
  solo = [_complete(server, p, **s).choices[0].text for p, s in zip(PROMPTS, settings)]
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    futures = [pool.submit(_complete, server, p, **s) for p, s in zip(PROMPTS, settings)]
    together = [f.result().choices[0].text for f in futures]
  assert together == solo


BAD = [  # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/completions", {"model": "@", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "@", "prompt": "x", "max_tokens": 10 ** 6}, 400, "max_tokens"),
    ("/v1/completions", {"model": "@", "prompt": "word " * 300}, 400, "prompt"),
    ("/v1/completions", {"model": "@", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "@", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "@", "prompt": "x", "temperature": 9}, 400, "temperature"),
    ("/v1/completions", {"model": "@", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "@", "prompt": "x", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"model": "@", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": "@", "prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"model": "@", "prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"model": "@", "prompt": [1, 10 ** 9]}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "@", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "@", "messages": [{"role": "user"}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"model": "@", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": -1}, 400, "max_tokens"),
]


def test_bad_input_is_a_4xx_with_openais_error_shape(server):
  for path, body, status, param in BAD:
    if isinstance(body, dict) and body.get("model") == "@":
      body = {**body, "model": server["name"]}
    code, reply = _http(server, "POST", path, body)
    assert code == status, (path, body, reply)
    err = reply["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, (body, err)
  with pytest.raises(openai.NotFoundError):
    server["client"].completions.create(model="nope", prompt="x")
  with pytest.raises(openai.BadRequestError):
    _complete(server, "x", max_tokens=0)
  assert _http(server, "GET", "/v1/nothing")[0] == 404
  assert _state(server)["status"] == "ok"
  assert _complete(server, "def ").choices[0].text  # and it still serves


def test_a_full_queue_is_429(server):
  sched = server["app"].state.scheduler
  room = 4 + 4  # max_batch rows + max_queue waiting
  sched.hold(True)  # rows fill but never free: the queue fills deterministically
  try:
    with concurrent.futures.ThreadPoolExecutor(room) as pool:
      futures = [pool.submit(_complete, server, "def ", max_tokens=2) for _ in range(room)]
      _until(lambda: (_state(server)["live"], _state(server)["waiting"]) == (4, 4),
             "the batch and the queue to fill")
      with pytest.raises(openai.RateLimitError) as e:
        _complete(server, "def ", max_tokens=2)
      assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
      sched.hold(False)
      assert all(f.result().choices[0].text for f in futures)
  finally:
    sched.hold(False)


def test_disconnect_mid_stream_frees_the_row(server):
  sched = server["app"].state.scheduler
  before = _state(server)
  body = {"model": server["name"], "prompt": "import os\n", "max_tokens": N, "stream": True,
          "temperature": 0}
  sched.hold(True)  # rows are admitted but do not advance: the request cannot finish first
  try:
    with _stream(server, "/v1/completions", body) as r:
      assert next(_lines(r)).startswith("data: ")  # admitted
      _until(lambda: _state(server)["live"] == 1, "the request to hold a row")
    # the client is gone: its job is flagged, then dropped at the next step boundary
    _until(lambda: _state(server)["cancelling"] == 1, "the server to notice the disconnect")
  finally:
    sched.hold(False)
  _until(lambda: _state(server)["live"] == 0, "the row to be freed")
  after = _state(server)
  assert after["cancelled"] == before.get("cancelled", 0) + 1
  assert after["completed"] == before["completed"]
  assert _complete(server, "def ").choices[0].text


def test_serve_script_starts_with_default_flags():
  port = _free_port()  # the one flag set: the default port may be taken on a shared machine
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "serve.py"),
                           f"--port={port}"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  try:
    def healthy():
      assert proc.poll() is None, proc.stdout.read()
      try:
        return _http({"port": port}, "GET", "/health")[1]["status"] == "ok"
      except OSError:
        return False
    _until(healthy, "scripts/serve.py to answer /health", timeout=120)
  finally:
    proc.terminate()
    proc.wait(timeout=30)
