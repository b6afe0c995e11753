"""The server across processes: process 0 answers HTTP, every other process follows its steps.

Every batch operation runs jitted collectives over all processes (the offload engine's psum of
every expert owner's terms, glmjax.offload.owners), so each process must run the same
operations in the same order on the same inputs. Process 0's scheduler tells the others each
operation just before it runs it: one command (a small JSON object) per operation, sent with
JAX's own `multihost_utils.broadcast_one_to_all`, a psum of a fixed-shape int32 buffer over the
processes. No transport of our own: the channel is the same collectives layer (gloo on CPU)
the model already uses, so a dead peer fails it the same way (a PeerError naming it), and it
is ordered with the model's collectives by construction (one thread per process issues both).

A follower holds a BatchDecoder of its own and replays the commands on it: admit (the same
prompt and sampling settings, so the same seeds and the same picked tokens), step, drop, the
fault recovery's reset and restore. It decides nothing: every choice (which request, when,
which row leaves) is process 0's, and each step command carries process 0's tokens, which the
follower checks against its own. While the server is idle process 0 sends `idle` every
IDLE_TICK_S, so a follower never waits in one collective long enough for a transport timeout,
and a dead follower is noticed within a tick even when no request comes.
"""

from __future__ import annotations

import json

import numpy as np

from glmjax.errors import GlmjaxError, InputError
from glmjax.offload.owners import peers_named

HEADER_WORDS = 256  # int32 words of every command's first broadcast: its length, then bytes
IDLE_TICK_S = 2.0  # process 0 sends `idle` this often while nothing happens


def _pack(data: bytes, words: int) -> np.ndarray:
  """`data` zero-padded into `words` int32 words `[words]`."""
  return np.frombuffer(data.ljust(4 * words, b"\0"), np.int32).copy()


class Channel:
  """Commands from process 0 to every other process, one broadcast (two for a long command:
  a header, then the payload padded to a power of two of words, so few shapes compile)."""

  def __init__(self):
    import jax
    self.leader = jax.process_index() == 0

  def _broadcast(self, buf: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils
    with peers_named("serve"):
      return np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=self.leader))

  def send(self, op: str, **fields) -> None:
    """Process 0: tells every follower the operation it is about to run."""
    assert self.leader
    data = json.dumps(dict(op=op, **fields), default=_plain).encode()
    room = 4 * (HEADER_WORDS - 1)
    head = np.concatenate([np.asarray([len(data)], np.int32), _pack(data[:room], HEADER_WORDS - 1)])
    self._broadcast(head)
    if len(data) > room:
      self._broadcast(_pack(data[room:], _words(len(data) - room)))

  def receive(self) -> dict:
    """A follower: the next command of process 0 (waits for it)."""
    head = self._broadcast(np.zeros(HEADER_WORDS, np.int32))
    n = int(head[0])
    room = 4 * (HEADER_WORDS - 1)
    data = head[1:].tobytes()[:min(n, room)]
    if n > room:
      data += self._broadcast(np.zeros(_words(n - room), np.int32)).tobytes()[:n - room]
    return json.loads(data)


def _plain(value):
  """A numpy scalar in a command (e.g. a float32 default temperature) as its Python value."""
  if isinstance(value, np.generic):
    return value.item()
  raise TypeError(f"a serve command cannot carry {type(value).__name__}")


def _words(n_bytes: int) -> int:
  """int32 words for `n_bytes`, rounded up to a power of two (≥ 64)."""
  return max(64, 1 << (-(-n_bytes // 4) - 1).bit_length())


class _Tag:
  """A follower's stand-in for process 0's job: the row's handle, by the job's id."""

  def __init__(self, job_id: int):
    self.id = job_id


class Follower:
  """Replays process 0's batch operations (`Channel` commands) on a BatchDecoder of its own."""

  def __init__(self, model, channel: Channel):
    from glmjax.serving.batch import GiB, BatchDecoder
    self.model, self.channel = model, channel
    hello = channel.receive()
    assert hello["op"] == "hello", hello
    self.batch = BatchDecoder(model, hello["width"], kv_cache_gb=hello["kv_bytes"] / GiB,
                              prefix_cache=hello["prefix_cache"])
    self.tags: dict[int, _Tag] = {}  # admitted, decoding: job id -> row tag
    self.ops = 0

  def run(self) -> None:
    """Follows until process 0 says `stop`. An InputError (a request refused before any
    compute, on the same inputs as process 0's, which refused it too) is logged and the loop
    goes on; any other failure ends it: a failure in the middle of an operation may have left
    this process's collectives out of step with the others', so the run must stop rather than
    go on (process 0's next collective then fails with a PeerError)."""
    import logging
    while True:
      cmd = self.channel.receive()
      if cmd["op"] == "stop":
        return
      self.ops += 1
      try:
        getattr(self, "_" + cmd["op"])(cmd)
      except InputError:
        logging.exception("follower: %s refused", cmd["op"])
      self.model.executor.save_stats()

  def _idle(self, cmd: dict) -> None:
    del cmd

  def _admit(self, cmd: dict) -> None:
    from glmjax.decoding.generation import new_request
    from glmjax.decoding.logprobs import prompt_logprobs
    prompt = np.asarray(cmd["prompt"], np.int32)  # [S]
    tag = _Tag(cmd["id"])
    req = new_request(self.model, prompt, **cmd["settings"])
    if cmd["echo"]:
      prompt_logprobs(self.model, prompt, req.logprobs or 0)
    if not (req.max_new_tokens == 0 or self.batch.admit(prompt, req, tag=tag)):
      self.tags[tag.id] = tag

  def _sum(self, cmd: dict) -> None:
    """Process 0 reports the engine counters summed over the processes (scheduler's
    `_engine_totals`): this process adds its own."""
    del cmd
    view = self.model.executor.telemetry()
    if view is not None:
      self.model.executor.sum_over_processes(view)

  def _step(self, cmd: dict) -> None:
    mine = [None if r is None else int(r.token) for r in self.batch.rows]
    if mine != cmd["tokens"]:
      raise GlmjaxError(f"serve: this follower's batch diverged from process 0's (tokens "
                      f"{mine} here, {cmd['tokens']} there)")
    for row in self.batch.step():
      self.tags.pop(row.tag.id)

  def _warm(self, cmd: dict) -> None:
    del cmd
    self.batch.warm_next()

  def _drop(self, cmd: dict) -> None:
    tag = self.tags.pop(cmd["id"], None)
    if tag is not None:
      self.batch.drop(tag)

  def _reset(self, cmd: dict) -> None:
    del cmd
    self.batch.reset()

  def _restore(self, cmd: dict) -> None:
    self.batch.restore(self.tags[cmd["id"]])


def follow(model, channel: Channel) -> int:
  """A follower process's main loop (scripts/serve.py on processes 1..n-1): 0 once process 0
  stopped the server; 1 when it died or left (a PeerError) or an operation failed here."""
  import sys
  import traceback
  try:
    Follower(model, channel).run()
  except GlmjaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except Exception:  # noqa: BLE001 - reported, and the run ends (see Follower.run)
    traceback.print_exc()
    return 1
  return 0
