"""The server across processes: scripts/serve.py through scripts/launch_local.py, 2 processes × 1
CPU device, mesh `expert:2`, on a tiny synthetic store of 16 experts per layer that needs
offload (no device pins, a host cache of two chunks per process). Process 0 answers HTTP, process 1
follows its batch operations (glmjax.serving.follow). A greedy completion through the `openai`
SDK gives the tokens of one process's `glmjax.load(store).generate`; stopping the server
(SIGTERM to the launcher, passed to process 0) ends both processes with status 0.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import openai
import pytest

import glmjax
from conftest import ROOT, SUITE_XLA_FLAGS

PROMPT = [5, 6, 7]
TOKENS = 4


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _healthy(base: str) -> bool:
  try:
    with urllib.request.urlopen(base + "/health", timeout=2) as r:
      return r.status == 200
  except OSError:
    return False


@pytest.fixture(scope="module")
def store(tmp_path_factory):
  from glmjax.formats.synthetic import make_synthetic_store
  path = str(tmp_path_factory.mktemp("mp_serve") / "tiny")
  manifest = make_synthetic_store(path, geometry="tiny", moe_layers=2, experts=16, seed=3,
                                  progress=False)
  return path, manifest["experts"]["main"]["layout"]["nbytes"]


def _launch(path: str, chunk: int, port: int) -> subprocess.Popen:
  """scripts/serve.py on 2 processes × 1 device through launch_local.py: no device pins, a
  host cache of two chunks per process (most experts are read from the store)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = SUITE_XLA_FLAGS  # launch_local.py adds the device count
  return subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "scripts", "launch_local.py"), "--processes=2",
       "--devices_per_process=1", "--timeout_s=120", "--",
       os.path.join(ROOT, "scripts", "serve.py"), f"--model={path}", "--mesh=expert:2",
       "--device_cache_gb=0", f"--host_cache_gb={_host_gb(chunk)}", f"--port={port}",
       "--max_context=256", "--max_batch=2"],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _host_gb(chunk: int) -> float:
  return 2.5 * chunk / 2 ** 30


def _wait_healthy(launch: subprocess.Popen, base: str) -> None:
  end = time.monotonic() + 90
  while not _healthy(base):
    assert launch.poll() is None, launch.communicate()[1][-3000:]
    assert time.monotonic() < end, "the 2-process server did not come up"
    time.sleep(0.2)


def _stop(launch: subprocess.Popen) -> str:
  """SIGTERM to the launcher (passed to process 0); its stderr once every process left."""
  launch.send_signal(signal.SIGTERM)
  try:
    return launch.communicate(timeout=60)[1]
  except subprocess.TimeoutExpired:
    launch.kill()
    return launch.communicate()[1]


def _child(pid: int, arg: str) -> int:
  """The child process of `pid` with `arg` on its command line."""
  with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
    children = [int(c) for c in f.read().split()]
  for c in children:
    with open(f"/proc/{c}/cmdline", "rb") as f:
      if arg.encode() in f.read().split(b"\0"):
        return c
  raise AssertionError(f"no child of {pid} runs with {arg} (children {children})")


def test_a_completion_on_two_processes_gives_one_process_tokens(store):
  path, chunk = store
  host_gb = _host_gb(chunk)
  port = _free_port()
  launch = _launch(path, chunk, port)
  try:
    with glmjax.load(path, progress=False, device_cache_gb=0, host_cache_gb=host_gb) as m:
      ref = m.generate(PROMPT, TOKENS, temperature=0.0)
      ref_pieces = [m.tokenizer.decode([int(t)]) for t in ref.tokens]
    base = f"http://127.0.0.1:{port}"
    _wait_healthy(launch, base)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                  logprobs=0)
    with urllib.request.urlopen(base + "/health", timeout=5) as h:
      health = json.load(h)
  finally:
    err = _stop(launch)  # process 0 stops serving; process 1 follows it out
  assert r.choices[0].logprobs.tokens == ref_pieces
  assert r.choices[0].text == "".join(ref_pieces)
  assert r.usage.completion_tokens == len(ref.tokens)
  assert health["completed"] == 1 and health["failed"] == 0
  assert health["engine"]["expert_misses"] > 0  # the store needs offload: experts were read
  # Process 0 reports the sums of both processes' counters: every expert the request used was
  # a pin hit, a host hit or a miss in the process owning it (one process alone counts half).
  eng = health["engine"]
  assert eng["expert_pin_hits"] + eng["expert_host_hits"] + eng["expert_misses"] == \
      ref.stats["experts_used"]
  assert launch.returncode == 0, err[-3000:]


def test_a_dead_follower_fails_requests_with_an_error_naming_it(store):
  path, chunk = store
  port = _free_port()
  launch = _launch(path, chunk, port)
  base = f"http://127.0.0.1:{port}"
  try:
    _wait_healthy(launch, base)
    os.kill(_child(launch.pid, "--process_id=1"), signal.SIGKILL)
    # process 0's idle tick (glmjax.serving.follow.IDLE_TICK_S) finds the follower gone
    end = time.monotonic() + 20
    while _healthy(base):
      assert time.monotonic() < end, "process 0 did not notice its dead follower"
      time.sleep(0.2)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=20)
    with pytest.raises(openai.APIStatusError) as e:
      client.completions.create(model="tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0)
  finally:
    err = _stop(launch)
  assert e.value.status_code == 503
  assert "process 1 of this 2-process run died or left" in str(e.value)
  assert launch.returncode != 0, err[-3000:]


def test_the_channel_carries_short_and_long_commands():
  """Channel's packing, with the broadcast replaced by a queue (what process 0 sends is what a
  follower receives): a step fits the fixed header; a long prompt takes a second, padded one."""
  from glmjax.serving import follow
  sent = []
  leader, member = follow.Channel(), follow.Channel()
  leader.leader, member.leader = True, False
  leader._broadcast = lambda buf: sent.append(buf.copy()) or buf
  member._broadcast = lambda buf: (sent.pop(0) if len(sent[0]) == len(buf) else
                                   pytest.fail(f"shapes {len(sent[0])} != {len(buf)}"))
  commands = [dict(op="step", tokens=[17, None]),
              dict(op="admit", id=3, prompt=list(range(2000)), echo=False,
                   settings=dict(temperature=np.float32(0.5), stop=["\n\n"]))]
  for cmd in commands:
    leader.send(**cmd)
  assert [len(b) for b in sent] == [follow.HEADER_WORDS, follow.HEADER_WORDS, 4096]
  got = [member.receive(), member.receive()]
  assert got[0] == commands[0]
  assert got[1]["prompt"] == list(range(2000)) and got[1]["settings"]["temperature"] == 0.5
  assert not sent
