"""The soak: a mixed workload against the OpenAI-compatible server, then checks (run by
scripts/soak.py).

Client threads send the KINDS: chat and completions, streaming and not; a stream closed after
two events (a cancel); prompts sharing up to three KV pages; a prompt of the whole context less
max_tokens; n = 3, streamed n = 2; logprobs; a chat offering a tool (`tools`); a json_schema
response_format (`json_schema`; `json_schema=False` for servers without it). Before them, one
`width` request per prefill width (a prompt of random tokens, no prefix hit, for each power of
two that fits): every prefill shape runs once with real routing. Warm-up ends when every
client has sent one full pass over every kind (every expert read: a host cache smaller than
the store is full), min(60 s, `minutes` / 5) has passed, the server compiles no prefill width
ahead any more (/health `warming`) and has compiled no new program for QUIET_S (/health
`compilations`), or at the latest at half the load. RSS
growth: the server's RSS at the end against that at warm-up's end, both read at rest (clients
parked, the server drained and past its idle heap trim), so that in-flight work does not count;
sampled every `rss_every` s meanwhile; not measured without the server's pid. A 429 (the queue
full: a cancelled stream's row stays until the server sees the disconnect) is counted and the
request sent again 0.25 s later, as clients with retries do.

Checks (exit status 1 if one fails): only 200s (429 aside), no 5xx; no empty reply (no body,
choice or text though tokens came), none truncated (no [DONE], a choice or finish_reason missing);
once drained, every KV page back (/health kv.pages_free, the free list and the prefix cache's idle
pages, equals kv.pages); /health counters against ours (submitted = choices accepted, completed +
cancelled = submitted, failed = 0); RSS growth at most `max_rss_growth`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import http.client
import json
import random
import threading
import time
import urllib.parse

import psutil

RETRIES_429 = 200  # sends of one request while the server answers 429 (0.25 s apart)
QUIET_S = 30.0  # warm-up ends after this long without a compilation in the server
KINDS = ("width", "chat", "chat_stream", "completion", "completion_stream", "cancel", "prefix",
         "long", "n", "n_stream", "logprobs", "chat_logprobs", "tools", "json_schema")
CODE = "import os\nimport sys\n\ndef main(argv):\n  for name in argv:\n    print(name)\n"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}


@dataclasses.dataclass(frozen=True)
class SoakOptions:
  minutes: float = 10.0  # the load's duration (the first pass always completes)
  clients: int = 4  # concurrent clients
  max_tokens: int = 16  # of each request
  tools: bool = True  # chats offering a tool
  json_schema: bool = True  # json_schema response_format chats
  rss_every: float = 10.0  # seconds between RSS samples
  max_rss_growth: float = 0.02  # most RSS growth after warm-up (a fraction)


class Soak:
  """The load against the server at `url` (its process `pid`, for RSS), and its record."""

  def __init__(self, url: str, pid: int | None, opts: SoakOptions = SoakOptions()):
    self.o = opts
    u = urllib.parse.urlparse(url)
    self.host, self.port, self.mt = u.hostname, u.port or 80, self.o.max_tokens
    self.headers = {"content-type": "application/json"}  # a loopback server: no key
    pid = pid or next((c.pid for c in psutil.net_connections("tcp") if c.pid and c.laddr and
                       c.laddr.port == self.port and c.status == "LISTEN"), None)
    self.proc = psutil.Process(pid) if pid else None
    self.kinds = [k for k in KINDS if getattr(self.o, k, True)]
    self.status, self.bad, self.sent, self.choices = (collections.Counter() for _ in range(4))
    self.retried = 0  # 429s (a full queue), each sent again
    self.hold, self.holding, self.parked, self.active = threading.Condition(), False, 0, 0
    self.latency, self.examples, self.rss = collections.defaultdict(list), [], []
    self.lock = threading.Lock()

  def call(self, method, path, body=None):  # the JSON reply of a plain request
    with contextlib.closing(http.client.HTTPConnection(self.host, self.port, timeout=600)) as c:
      c.request(method, path, json.dumps(body) if body is not None else None, self.headers)
      return json.loads(c.getresponse().read() or b"null")

  def setup(self):
    """The model's name, token-id prompts sized by the server's context and pages; /health."""
    self.model = self.call("GET", "/v1/models")["data"][0]["id"]
    h = self.call("GET", "/health")
    ps, ids = h["kv"]["page_size"], self.call("POST", "/tokenize", {"prompt": CODE})["tokens"]
    room = min(h["kv"]["context"], h["kv"]["pages"] * ps // h["max_batch"]) - self.mt - 1
    self.ids = ids = ids * (1 + room // len(ids))
    self.long, self.prefix = ids[:room], ids[:min(3, (room - 4) // ps) * ps or (room - 4) // 2]
    self.widths = [1 << i for i in range(room.bit_length())]  # [1, 2, 4, ...] ≤ room
    return h

  def body(self, kind, rng, width=None):
    """(path, JSON body) of one request of `kind` (a `width` one: `width` random tokens, by
    default a random one of `self.widths`)."""
    chat = {"messages": [{"role": "user", "content": CODE[:rng.randint(10, 60)]}]}
    text, stream = {"prompt": CODE[:rng.randint(10, 60)]}, {"stream": True}
    width = width or rng.choice(self.widths)
    b = {"width": {"prompt": [rng.choice(self.ids) for _ in range(width)]},
         "chat": chat, "chat_stream": {**chat, **stream}, "completion": text,
         "completion_stream": {**text, **stream},
         "cancel": {**text, **stream, "max_tokens": 4 * self.mt},
         "prefix": {"prompt": self.prefix + [rng.choice(self.ids) for _ in range(4)]},
         "long": {"prompt": self.long},
         "n": {**text, "n": 3, "temperature": 0.8, "seed": rng.randint(0, 9999)},
         "n_stream": {**chat, **stream, "n": 2, "temperature": 0.8},
         "logprobs": {**text, **stream, "logprobs": 3},
         "chat_logprobs": {**chat, "logprobs": True, "top_logprobs": 2},
         "tools": {**chat, "tools": [TOOL], "tool_choice": "auto"},
         "json_schema": {**chat, "response_format": SCHEMA}}[kind]
    path = "/v1/chat/completions" if "messages" in b else "/v1/completions"
    return path, {"model": self.model, "max_tokens": self.mt, **b}

  def one(self, kind, rng, width=None):  # sends one request of `kind`; records what came back
    path, body = self.body(kind, rng, width)
    n, r, problem, t0 = body.get("n", 1), None, None, time.monotonic()
    texts, finish, tokens, done = collections.defaultdict(str), {}, 0, False
    conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
    try:
      for _ in range(RETRIES_429):
        conn.request("POST", path, json.dumps(body), self.headers)
        if (r := conn.getresponse()).status != 429:
          break
        r.read()
        conn.close()  # the next request opens it again
        with self.lock:
          self.retried += 1
        time.sleep(0.25)
      if r.status != 200:
        problem = f"status {r.status}: {r.read()[:200]!r}"
      elif body.get("stream"):
        events = list(_sse(r, 2 if kind == "cancel" else None))
        done = events[-1:] == [b"[DONE]"]
        choices = [c for e in events if e != b"[DONE]" for c in json.loads(e)["choices"]]
      else:
        raw = r.read()
        reply = json.loads(raw) if raw.strip() else {}
        choices, done = reply.get("choices") or [], True
        tokens = reply.get("usage", {}).get("completion_tokens", 0)
        problem = None if choices else f"empty: {raw[:200]!r}"
      for c in choices if problem is None else []:
        texts[c["index"]] += _text(c.get("delta") or c.get("message") or c)
        finish[c["index"]] = c.get("finish_reason") or finish.get(c["index"])
      if problem is None and kind != "cancel":
        if not done:
          problem = "truncated: no [DONE]"
        elif sorted(finish) != list(range(n)) or not all(finish.values()):
          problem = f"truncated: finish_reason {finish} of {n} choices"
        elif not any(texts.values()) and (tokens or set(finish.values()) == {"length"}):
          problem = "empty: no text though tokens were generated"
    except Exception as e:  # noqa: BLE001 - a transport failure is a finding, not a crash
      problem = f"error: {type(e).__name__}: {e}"
    finally:
      conn.close()  # mid-stream for a cancel: the server notices the disconnect
    with self.lock:
      status = getattr(r, "status", "transport")
      self.sent[kind] += 1
      self.status[status] += 1
      self.choices["cancel" if kind == "cancel" else "plain"] += n * (status == 200)
      if problem:
        self.bad[f"{kind}: {problem.split(':')[0]}"] += 1
        self.examples += [f"{kind}: {problem}"][:10 - len(self.examples)]
      elif kind != "cancel":
        self.latency[kind].append(time.monotonic() - t0)

  def client(self, i, start, first_pass):
    rng = random.Random(i)  # client i's kinds: the same every run
    for w in self.widths[i::self.o.clients]:  # the first pass: every prefill width once,
      self.one("width", rng, w)
    for kind in rng.sample(self.kinds, len(self.kinds)):  # and every kind once
      self.one(kind, rng)
    with self.hold:
      self.active += 1
    first_pass.wait()
    try:
      while time.monotonic() - start < self.o.minutes * 60:
        self._park()
        self.one(rng.choice(self.kinds), rng)
    finally:
      with self.hold:
        self.active -= 1
        self.hold.notify_all()

  def _park(self):  # between two requests: waits while the main thread holds the load
    with self.hold:
      if self.holding:
        self.parked += 1
        self.hold.notify_all()
        self.hold.wait_for(lambda: not self.holding)
        self.parked -= 1

  def _warm_up(self, start: float) -> None:
    """Returns when warm-up ends: min(60 s, a fifth of the load) has passed and the server
    has compiled nothing new (/health `compilations`, where it has them) for QUIET_S; at the
    latest when half the load has passed."""
    settle, latest, last, since = min(60.0, self.o.minutes * 12), self.o.minutes * 30, -1, 0.0
    while (now := time.monotonic()) - start < latest:
      h = self.call("GET", "/health")
      n = h.get("compilations")
      last, since = (last, since) if n == last else (n, now)
      if now - start >= settle and not h.get("warming") and (
          n is None or now - since >= QUIET_S):
        return
      time.sleep(1.0)

  def _drained(self) -> dict:  # /health once nothing is live, waiting or cancelling (≤ 120 s)
    end = time.monotonic() + 120
    while (h := self.call("GET", "/health")) and time.monotonic() < end and \
        (h["live"] or h["waiting"] or h["cancelling"]):
      time.sleep(0.2)
    return h

  def _at_rest(self, rss) -> tuple:
    """(the server's RSS, /health) at rest: drained, then past its next idle heap trim (1 s
    into idleness; 10 s at most). Warm-up's end and the end are both read so, no request in
    flight: the growth is what the server kept, not its working set at that moment."""
    h = self._drained()
    trims, end = (h.get("heap_trim") or {}).get("trims"), time.monotonic() + 10
    while trims is not None and time.monotonic() < end and \
        self.call("GET", "/health")["heap_trim"]["trims"] == trims:
      time.sleep(0.2)
    return rss(), h

  def run(self) -> dict:
    before, start, stop = self.setup(), time.monotonic(), threading.Event()
    rss = lambda: self.proc and self.proc.memory_info().rss  # noqa: E731

    def sample():
      while self.proc and not stop.wait(self.o.rss_every):
        self.rss.append((round(time.monotonic() - start, 1), _mb(rss())))
    first_pass = threading.Barrier(self.o.clients + 1)  # the main thread waits on it too
    threads = [threading.Thread(target=self.client, args=(i, start, first_pass))
               for i in range(self.o.clients)] + [threading.Thread(target=sample)]
    for t in threads:
      t.start()
    first_pass.wait()
    self._warm_up(start)
    with self.hold:  # warm: the clients park between requests while the RSS is read at rest
      self.holding = True
      self.hold.wait_for(lambda: self.parked == self.active)
    warm_s, (warm_rss, warm) = time.monotonic() - start, self._at_rest(rss)
    with self.hold:
      self.holding = False
      self.hold.notify_all()
    for t in threads[:-1]:
      t.join()
    stop.set()
    load_s = time.monotonic() - start
    final_rss, after = self._at_rest(rss)
    kv = after["kv"]
    d = {k: after[k] - before[k] for k in ("submitted", "completed", "cancelled", "failed")}
    lat = sorted(x for v in self.latency.values() for x in v)
    growth = final_rss / warm_rss - 1 if warm_rss else None
    checks = dict(
        no_5xx=not any(isinstance(s, int) and s >= 500 for s in self.status),
        only_200=set(self.status) <= {200, 429}, no_empty_or_truncated=not self.bad,
        drained=not (after["live"] or after["waiting"] or after["cancelling"]),
        all_pages_back=kv["pages_free"] == kv["pages"] >= kv.get("prefix_cached_pages", 0),
        health_counts=d["submitted"] == sum(self.choices.values()) and d["failed"] == 0 and
        d["completed"] + d["cancelled"] == d["submitted"] and
        d["cancelled"] <= self.choices["cancel"], health_ok=after.get("status") == "ok",
        **({"rss_growth": growth <= self.o.max_rss_growth} if growth is not None else {}))
    return {
        "load_s": round(load_s, 1), "warmup_s": round(warm_s, 1), "clients": self.o.clients,
        "compilations": {"warm": warm.get("compilations"), "final": after.get("compilations")},
        "max_tokens": self.mt, "requests": sum(self.sent.values()), "by_kind": dict(self.sent),
        "status": {str(k): v for k, v in self.status.items()}, "retried_429": self.retried,
        "problems": dict(self.bad),
        "latency_s": {"p50": _pct(lat, 50), "p99": _pct(lat, 99), **{
            k: {"p50": _pct(sorted(v), 50), "p99": _pct(sorted(v), 99)}
            for k, v in sorted(self.latency.items())}},
        "health_delta": d, "our_choices": dict(self.choices), "examples": self.examples,
        "kv_after": {**kv, "pages_in_use": kv["pages"] - kv["pages_free"]},
        "rss_mb": {"warm": _mb(warm_rss), "final": _mb(final_rss), "samples": self.rss,
                   "growth_after_warmup": None if growth is None else round(growth, 4),
                   "server_heap_trim": after.get("heap_trim")},  # the scheduler's trims
        "checks": checks, "ok": all(checks.values())}


def _text(c: dict) -> str:
  calls = json.dumps(c["tool_calls"]) if c.get("tool_calls") else ""
  return "".join(c.get(k) or "" for k in ("text", "content", "reasoning_content")) + calls


def _sse(r, limit=None):
  """The data of a server-sent event stream, up to [DONE] or `limit` events."""
  for count, line in enumerate(x[6:].strip() for x in r if x.startswith(b"data: ")):
    yield line
    if line == b"[DONE]" or count + 1 == limit:
      return


def _pct(xs, q):  # the q-th percentile of sorted `xs`
  return round(xs[min(len(xs) - 1, int(len(xs) * q / 100))], 3) if xs else None


_mb = lambda b: None if b is None else round(b / 2 ** 20, 1)  # noqa: E731
