"""The OpenAI-compatible HTTP server: a Starlette app over the continuous-batching scheduler.

  POST /v1/chat/completions   the model's own chat template (as Model.chat), stream or not;
                              tools, tool calls and reasoning (glmjax.serving.chat)
  POST /v1/completions        prompts as text or token ids, one or a batch; echo and logprobs
  POST /v1/messages           Anthropic's Messages API (glmjax.serving.anthropic); and
       /v1/messages/count_tokens
  GET  /v1/models             the one served model
  GET  /tokenizer_info        eos/bos/pad tokens and the chat template (lm-eval's probe)
  POST /tokenize, /detokenize text ↔ token ids with the model's tokenizer
  GET  /health                liveness, batch and queue state, engine counters (no key needed)
  GET  /openapi.json          the OpenAPI 3.1 description of these routes and their bounds
                              (glmjax.serving.openapi; no key needed)

Every route but /health checks the guard (API key, Host header, JSON body, its size and read
timeout: see glmjax.serving.guard; /openapi.json the Host only); headers beyond 16 kB are a 431
and cross-origin calls need --cors_origins (glmjax.serving.transport). Routes check their input and answer OpenAI's error shape with a 4xx;
only a fault of the server itself is a 5xx. Streams are server-sent events ending with
`data: [DONE]`; a client that goes away, streaming or not, cancels its choices, whose batch
rows are freed at the next step boundary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from glmjax.decoding import grammar, sampling
from glmjax.decoding.grammar import GrammarSpec
from glmjax.errors import GlmjaxError, InputError, PeerError
from glmjax.serving import anthropic, chat, fields, openapi, protocol, transport
from glmjax.serving.guard import Guard
from glmjax.serving.protocol import ApiError
from glmjax.serving.scheduler import Job, QueueFull, ServerDown

DEFAULT_MAX_TOKENS = {"chat": 512, "completion": 16}  # OpenAI's completion default is 16


def model_name(model) -> str:
  """The served model's id: its directory's name."""
  return os.path.basename(os.path.normpath(model.path or "glmjax")) or "glmjax"


def _error(e: ApiError) -> JSONResponse:
  return JSONResponse(e.body, status_code=e.status, headers=e.headers)


def create_app(model, max_batch: int = 4, max_queue: int = 16, name: str | None = None,
               kv_cache_gb: float | None = None, guard: Guard | None = None,
               prefix_cache: bool = True, channel=None, cors_origins: tuple[str, ...] = (),
               warm_prefill: bool = True):
  """A Starlette app serving `model` (glmjax.api.Model) with continuous batching of up to
  `max_batch` requests and `max_queue` waiting, their KV pages from a budget of `kv_cache_gb`
  (None: automatic, glmjax.serving.batch.kv_budget), behind `guard` (default: no API key, a
  loopback bind, 8 MB bodies). With `prefix_cache`, requests reuse the KV pages of prompt
  prefixes already prefilled (glmjax.decoding.prefix). With `channel`
  (glmjax.serving.follow.Channel, on process 0 of several) the other processes follow its batch
  operations. Browsers on `cors_origins` (exact origins, glmjax.serving.transport.cors_origins)
  may call it cross-origin; by default none may. With `warm_prefill` the scheduler compiles
  every prefill width ahead while idle (Scheduler `warm`). `app.state.scheduler` is its
  scheduler; call `app.state.scheduler.close()` when done."""
  from glmjax.serving.scheduler import Scheduler
  name = name or model_name(model)
  guard = guard or Guard()
  tok = model.tokenizer
  if tok is None:
    raise GlmjaxError(f"{model.path}: serving needs a tokenizer (tokenizer.json)")
  scheduler = Scheduler(model, max_batch, max_queue, kv_cache_gb, prefix_cache, channel,
                        warm_prefill)
  gen = sampling.SamplingParams.from_generation_config(tok.generation_config or {})
  defaults = {"temperature": gen.temperature, "top_p": gen.top_p}

  def token_text(t: int) -> str:
    return tok.decode([t])

  def encode(kind: str, body: dict,
             req: chat.ChatRequest | None) -> list[tuple[np.ndarray, str]]:
    """(token ids, text) per prompt: the chat's templated messages, or each completion prompt."""
    try:
      if kind == "chat":
        return [(model.check_tokens(req.encode(tok)), "")]
      out = []
      for p in protocol.prompts(body):
        ids = model.check_tokens(tok.encode(p) if isinstance(p, str) else p)
        out.append((ids, p if isinstance(p, str) else tok.decode(list(p))))
      return out
    except GlmjaxError as e:
      raise ApiError(400, str(e), "messages" if kind == "chat" else "prompt") from None

  def plan(kind: str, body: dict) -> tuple[list[dict], bool, bool, chat.ChatRequest | None]:
    """The request's choices (prompt ids, text, settings, index), stream, include_usage and
    the chat request: all checks on a worker thread, before anything is queued."""
    fields.check(body, fields.CHAT if kind == "chat" else fields.COMPLETION,
                 fields.OPENAI_IGNORED)
    if isinstance(body.get("stream_options"), dict):
      fields.check(body["stream_options"], fields.STREAM_OPTIONS, fields.STREAM_OPTIONS_IGNORED,
                   "stream_options.")
    protocol.check_model(body, name)
    stream = protocol.stream_flag(body)
    usage = protocol.include_usage(body)
    req = chat.request(body, tok) if kind == "chat" else None
    prompts = encode(kind, body, req)
    n = protocol.choices_per_prompt(body, len(prompts))
    choices = []
    for p, (ids, text) in enumerate(prompts):
      settings = checked_sampling(body, len(ids), DEFAULT_MAX_TOKENS[kind],
                                  req.stops if req is not None else [])
      if req is not None and req.grammar is not None:
        settings["grammar"] = checked_grammar(req.grammar)
      for j in range(n):  # choice j of a prompt samples with seed + j
        choices.append(dict(ids=ids, text=text, index=p * n + j, first=j == 0, settings={
            **settings, "seed": (settings["seed"] + j) % protocol.MAX_SEED}))
    return choices, stream, usage, req

  def checked_sampling(body: dict, n_prompt: int, default_max: int, own_stops: list) -> dict:
    settings = protocol.sampling(body, n_prompt, scheduler.context, default_max, defaults,
                                 own_stops)
    try:  # the sampler's own checks, before the request takes a place in the queue
      sampling.SamplingParams(settings["temperature"], settings["top_k"], settings["top_p"],
                              settings["min_p"], settings["repetition_penalty"])
    except GlmjaxError as e:
      raise ApiError(400, str(e)) from None
    return settings

  def checked_grammar(spec: GrammarSpec) -> dict:
    """The grammar's JSON for the request's settings, once compiled here: a schema the
    grammar library refuses is a 400 naming its field, before anything is queued."""
    try:
      grammar.validate(spec, tok, model.config.vocab_size, model.default_stop_ids())
    except grammar.GrammarError as e:
      raise ApiError(400, str(e), e.field) from None
    return spec.to_json()

  async def submit(choices: list[dict], echo: bool = False) -> list[Job]:
    """Queues the choices as jobs sharing one event queue (a 429 when full, a 503 when the
    scheduler is down); on a refusal the ones already queued are cancelled."""
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    jobs = [Job(c["ids"], c["settings"], loop, queue, c["index"], echo, c["first"])
            for c in choices]
    try:
      for job in jobs:
        scheduler.submit(job)
    except (QueueFull, ServerDown, InputError) as e:
      for job in jobs:
        job.cancel()
      if isinstance(e, QueueFull):
        raise ApiError(429, str(e), None, "queue_full", "rate_limit_error") from None
      if isinstance(e, ServerDown):
        raise ApiError(503, str(e), None, "server_down", "server_error") from None
      # more than the batch can ever hold: its context or KV budget
      raise ApiError(400, str(e), "max_tokens", "context_length_exceeded") from None
    return jobs

  async def complete(request: Request, kind: str):
    jobs: list[Job] = []
    try:
      guard.admit(request)
      body = await guard.json_body(request)
      choices, stream, usage, req = await run_in_threadpool(plan, kind, body)
      jobs = await submit(choices, protocol.echo(body))
    except ApiError as e:
      return _error(e)
    reply = protocol.Reply(kind, name, token_text)
    texts = {c["index"]: c["text"] for c in choices}
    replies = None  # chat: each choice's reader of reasoning, answer and tool calls
    if req is not None:
      replies = {c["index"]: chat.ChoiceReply(req, tok.end_think_id) for c in choices}
    if stream:
      return StreamingResponse(_events(jobs, reply, usage, texts, replies),
                               media_type="text/event-stream")
    try:
      summaries = []
      while len(summaries) < len(jobs):
        event = await _next_event(jobs[0].queue, request)
        if event is None:
          return _error(ApiError(499, "the client went away", None, "client_closed"))
        kind_, value, index = event
        if kind_ == "done":
          summary = {**value, "prompt_text": texts[index],
                     "echo_text": texts[index] if value["echo"] else ""}
          if replies is not None:
            replies[index].feed(value["text"])
            replies[index].finish(summary)
          summaries.append(summary)
        elif kind_ == "error":
          return _error(_failure(value))
      return JSONResponse(reply.whole(summaries))
    finally:
      for job in jobs:
        job.cancel()  # a no-op once done; frees the rows if the client went away or one failed

  async def chat_completions(request: Request):
    return await complete(request, "chat")

  async def completions(request: Request):
    return await complete(request, "completion")

  served = anthropic.Served(name, tok, guard, model.check_tokens,
                            lambda body, n, default_max, stops: checked_sampling(
                                body, n, default_max, stops), checked_grammar, submit,
                            _next_event, _failure)

  async def messages(request: Request):
    return await anthropic.messages(request, served)

  async def count_tokens(request: Request):
    return await anthropic.messages(request, served, count_only=True)

  async def guarded(request: Request, answer, needs_body: bool = True):
    try:
      guard.admit(request)
      body = await guard.json_body(request) if needs_body else None
      return JSONResponse(await run_in_threadpool(answer, body))
    except ApiError as e:
      return _error(e)

  async def models(request: Request):
    return await guarded(request, lambda _: {"object": "list", "data": [
        {"id": name, "object": "model", "created": int(time.time()), "owned_by": "glmjax"}]},
        needs_body=False)

  async def tokenizer_info(request: Request):
    return await guarded(request, lambda _: protocol.tokenizer_info(tok), needs_body=False)

  def checked(allowed: set, answer):
    def run(body: dict):
      fields.check(body, allowed, fields.TOKENIZER_IGNORED)
      return answer(body)
    return run

  async def tokenize(request: Request):
    return await guarded(request, checked(fields.TOKENIZE, lambda b: protocol.tokenize(tok, b)))

  async def detokenize(request: Request):
    return await guarded(request, checked(fields.DETOKENIZE, lambda b: protocol.detokenize(
        tok, b, model.config.vocab_size)))

  async def health(request: Request):
    state = scheduler.state()
    ok = scheduler.dead is None
    if model.memory is not None:  # what load() planned: each part's bytes, the dense format
      state["memory"] = dict(dataclasses.asdict(model.memory))
    return JSONResponse({"status": "ok" if ok else "error", "model": name, **state},
                        status_code=200 if ok else 503)

  schema = openapi.document(name, scheduler.context, model.config.vocab_size,
                            bool(guard.keys), DEFAULT_MAX_TOKENS,
                            "reasoning_effort" in (tok.chat_template or ""))

  async def openapi_json(request: Request):
    try:
      guard.admit(request, needs_key=False)  # the Host check still holds
    except ApiError as e:
      return _error(e)
    return JSONResponse(schema)

  async def not_found(request: Request, exc):
    status = getattr(exc, "status_code", 404)
    return _error(ApiError(status, f"{request.method} {request.url.path}: "
                           f"{getattr(exc, 'detail', 'not found')}", None, "not_found"))

  app = Starlette(routes=[
      Route("/v1/chat/completions", chat_completions, methods=["POST"]),
      Route("/v1/completions", completions, methods=["POST"]),
      Route("/v1/messages", messages, methods=["POST"]),
      Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
      Route("/v1/models", models, methods=["GET"]),
      Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
      Route("/tokenize", tokenize, methods=["POST"]),
      Route("/detokenize", detokenize, methods=["POST"]),
      Route("/health", health, methods=["GET"]),
      Route("/openapi.json", openapi_json, methods=["GET"]),
  ], exception_handlers={404: not_found, 405: not_found})
  app.add_middleware(transport.HeaderCap)
  transport.with_cors(app, cors_origins)
  app.state.scheduler = scheduler
  app.state.model_name = name
  app.state.guard = guard
  return app


