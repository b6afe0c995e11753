"""The server as real clients use it: lm-eval's request shapes (token-id batches, echo,
logprobs), batches and n, API keys, the guard (content type, body size, Host), hostile input,
and one request's fault never failing another.

References are independent of the server's logprob path: float64 log-softmax of the model's
full logits (`Model.score(tokens)`), and a plain numpy temperature/top-p distribution.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading

import numpy as np
import openai
import pytest

import glmjax
from glmjax.errors import InputError
from glmjax.serving.app import create_app
from glmjax.serving.guard import Guard, api_keys, is_loopback
from tests.test_serve import _until, serving

KEY = "sekrit-key"
CODE = "import os\nimport sys\n\ndef main(argv):\n  for name in argv:\n    print(name)\n"


@pytest.fixture(scope="module")
def server():
  model = glmjax.load(progress=False, max_context=256)
  app = create_app(model, max_batch=4, max_queue=8, guard=Guard((KEY,)), warm_prefill=False)
  with serving(app) as port:
    base = f"http://127.0.0.1:{port}"
    yield dict(model=model, app=app, port=port, name=app.state.model_name,
               client=openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0))
  model.close()


def _raw(server, method, path, body=None, headers=None, key=KEY):
  """(status, parsed JSON or None) of one HTTP call; `body` bytes or an object sent as JSON."""
  if body is not None and not isinstance(body, (bytes, bytearray)):
    body = json.dumps(body).encode()
  h = {"content-type": "application/json"}
  if key is not None:
    h["authorization"] = f"Bearer {key}"
  h.update(headers or {})
  conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=120)
  try:
    conn.request(method, path, body, h)
    r = conn.getresponse()
    raw = r.read()
    try:
      return r.status, json.loads(raw)
    except ValueError:
      return r.status, None
  finally:
    conn.close()


def _log_softmax64(model, ids) -> np.ndarray:
  """float64 log-softmax `[S, V]` of the model's full logits over `ids`."""
  logits = model.score(np.asarray([ids], np.int32))[0].astype(np.float64)
  logits -= logits.max(-1, keepdims=True)
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def _lm_eval_request(server, prompts, **kw):
  """lm-eval local-completions' loglikelihood request: a batch of token-id prompts."""
  return server["client"].completions.create(
      model=server["name"], prompt=prompts, temperature=0, max_tokens=1, logprobs=1, seed=1234,
      echo=True, **kw)


def test_lm_eval_loglikelihood_shapes_equal_the_models_scores(server):
  model, tok = server["model"], server["model"].tokenizer
  ctx = tok.encode(CODE[:40])
  conts = [tok.encode(" print(name)"), tok.encode(" return 0")]
  prompts = [ctx + c for c in conts]
  r = _lm_eval_request(server, prompts)
  choices = sorted(r.choices, key=lambda c: c.index)
  assert [c.index for c in choices] == [0, 1]
  for ids, cont, choice in zip(prompts, conts, choices):
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 1
    ref = _log_softmax64(model, ids)
    want = sum(ref[i - 1, ids[i]] for i in range(len(ctx), len(ids)))
    got = sum(lp.token_logprobs[len(ctx):-1])
    assert abs(got - want) < 1e-4, (got, want)
    greedy = all(abs(lp.token_logprobs[i] - max(lp.top_logprobs[i].values())) < 1e-6
                 for i in range(len(ctx), len(ids)))  # lm-eval's is_greedy
    assert greedy == all(int(np.argmax(ref[i - 1])) == ids[i] for i in range(len(ctx), len(ids)))
    assert choice.text.startswith(tok.decode(ids))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_with_no_new_tokens_scores_the_prompt_only(server):
  ids = server["model"].tokenizer.encode(CODE[:30])
  r = server["client"].completions.create(model=server["name"], prompt=ids, max_tokens=0,
                                          echo=True, logprobs=0)
  lp = r.choices[0].logprobs
  assert len(lp.token_logprobs) == len(ids) and r.usage.completion_tokens == 0
  assert all(t == {} for t in lp.top_logprobs[1:])  # logprobs=0: no alternatives
  ref = _log_softmax64(server["model"], ids)
  np.testing.assert_allclose(lp.token_logprobs[1:], [ref[i - 1, ids[i]] for i in
                                                     range(1, len(ids))], atol=1e-4)
  with pytest.raises(openai.BadRequestError):  # without echo, 0 tokens is still a 400
    server["client"].completions.create(model=server["name"], prompt=ids, max_tokens=0)


