"""scripts/soak.py against an in-process server (started as test_serve_clients starts its own):
its first pass (every request kind at least once, from 4 clients at a time; it always completes)
and 6 s of mixed load after it, then its invariants. Timing, RSS and endurance are the long runs'
business (README, Reliability): this machine is too noisy for them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import glmjax
from glmjax.serving.app import create_app
from tests.test_serve import serving

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                      "soak.py")


def test_soak_keeps_its_invariants(tmp_path):
  model = glmjax.load(progress=False, max_context=256)
  app = create_app(model, max_batch=4, max_queue=8)
  out = tmp_path / "soak.json"
  try:
    with serving(app) as port:
      r = subprocess.run(
          [sys.executable, SCRIPT, f"--url=http://127.0.0.1:{port}", "--minutes=0.1",
           "--clients=4", "--max_tokens=8", "--max_rss_growth=1e9", f"--json={out}"],
          capture_output=True, text=True, timeout=600,
          env={**os.environ, "PYTHONPATH": os.pathsep.join(
              [os.path.dirname(os.path.dirname(SCRIPT)), os.environ.get("PYTHONPATH", "")])})
      health = app.state.scheduler.state()
  finally:
    model.close()
  assert r.returncode == 0, r.stderr[-3000:]
  report = json.loads(out.read_text())
  kinds = {"width", "chat", "chat_stream", "completion", "completion_stream", "cancel", "prefix",
           "long", "n", "n_stream", "logprobs", "chat_logprobs", "tools", "json_schema"}
  assert set(report["by_kind"]) == kinds  # the first pass sends every kind
  assert report["status"] == {"200": report["requests"]}  # no 5xx, nor any other refusal
  assert report["problems"] == {} and report["examples"] == []  # no empty or truncated reply
  kv = report["kv_after"]
  assert kv["pages_in_use"] == 0 and kv["pages_free"] == kv["pages"]  # every page came back
  assert health["live"] == health["waiting"] == 0 and health["failed"] == 0
  delta = report["health_delta"]
  assert delta["submitted"] == sum(report["our_choices"].values())
  assert delta["completed"] + delta["cancelled"] == delta["submitted"] and delta["failed"] == 0
  assert {k: v for k, v in report["checks"].items() if not v} == {}