async def _next_event(queue: asyncio.Queue, request: Request, poll_s: float = 0.25):
  """The next event of a request's choices, or None once its client has disconnected (a
  non-streaming client is noticed too, between polls)."""
  while True:
    try:
      return await asyncio.wait_for(queue.get(), poll_s)
    except asyncio.TimeoutError:
      if await request.is_disconnected():
        return None


def _failure(e: Exception) -> ApiError:
  """A job's failure: the request's fault (InputError) is a 400, a stopped scheduler or a
  dead peer process (PeerError, several processes) a 503, anything else the server's 500."""
  if isinstance(e, InputError):
    return ApiError(400, str(e))
  if isinstance(e, (ServerDown, PeerError)):
    return ApiError(503, str(e), None, "server_down", "server_error")
  return ApiError(500, str(e), None, "internal_error", "server_error")


def _sse(obj) -> str:
  # A NaN would go out as `NaN`, which is not JSON: the stream fails instead (the server's fault).
  return f"data: {json.dumps(obj, allow_nan=False)}\n\n"


async def _events(jobs: list[Job], reply: protocol.Reply, include_usage: bool,
                  texts: dict[int, str], replies: dict | None = None):
  """The server-sent events of a request's choices, each chunk naming its choice; a text chunk
  carries the logprobs of the tokens scored since the last one (with echo, the first chunk is
  the prompt and its logprobs). Chat text goes through each choice's `replies` reader
  (glmjax.serving.chat.ChoiceReply): reasoning, answer and whole tool calls apart, text it
  holds back (a call not closed yet) sent later with its tokens' logprobs. Cancels the choices
  when the client disconnects (Starlette then cancels the stream, which runs the `finally`)."""
  queue = jobs[0].queue
  opened, summaries = set(), []
  pending = {job.index: [] for job in jobs}  # scored tokens whose text has not gone out yet
  offset = {job.index: len(texts[job.index]) for job in jobs}  # completions' text_offset

  def logprobs(index: int, scored: list | None = None, at: int | None = None):
    scored = pending[index] if scored is None else scored
    if not scored or not any(j.settings["logprobs"] is not None for j in jobs):
      return None
    obj, offset[index] = reply.logprobs(scored, offset[index] if at is None else at)
    pending[index] = [] if scored is pending[index] else pending[index]
    return obj

  try:
    while len(summaries) < len(jobs):
      kind, value, index = await queue.get()
      if kind == "score":
        pending[index].append(value)
      elif kind == "echo":
        yield _sse(reply.chunk(texts[index], index, index not in opened,
                               logprobs=logprobs(index, value, at=0)))
        opened.add(index)
      elif kind == "start" or (kind == "text" and value):
        piece = replies[index].feed(value) if replies is not None and value else value
        if kind == "start" or piece:
          yield _sse(reply.chunk(piece, index, index not in opened, logprobs=logprobs(index)))
          opened.add(index)
      elif kind == "done":
        summaries.append(value)
        if reply.chat and pending[index] and len(value["scores"]) > len(value["tokens"]):
          pending[index] = pending[index][:-1]  # the stop token is not content
        last = replies[index].finish(value) if replies is not None else None
        yield _sse(reply.chunk(last, index, index not in opened, value, logprobs(index)))
      else:
        yield _sse(_failure(value).body)
        break
    else:
      if include_usage:
        yield _sse(reply.usage_chunk(summaries))
    yield "data: [DONE]\n\n"
  finally:
    for job in jobs:
      job.cancel()
