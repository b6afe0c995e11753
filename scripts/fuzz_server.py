"""Schema fuzzing of a running server: schemathesis generates requests from the server's own
`GET /openapi.json` (glmjax.serving.openapi), valid ones (positive) and ones that break exactly
one rule of the schema (negative), for every route, and checks each response.

  python scripts/serve.py --port=8123 &
  python scripts/fuzz_server.py --url=http://127.0.0.1:8123 --examples=200 --json=/tmp/fuzz.json

Checks on every response: no 5xx (not_a_server_error); a documented status, content type and
body (status_code_conformance, content_type_conformance, response_schema_conformance); a
negative request is refused with a 4xx (negative_data_rejection). After the fuzzing a plain chat
request must still get its 200 and /health must say ok. Generation is kept cheap: a valid
request's max_tokens (or its absence, which would mean the route's default) is capped at
--max_tokens. The JSON report: examples, status counts and failures per route and mode.
Exit status 1 on any failure.
"""

from __future__ import annotations

import collections
import json
import sys
import time

import requests
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("url", "http://127.0.0.1:8000", "The server's base URL (no /v1).")
flags.DEFINE_integer("examples", 200, "Examples per route and mode (hypothesis' max_examples: "
                     "fewer where a route's schema has fewer distinct requests).", lower_bound=1)
flags.DEFINE_list("modes", ["positive", "negative"], "Generation modes.")
flags.DEFINE_integer("max_tokens", 4, "Cap on a valid request's max_tokens.", lower_bound=1)
flags.DEFINE_string("api_key", None, "Sent as a bearer token.")
flags.DEFINE_string("json", None, "Write the report here (else stdout).")
flags.DEFINE_integer("seed", 0, "Hypothesis' seed (runs are reproducible).")
flags.DEFINE_float("timeout_s", 120, "Per-request timeout.", lower_bound=1)
flags.DEFINE_bool("expect_full", False, "The server's scheduler refuses every request as full "
                  "(429; tests/test_openapi_fuzz.py): the check afterwards expects that.")

CAPPED = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
          "/v1/completions": ("max_tokens",), "/v1/messages": ("max_tokens",)}
MAX_FAILURES = 20  # kept per route and mode in the report


def cap_tokens(case, cap: int) -> None:
  """A valid request costs at most `cap` new tokens per choice."""
  names = CAPPED.get(case.operation.path)
  if not names or not isinstance(case.body, dict):
    return
  for name in names:
    if isinstance(case.body.get(name), int) and case.body[name] > cap:
      case.body[name] = cap
  if case.body.get(names[0]) is None and not any(case.body.get(n) for n in names[1:]):
    case.body[names[0]] = cap


def check_functions() -> list:
  from schemathesis import checks
  return [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance,
          checks.negative_data_rejection]


def fuzz_operation(op, mode, base: str, headers: dict, examples: int, cap: int, seed: int,
                   timeout_s: float) -> dict:
  """Runs `examples` generated requests of one operation; returns its record."""
  import hypothesis
  from hypothesis import HealthCheck, given, settings
  from schemathesis.core.failures import FailureGroup
  record = {"examples": 0, "status": collections.Counter(), "failures": [], "failed": 0,
            "refused": []}
  session = requests.Session()
  checks = check_functions()

  @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
            suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate],
            print_blob=False)
  @hypothesis.seed(seed)
  @given(case=op.as_strategy(generation_mode=mode))
  def run(case):
    if mode.is_positive:
      cap_tokens(case, cap)
    record["examples"] += 1
    try:
      response = case.call(base_url=base, session=session, headers=headers, timeout=timeout_s)
    except requests.RequestException as e:
      return _fail(record, f"transport: {type(e).__name__}: {e}", case, None)
    record["status"][str(response.status_code)] += 1
    if mode.is_positive and response.status_code >= 400 and len(record["refused"]) < 5:
      record["refused"].append(response.text[:300])  # why a valid request was still refused
    try:
      case.validate_response(response, checks=checks, headers=headers)
    except (FailureGroup, AssertionError) as e:
      _fail(record, str(e), case, response)

  try:
    run()
  except hypothesis.errors.Unsatisfiable:  # e.g. no negative form of a route without inputs
    record["unsatisfiable"] = True
  record["status"] = dict(sorted(record["status"].items()))
  return record


def _fail(record: dict, message: str, case, response) -> None:
  record["failed"] += 1
  if len(record["failures"]) < MAX_FAILURES:
    record["failures"].append({
        "message": message[:2000], "status": None if response is None else response.status_code,
        "body": json.dumps(case.body, default=str)[:1000] if case.body is not None else None,
        "reply": None if response is None else response.text[:500]})


def still_serving(base: str, headers: dict, name: str, timeout_s: float) -> dict:
  """A plain chat request and /health after the fuzzing."""
  r = requests.post(base + "/v1/chat/completions", headers=headers, timeout=timeout_s, json={
      "model": name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
  health = requests.get(base + "/health", timeout=timeout_s)
  return {"chat_status": r.status_code, "health_status": health.status_code,
          "health": health.json().get("status")}


def fuzz(base: str, examples: int, modes: list[str], cap: int, api_key: str | None = None,
         seed: int = 0, timeout_s: float = 120, expect_full: bool = False) -> dict:
  import schemathesis
  from schemathesis import GenerationMode
  headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
  doc = requests.get(base + "/openapi.json", timeout=timeout_s).json()
  schema = schemathesis.openapi.from_dict(doc)
  name = doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"][
      "schema"]["properties"]["data"]["items"]["properties"]["id"]["const"]
  routes, start = {}, time.monotonic()
  for result in schema.get_all_operations():
    op = result.ok()
    for mode_name in modes:
      record = fuzz_operation(op, GenerationMode(mode_name), base, headers, examples, cap, seed,
                              timeout_s)
      routes[f"{op.method.upper()} {op.path} {mode_name}"] = record
      print(f"{op.method.upper()} {op.path} {mode_name}: {record['examples']} examples, "
            f"{record['status']}, {record['failed']} failed", file=sys.stderr, flush=True)
  after = still_serving(base, headers, name, timeout_s)
  statuses = collections.Counter()
  for r in routes.values():
    statuses.update(r["status"])
  ok = (all(r["failed"] == 0 for r in routes.values()) and
        after["chat_status"] == (429 if expect_full else 200) and
        after["health"] == "ok" and not any(s.startswith("5") for s in statuses))
  return {"ok": ok, "url": base, "examples_per_route_mode": examples, "modes": modes,
          "max_tokens": cap, "seconds": round(time.monotonic() - start, 1),
          "examples": sum(r["examples"] for r in routes.values()),
          "status": dict(sorted(statuses.items())), "after": after, "routes": routes}


def main(argv):
  del argv
  report = fuzz(FLAGS.url.rstrip("/"), FLAGS.examples, FLAGS.modes, FLAGS.max_tokens,
                FLAGS.api_key, FLAGS.seed, FLAGS.timeout_s, FLAGS.expect_full)
  text = json.dumps(report, indent=1)
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      f.write(text)
  else:
    print(text)
  print(f"{'ok' if report['ok'] else 'FAILED'}: {report['examples']} examples in "
        f"{report['seconds']} s, statuses {report['status']}, after {report['after']}",
        file=sys.stderr)
  return 0 if report["ok"] else 1


if __name__ == "__main__":
  app.run(main)
