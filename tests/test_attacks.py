"""Issue 47, items 2 and 3, against one in-process server (the transport serve.py runs:
glmjax.serving.transport), in one module so that the model loads once.

The attack classes: each gets a 4xx, or a closed connection at the transport level; nothing of
it reaches the scheduler (its `submitted` counter does not move) and /health still says ok and
a good request still gets its 200 afterwards.

The published schema (`/openapi.json`, glmjax.serving.openapi): its bounds are the ones the
checks enforce, probed at and just past each bound; replies follow it; and the short version of
scripts/fuzz_server.py (schemathesis over every route, valid and invalid requests): no 5xx,
every response as documented, and the server still serving afterwards.

Timing: the read timeout is short here (READ_TIMEOUT_S) so that slow clients are cut off soon,
but every wait in these tests is a generous bound, never an assertion on speed.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import os
import socket
import subprocess
import sys

import pytest

import glmjax
from glmjax.errors import InputError
from glmjax.serving import transport
from glmjax.serving.app import create_app
from glmjax.serving.guard import Guard
from glmjax.serving.scheduler import QueueFull
from tests.test_serve import _free_port, _until, serving

READ_TIMEOUT_S = 5.0  # uvicorn's keep-alive (transport.KEEP_ALIVE_S): pooled clients are safe
WAIT_S = 120  # a generous bound on anything the server should do "soon"
IDS = [5, 6, 7, 8]
KEY = "attack-key"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = 10  # schemathesis examples per route and mode here; the long run's 200


class Records(logging.Handler):
  """Every log record of the server's loggers, as its message."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.messages: list[str] = []

  def emit(self, record):
    self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def server():
  model = glmjax.load(progress=False, max_context=256)
  app = create_app(model, max_batch=4, max_queue=8, warm_prefill=False,
                   guard=Guard((KEY,), read_timeout_s=READ_TIMEOUT_S))
  records = Records()
  loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "uvicorn.access")]
  try:
    # serve.py's transport (transport.server_config) on a free loopback port
    config = transport.server_config(app, "127.0.0.1", _free_port(), READ_TIMEOUT_S,
                                     log_level="info")
    with serving(app, config) as port:
      for lg in loggers:
        lg.addHandler(records)
      yield dict(model=model, app=app, port=port, tok=model.tokenizer,
                 name=app.state.model_name, records=records)
  finally:
    for lg in loggers:
      lg.removeHandler(records)
    app.state.scheduler.close()
    model.close()


def _http(server, method, path, body=None, headers=None):
  """(status, parsed JSON or None, response headers) of one request on its own connection."""
  if body is not None and not isinstance(body, bytes):
    body = json.dumps(body).encode()
  conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=WAIT_S)
  try:
    conn.request(method, path, body, {"content-type": "application/json",
                                      "authorization": f"Bearer {KEY}", **(headers or {})})
    r = conn.getresponse()
    raw = r.read()
    try:
      return r.status, json.loads(raw), dict(r.getheaders())
    except ValueError:
      return r.status, None, dict(r.getheaders())
  finally:
    conn.close()


def _submitted(server) -> int:
  return server["app"].state.scheduler.state()["submitted"]


@contextlib.contextmanager
def nothing_queued(server):
  """The block's requests reach no scheduler; afterwards /health is ok and serves."""
  before = _submitted(server)
  yield
  assert _submitted(server) == before
  _still_serving(server)


def _still_serving(server):
  status, health, _ = _http(server, "GET", "/health")
  assert status == 200 and health["status"] == "ok"
  status, body, _ = _http(server, "POST", "/v1/completions", {
      "model": server["name"], "prompt": IDS, "max_tokens": 2, "temperature": 0})
  assert status == 200 and body["usage"]["completion_tokens"] == 2


