"""The server's transport: uvicorn's settings, a deadline on a request's headers, the CORS
allowlist and log records with CR/LF escaped. scripts/serve.py and the tests build their uvicorn
server through `server_config`, so both run the same transport.

Slow clients: a connection must deliver a request's headers within `read_timeout_s` of opening
(or of its previous response ending), else it is closed (`HeaderDeadline`); the body then has
`read_timeout_s` more (glmjax.serving.guard: a 408, then the connection is closed). Between
requests a keep-alive connection idles `KEEP_ALIVE_S` at most (uvicorn's own timer). Headers
are capped at `MAX_HEADER_BYTES` in all (`HeaderCap`: a 431, then the connection is closed).
"""

from __future__ import annotations

import functools
import logging
import re

from glmjax.errors import InputError

DEFAULT_READ_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 5
MAX_HEADER_BYTES = 16 << 10  # h11's default incomplete-event cap, named here
# An origin as browsers send it: scheme://host[:port], nothing after.
_ORIGIN = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+")


def cors_origins(spec: str | None) -> tuple[str, ...]:
  """The exact origins of `--cors_origins` (comma-separated). A wildcard is refused: a browser
  page from any site could then drive the model with the user's network position."""
  origins = tuple(o.strip().rstrip("/") for o in (spec or "").split(",") if o.strip())
  for o in origins:
    if o == "*" or "*" in o:
      raise InputError("--cors_origins: a wildcard is refused; name each origin "
                       "(scheme://host[:port])")
    if not _ORIGIN.fullmatch(o):
      raise InputError(f"--cors_origins: {o!r} is not an origin (scheme://host[:port])")
  return origins


def with_cors(app, origins: tuple[str, ...]):
  """`app` behind Starlette's CORSMiddleware for exactly `origins` (none: `app` unchanged, so
  preflights stay unanswered: 405 and no CORS header). No credentials: the API key travels in
  a header the page sets itself, never in cookies."""
  if not origins:
    return app
  from starlette.middleware.cors import CORSMiddleware
  app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                     allow_headers=["authorization", "content-type", "x-api-key",
                                    "anthropic-version"], allow_credentials=False, max_age=600)
  return app


class HeaderCap:
  """ASGI middleware: a request whose headers (names, values and target) exceed `max_bytes`
  gets 431 and the connection is closed. h11's own cap covers only headers still incomplete
  in its buffer: a whole request that arrives in one read (64 kB) passes it."""

  def __init__(self, app, max_bytes: int = MAX_HEADER_BYTES):
    self.app = app
    self.max_bytes = max_bytes

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http":
      size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
      size += sum(len(k) + len(v) + 4 for k, v in scope["headers"])
      if size > self.max_bytes:
        from starlette.responses import JSONResponse
        body = {"error": {"message": f"the request's headers exceed {self.max_bytes} bytes",
                          "type": "invalid_request_error", "param": None,
                          "code": "headers_too_large"}}
        await JSONResponse(body, 431, headers={"connection": "close"})(scope, receive, send)
        return
    await self.app(scope, receive, send)


def _header_deadline_class():
  from uvicorn.protocols.http.h11_impl import H11Protocol

  class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers: armed when the
    connection opens and when a response ends, disarmed when a request's headers are in.
    A client that never finishes its headers (slow-loris) loses the connection."""

    def __init__(self, *args, header_timeout_s: float = DEFAULT_READ_TIMEOUT_S, **kw):
      super().__init__(*args, **kw)
      self._header_timeout_s = header_timeout_s
      self._deadline = None

    def _arm(self) -> None:
      self._disarm()
      self._deadline = self.loop.call_later(self._header_timeout_s, self._expired)

    def _disarm(self) -> None:
      if self._deadline is not None:
        self._deadline.cancel()
        self._deadline = None

    def _reading_headers(self) -> bool:
      return self.cycle is None or self.cycle.response_complete

    def _expired(self) -> None:
      self._deadline = None
      if self._reading_headers() and not self.transport.is_closing():
        self.transport.close()

    def connection_made(self, transport) -> None:
      super().connection_made(transport)
      self._arm()

    def connection_lost(self, exc) -> None:
      self._disarm()
      super().connection_lost(exc)

    def handle_events(self) -> None:
      super().handle_events()
      if not self._reading_headers():  # a request's headers came: the body has its own timer
        self._disarm()

    def on_response_complete(self) -> None:
      self._arm()
      super().on_response_complete()  # may start a pipelined request (handle_events disarms)

  return HeaderDeadline


def server_config(app, host: str, port: int, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                  log_level: str = "warning"):
  """uvicorn's Config for `app`: the h11 protocol with the header deadline, the keep-alive
  and header-size caps above."""
  import uvicorn
  if not read_timeout_s > 0:
    raise InputError(f"read_timeout_s must be > 0, got {read_timeout_s}")
  protocol = functools.partial(_header_deadline_class(), header_timeout_s=read_timeout_s)
  return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                        timeout_keep_alive=KEEP_ALIVE_S,
                        h11_max_incomplete_event_size=MAX_HEADER_BYTES)


class EscapeNewlines(logging.Filter):
  """Escapes CR and LF in a record's message (CWE-117, log forging): a line of the log is one
  record, whatever a client put in a value the message quotes. Tracebacks (exc_info) are the
  server's own text and keep their lines."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if "\r" in message or "\n" in message:
      record.msg = message.replace("\r", "\\r").replace("\n", "\\n")
      record.args = None
    return True


def escape_logs(names=("", "uvicorn", "uvicorn.error", "uvicorn.access", "absl")) -> None:
  """Puts `EscapeNewlines` on the handlers of the named loggers (and the root's), where it
  sees every record they write."""
  for name in names:
    for handler in logging.getLogger(name).handlers:
      if not any(isinstance(f, EscapeNewlines) for f in handler.filters):
        handler.addFilter(EscapeNewlines())