def test_greedy_logprobs_are_the_models_log_softmax(server):
  model = server["model"]
  prompt = model.tokenizer.encode(CODE[:25])
  r = server["client"].completions.create(model=server["name"], prompt=prompt, max_tokens=5,
                                          temperature=0, logprobs=3)
  lp = r.choices[0].logprobs
  out = model.generate(prompt, 5).tokens
  ref = _log_softmax64(model, prompt + out)
  for j, t in enumerate(out):
    row = ref[len(prompt) + j - 1]
    assert abs(lp.token_logprobs[j] - row[t]) < 1e-4
    top = np.argsort(-row)[:3]
    assert list(lp.top_logprobs[j].values()) == pytest.approx(row[top], abs=1e-4)
    assert int(top[0]) == t  # greedy picks the most likely


def test_sampled_logprobs_are_those_of_the_distribution_sampled_from(server):
  model, t, p = server["model"], 0.7, 0.9
  prompt = model.tokenizer.encode(CODE[:25])
  r = server["client"].completions.create(model=server["name"], prompt=prompt, max_tokens=4,
                                          temperature=t, top_p=p, seed=7, logprobs=2)
  lp = r.choices[0].logprobs
  out = model.generate(prompt, 4, temperature=t, top_p=p, seed=7).tokens
  assert r.choices[0].text == model.tokenizer.decode(out)
  logits = model.score(np.asarray([prompt + out], np.int32))[0].astype(np.float64)
  for j, tok in enumerate(out):
    x = logits[len(prompt) + j - 1] / t
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = np.cumsum(probs[order]) - probs[order] < p  # the smallest set reaching p
    nucleus = np.zeros_like(probs)
    nucleus[order[keep]] = probs[order[keep]]
    assert abs(lp.token_logprobs[j] - np.log(nucleus[tok] / nucleus.sum())) < 1e-4
    assert len(lp.top_logprobs[j]) == min(2, int(keep.sum()))  # only tokens it could sample


def test_chat_logprobs(server):
  r = server["client"].chat.completions.create(
      model=server["name"], messages=[{"role": "user", "content": "def "}], max_tokens=6,
      temperature=0, logprobs=True, top_logprobs=2)
  content = r.choices[0].logprobs.content
  assert len(content) == r.usage.completion_tokens
  assert "".join(c.token for c in content) == r.choices[0].message.content
  for c in content:
    assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
    assert c.logprob == pytest.approx(c.top_logprobs[0].logprob)  # greedy: the top token


def test_a_batch_of_prompts_is_one_choice_each_in_order(server):
  prompts = ["def ", "for i in", "import os\n"]
  r = server["client"].completions.create(model=server["name"], prompt=prompts, max_tokens=6,
                                          temperature=0)
  assert [c.index for c in r.choices] == [0, 1, 2]
  for p, c in zip(prompts, r.choices):
    assert c.text == server["model"].generate(p, 6).text
  enc = server["model"].tokenizer.encode
  assert r.usage.prompt_tokens == sum(len(enc(p)) for p in prompts)


def test_n_choices_sample_with_consecutive_seeds(server):
  r = server["client"].completions.create(model=server["name"], prompt="def ", max_tokens=6,
                                          temperature=1.0, top_p=1.0, seed=11, n=3)
  model = server["model"]
  assert [c.text for c in r.choices] == [model.generate("def ", 6, temperature=1.0,
                                                        seed=11 + j).text for j in range(3)]
  assert r.usage.prompt_tokens == len(model.tokenizer.encode("def "))


def test_stream_include_usage_ends_with_the_usage_chunk(server):
  chunks = list(server["client"].completions.create(
      model=server["name"], prompt=["def ", "x = "], max_tokens=4, temperature=0, stream=True,
      stream_options={"include_usage": True}))
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 2
  texts = {0: "", 1: ""}
  for ch in chunks[:-1]:
    for c in ch.choices:
      texts[c.index] += c.text
  assert texts == {i: server["model"].generate(p, 4).text for i, p in enumerate(["def ", "x = "])}


