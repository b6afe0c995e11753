"""The scheduler: one thread that owns the model and its decode batch.

Requests wait in a bounded queue; between decode steps the thread drops cancelled requests,
admits waiting ones into free rows (each prefilled alone) and runs one step of the batch.
Results go back to the web server's event loop as events on each job's asyncio queue:
("start", None) when admitted, ("text", piece) while decoding, then ("done", summary) or
("error", GlmjaxError).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time

import numpy as np

from glmjax.errors import GlmjaxError, InputError
from glmjax.decoding.generation import new_request
from glmjax.decoding.pages import GiB
from glmjax.serving.batch import BatchDecoder

# Engine counters each request gets its share of (a step's reads serve every live row).
ENGINE_KEYS = ("expert_pin_hits", "expert_host_hits", "expert_misses", "expert_bytes_read")


class QueueFull(GlmjaxError):
  """The scheduler's queue holds `max_queue` waiting requests already."""


class Job:
  """One request's journey: its prompt and settings in, events out to `loop`'s `queue`."""
  _ids = itertools.count()

  def __init__(self, prompt_ids: np.ndarray, settings: dict, loop: asyncio.AbstractEventLoop):
    self.id = next(Job._ids)
    self.prompt_ids = prompt_ids  # [S] int32
    self.settings = settings  # new_request keywords (max_new_tokens, temperature, ...)
    self.loop = loop
    self.queue: asyncio.Queue = asyncio.Queue()
    self.cancelled = False
    self.req = None  # glmjax.decoding.generation.Request once admitted
    self.t_submit = time.perf_counter()
    self.t_first: float | None = None
    self.engine: dict[str, float] = {}  # its share of the offload engine's counters

  def push(self, kind: str, value) -> None:
    """Thread-safe: hands an event to the request's coroutine (dropped once its loop closed)."""
    try:
      self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
    except RuntimeError:
      pass

  def cancel(self) -> None:
    """The client went away: the scheduler frees the job's row at the next step boundary."""
    self.cancelled = True

  def summary(self) -> dict:
    """Usage and glmjax telemetry of a finished job."""
    now, req = time.perf_counter(), self.req
    n_out = len(req.out)
    first = self.t_first or now
    decode_s = now - first
    out = dict(prompt_tokens=int(len(self.prompt_ids)), completion_tokens=n_out,
               finish_reason="length" if req.reason == "max_new_tokens" else "stop",
               text="".join(req.pieces), tokens=list(req.out),
               ttft_s=first - self.t_submit, latency_s=now - self.t_submit,
               decode_tok_s=(n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else 0.0)
    out.update(self.engine)
    return out


class Scheduler:
  """Continuous batching over `model`: up to `max_batch` requests decode together, up to
  `max_queue` more wait. `submit` is called from the server's threads; the rest runs on the
  scheduler's own thread."""

  def __init__(self, model, max_batch: int = 4, max_queue: int = 16,
               kv_cache_gb: float | None = None):
    if max_queue < 0:
      raise InputError(f"max_queue must be ≥ 0, got {max_queue}")
    self.model = model
    self.max_queue = max_queue
    self.batch = BatchDecoder(model, max_batch, kv_cache_gb=kv_cache_gb)
    self.context = self.batch.context
    self._waiting: collections.deque[Job] = collections.deque()
    self._jobs: dict[int, Job] = {}  # admitted, decoding
    self._cond = threading.Condition()
    self._stop = False
    self._held = False
    self.counts = dict.fromkeys(("submitted", "completed", "cancelled", "failed", "steps"), 0)
    self.peak_live = 0
    self._thread = threading.Thread(target=self._run, name="glmjax-scheduler", daemon=True)
    self._thread.start()

  # --- called from the server ------------------------------------------------------------
  def submit(self, job: Job) -> None:
    """Queues `job`; raises InputError when the batch can never hold it (its context or the
    whole KV budget), QueueFull when `max_queue` requests are waiting already."""
    self.batch.check_fits(self._tokens(job))
    with self._cond:
      if len(self._waiting) >= self.max_queue + self.batch.free():
        raise QueueFull(f"the queue is full ({self.max_queue} waiting requests); retry later")
      self._waiting.append(job)
      self.counts["submitted"] += 1
      self._cond.notify()

  def state(self) -> dict:
    """Live rows, waiting requests and counters (the /health payload)."""
    with self._cond:
      jobs = list(self._jobs.values())
      pool = self.batch.pool
    out = dict(live=self.batch.live, waiting=len(self._waiting), max_batch=self.batch.width,
               cancelling=sum(j.cancelled for j in jobs),
               max_queue=self.max_queue, peak_live=self.peak_live, **self.counts,
               kv={"budget_bytes": self.batch.kv_bytes, "pages": pool.n_pages - 1,
                   "pages_free": len(pool.free), "page_size": pool.layout.page_size,
                   "context": self.batch.context})
    if self.model.engine is not None:
      tel = self.model.engine.telemetry()
      out["engine"] = {k: tel.get(k, 0.0) for k in ENGINE_KEYS}
    return out

  def hold(self, held: bool) -> None:
    """Pauses decoding at the next step boundary (True) or resumes it. While held, requests
    still queue and are admitted (prefilled) into free rows, but no row advances: for
    maintenance, and for tests of a full queue or a disconnect that must not race the decoder."""
    with self._cond:
      self._held = held
      self._cond.notify()

  def close(self) -> None:
    with self._cond:
      self._stop = True
      self._cond.notify()
    self._thread.join(timeout=30)

  # --- the scheduler thread ----------------------------------------------------------------
  def _run(self) -> None:
    while True:
      with self._cond:
        while not self._stop and not (self._waiting and self.batch.can_admit(
            self._tokens(self._waiting[0]))) and (self._held or not self.batch.live):
          self._cond.wait()
        if self._stop:
          return
      try:
        self._turn()
      except Exception as e:  # never let one failure stop the server: fail what was running
        logging.exception("scheduler step failed")
        self._fail_all(e)

  def _turn(self) -> None:
    """One step boundary: drop cancelled rows, admit waiting jobs, decode one step."""
    for job in [j for j in self._jobs.values() if j.cancelled]:
      self.batch.drop(job)
      del self._jobs[job.id]
      self.counts["cancelled"] += 1
    while self.batch.free():
      with self._cond:  # in order: the head waits for pages rather than be overtaken
        if not self._waiting or not self.batch.can_admit(self._tokens(self._waiting[0])):
          break
        job = self._waiting.popleft()
      self._admit(job)
    if not self.batch.live or self._held:
      return
    self.peak_live = max(self.peak_live, self.batch.live)
    before = self._telemetry()
    done = self.batch.step()
    self.counts["steps"] += 1
    self._share(before, list(self._jobs.values()))
    for row in done:
      self._finish(self._jobs.pop(row.tag.id))

  def _admit(self, job: Job) -> None:
    if job.cancelled:
      self.counts["cancelled"] += 1
      return
    job.push("start", None)  # streams open with a chunk before the first token
    try:
      job.req = new_request(self.model, job.prompt_ids, on_text=lambda p: job.push("text", p),
                            **job.settings)
      before = self._telemetry()
      finished = self.batch.admit(job.prompt_ids, job.req, tag=job)
      self._share(before, [job])
    except Exception as e:
      self.counts["failed"] += 1
      job.push("error", e if isinstance(e, GlmjaxError) else
               GlmjaxError(f"internal error during prefill: {e}"))
      if not isinstance(e, GlmjaxError):
        raise  # the batch may be unusable: _run starts it over
      return
    job.t_first = time.perf_counter()
    if finished:
      self._finish(job)
    else:
      self._jobs[job.id] = job

  @staticmethod
  def _tokens(job: Job) -> int:
    return len(job.prompt_ids) + job.settings.get("max_new_tokens", 0)

  def _finish(self, job: Job) -> None:
    self.counts["completed"] += 1
    job.push("done", job.summary())

  def _telemetry(self) -> dict | None:
    eng = self.model.engine
    return eng.telemetry() if eng is not None else None

  def _share(self, before: dict | None, jobs: list[Job]) -> None:
    """Splits the engine counters' growth since `before` evenly over `jobs` (one layer step's
    reads serve every row of the batch)."""
    if before is None or not jobs:
      return
    after = self._telemetry()
    for k in ENGINE_KEYS:
      share = (after.get(k, 0.0) - before.get(k, 0.0)) / len(jobs)
      for job in jobs:
        job.engine[k] = job.engine.get(k, 0.0) + share

  def _fail_all(self, error: Exception) -> None:
    """After an unexpected failure mid-step (the batch cache may be donated): fail the live
    jobs and start over with an empty batch."""
    message = GlmjaxError(f"internal error during decoding: {error}")
    for job in self._jobs.values():
      self.counts["failed"] += 1
      job.push("error", message)
    self._jobs.clear()
    self.batch = BatchDecoder(self.model, self.batch.width, self.batch.context,
                              self.batch.kv_bytes / GiB)