def _refused(server, path, body, param=None, status=400):
  got, reply, _ = _http(server, "POST", path, body)
  assert got == status, (body, reply)
  if path.startswith("/v1/messages"):
    assert reply["type"] == "error" and reply["error"]["message"]
  else:
    err = reply["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
      assert err["param"] == param, err
  return reply


def _chat(server, **kw):
  return {"model": server["name"], "messages": [{"role": "user", "content": "hi"}],
          "max_tokens": 2, **kw}


def _completion(server, **kw):
  return {"model": server["name"], "prompt": IDS, "max_tokens": 2, **kw}


# --- request bodies ------------------------------------------------------------------------------

def test_unbounded_n_and_prompt_lists(server):
  with nothing_queued(server):
    _refused(server, "/v1/completions", _completion(server, n=17), "n")
    _refused(server, "/v1/completions", _completion(server, n=10 ** 9), "n")
    _refused(server, "/v1/chat/completions", _chat(server, n=17), "n")
    _refused(server, "/v1/completions", _completion(server, prompt=[IDS] * 17), "prompt")
    _refused(server, "/v1/completions", _completion(server, prompt=["x"] * 100_000), "prompt")
    _refused(server, "/v1/completions", _completion(server, prompt=[IDS] * 4, n=5), "n")
    _refused(server, "/v1/completions", _completion(server, stop=["a"] * 5), "stop")
    _refused(server, "/v1/messages", {"model": server["name"], "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}], "stop_sequences": ["a"] * 17})


def test_min_tokens_is_refused_while_unsupported(server):
  with nothing_queued(server):
    for route, body in (("/v1/completions", _completion(server)),
                        ("/v1/chat/completions", _chat(server))):
      _refused(server, route, {**body, "min_tokens": 4}, "min_tokens")
      _refused(server, route, {**body, "min_tokens": 4, "max_tokens": None}, "min_tokens")
      _refused(server, route, {**body, "min_tokens": 10 ** 6, "max_tokens": None}, "min_tokens")


def test_logprobs_limits(server):
  with nothing_queued(server):
    _refused(server, "/v1/chat/completions", _chat(server, logprobs=True, top_logprobs=21),
             "top_logprobs")
    _refused(server, "/v1/chat/completions", _chat(server, top_logprobs=5), "top_logprobs")
    _refused(server, "/v1/chat/completions", _chat(server, logprobs=True, top_logprobs=-1),
             "top_logprobs")
    _refused(server, "/v1/completions", _completion(server, logprobs=21), "logprobs")
    _refused(server, "/v1/completions", _completion(server, logprobs=10 ** 9), "logprobs")
    _refused(server, "/v1/completions", _completion(server, logprobs=True), "logprobs")


def test_out_of_range_token_ids(server):
  vocab = server["model"].config.vocab_size
  with nothing_queued(server):
    for bad in (vocab, -1, 2 ** 31, 2 ** 64, 1.5):
      _refused(server, "/v1/completions", _completion(server, prompt=[5, bad]), "prompt")
      _refused(server, "/v1/completions", _completion(server, prompt=[[5], [5, bad]]), "prompt")
      _refused(server, "/detokenize", {"tokens": [5, bad]}, "tokens")
    # logit_bias and bad_words are not supported: refused, never silently ignored
    _refused(server, "/v1/completions", _completion(server, logit_bias={str(vocab): 100}),
             "logit_bias")
    _refused(server, "/v1/chat/completions", _chat(server, logit_bias={"5": 100}), "logit_bias")
    _refused(server, "/v1/completions", _completion(server, bad_words=["x"]), "bad_words")


def test_regex_redos_in_structured_output(server):
  evil = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}}
  tool = {"type": "function", "function": {"name": "f", "parameters": evil}}
  with nothing_queued(server):
    r = _refused(server, "/v1/chat/completions", _chat(server, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": evil}}))
    assert "pattern" in r["error"]["message"]
    _refused(server, "/v1/chat/completions", _chat(server, tools=[tool], tool_choice={
        "type": "function", "function": {"name": "f"}}))
    _refused(server, "/v1/chat/completions", _chat(server, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "pattern": "(a|a)*b" + "x" * 2000}}}))
    _refused(server, "/v1/messages", {
        "model": server["name"], "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
        "tools": [{"name": "f", "input_schema": evil}], "tool_choice": {"type": "tool",
                                                                       "name": "f"}})