def test_api_key_and_the_guard(server):
  body = {"model": server["name"], "prompt": "def ", "max_tokens": 2}
  assert _raw(server, "POST", "/v1/completions", body, key=None)[0] == 401
  assert _raw(server, "POST", "/v1/completions", body, key="wrong")[0] == 401
  assert _raw(server, "POST", "/v1/completions", body, key="")[0] == 401
  assert _raw(server, "POST", "/v1/completions", body)[0] == 200
  assert _raw(server, "POST", "/v1/completions", body, {"x-api-key": KEY}, key=None)[0] == 200
  assert _raw(server, "GET", "/v1/models", key=None)[0] == 401
  assert _raw(server, "POST", "/tokenize", {"prompt": "x"}, key=None)[0] == 401
  assert _raw(server, "GET", "/health", key=None)[0] == 200  # public
  with pytest.raises(openai.AuthenticationError):
    openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="nope",
                  max_retries=0).models.list()
  assert _raw(server, "POST", "/v1/completions", json.dumps(body).encode(),
              {"content-type": "text/plain"})[0] == 415
  assert _raw(server, "POST", "/v1/completions", b"x" * (9 << 20))[0] == 413
  assert _raw(server, "POST", "/v1/completions", body, {"host": "evil.example:8000"})[0] == 403
  assert _raw(server, "POST", "/v1/completions", body, {"host": "localhost:1"})[0] == 200


def test_tokenizer_routes(server):
  tok = server["model"].tokenizer
  status, info = _raw(server, "GET", "/tokenizer_info")
  assert status == 200 and info["eos_token"] == "<|endoftext|>"
  assert _raw(server, "POST", "/tokenize", {"prompt": CODE, "add_special_tokens": False}
              )[1] == {"tokens": tok.encode(CODE)}
  assert _raw(server, "POST", "/detokenize", {"tokens": tok.encode(CODE)})[1] == {"prompt": CODE}
  assert _raw(server, "POST", "/detokenize", {"tokens": [10 ** 9]})[0] == 400


def test_huge_seed_is_a_400_and_fails_no_one_else(server):
  c = server["client"]
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    other = pool.submit(lambda: c.completions.create(model=server["name"], prompt="for i in",
                                                     max_tokens=8, temperature=0))
    with pytest.raises(openai.BadRequestError) as e:
      c.completions.create(model=server["name"], prompt="def ", seed=2 ** 64)
    assert e.value.body["param"] == "seed"
    assert other.result().choices[0].text == server["model"].generate("for i in", 8).text
  with pytest.raises(InputError, match="seed"):
    server["model"].generate("def ", 2, seed=2 ** 64)
  with pytest.raises(InputError, match="seed"):
    server["model"].generate("def ", 2, seed=-1)


def _hostile_requests(name: str):
  """A few hundred malformed or hostile (path, body bytes, headers) triples."""
  rng = np.random.default_rng(0)
  fields = ["max_tokens", "temperature", "top_p", "seed", "n", "logprobs", "stop", "stream",
            "echo", "prompt", "messages", "stream_options", "top_logprobs", "model"]
  values = [None, True, -1, 0, 2 ** 64, -2 ** 70, 1e308, float("nan"), "x", "", [], {}, [[]],
            [-5], [2 ** 40], ["a", 1], {"a": [1]}, "\udcff", "é" * 50, [[1, 2], "x"],
            list(range(40)), 10 ** 6]
  out = []
  for i in range(240):
    body = {"model": name, "prompt": "def "} if i % 3 else {"model": name, "messages": [
        {"role": "user", "content": "hi"}]}
    for f in rng.choice(fields, rng.integers(1, 4), replace=False):
      body[str(f)] = values[rng.integers(len(values))]
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    try:
      raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    except ValueError:
      continue
    out.append((path, raw, {}))
  deep = b"[" * 100000 + b"]" * 100000
  out += [("/v1/completions", deep, {}), ("/v1/completions", b"\xff\xfe", {}),
          ("/v1/completions", b'{"model": 1e999999}', {}), ("/v1/completions", b"", {}),
          ("/v1/completions", b"{}", {"content-type": "application/x-www-form-urlencoded"}),
          ("/v1/completions", b"{}", {"content-length": "999999999999"}),
          ("/tokenize", b'{"prompt": ["x"]}', {}), ("/detokenize", b'{"tokens": "abc"}', {})]
  return out


