"""The server's load-test workloads, driven over HTTP on loopback (scripts/bench_server.py).

`phase`: streaming completions from N clients at once (throughput, TTFT, latency, expert bytes
per token). `prefix_phase`: lm-eval's shape of work, several continuations of each long
context as token-id prompts from N clients, with the prefill the server did and the tokens its
prefix cache saved (from each response's `usage`).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import statistics
import time

import numpy as np

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:\n", "The quick brown fox",
           "for i in range(10):", "# A function that", "x = [", "Once upon a time"]


def http_json(host, port, method, path, body=None, timeout=600):
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


def engine_bytes(host, port) -> float:
  return http_json(host, port, "GET", "/health")[1].get("engine", {}).get("expert_bytes_read", 0.0)


def phase(host, port, model: str, clients: int, requests: int, max_tokens: int) -> dict:
  """`clients` threads × `requests` each; prompts cycle so requests differ."""
  jobs = [[PROMPTS[(c * requests + i) % len(PROMPTS)] for i in range(requests)]
          for c in range(clients)]

  def client(prompts):
    return [one_request(host, port, model, p, max_tokens) for p in prompts]

  bytes0 = engine_bytes(host, port)
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    results = [r for rs in pool.map(client, jobs) for r in rs]
  wall = time.perf_counter() - t0
  read = engine_bytes(host, port) - bytes0
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


def prefix_workload(tokenizer, n_contexts: int = 8, context_tokens: int = 768,
                    continuations: int = 4, offset: int = 0) -> list[list[int]]:
  """Token-id prompts: `n_contexts` contexts of `context_tokens` tokens (consecutive windows of
  held-out standard-library text, from window `offset`), each followed by `continuations`
  different short continuations, context-major."""
  from glmjax.formats import corpus
  ids = []
  for name in corpus.HELD_OUT:
    ids += tokenizer.encode(corpus.read(name) or "")
    if len(ids) > (offset + n_contexts + 1) * (context_tokens + 64):
      break
  prompts = []
  for c in range(offset, offset + n_contexts):
    at = c * (context_tokens + 64)
    context = ids[at:at + context_tokens]
    tail = ids[at + context_tokens:at + context_tokens + 64]
    prompts += [context + tail[8 * j:8 * j + 4 + 2 * j] for j in range(continuations)]
  return prompts


def prefix_phase(host, port, model: str, prompts: list[list[int]], clients: int,
                 max_tokens: int) -> dict:
  """The prompts in order from `clients` threads at once (each takes the next one), as greedy
  non-streaming completions: requests/s and the prompt tokens prefilled against cached."""
  queue = list(reversed(prompts))
  results = []

  def client():
    while True:
      try:
        prompt = queue.pop()
      except IndexError:
        return
      status, body = http_json(host, port, "POST", "/v1/completions", {
          "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
      results.append(body["usage"] if status == 200 else {"error": body})

  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    for f in [pool.submit(client) for _ in range(clients)]:
      f.result()
  wall = time.perf_counter() - t0
  good = [u for u in results if "error" not in u]
  prompt_tokens = sum(u["prompt_tokens"] for u in good)
  cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in good)
  return {"clients": clients, "requests": len(results), "completed": len(good),
          "errors": [u["error"] for u in results if "error" in u][:5], "wall_s": wall,
          "requests_per_s": len(results) / wall, "prompt_tokens": prompt_tokens,
          "cached_tokens": cached, "prefilled_tokens": prompt_tokens - cached,
          "prefill_fraction": (prompt_tokens - cached) / prompt_tokens if prompt_tokens else 0}


# A bounded schema (an enum, a bounded integer, a short string): every reply completes.
GRAMMAR_SCHEMA = {"type": "object", "additionalProperties": False,
                  "required": ["color", "n", "note"],
                  "properties": {"color": {"enum": ["red", "green", "blue"]},
                                 "n": {"type": "integer", "minimum": 1, "maximum": 9},
                                 "note": {"type": "string", "maxLength": 8}}}


def grammar_phase(host, port, model: str, requests: int, max_tokens: int) -> dict:
  """One client's chat completions at temperature 1, alternately under `GRAMMAR_SCHEMA` (a
  json_schema response_format) and free, seeds 0, 1, ...: the server's decode time per token
  (its `glmjax.decode_tok_s`) for each, medians, and their ratio."""
  per_token: dict[str, list] = {"grammar": [], "plain": []}
  valid = 0
  for i in range(requests):
    for kind in ("grammar", "plain"):
      ask = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
      body = {"model": model, "messages": ask, "max_tokens": max_tokens, "temperature": 1.0,
              "seed": i}
      if kind == "grammar":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "pick", "schema": GRAMMAR_SCHEMA, "strict": True}}
      status, reply = http_json(host, port, "POST", "/v1/chat/completions", body)
      if status != 200:
        raise RuntimeError(f"HTTP {status}: {reply}")
      rate = reply["glmjax"]["decode_tok_s"]
      if rate > 0:
        per_token[kind].append(1e3 / rate)
      if kind == "grammar" and reply["choices"][0]["finish_reason"] == "stop":
        try:
          valid += isinstance(json.loads(reply["choices"][0]["message"]["content"]), dict)
        except ValueError:
          pass
  g, p = (statistics.median(per_token[k]) for k in ("grammar", "plain"))
  return {"requests": requests, "max_tokens": max_tokens, "grammar_ms_per_token": g,
          "plain_ms_per_token": p, "ratio": g / p, "grammar_replies_valid": valid}