def test_chat_template_render_abuse(server):
  """Template syntax in a message is text, not template; a body that renders past the
  context (many messages) is a 400 before anything is queued."""
  tok = server["tok"]
  bomb = "{% for i in range(10**9) %}{{ i }}{% endfor %}{{ self.__init__ }}"
  with nothing_queued(server):
    _refused(server, "/v1/chat/completions", _chat(server, messages=[
        {"role": "user", "content": "x"}] * 20_000), "messages")
    _refused(server, "/v1/messages", {"model": server["name"], "max_tokens": 2, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}] * 10_000})
  status, r, _ = _http(server, "POST", "/v1/messages/count_tokens", {
      "model": server["name"], "messages": [{"role": "user", "content": bomb}]})
  assert status == 200
  status, plain, _ = _http(server, "POST", "/v1/messages/count_tokens", {
      "model": server["name"], "messages": [{"role": "user", "content": "z"}]})
  # the bomb counts as its own plain tokens, in place of the one-token "z"
  assert r["input_tokens"] - plain["input_tokens"] == len(tok.encode_plain(bomb)) - len(
      tok.encode_plain("z"))


def test_chat_template_kwargs_are_an_allowlist(server):
  with nothing_queued(server):
    for key, value in (("add_generation_prompt", False), ("messages", []), ("tools", []),
                       ("bos_token", "<|system|>"), ("raise_exception", True),
                       ("reasoning_effort", "high")):
      _refused(server, "/v1/chat/completions", _chat(server, chat_template_kwargs={key: value}),
               f"chat_template_kwargs.{key}")
    _refused(server, "/v1/chat/completions", _chat(server, chat_template_kwargs="x"),
             "chat_template_kwargs")
    _refused(server, "/v1/chat/completions",
             _chat(server, chat_template_kwargs={"enable_thinking": "yes"}),
             "chat_template_kwargs.enable_thinking")


def _prompt_ids(server, monkeypatch, path, body) -> list[int]:
  """The token ids the server hands the scheduler for `body` (which then refuses it as if
  full, so that nothing is prefilled: the ids are what this test reads)."""
  from glmjax.serving.scheduler import QueueFull
  seen = []

  def submit(job):
    seen.append([int(t) for t in job.prompt_ids])
    raise QueueFull("recorded")
  monkeypatch.setattr(server["app"].state.scheduler, "submit", submit)
  status, reply, _ = _http(server, "POST", path, body)
  monkeypatch.undo()
  assert status == 429 and len(seen) == 1, reply
  return seen[0]


def test_special_token_placeholders_in_text_are_plain_text(server, monkeypatch):
  """Every field that reaches the prompt, each with a special token's spelling (all of them
  over the fields): the prompt holds each special id exactly as often as the same
  conversation with plain text in their place."""
  tok = server["tok"]
  specials = tok.added_tokens
  ids = {s: tok.token_id(s) for s in specials}

  def forged(i):
    return "a" + specials[i % len(specials)] + "b"

  def openai(t):
    return _chat(server, messages=[
        {"role": "system", "content": t(0)},
        {"role": "user", "content": [{"type": "text", "text": t(2)}]},
        {"role": "assistant", "content": t(4), "reasoning_content": t(6),
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": json.dumps({"q": t(8)})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": t(1)},
        {"role": "user", "content": [{"type": "text", "text": t(3)},
                                     {"type": "text", "text": t(7)}]}],
        tools=[{"type": "function", "function": {"name": "f", "description": t(5)}}])

  def anthropic(t):
    return {"model": server["name"], "max_tokens": 2, "system": t(0), "messages": [
        {"role": "user", "content": t(2)},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": t(4)},
                                          {"type": "text", "text": t(6)}]},
        {"role": "user", "content": [{"type": "text", "text": t(8)}]}]}

  for path, build in (("/v1/chat/completions", openai), ("/v1/messages", anthropic)):
    got = _prompt_ids(server, monkeypatch, path, build(forged))
    clean = _prompt_ids(server, monkeypatch, path, build(lambda i: "ab"))
    for s, i in ids.items():
      assert got.count(i) == clean.count(i), (path, s)
    assert len(got) > len(clean)  # the spellings are there, as plain tokens
  # a completion prompt is raw text: special spellings are the caller's to use there
  assert tok.encode("<|user|>") == [ids["<|user|>"]]


