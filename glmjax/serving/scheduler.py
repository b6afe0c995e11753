"""The scheduler: one thread that owns the model and its decode batch.

Requests wait in a bounded queue; between decode steps the thread drops cancelled requests,
admits waiting ones into free rows (each prefilled alone) and runs one step of the batch.
Results go back to the web server's event loop as events on each job's asyncio queue:
("start", None) when admitted, ("echo", prompt logprobs) with echo, ("score", (token,
TokenLogprob)) before each token's text when logprobs are asked for, ("text", piece) while
decoding, then ("done", summary) or
("error", GlmjaxError).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import threading
import time

import numpy as np

from glmjax.errors import ExpertIOError, GlmjaxError, InputError, PeerError
from glmjax.decoding.generation import new_request
from glmjax.decoding.logprobs import prompt_logprobs
from glmjax.serving.batch import GiB, BatchDecoder, kv_budget
from glmjax.offload.owners import peers_named
from glmjax.runtime import compile_cache
from glmjax.serving.follow import IDLE_TICK_S

# Engine counters each request gets its share of (a step's reads serve every live row).
ENGINE_KEYS = ("expert_pin_hits", "expert_host_hits", "expert_misses", "expert_bytes_read")
# Failed turns in a row before the live rows are failed rather than recomputed. A failed expert
# read is blamed on the rows that routed to it (`_blame`): they fail, the rest step on; uncounted.
MAX_FAULTS = 3


# glibc keeps memory the threads free in their arenas: a 10-minute soak of an offloaded store
# grew RSS 9.1% after warm-up, and malloc_trim(0) gave it back (docs/measurements/
# reliability.md). The scheduler trims at a step boundary at most every TRIM_BUSY_S under
# load (a trim that finds much to return takes ~10 ms), and when it falls idle, at most every
# TRIM_IDLE_S.
TRIM_BUSY_S, TRIM_IDLE_S = 10.0, 1.0


def _malloc_trim():
  """glibc's malloc_trim, or None (another C library, or no ctypes)."""
  try:
    import ctypes
    return ctypes.CDLL(None).malloc_trim
  except (ImportError, OSError, AttributeError):
    return None


def _rss_mb() -> float:
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
  except (OSError, ValueError, IndexError):
    return 0.0


class HeapTrim:
  """Hands the heap memory freed since the last trim back to the OS (glibc's `malloc_trim(0)`,
  which walks every thread's arena), at most every `busy_s` seconds while serving and every
  `idle_s` once idle. A no-op off glibc. Counts its trims, their seconds and the RSS they
  returned (the /health `heap_trim` figures)."""

  def __init__(self, busy_s: float = TRIM_BUSY_S, idle_s: float = TRIM_IDLE_S):
    self.fn = _malloc_trim()
    self.busy_s, self.idle_s = busy_s, idle_s
    self.last = time.monotonic()
    self.trims, self.seconds, self.freed_mb = 0, 0.0, 0.0

  def tick(self, idle: bool) -> None:
    """After a turn: trims if the last trim is old enough for the scheduler's state."""
    if self.fn is None or time.monotonic() - self.last < (self.idle_s if idle else self.busy_s):
      return
    before, t0 = _rss_mb(), time.perf_counter()
    self.fn(0)
    self.seconds += time.perf_counter() - t0
    self.freed_mb += max(0.0, before - _rss_mb())
    self.trims += 1
    self.last = time.monotonic()

  def state(self) -> dict:
    return {"trims": self.trims, "seconds": round(self.seconds, 3),
            "freed_mb": round(self.freed_mb, 1)}


class QueueFull(GlmjaxError):
  """The scheduler's queue holds `max_queue` waiting requests already."""


class ServerDown(GlmjaxError):
  """The scheduler thread stopped: nothing more can be served (a 503)."""


