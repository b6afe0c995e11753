"""A bounded load test of the OpenAI-compatible server on loopback (JSON out).

  python scripts/bench_server.py                       # embedded model, 4 clients × 4 requests
  python scripts/bench_server.py --clients=8 --requests=2 --max_batch=8
  python scripts/bench_server.py --model=/tmp/store --host_cache_gb=0.002 --device_cache_gb=0
  python scripts/bench_server.py --url=http://127.0.0.1:8000   # a server already running
  python scripts/bench_server.py --workload=prefix     # prefix cache on against off
  python scripts/bench_server.py --workload=grammar    # time per token under a JSON schema

Without --url it starts a server in-process on a free loopback port. Each of --clients threads
sends --requests streaming completions one after another (both capped); before that, the same
requests run one at a time from a single client (--sequential) as the baseline. Every request
must complete with its usage. Reported per phase: throughput (generated tokens/s), requests/s,
TTFT (time to the first generated text) and latency p50/p99, and the expert bytes the server
read per generated token (from /health; 0 for resident models). Prefill and decode shapes are
compiled by one warm-up request first.
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import json
import socket
import threading
import time
import urllib.parse

from absl import app, flags, logging

from glmjax import cli
from glmjax.bench.server import (PROMPTS, grammar_phase, http_json, one_request, phase,
                                 prefix_phase, prefix_workload)

MAX_CLIENTS, MAX_REQUESTS = 64, 100  # the load is bounded whatever the flags say

FLAGS = flags.FLAGS
flags.DEFINE_string("url", None, "A running server (default: start one in-process).")
cli.define_model_flag(cli.MODEL_KINDS + " (the in-process server's)")
flags.DEFINE_integer("clients", 4, "Concurrent clients.", lower_bound=1, upper_bound=MAX_CLIENTS)
flags.DEFINE_integer("requests", 4, "Requests per client, one after another.", lower_bound=1,
                     upper_bound=MAX_REQUESTS)
flags.DEFINE_integer("max_tokens", 32, "max_tokens of each request.", lower_bound=1)
flags.DEFINE_bool("sequential", True, "Also run every request from one client first (baseline).")
flags.DEFINE_integer("max_batch", 4, "In-process server: decode batch width.", lower_bound=1)
flags.DEFINE_integer("max_queue", 64, "In-process server: queue bound.", lower_bound=0)
cli.define_load_flags(  # the in-process server's model
    only=("prefill_chunk", "max_context", "device_cache_gb", "host_cache_gb", "prefetch"),
    defaults={"max_context": 256}, notes={"max_context": "Here: the batch's cache length."})
flags.DEFINE_string("json", None, "Also write the JSON report here.")
flags.DEFINE_enum("workload", "stream", ["stream", "prefix", "grammar"], "stream: the clients' "
                  "streaming completions; prefix: 8 contexts of 768 tokens × 4 continuations "
                  "(token-id prompts, max_tokens 8 unless set) with the prefix cache and "
                  "without, each on its own in-process server (--max_context raised to 1024); "
                  "grammar: --requests chat completions under a JSON schema, each beside the "
                  "same request free, from one client: decode ms per token, medians.")


def _start_server(prefix_cache: bool = True, max_context: int | None = None):
  """An in-process server on a free loopback port: (host, port, stop)."""
  import uvicorn
  import glmjax
  from glmjax.serving.app import create_app
  model = glmjax.load(FLAGS.model, **dict(cli.load_options(), progress=False,
                                           max_context=max_context or FLAGS.max_context))
  server_app = create_app(model, FLAGS.max_batch, FLAGS.max_queue, prefix_cache=prefix_cache)
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
  return "127.0.0.1", port, stop, model.tokenizer


def prefix_report() -> dict:
  """The prefix workload on a server with the prefix cache and on one without, in turn."""
  max_tokens = FLAGS.max_tokens if FLAGS["max_tokens"].present else 8
  report = {"workload": "prefix", "max_tokens": max_tokens, "clients": FLAGS.clients}
  for name, on in (("cached", True), ("uncached", False)):
    host, port, stop, tok = _start_server(prefix_cache=on, max_context=1024)
    try:
      model = http_json(host, port, "GET", "/v1/models")[1]["data"][0]["id"]
      warm = prefix_workload(tok, 1, offset=8, continuations=2)  # compiles both prefill shapes
      prefix_phase(host, port, model, warm, 1, max_tokens)
      report[name] = prefix_phase(host, port, model, prefix_workload(tok), FLAGS.clients,
                                  max_tokens)
    finally:
      stop()
  c, u = report["cached"], report["uncached"]
  report["prefill_ratio"] = c["prefilled_tokens"] / u["prefilled_tokens"]
  report["requests_per_s_ratio"] = c["requests_per_s"] / u["requests_per_s"]
  return report


def _target():
  """(host, port, stop) of the server at --url, or of one started in this process."""
  if FLAGS.url:
    u = urllib.parse.urlparse(FLAGS.url)
    return u.hostname, u.port or 80, lambda: None
  host, port, stop, _ = _start_server()
  return host, port, stop


def _emit(report: dict) -> None:
  """The report as JSON on stdout, and at --json."""
  out = json.dumps(report, indent=2)
  print(out)
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      f.write(out + "\n")


def grammar_report() -> int:
  """The grammar workload on an in-process server (or --url): warm-up, then the pairs."""
  host, port, stop = _target()
  try:
    model = http_json(host, port, "GET", "/v1/models")[1]["data"][0]["id"]
    grammar_phase(host, port, model, 2, FLAGS.max_tokens)  # compiles the shapes met
    report = grammar_phase(host, port, model, FLAGS.requests, FLAGS.max_tokens)
  finally:
    stop()
  _emit({"workload": "grammar", "model": model, **report})
  return 0


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if FLAGS.workload == "prefix":
    report = prefix_report()
    _emit(report)
    phases = [report["cached"], report["uncached"]]
    return 0 if all(p["completed"] == p["requests"] for p in phases) else 1
  if FLAGS.workload == "grammar":
    return grammar_report()
  host, port, stop = _target()
  try:
    model = http_json(host, port, "GET", "/v1/models")[1]["data"][0]["id"]
    for p in PROMPTS:  # warm-up: compiles the prefill shapes and the batch's decode step
      one_request(host, port, model, p, FLAGS.max_tokens)
    report = {"model": model, "max_tokens": FLAGS.max_tokens,
              "max_batch": http_json(host, port, "GET", "/health")[1].get("max_batch")}
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
  _emit(report)
  phases = [report[k] for k in ("sequential", "concurrent") if k in report]
  return 0 if all(p["completed"] == p["requests"] for p in phases) else 1


if __name__ == "__main__":
  app.run(main)