def test_fuzz_every_hostile_request_is_a_4xx(server):
  before = _raw(server, "GET", "/health")[1]
  statuses = []
  for path, raw, headers in _hostile_requests(server["name"]):
    try:
      status, body = _raw(server, "POST", path, raw, headers)
    except (ConnectionError, http.client.HTTPException):
      continue  # the server may close a connection it refused to read: never a 500
    statuses.append(status)
    assert 400 <= status < 500 or status == 200, (path, raw[:200], status, body)
    if status != 200:
      assert set(body["error"]) == {"message", "type", "param", "code"}
  assert len(statuses) > 200 and statuses.count(200) < len(statuses)
  after = _raw(server, "GET", "/health")[1]
  assert after["status"] == "ok" and after["failed"] == before["failed"]
  assert server["client"].completions.create(model=server["name"], prompt="def ", max_tokens=4,
                                             temperature=0).choices[0].text


def test_an_injected_fault_fails_its_request_only(server, monkeypatch):
  sched = server["app"].state.scheduler
  model, c = server["model"], server["client"]
  want = model.generate("for i in", 8).text
  runner = sched.batch.executor
  real = runner.prefill
  bad = model.tokenizer.encode("x = ")

  def faulty(cache, ids, start, *a, **k):
    if list(ids) == bad:  # a fault after donating: the batch's KV arrays are lost with it
      real(cache, ids, start, *a, **k)
      for leaf in __import__("jax").tree.leaves(cache.layers):
        leaf.delete() if not leaf.is_deleted() else None
      raise RuntimeError("injected fault")
    return real(cache, ids, start, *a, **k)
  before = _raw(server, "GET", "/health")[1]
  sched.hold(True)  # the healthy request is admitted first and waits: the fault hits mid-flight
  try:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      good = pool.submit(lambda: c.completions.create(model=server["name"], prompt="for i in",
                                                      max_tokens=8, temperature=0))
      _until(lambda: _raw(server, "GET", "/health")[1]["live"] == 1, "the request's row")
      monkeypatch.setattr(runner, "prefill", faulty)
      with pytest.raises(openai.InternalServerError):
        c.completions.create(model=server["name"], prompt="x = ", max_tokens=4)
      monkeypatch.setattr(runner, "prefill", real)
      sched.hold(False)
      assert good.result().choices[0].text == want
  finally:
    sched.hold(False)
  after = _raw(server, "GET", "/health")[1]
  assert after["failed"] == before["failed"] + 1 and after["recovered"] == before["recovered"] + 1
  assert after["status"] == "ok"


def test_a_dead_scheduler_is_a_503_at_once():
  from starlette.testclient import TestClient
  model = glmjax.load(progress=False, max_context=64)
  app = create_app(model, max_batch=1, max_queue=1, warm_prefill=False)
  sched = app.state.scheduler

  def die():
    raise SystemExit("injected: the thread ends")
  sched._turn = die  # the next turn kills the thread
  try:
    with TestClient(app, base_url="http://localhost") as client:
      r = client.post("/v1/completions", json={"model": app.state.model_name, "prompt": "def ",
                                               "max_tokens": 2})
      assert r.status_code == 503 and "scheduler stopped" in r.json()["error"]["message"]
      health = client.get("/health")
      assert health.status_code == 503 and "injected" in health.json()["error"]
      r = client.post("/v1/completions", json={"model": app.state.model_name, "prompt": "x",
                                               "max_tokens": 2})
      assert r.status_code == 503
  finally:
    sched.close()
    model.close()


def test_guard_helpers(tmp_path, monkeypatch):
  assert is_loopback("127.0.0.1") and is_loopback("[::1]") and is_loopback("localhost")
  assert not is_loopback("0.0.0.0") and not is_loopback("evil.example")
  monkeypatch.setenv("GLMJAX_API_KEY", "a, b")
  assert api_keys() == ("a", "b") and api_keys("c") == ("c",)
  f = tmp_path / "keys"
  f.write_text("k1\n\nk2\n")
  assert api_keys(key_file=str(f)) == ("k1", "k2")
  with pytest.raises(InputError, match="nothere"):
    api_keys(key_file=str(tmp_path / "nothere"))


def test_presence_and_frequency_penalties_follow_openais_rule(server):
  model, prompt = server["model"], "print(print(print("  # greedy repeats itself here
  r = server["client"].completions.create(model=server["name"], prompt=prompt, max_tokens=12,
                                          temperature=0, presence_penalty=0.5,
                                          frequency_penalty=1.5)
  ids, out = model.tokenizer.encode(prompt), []
  counts = np.zeros(model.config.vocab_size)
  stops = model.default_stop_ids()
  for _ in range(12):  # greedy over logits − presence·[count > 0] − frequency·count, by hand
    seq = ids + out
    padded = np.zeros((1, 64), np.int32)
    padded[0, :len(seq)] = seq
    logits = model.score(padded)[0, len(seq) - 1].astype(np.float64)
    tok = int(np.argmax(logits - 0.5 * (counts > 0) - 1.5 * counts))
    if tok in stops:
      break
    out.append(tok)
    counts[tok] += 1
  assert r.choices[0].text == model.tokenizer.decode(out)
  assert r.choices[0].text != model.generate(prompt, 12).text  # the penalties changed something
  with pytest.raises(openai.BadRequestError):
    server["client"].completions.create(model=server["name"], prompt="x", presence_penalty=3)