class Job:
  """One choice of a request: its prompt and settings in, events out to `loop`'s `queue`
  (shared by the request's choices; each event names its choice `index`)."""
  _ids = itertools.count()

  def __init__(self, prompt_ids: np.ndarray, settings: dict, loop: asyncio.AbstractEventLoop,
               queue: asyncio.Queue | None = None, index: int = 0, echo: bool = False,
               first_of_prompt: bool = True):
    self.id = next(Job._ids)
    self.prompt_ids = prompt_ids  # [S] int32
    self.settings = settings  # new_request keywords (max_new_tokens, temperature, ...)
    self.loop = loop
    self.queue: asyncio.Queue = queue if queue is not None else asyncio.Queue()
    self.index, self.echo, self.first_of_prompt = index, echo, first_of_prompt
    self.cancelled = False
    self.req = None  # glmjax.decoding.generation.Request once admitted
    self.prompt_scores: list | None = None  # with echo: (token, TokenLogprob | None) each
    self.t_submit = time.perf_counter()
    self.t_first: float | None = None
    self.engine: dict[str, float] = {}  # its share of the offload engine's counters

  def push(self, kind: str, value) -> None:
    """Thread-safe: hands an event to the request's coroutine (dropped once its loop closed)."""
    try:
      self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value, self.index))
    except RuntimeError:
      pass

  def cancel(self) -> None:
    """The client went away: the scheduler frees the job's row at the next step boundary."""
    self.cancelled = True

  def summary(self) -> dict:
    """Usage, logprobs and glmjax telemetry of a finished job."""
    now, req = time.perf_counter(), self.req
    n_out = len(req.out)
    first = self.t_first or now
    decode_s = now - first
    out = dict(index=self.index, first_of_prompt=self.first_of_prompt, echo=self.echo,
               prompt_tokens=int(len(self.prompt_ids)), completion_tokens=n_out,
               finish_reason="length" if req.reason == "max_new_tokens" else "stop",
               text="".join(req.pieces), tokens=list(req.out), logprobs=req.logprobs,
               stop_matched=req.matcher.matched if req.matcher is not None else None,
               scores=list(req.scores), prompt_ids=[int(t) for t in self.prompt_ids],
               prompt_scores=self.prompt_scores, cached_tokens=req.cached_tokens,
               ttft_s=first - self.t_submit, latency_s=now - self.t_submit,
               decode_tok_s=(n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else 0.0)
    out.update(self.engine)
    return out


class Scheduler:
  """Continuous batching over `model`: up to `max_batch` requests decode together, up to
  `max_queue` more wait. `submit`, `state` and `close` are called from the server's threads;
  everything that touches the model runs on the scheduler's own thread, which publishes a
  snapshot of the engine's counters after each step for `state` to read. With `channel`
  (glmjax.serving.follow.Channel, several processes) that thread tells the other processes
  each batch operation before running it, so that theirs run the same collectives."""

  def __init__(self, model, max_batch: int = 4, max_queue: int = 16,
               kv_cache_gb: float | None = None, prefix_cache: bool = False, channel=None,
               warm: bool = True):
    if max_queue < 0:
      raise InputError(f"max_queue must be ≥ 0, got {max_queue}")
    self.model = model
    self.max_queue = max_queue
    self.channel = channel
    if channel is not None:  # one budget for all: the automatic one depends on local memory
      kv_bytes = kv_budget(model, max_batch, model.max_context, kv_cache_gb)
      channel.send("hello", width=max_batch, kv_bytes=kv_bytes, prefix_cache=prefix_cache)
      kv_cache_gb = kv_bytes / GiB
    self.batch = BatchDecoder(model, max_batch, kv_cache_gb=kv_cache_gb,
                              prefix_cache=prefix_cache)
    self.context = self.batch.context
    # With `warm`, an idle turn (no live row, nothing waiting) compiles one prefill width not
    # compiled yet, until none is left (`BatchDecoder.warm_next`): later requests meet compiled
    # steps only, and a request never waits on more than the one compilation under way.
    self.warm = warm
    self._waiting: collections.deque[Job] = collections.deque()
    self._jobs: dict[int, Job] = {}  # admitted, decoding
    self._cond = threading.Condition()
    self._stop = False
    self._held = False
    self.dead: str | None = None  # why the scheduler thread stopped, once it has
    self.counts = dict.fromkeys(("submitted", "completed", "cancelled", "failed", "steps",
                                 "faults", "recovered"), 0)
    self.peak_live = 0
    self._trim = HeapTrim()
    self._compiled_before = compile_cache.compilations()  # /health counts the serving's
    self._engine_view = self._telemetry()  # published by the scheduler thread from now on
    self._thread = threading.Thread(target=self._run, name="glmjax-scheduler", daemon=True)
    self._thread.start()

  # --- called from the server ------------------------------------------------------------
  def submit(self, job: Job) -> None:
    """Queues `job`; raises InputError when the batch can never hold it (its context or the
    whole KV budget), QueueFull when `max_queue` requests are waiting already, ServerDown
    when the scheduler thread has stopped."""
    self.batch.check_fits(self._tokens(job))
    with self._cond:
      if self.dead:
        raise ServerDown(self.dead)
      if len(self._waiting) >= self.max_queue + self.batch.free():
        raise QueueFull(f"the queue is full ({self.max_queue} waiting requests); retry later")
      self._waiting.append(job)
      self.counts["submitted"] += 1
      self._cond.notify()

  def state(self) -> dict:
    """Live rows, waiting requests and counters (the /health payload); never touches the
    engine, whose counters come from the scheduler thread's last snapshot."""
    with self._cond:
      jobs = list(self._jobs.values())
      pool = self.batch.pool
      out = dict(live=self.batch.live, waiting=len(self._waiting), max_batch=self.batch.width,
                 cancelling=sum(j.cancelled for j in jobs),
                 max_queue=self.max_queue, peak_live=self.peak_live, **self.counts,
                 kv={"budget_bytes": self.batch.kv_bytes, "pages": pool.n_pages - 1,
                     "pages_free": pool.available, "page_size": pool.layout.page_size,
                     "context": self.batch.context})
      if pool.prefix is not None:
        out["kv"]["prefix_cached_pages"] = pool.prefix.cached_pages
        out["kv"]["prefix_hit_tokens"] = pool.prefix.hits_tokens
      out["heap_trim"] = self._trim.state()
      out["compilations"] = compile_cache.compilations() - self._compiled_before
      if self.warm:
        out["warming"] = len(self.batch.cold_widths)  # prefill widths still to compile
      if self._engine_view is not None:
        out["engine"] = {k: self._engine_view.get(k, 0.0) for k in ENGINE_KEYS}
    if self.dead:
      out["error"] = self.dead
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
    try:
      self._serve()
      self._tell("stop")
    except BaseException as e:  # the thread is gone: say so, and answer everyone at once
      logging.exception("the scheduler thread stopped")
      with self._cond:
        self.dead = f"the scheduler stopped: {type(e).__name__}: {e}"
        jobs = list(self._waiting) + list(self._jobs.values())
        self._waiting.clear()
        self._jobs.clear()
      for job in jobs:
        self.counts["failed"] += 1
        job.push("error", ServerDown(self.dead))
      if not isinstance(e, PeerError):  # followers still listening: let them leave
        try:
          self._tell("stop")
        except Exception:  # noqa: BLE001 - best effort; the thread is stopping anyway
          pass

  def _tell(self, op: str, **fields) -> None:
    """Several processes: tells the followers the batch operation about to run."""
    if self.channel is not None:
      self.channel.send(op, **fields)

  def _has_work(self) -> bool:
    return self._stop or bool(self._waiting and self.batch.can_admit(
        self._tokens(self._waiting[0]))) or (not self._held and bool(self.batch.live)) or (
            self._warm_due())

  def _serve(self) -> None:
    faults = 0  # consecutive failed turns
    # Several processes: an idle server still ticks (follow.IDLE_TICK_S), see _tell.
    tick = None if self.channel is None else IDLE_TICK_S
    while True:
      with self._cond:
        ready = self._cond.wait_for(self._has_work, timeout=tick)
        if self._stop:
          return
      if not ready:
        self._tell("idle")
        continue
      try:
        self._turn()
        faults = 0
      except PeerError:  # another process is gone: nothing can run any more
        raise
      except Exception as e:  # a fault mid-step: the live requests are recomputed, not failed
        logging.exception("scheduler step failed")
        if not self._blame(e):  # a fault blamed on its rows makes progress: not counted
          faults += 1
          self._recover(e, give_up=faults >= MAX_FAULTS)
        self._engine_view = self._engine_totals()
      self.model.executor.save_stats()  # throttled: at most every STATS_EVERY_S
      with self._cond:
        idle = not self._has_work()
      self._trim.tick(idle)

  def _turn(self) -> None:
    """One step boundary: drop cancelled rows, admit waiting jobs, decode one step."""
    for job in [j for j in self._jobs.values() if j.cancelled]:
      self._tell("drop", id=job.id)
      self.batch.drop(job)
      with self._cond:
        del self._jobs[job.id]
      self.counts["cancelled"] += 1
    while self.batch.free():
      with self._cond:  # in order: the head waits for pages rather than be overtaken
        if not self._waiting or not self.batch.can_admit(self._tokens(self._waiting[0])):
          break
        job = self._waiting.popleft()
      self._admit(job)
    if self._warm_due():
      self._warm_one()
    if not self.batch.live or self._held:
      return
    self.peak_live = max(self.peak_live, self.batch.live)
    before = self._telemetry()
    self._tell("step", tokens=[None if r is None else int(r.token) for r in self.batch.rows])
    done = self.batch.step()
    self.counts["steps"] += 1
    self._share(before, list(self._jobs.values()))
    self._engine_view = self._engine_totals()  # before any client hears its request is done
    for row in done:
      with self._cond:
        job = self._jobs.pop(row.tag.id)
      self._finish(job)

  def _admit(self, job: Job) -> None:
    """Prefills a job into a row. Its own failure fails it alone: the live rows are rebuilt
    (`_recover`) when the failure may have taken the batch's KV arrays with it."""
    if job.cancelled:
      self.counts["cancelled"] += 1
      return
    job.push("start", None)  # streams open with a chunk before the first token
    try:
      job.req = new_request(self.model, job.prompt_ids, on_text=lambda p: job.push("text", p),
                            on_score=lambda s: job.push("score", s), **job.settings)
      self._tell("admit", id=job.id, prompt=[int(t) for t in job.prompt_ids],
                 settings=job.settings, echo=job.echo)
      before = self._telemetry()
      if job.echo:  # the prompt's own logprobs: one teacher-forced pass (Model.score)
        job.prompt_scores = prompt_logprobs(self.model, job.prompt_ids, job.req.logprobs or 0)
        job.push("echo", job.prompt_scores)
      finished = (job.req.max_new_tokens == 0 or
                  self.batch.admit(job.prompt_ids, job.req, tag=job))
      self._share(before, [job])
      self._engine_view = self._engine_totals()  # before its client may hear it is done
    except Exception as e:
      self.counts["failed"] += 1
      job.push("error", e if isinstance(e, GlmjaxError) else
               GlmjaxError(f"internal error during prefill: {type(e).__name__}: {e}"))
      if isinstance(e, PeerError):  # another process is gone: the scheduler stops
        raise
      if self.batch.damaged():
        self._recover(e, give_up=False)
      return
    job.t_first = time.perf_counter()
    if finished:
      self._finish(job)
    else:
      with self._cond:
        self._jobs[job.id] = job

  def _warm_due(self) -> bool:
    return self.warm and bool(self.batch.cold_widths) and not (self.batch.live or self._waiting)

  def _warm_one(self) -> None:
    """Compiles one more prefill width. A failure ends the warm-up (the widths left compile
    on first use) and fails no request; its step may have taken the KV arrays: `_recover`."""
    self._tell("warm")
    try:
      self.batch.warm_next()
    except PeerError:
      raise
    except Exception as e:  # noqa: BLE001 - logged; serving goes on without the warm-up
      logging.exception("compiling a prefill width ahead failed; the rest compile on first use")
      self.warm = False
      self.batch.cold_widths.clear()
      if self.batch.damaged():
        self._recover(e, give_up=False)

  @staticmethod
  def _tokens(job: Job) -> int:
    return len(job.prompt_ids) + job.settings.get("max_new_tokens", 0)

  def _finish(self, job: Job) -> None:
    self.counts["completed"] += 1
    job.push("done", job.summary())

  def _engine_totals(self) -> dict | None:
    """The engine counters /health shows. With several processes each counts only its own
    experts, so process 0 reports their sums: a `sum` operation that every follower joins
    (follow.Follower._sum), after each prefill and decode step, so a /health read after a
    response already counts its work."""
    view = self._telemetry()
    if view is None or self.channel is None:
      return view
    self._tell("sum")
    with peers_named("serve"):
      return self.model.executor.sum_over_processes(view)

  def _telemetry(self) -> dict | None:
    return self.model.executor.telemetry()

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

  def _blame(self, error: Exception) -> bool:
    """A step that failed on one expert's read (an ExpertIOError naming layer and expert, and
    the batch rows whose tokens routed to it): those requests fail with it; the others keep
    their KV cache as the failed step left it (`BatchDecoder.salvage`) and simply step again
    next turn, so they finish with the tokens they give alone. False when the fault cannot be
    blamed on rows (another kind of fault, the arrays lost, several processes): `_recover`."""
    if not isinstance(error, ExpertIOError):
      return False
    if self.channel is not None:  # the followers' steps failed elsewhere: rebuild everywhere
      error.kv = None
      return False
    jobs = self.batch.salvage(error)
    if jobs is None:
      return False
    self.counts["faults"] += 1
    for job in jobs:
      self.batch.drop(job)
      with self._cond:
        self._jobs.pop(job.id, None)
      self.counts["failed"] += 1
      job.push("error", error)
    self.counts["recovered"] += self.batch.live
    return True

  def _recover(self, error: Exception, give_up: bool) -> None:
    """After a fault mid-step, whose step may have donated the batch's KV arrays: new arrays,
    and every live row prefilled again from its tokens, so one request's failure fails no
    other. A row that cannot be restored fails alone; after MAX_FAULTS faults in a row the
    live rows fail (the fault is not passing)."""
    self.counts["faults"] += 1
    with self._cond:
      jobs = list(self._jobs.values())
    self._tell("reset")
    self.batch.reset()
    for job in jobs:
      try:
        if give_up:
          raise GlmjaxError(f"internal error during decoding, {MAX_FAULTS} times in a row: "
                            f"{type(error).__name__}: {error}")
        self._tell("restore", id=job.id)
        self.batch.restore(job)
        self.counts["recovered"] += 1
      except Exception as e:
        if isinstance(e, PeerError):
          raise
        self._tell("drop", id=job.id)
        self.batch.drop(job)
        with self._cond:
          self._jobs.pop(job.id, None)
        self.counts["failed"] += 1
        job.push("error", e if isinstance(e, GlmjaxError) else
                 GlmjaxError(f"internal error during decoding: {type(e).__name__}: {e}"))
