"""The OpenAI-compatible HTTP server: a Starlette app over the continuous-batching scheduler.

  POST /v1/chat/completions   the model's own chat template (as Model.chat), stream or not
  POST /v1/completions        the prompt encoded as Model.generate(str) does, no template
  GET  /v1/models             the one served model
  GET  /health                liveness, batch and queue state, engine counters

Routes check their input and answer OpenAI's error shape with a 4xx; only a fault of the
server itself is a 500. Streams are server-sent events ending with `data: [DONE]`; a client
that goes away cancels its job, whose batch row is freed at the next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from glmjax.decoding import sampling
from glmjax.errors import GlmjaxError, InputError
from glmjax.serving import protocol
from glmjax.serving.protocol import ApiError
from glmjax.serving.scheduler import Job, QueueFull, Scheduler

DEFAULT_MAX_TOKENS = {"chat": 512, "completion": 16}  # OpenAI's completion default is 16


def model_name(model) -> str:
  """The served model's id: its directory's name."""
  return os.path.basename(os.path.normpath(model.path or "glmjax")) or "glmjax"


def _error(e: ApiError) -> JSONResponse:
  return JSONResponse(e.body, status_code=e.status)


def create_app(model, max_batch: int = 4, max_queue: int = 16, name: str | None = None,
               kv_cache_gb: float | None = None):
  """A Starlette app serving `model` (glmjax.api.Model) with continuous batching of up to
  `max_batch` requests and `max_queue` waiting, their KV pages from a budget of `kv_cache_gb`
  (None: automatic, glmjax.serving.batch.kv_budget). `app.state.scheduler` is its scheduler;
  call `app.state.scheduler.close()` when done."""
  name = name or model_name(model)
  if model.tokenizer is None:
    raise GlmjaxError(f"{model.path}: serving needs a tokenizer (tokenizer.json)")
  scheduler = Scheduler(model, max_batch, max_queue, kv_cache_gb)
  gen = sampling.SamplingParams.from_generation_config(model.tokenizer.generation_config or {})
  defaults = {"temperature": gen.temperature, "top_p": gen.top_p}

  async def body_of(request: Request) -> dict:
    raw = await request.body()
    try:
      body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
      raise ApiError(400, f"the request body is not valid JSON: {e}", None,
                     "invalid_json") from None
    if not isinstance(body, dict):
      raise ApiError(400, "the request body must be a JSON object", None, "invalid_type")
    return body

  def encode(kind: str, body: dict) -> np.ndarray:
    from glmjax.decoding import text
    try:
      if kind == "chat":
        ids = text.encode_chat(protocol.messages(body), model.tokenizer,
                               add_generation_prompt=True, enable_thinking=False)
      else:
        p = protocol.prompt(body)
        ids = model.tokenizer.encode(p) if isinstance(p, str) else p
      return model.check_tokens(ids)
    except GlmjaxError as e:
      raise ApiError(400, str(e), "messages" if kind == "chat" else "prompt") from None

  async def complete(request: Request, kind: str):
    try:
      body = await body_of(request)
      protocol.check_model(body, name)
      stream = protocol.stream_flag(body)
      ids = encode(kind, body)
      settings = protocol.sampling(body, len(ids), scheduler.context, DEFAULT_MAX_TOKENS[kind],
                                   defaults)
      try:  # the sampler's own checks, before the request takes a place in the queue
        sampling.SamplingParams(settings["temperature"], 0, settings["top_p"], 0.0, 1.0)
      except GlmjaxError as e:
        raise ApiError(400, str(e)) from None
      job = Job(ids, settings, asyncio.get_running_loop())
      try:
        scheduler.submit(job)
      except QueueFull as e:
        raise ApiError(429, str(e), None, "queue_full", "rate_limit_error") from None
      except InputError as e:  # more than the batch can ever hold: its context or KV budget
        raise ApiError(400, str(e), "max_tokens", "context_length_exceeded") from None
    except ApiError as e:
      return _error(e)
    reply = protocol.Reply(kind, name)
    if stream:
      return StreamingResponse(_events(job, reply, request), media_type="text/event-stream")
    try:
      while True:
        kind_, value = await job.queue.get()
        if kind_ == "done":
          return JSONResponse(reply.whole(value))
        if kind_ == "error":
          return _error(_failure(value))
    finally:
      job.cancel()  # a no-op once done; frees the row if the client went away

  async def chat(request: Request):
    return await complete(request, "chat")

  async def completions(request: Request):
    return await complete(request, "completion")

  async def models(request: Request):
    return JSONResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": int(time.time()), "owned_by": "glmjax"}]})

  async def health(request: Request):
    return JSONResponse({"status": "ok", "model": name, **scheduler.state()})

  async def not_found(request: Request, exc):
    status = getattr(exc, "status_code", 404)
    return _error(ApiError(status, f"{request.method} {request.url.path}: "
                           f"{getattr(exc, 'detail', 'not found')}", None, "not_found"))

  app = Starlette(routes=[
      Route("/v1/chat/completions", chat, methods=["POST"]),
      Route("/v1/completions", completions, methods=["POST"]),
      Route("/v1/models", models, methods=["GET"]),
      Route("/health", health, methods=["GET"]),
  ], exception_handlers={404: not_found, 405: not_found})
  app.state.scheduler = scheduler
  app.state.model_name = name
  return app


def _failure(e: Exception) -> ApiError:
  """A job's failure: the request's fault (InputError) is a 400, anything else the server's."""
  if isinstance(e, InputError):
    return ApiError(400, str(e))
  return ApiError(500, str(e), None, "internal_error", "server_error")


def _sse(obj) -> str:
  return f"data: {json.dumps(obj)}\n\n"


async def _events(job: Job, reply: protocol.Reply, request: Request):
  """A job's server-sent events; cancels the job when the client disconnects (Starlette then
  cancels the stream, which runs the `finally`)."""
  first = True
  try:
    while True:
      kind, value = await job.queue.get()
      if kind == "start" or (kind == "text" and value):
        yield _sse(reply.chunk(value, first))
        first = False
      elif kind == "done":
        yield _sse(reply.chunk(None, first, value))
        break
      else:
        yield _sse(_failure(value).body)
        break
    yield "data: [DONE]\n\n"
  finally:
    job.cancel()