# --- the transport ---------------------------------------------------------------------------

def _raw(server, data: bytes, wait_s: float = WAIT_S) -> bytes:
  """What the server sends back on a connection that sends `data`, until it closes."""
  with socket.create_connection(("127.0.0.1", server["port"]), timeout=wait_s) as s:
    try:
      s.sendall(data)
    except OSError:  # the server may close before the whole attack is written
      pass
    out = b""
    while True:
      try:
        part = s.recv(65536)
      except ConnectionResetError:
        return out
      if not part:
        return out
      out += part


def _status(raw: bytes) -> int | None:
  return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else None


def test_oversized_and_malformed_headers(server):
  get = (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " +
         KEY.encode() + b"\r\n")
  attacks = [
      get + b"X-Big: " + b"a" * (transport.MAX_HEADER_BYTES + 1) + b"\r\n\r\n",
      get + b"".join(b"X-%d: v\r\n" % i for i in range(5000)) + b"\r\n",
      get + b"X-Crlf: a\rInjected: b\r\n\r\n",  # a bare CR inside a value
      get + b"X-Nul: a\x00b\r\n\r\n",
      b"GET /v1/models\r\nInjected: x HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
  ]
  with nothing_queued(server):
    for data in attacks:
      reply = _raw(server, data + get + b"\r\n")  # + a request that must not be served
      status = _status(reply)
      assert status is None or 400 <= status < 500, (data[:80], reply[:200])
      assert reply.count(b"HTTP/1.1 ") <= 1  # the connection closed after the refusal


def test_crlf_never_reaches_the_log_as_a_line(server):
  """Values a client controls, with CR/LF in them, in every place the server or uvicorn could
  log them; no log record carries the forged line as a line of its own."""
  marker = "FORGED-LOG-LINE"
  records = server["records"]
  start = len(records.messages)
  forged = f"x\r\n{marker}\r\n"
  with nothing_queued(server):
    _http(server, "GET", "/v1/models%0d%0a" + marker)
    _http(server, "POST", "/v1/completions", {"model": forged, "prompt": IDS})
    _http(server, "POST", "/v1/completions", _completion(server, **{forged: 1}))
    _http(server, "POST", "/v1/chat/completions", _chat(server, stop=[forged], n=forged))
    _raw(server, ("GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: " + forged +
                  "\r\n\r\n").encode())
  logged = records.messages[start:]
  assert any("/v1/models" in m for m in logged)  # the access log did see these requests
  for m in logged:
    assert f"\n{marker}" not in m and f"\r{marker}" not in m, m
  record = logging.LogRecord("x", logging.WARNING, __file__, 1, "got %s", (forged,), None)
  transport.EscapeNewlines().filter(record)
  assert "\n" not in record.getMessage() and "\r" not in record.getMessage()
  assert marker in record.getMessage()


def test_slow_clients_are_cut_off_and_others_served(server):
  """Headers never finished, or a body dribbled: the connection is closed within the read
  timeout (a 408 when the headers were in), while other clients are served meanwhile."""
  head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " +
          KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
  slow, before = [], _submitted(server)
  for data in (b"POST /v1/completions HTTP/1.1\r\nHost: 127", head + b'{"model": ', b""):
    s = socket.create_connection(("127.0.0.1", server["port"]), timeout=WAIT_S)
    if data:
      s.sendall(data)
    slow.append(s)
  _still_serving(server)  # while the slow ones hold their connections
  replies = []
  for s in slow:
    out = b""
    while part := s.recv(65536):  # until the server closes it (bounded by WAIT_S)
      out += part
    replies.append(out)
    s.close()
  assert replies[0] == b"" and replies[2] == b""  # no request to answer: closed
  assert _status(replies[1]) == 408 and b"request_timeout" in replies[1]
  assert _submitted(server) == before + 1  # the good request only
  _still_serving(server)