def test_an_offloaded_server_under_four_streams_with_health_polled(embedded_store, tmp_path):
  """A store with a small host cache: four clients stream while /health is polled all along;
  every stream equals its solo greedy run and every /health answers 200 with counters that
  only grow (the scheduler thread publishes them; the event loop never touches the engine)."""
  import shutil
  store = str(tmp_path / "store")
  shutil.copytree(embedded_store, store)
  model = glmjax.load(store, progress=False, max_context=64, device_cache_gb=0,
                      host_cache_gb=0.002)
  assert not model.executor.stateless
  prompts = ["def ", "for i in", "import os\n", "x = "]
  want = [model.generate(p, 6).text for p in prompts]
  app = create_app(model, max_batch=4, max_queue=4, warm_prefill=False)
  polls, stop = [], threading.Event()

  def poll(port):  # every 20 ms: a tight loop would take the GIL from the scheduler
    while not stop.is_set():
      polls.append(_raw({"port": port}, "GET", "/health", key=None))
      stop.wait(0.02)
  with serving(app) as port:
    poller = threading.Thread(target=poll, args=(port,), daemon=True)
    poller.start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)

    def stream(p):
      return "".join(c.choices[0].text for c in client.completions.create(
          model=app.state.model_name, prompt=p, max_tokens=6, temperature=0, stream=True)
          if c.choices)
    try:
      with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(stream, prompts))
    finally:
      stop.set()
      poller.join(timeout=30)
  model.close()
  assert got == want
  assert len(polls) > 1 and all(status == 200 for status, _ in polls)
  read = [body["engine"]["expert_bytes_read"] for _, body in polls]
  assert read == sorted(read) and read[-1] > read[0]


def test_a_non_streaming_client_that_leaves_frees_its_row(server):
  sched = server["app"].state.scheduler
  before = _raw(server, "GET", "/health")[1]
  body = json.dumps({"model": server["name"], "prompt": "import os\n", "max_tokens": 8}).encode()
  sched.hold(True)  # admitted, never advancing: it cannot finish before the client leaves
  try:
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json",
                                                   "authorization": f"Bearer {KEY}"})
    _until(lambda: _raw(server, "GET", "/health")[1]["live"] == 1, "the request's row")
    conn.close()  # gone without reading a byte
    _until(lambda: _raw(server, "GET", "/health")[1]["cancelling"] == 1, "the disconnect")
  finally:
    sched.hold(False)
  _until(lambda: _raw(server, "GET", "/health")[1]["live"] == 0, "the row to be freed")
  after = _raw(server, "GET", "/health")[1]
  assert after["cancelled"] == before["cancelled"] + 1
  assert after["completed"] == before["completed"]


def test_streamed_logprobs_and_echo_equal_the_whole_response(server):
  c, name = server["client"], server["name"]
  ids = server["model"].tokenizer.encode(CODE[:30])
  for kw in (dict(prompt=ids, echo=True, logprobs=2), dict(prompt="def ", logprobs=3)):
    whole = c.completions.create(model=name, max_tokens=6, temperature=0, **kw).choices[0]
    chunks = [ch.choices[0] for ch in c.completions.create(
        model=name, max_tokens=6, temperature=0, stream=True, **kw) if ch.choices]
    assert "".join(ch.text for ch in chunks) == whole.text
    got = [ch.logprobs for ch in chunks if ch.logprobs]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
      assert sum((getattr(lp, field) for lp in got), []) == getattr(whole.logprobs, field)
  whole = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
  chunks = [ch.choices[0] for ch in c.chat.completions.create(
      model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
      logprobs=True, top_logprobs=2, stream=True) if ch.choices]
  streamed = [e for ch in chunks if ch.logprobs for e in ch.logprobs.content]
  assert [(e.token, e.logprob) for e in streamed] == [
      (e.token, e.logprob) for e in whole.choices[0].logprobs.content]
