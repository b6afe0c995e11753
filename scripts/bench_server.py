"""A bounded load test of the OpenAI-compatible server on loopback (JSON out).

  python scripts/bench_server.py                       # embedded model, 4 clients × 4 requests
  python scripts/bench_server.py --clients=8 --requests=2 --max_batch=8
  python scripts/bench_server.py --model=/tmp/store --host_cache_gb=0.002 --device_cache_gb=0
  python scripts/bench_server.py --url=http://127.0.0.1:8000   # a server already running

Without --url it starts a server in-process on a free loopback port. Each of --clients threads
sends --requests streaming completions one after another (both capped); before that, the same
requests run one at a time from a single client (--sequential) as the baseline. Every request
must complete with its usage. Reported per phase: throughput (generated tokens/s), requests/s,
TTFT (time to the first generated text) and latency p50/p99, and the expert bytes the server
read per generated token (from /health; 0 for resident models). Prefill and decode shapes are
compiled by one warm-up request first.
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_hugepages.py
  import _hugepages
  _hugepages.reexec()

import concurrent.futures
import http.client
import json
import socket
import sys
import threading
import time
import urllib.parse

from absl import app, flags, logging
import numpy as np

MAX_CLIENTS, MAX_REQUESTS = 64, 100  # the load is bounded whatever the flags say

FLAGS = flags.FLAGS
flags.DEFINE_integer("prefill_chunk", None, "Prompts longer than this prefill chunk by chunk "
                     "(default 1024; 0 = one piece).", lower_bound=0)
flags.DEFINE_string("url", None, "A running server (default: start one in-process).")
flags.DEFINE_string("model", None, "HF checkpoint or expert store (in-process server); default: "
                    "embedded.")
flags.DEFINE_integer("clients", 4, "Concurrent clients.", lower_bound=1, upper_bound=MAX_CLIENTS)
flags.DEFINE_integer("requests", 4, "Requests per client, one after another.", lower_bound=1,
                     upper_bound=MAX_REQUESTS)
flags.DEFINE_integer("max_tokens", 32, "max_tokens of each request.", lower_bound=1)
flags.DEFINE_bool("sequential", True, "Also run every request from one client first (baseline).")
flags.DEFINE_integer("max_batch", 4, "In-process server: decode batch width.", lower_bound=1)
flags.DEFINE_integer("max_queue", 64, "In-process server: queue bound.", lower_bound=0)
flags.DEFINE_integer("max_context", 256, "In-process server: context (batch cache length).",
                     lower_bound=16)
flags.DEFINE_float("device_cache_gb", None, "In-process server: device expert budget (store).")
flags.DEFINE_float("host_cache_gb", None, "In-process server: host expert budget (store).")
flags.DEFINE_bool("prefetch", None, "In-process server: prefetch predicted experts (store; "
                  "default on).")
flags.DEFINE_string("json", None, "Also write the JSON report here.")

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:\n", "The quick brown fox",
           "for i in range(10):", "# A function that", "x = [", "Once upon a time"]


def _http(host, port, method, path, body=None, timeout=600):
  conn = http.client.HTTPConnection(host, port, timeout=timeout)
  try:
    conn.request(method, path, None if body is None else json.dumps(body).encode(),
                 {"content-type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())
  finally:
    conn.close()


def one_request(host, port, model: str, prompt: str, max_tokens: int) -> dict:
  """A streaming completion: its TTFT, latency and generated tokens (from the final usage)."""
  body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
          "stream": True}
  t0 = time.perf_counter()
  conn = http.client.HTTPConnection(host, port, timeout=600)
  ttft, usage, done = None, None, False
  try:
    conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                 {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
      return {"ok": False, "error": f"HTTP {r.status}: {r.read()[:200]!r}"}
    for raw in r:
      line = raw.decode().strip()
      if not line.startswith("data: "):
        continue
      data = line[len("data: "):]
      if data == "[DONE]":
        done = True
        break
      chunk = json.loads(data)
      if "error" in chunk:
        return {"ok": False, "error": chunk["error"]["message"]}
      if ttft is None and chunk["choices"][0]["text"]:
        ttft = time.perf_counter() - t0
      usage = chunk.get("usage") or usage
  finally:
    conn.close()
  latency = time.perf_counter() - t0
  ok = done and usage is not None
  return {"ok": ok, "ttft_s": ttft if ttft is not None else latency, "latency_s": latency,
          "tokens": usage["completion_tokens"] if usage else 0,
          **({} if ok else {"error": "stream ended without usage or [DONE]"})}


def _engine_bytes(host, port) -> float:
  return _http(host, port, "GET", "/health")[1].get("engine", {}).get("expert_bytes_read", 0.0)


def phase(host, port, model: str, clients: int, requests: int, max_tokens: int) -> dict:
  """`clients` threads × `requests` each; prompts cycle so requests differ."""
  jobs = [[PROMPTS[(c * requests + i) % len(PROMPTS)] for i in range(requests)]
          for c in range(clients)]

  def client(prompts):
    return [one_request(host, port, model, p, max_tokens) for p in prompts]

  bytes0 = _engine_bytes(host, port)
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    results = [r for rs in pool.map(client, jobs) for r in rs]
  wall = time.perf_counter() - t0
  read = _engine_bytes(host, port) - bytes0
  good = [r for r in results if r["ok"]]
  tokens = sum(r["tokens"] for r in good)
  pct = lambda key, q: float(np.percentile([r[key] for r in good], q)) if good else 0.0
  return {"clients": clients, "requests": len(results), "completed": len(good),
          "errors": [r["error"] for r in results if not r["ok"]][:5],
          "wall_s": wall, "tokens": tokens, "throughput_tok_s": tokens / wall,
          "requests_per_s": len(results) / wall,
          "ttft_p50_s": pct("ttft_s", 50), "ttft_p99_s": pct("ttft_s", 99),
          "latency_p50_s": pct("latency_s", 50), "latency_p99_s": pct("latency_s", 99),
          "expert_bytes_read": read, "bytes_per_token": read / tokens if tokens else 0.0}


def _start_server():
  """An in-process server on a free loopback port: (host, port, stop)."""
  import uvicorn
  import glmjax
  from glmjax.serving.app import create_app
  opts = {k: getattr(FLAGS, k) for k in ("device_cache_gb", "host_cache_gb", "prefetch")
          if getattr(FLAGS, k) is not None}
  model = glmjax.load(FLAGS.model, progress=False, prefill_chunk=FLAGS.prefill_chunk,
                      max_context=FLAGS.max_context, **opts)
  server_app = create_app(model, FLAGS.max_batch, FLAGS.max_queue)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = uvicorn.Server(uvicorn.Config(server_app, host="127.0.0.1", port=port,
                                         log_level="warning"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  end = time.monotonic() + 300
  while not server.started:
    if time.monotonic() > end or not thread.is_alive():
      raise RuntimeError("the in-process server did not start")
    time.sleep(0.05)

  def stop():
    server.should_exit = True
    thread.join(timeout=30)
    server_app.state.scheduler.close()
    model.close()
  return "127.0.0.1", port, stop


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if FLAGS.url:
    u = urllib.parse.urlparse(FLAGS.url)
    host, port, stop = u.hostname, u.port or 80, lambda: None
  else:
    host, port, stop = _start_server()
  try:
    model = _http(host, port, "GET", "/v1/models")[1]["data"][0]["id"]
    for p in PROMPTS:  # warm-up: compiles the prefill shapes and the batch's decode step
      one_request(host, port, model, p, FLAGS.max_tokens)
    report = {"model": model, "max_tokens": FLAGS.max_tokens,
              "max_batch": _http(host, port, "GET", "/health")[1].get("max_batch")}
    if FLAGS.sequential:
      report["sequential"] = phase(host, port, model, 1, FLAGS.clients * FLAGS.requests,
                                   FLAGS.max_tokens)
    report["concurrent"] = phase(host, port, model, FLAGS.clients, FLAGS.requests,
                                 FLAGS.max_tokens)
    if FLAGS.sequential:
      seq, con = report["sequential"], report["concurrent"]
      report["speedup"] = con["throughput_tok_s"] / seq["throughput_tok_s"]
      if seq["bytes_per_token"]:
        report["bytes_per_token_ratio"] = con["bytes_per_token"] / seq["bytes_per_token"]
  finally:
    stop()
  out = json.dumps(report, indent=2)
  print(out)
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      f.write(out + "\n")
  phases = [report[k] for k in ("sequential", "concurrent") if k in report]
  return 0 if all(p["completed"] == p["requests"] for p in phases) else 1


if __name__ == "__main__":
  app.run(main)