def test_cors_is_off_by_default_and_an_exact_allowlist(server):
  preflight = {"origin": "http://evil.example", "access-control-request-method": "POST",
               "access-control-request-headers": "content-type"}
  status, _, headers = _http(server, "OPTIONS", "/v1/chat/completions", headers=preflight)
  assert status == 405 and not any(h.lower().startswith("access-control") for h in headers)
  with pytest.raises(InputError, match="wildcard"):
    transport.cors_origins("http://a.example,*")
  with pytest.raises(InputError, match="not an origin"):
    transport.cors_origins("http://a.example/path")
  from starlette.testclient import TestClient
  allowed = "http://app.example:3000"
  origins = transport.cors_origins(allowed + ", http://b.example")
  app = create_app(server["model"], max_batch=4, max_queue=8,  # the fixture's shapes
                   warm_prefill=False, cors_origins=origins)
  try:
    client = TestClient(app, base_url="http://127.0.0.1")
    r = client.options("/v1/chat/completions", headers={**preflight, "origin": allowed})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == allowed
    assert "access-control-allow-credentials" not in r.headers
    r = client.options("/v1/chat/completions", headers=preflight)
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
    r = client.get("/v1/models", headers={"origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = client.get("/v1/models", headers={"origin": allowed})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == allowed
  finally:
    app.state.scheduler.close()


# --- the published schema and schemathesis -------------------------------------------------

def _post(server, path, body):
  return _http(server, "POST", path, body)[:2]


def _branches(schema: dict) -> list[dict]:
  """The alternatives a field may take (nullable and anyOf unfolded), null left out."""
  if "anyOf" in schema:
    return [b for a in schema["anyOf"] for b in _branches(a)]
  return [] if schema == {"type": "null"} else [schema]


def _probes(s: dict) -> list[tuple[object, bool]]:
  """(value, accepted?) at and just past each bound the schema `s` states."""
  out = []
  integer = s.get("type") == "integer"
  step = (lambda v, d: v + d) if integer else (lambda v, d: math.nextafter(v, d * math.inf))
  if "maximum" in s:
    out += [(s["maximum"], True), (step(s["maximum"], 1), False)]
  if "minimum" in s:
    out += [(s["minimum"], True), (step(s["minimum"], -1), False)]
  if "exclusiveMinimum" in s:
    out += [(s["exclusiveMinimum"], False), (step(s["exclusiveMinimum"], 1), True)]
  if s.get("type") == "array" and "maxItems" in s:
    items = s["items"]
    item = 5 if items.get("type") == "integer" else [5] if "anyOf" in items else "s"
    out += [([item] * s["maxItems"], True), ([item] * (s["maxItems"] + 1), False)]
  return out


BASES = {"/v1/completions": {"prompt": [5], "max_tokens": 1, "echo": True},  # echo: 0 tokens
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}],
                                  "max_tokens": 1, "logprobs": True},
         "/v1/messages": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}}
# At their maximum these need a one-token prompt, which only /v1/completions has.
LONG = {"max_tokens", "max_completion_tokens"}


def test_published_bounds_are_the_enforced_bounds(server, monkeypatch):
  """Each numeric or list bound in the request schemas, probed: at the bound the request passes
  every check (it reaches the scheduler, which here refuses it as full: 429), past it the
  request is a 400 naming that field."""
  def full(job):
    raise QueueFull("probe")
  monkeypatch.setattr(server["app"].state.scheduler, "submit", full)
  doc = _http(server, "GET", "/openapi.json")[1]
  probed = set()
  for path, base in BASES.items():
    body_schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    for name, field in body_schema["schema"]["properties"].items():
      for value, ok in [p for b in _branches(field) for p in _probes(b)]:
        if ok and name in LONG and path != "/v1/completions":
          continue
        body = {**base, "model": server["name"], name: value}
        status, reply = _post(server, path, body)
        probed.add((path, name))
        if ok:
          assert status == 429, (path, name, value, reply)
        else:
          assert status == 400, (path, name, value, reply)
          if "error" in reply and "param" in reply["error"]:
            assert reply["error"]["param"] == name, (path, name, value, reply)
  want = {("/v1/completions", f) for f in (
      "max_tokens", "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
      "frequency_penalty", "seed", "top_k", "n", "logprobs", "stop", "prompt")}
  want |= {("/v1/chat/completions", "top_logprobs"), ("/v1/messages", "temperature"),
           ("/v1/messages", "stop_sequences")}
  assert want <= probed, want - probed
  # token ids: the vocabulary is the bound, on both routes that take them
  vocab = server["model"].config.vocab_size
  assert _post(server, "/detokenize", {"tokens": [vocab - 1]})[0] == 200
  assert _post(server, "/detokenize", {"tokens": [vocab]})[0] == 400
  assert _post(server, "/v1/completions", {**BASES["/v1/completions"], "model": server["name"],
                                           "prompt": [vocab]})[0] == 400


