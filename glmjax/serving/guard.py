"""What stands between the network and the model: API keys, the bind's allowed hosts, and the
request body (JSON only, size-capped, parsed off the event loop).

A browser on the same machine can be made to POST to `localhost` by any web page; only a JSON
content type (which needs a CORS preflight the server grants only to the origins of
`--cors_origins`, none by default) and a loopback `Host` header (which a DNS-rebinding page
cannot send) keep such requests out. A body must arrive within `read_timeout_s` (slow-loris:
a 408, and the connection is closed; glmjax.serving.transport bounds the headers).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from glmjax.errors import InputError
from glmjax.serving.protocol import ApiError
from glmjax.serving.transport import DEFAULT_READ_TIMEOUT_S

DEFAULT_MAX_BODY_MB = 8
KEY_ENV = "GLMJAX_API_KEY"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
  """True for a loopback address or name (the default bind)."""
  host = host.strip("[]").lower()
  if host in LOOPBACK_NAMES or host.endswith(".localhost"):
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def api_keys(key: str | None = None, key_file: str | None = None) -> tuple[str, ...]:
  """The accepted keys: `key` (comma-separated), else the file `key_file` (one per line), else
  the GLMJAX_API_KEY environment variable; () when none is set (no authentication)."""
  if key_file:
    try:
      with open(key_file, encoding="utf-8") as f:
        text = f.read()
    except OSError as e:
      raise InputError(f"--api_key_file {key_file}: {e.strerror}") from None
    keys = [line.strip() for line in text.splitlines()]
  else:
    keys = (key if key is not None else os.environ.get(KEY_ENV, "")).split(",")
  keys = tuple(k.strip() for k in keys if k.strip())
  if key_file and not keys:
    raise InputError(f"--api_key_file {key_file}: holds no key")
  return keys


class Guard:
  """Checks a request before the app reads it: `keys` (none: open), `loopback` (the server is
  bound to a loopback address: foreign Host headers are refused), `max_body_bytes`, and
  `read_timeout_s` for the whole body to arrive."""

  def __init__(self, keys: tuple[str, ...] = (), loopback: bool = True,
               max_body_bytes: int = DEFAULT_MAX_BODY_MB << 20,
               read_timeout_s: float = DEFAULT_READ_TIMEOUT_S):
    if max_body_bytes < 1:
      raise InputError(f"max_body_mb must be > 0, got {max_body_bytes / 2 ** 20}")
    if not read_timeout_s > 0:
      raise InputError(f"read_timeout_s must be > 0, got {read_timeout_s}")
    self.keys = tuple(k.encode() for k in keys)
    self.loopback = loopback
    self.max_body_bytes = max_body_bytes
    self.read_timeout_s = read_timeout_s

  def admit(self, request: Request, needs_key: bool = True) -> None:
    """403 for a foreign Host on a loopback bind, 401 for a missing or wrong key."""
    if self.loopback:
      host = request.headers.get("host", "")
      name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
      if host and not is_loopback(name):
        raise ApiError(403, f"Host {host!r} is not a loopback name; this server is bound to a "
                       "loopback address", None, "forbidden_host", "permission_error")
    if needs_key and self.keys and not self._key_ok(request):
      raise ApiError(401, "a valid API key is required (Authorization: Bearer <key>, or "
                     "X-Api-Key)", None, "invalid_api_key", "authentication_error")

  def _key_ok(self, request: Request) -> bool:
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    given = (given or request.headers.get("x-api-key", "")).encode()
    ok = False
    for key in self.keys:  # every key compared, each in constant time
      ok |= hmac.compare_digest(given, key)
    return ok

  async def json_body(self, request: Request) -> dict:
    """The request's JSON object: 415 unless application/json, 413 beyond the size cap, 408
    (closing the connection) when it has not all come within the read timeout, 400 for
    anything that is not a JSON object. Parsed on a worker thread."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
      raise ApiError(415, f"the request body must be application/json, got {kind or 'none'!r}",
                     None, "unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
      raise self._too_large()
    try:
      raw = await asyncio.wait_for(self._read(request), self.read_timeout_s)
    except asyncio.TimeoutError:
      raise ApiError(408, f"the request body did not arrive within {self.read_timeout_s} s",
                     None, "request_timeout", headers={"connection": "close"}) from None
    except ClientDisconnect:
      raise ApiError(499, "the client went away", None, "client_closed") from None
    return await run_in_threadpool(parse_json, raw)

  async def _read(self, request: Request) -> bytes:
    raw = bytearray()
    async for part in request.stream():
      raw += part
      if len(raw) > self.max_body_bytes:
        raise self._too_large()
    return bytes(raw)

  def _too_large(self) -> ApiError:
    return ApiError(413, f"the request body exceeds {self.max_body_bytes} bytes (--max_body_mb)",
                    None, "body_too_large")


def parse_json(raw: bytes) -> dict:
  """A JSON object from `raw`, or a 400 (deep nesting included)."""
  try:
    body = json.loads(raw)
  except (ValueError, UnicodeDecodeError, RecursionError) as e:
    raise ApiError(400, f"the request body is not valid JSON: {type(e).__name__}: "
                   f"{str(e)[:200]}", None, "invalid_json") from None
  if not isinstance(body, dict):
    raise ApiError(400, "the request body must be a JSON object", None, "invalid_type")
  return body
