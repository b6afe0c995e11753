"""Serves a GLM-5 model over an OpenAI-compatible HTTP API, with continuous batching.

  python scripts/serve.py                                  # the embedded model on 127.0.0.1:8000
  python scripts/serve.py --model=/nvme/glm5-int4 --host_cache_gb=64 --max_batch=8

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming or not), GET /v1/models,
GET /tokenizer_info, POST /tokenize, POST /detokenize, GET /health, GET /openapi.json (the
routes' schema). With an API key (--api_key, --api_key_file or GLMJAX_API_KEY) every route but
/health and /openapi.json needs it. Requests decode together, up to --max_batch at a time; up to
--max_queue more wait, and a request beyond that is answered 429. Slow clients are cut off after
--read_timeout_s; browsers on other origins are refused unless named in --cors_origins. Unset
temperature/top_p take the model's generation_config.json.

Several processes (hosts), each with its own tiers of the experts it owns (glmjax.offload.owners):
  python scripts/serve.py --model=/nvme/glm5-int4 --host_cache_gb=200 --mesh=expert:2 \
      --coordinator=HOST0:PORT --num_processes=2 --process_id=I      # on each host, I = 0, 1
Process 0 answers HTTP; the others follow its batch operations (glmjax.serving.follow) and
leave when it stops. `{process}` in --model is the process index (a store copy per process).
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import sys

from absl import app, flags, logging

import glmjax
from glmjax import cli, distributed

FLAGS = flags.FLAGS
distributed.define_flags()  # --mesh, and --coordinator etc. for several processes
cli.define_model_flag("an HF checkpoint or expert store directory; default: the embedded model "
                      "(`{process}` in it: the process index, as in generate.py)")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (loopback by default).")
flags.DEFINE_integer("port", 8000, "Port to listen on (0: any free port, printed).",
                     lower_bound=0, upper_bound=65535)
flags.DEFINE_string("served_name", None, "Model id clients name (default: the model "
                    "directory's name).")
flags.DEFINE_integer("max_batch", 4, "Requests decoded together (the batch's fixed width).",
                     lower_bound=1)
flags.DEFINE_integer("max_queue", 16, "Requests waiting for a batch row at most; more get 429.",
                     lower_bound=0)
flags.DEFINE_float("kv_cache_gb", None, "KV cache budget of the batch, shared by its rows' pages "
                   "(default: enough for --max_batch full contexts, at most a quarter of the "
                   "free memory). A request needing more than all of it gets a 400.")
flags.DEFINE_string("api_key", None, "API key(s) clients must send (Authorization: Bearer or "
                    "X-Api-Key), comma-separated; default: the GLMJAX_API_KEY environment "
                    "variable, else none (open).")
flags.DEFINE_string("api_key_file", None, "A file of API keys, one per line (instead of --api_key).")
flags.DEFINE_float("max_body_mb", 8, "Request bodies larger than this get 413.", lower_bound=0.001)
flags.DEFINE_float("read_timeout_s", 30, "A request's headers must arrive within this many "
                   "seconds of the connection opening (or of its previous response), else the "
                   "connection is closed; its body within as many more, else 408 and closed "
                   "(slow clients, slow-loris).", lower_bound=0.001)
flags.DEFINE_string("cors_origins", None, "Comma-separated exact origins (scheme://host[:port]) "
                    "whose pages may call the server cross-origin; default none (preflights get "
                    "405). A wildcard is refused.")
flags.DEFINE_boolean("warm_prefill", True, "Compile every prefill width a prompt may need "
                     "(powers of two up to --prefill_chunk) ahead, one at a time while no "
                     "request is live or waiting, so that later requests meet compiled steps.")
# Every glmjax.load option; the server's prefix cache is on by default and goes to the batch.
cli.define_load_flags(defaults={"prefix_cache": True},
                      notes={"prefix_cache": "Here: the batch's requests share them."})


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  distributed.initialize()
  import uvicorn
  from glmjax.serving.app import create_app
  from glmjax.serving import transport
  from glmjax.serving.guard import Guard, api_keys, is_loopback
  try:
    keys = api_keys(FLAGS.api_key, FLAGS.api_key_file)
    origins = transport.cors_origins(FLAGS.cors_origins)
    guard = Guard(keys, loopback=is_loopback(FLAGS.host),
                  max_body_bytes=int(FLAGS.max_body_mb * 2 ** 20),
                  read_timeout_s=FLAGS.read_timeout_s)
    mesh = distributed.mesh_from_flags()
    model = glmjax.load(distributed.per_process(FLAGS.model), mesh=mesh,
                        **cli.load_options(exclude=("prefix_cache",)))
    if not distributed.is_main():
      return follower(model)
    from glmjax.serving.follow import Channel
    channel = Channel() if distributed.process_count() > 1 else None
    server = create_app(model, FLAGS.max_batch, FLAGS.max_queue, FLAGS.served_name,
                        FLAGS.kv_cache_gb, guard, FLAGS.prefix_cache, channel, origins,
                        FLAGS.warm_prefill)
  except glmjax.GlmjaxError as e:
    print(f"error: {e}", file=sys.stderr)
    distributed.exit_now(1)  # several processes: the others' next collective fails
    return 1
  if not keys and not is_loopback(FLAGS.host):
    print(f"warning: serving on {FLAGS.host} without an API key: anyone who can reach this "
          "address can use the model (set --api_key or GLMJAX_API_KEY)", file=sys.stderr)
  batch = server.state.scheduler.batch
  print(f"serving {server.state.model_name} ({model!r}) on http://{FLAGS.host}:{FLAGS.port}"
        f"/v1, batch {FLAGS.max_batch}, queue {FLAGS.max_queue}, KV cache "
        f"{batch.kv_bytes / 2**30:.2f} GB ({batch.capacity_tokens} tokens at most per request)"
        f"{', API key required' if keys else ''}",
        flush=True)
  try:
    config = transport.server_config(server, FLAGS.host, FLAGS.port, FLAGS.read_timeout_s)
    transport.escape_logs()  # after the config, which sets uvicorn's log handlers up
    uvicorn.Server(config).run()
  except KeyboardInterrupt:  # the signal that stopped the server, raised again once it shut
    pass  # down (uvicorn.run, which this replaces, swallows it the same way)
  finally:
    server.state.scheduler.close()
    model.close()
  if server.state.scheduler.dead:  # e.g. a follower died (PeerError): no shutdown barrier
    print(f"error: {server.state.scheduler.dead}", file=sys.stderr)
    distributed.exit_now(1)
    return 1
  return 0


def follower(model) -> int:
  """Processes 1..n-1: follow process 0's batch operations until it stops the server."""
  from glmjax.serving.follow import Channel, follow
  try:
    code = follow(model, Channel())
  finally:
    model.close()
  if code:  # process 0 is gone: leave without the shutdown barrier
    distributed.exit_now(code)
  return code


if __name__ == "__main__":
  app.run(main)