def test_unknown_fields_are_refused_as_published(server):
  doc = _http(server, "GET", "/openapi.json")[1]
  for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/tokenize"):
    schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema["additionalProperties"] == {"type": "null"}
    body = {**BASES.get(path, {"prompt": "x"}), "model": server["name"]}
    assert _post(server, path, {**body, "surely_unknown": 1})[0] == 400
  assert doc["paths"]["/health"]["get"]["security"] == []
  assert doc["security"] == [{"bearer": []}, {"apiKey": []}]  # the server has a key
  assert _http(server, "GET", "/v1/models", headers={"authorization": ""})[0] == 401


def _reply_schema(doc: dict, path: str) -> dict:
  return doc["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]


def test_generated_replies_follow_the_published_schema(server):
  """Replies of the model (which the short fuzz below does not wait for) against the
  published 200 schemas, checked by jsonschema; streams as events of `data:` lines."""
  import jsonschema
  doc = _http(server, "GET", "/openapi.json")[1]
  name = server["name"]
  cases = [("/v1/completions", {"model": name, "prompt": IDS, "max_tokens": 2, "logprobs": 1,
                                "echo": True}),
           ("/v1/chat/completions", {"model": name, "max_tokens": 3,
                                     "messages": [{"role": "user", "content": "hi"}]}),
           ("/v1/messages", {"model": name, "max_tokens": 3,
                             "messages": [{"role": "user", "content": "hi"}]})]
  for path, body in cases:
    status, reply = _post(server, path, body)
    assert status == 200, reply
    jsonschema.validate(reply, _reply_schema(doc, path))
  status, raw, headers = _http(server, "POST", "/v1/completions", {**cases[0][1], "stream": True})
  assert status == 200 and headers["content-type"].startswith("text/event-stream")


def test_schemathesis_short_run(server, tmp_path, monkeypatch):
  """scripts/fuzz_server.py with EXAMPLES per route and mode: no failure of any check. A
  request that passes every check reaches the scheduler, which here refuses it as full (429,
  a documented status): model time is the long run's (200 examples a route and mode, with
  generation; docs/measurements/reliability.md), compiling every shape it meets too slow here."""
  def full(job):
    raise QueueFull("the short fuzz: checked, not generated")
  monkeypatch.setattr(server["app"].state.scheduler, "submit", full)
  out = tmp_path / "fuzz.json"
  r = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "fuzz_server.py"),
       f"--url=http://127.0.0.1:{server['port']}", f"--examples={EXAMPLES}", f"--api_key={KEY}",
       f"--json={out}", "--expect_full"], capture_output=True, text=True, timeout=600,
      env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
  report = json.loads(out.read_text())
  failures = {k: v["failures"][:2] for k, v in report["routes"].items() if v["failed"]}
  assert r.returncode == 0 and report["ok"], (failures, report["after"], r.stderr[-2000:])
  assert not any(s.startswith("5") for s in report["status"])
  assert report["status"].get("429", 0) > 0  # valid requests did pass every check
  for route, record in report["routes"].items():
    if route.startswith("POST"):
      assert record["examples"] >= EXAMPLES, route  # every mode of every body route ran
  assert report["after"]["health"] == "ok" and report["after"]["chat_status"] == 429
  monkeypatch.undo()
  status, reply = _post(server, "/v1/chat/completions", {
      "model": server["name"], "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
  assert status == 200 and reply["usage"]["completion_tokens"] >= 1  # still serving
  assert server["app"].state.scheduler.state()["failed"] == 0
