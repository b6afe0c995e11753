"""Routing traces: which experts each position chose at each MoE layer, on disk.

A trace is one directory (format 1):

    trace.json       manifest, written last: format, model config, moe_layers, n_experts,
                     top_k, expert_bytes, recording options, live-run extras
    ids/             int32 [N, L, K] top-k expert ids in rank order
    weights/         float32 [N, L, K] their router weights
    tokens/          int32 [N]
    steps/           int64 [N] forward pass of each position (positions of one pass share it)
    seq_starts/      int64 [S+1] sequence boundaries, offsets into N
    scores/, score_ids/        optional float32 / int32 [N, L, M]: the router's sigmoid
                     scores' top-M, ranked by the biased routing score
    pilot/, pilot_scores/      optional int32 / float32 [N, L, P]: layer j's experts as
                     predicted one layer early (row j = 0 is all -1)

Every array is a zarr v3 array (tensorstore "zarr3" driver, file kvstore) chunked along N, so
any zarr v3 reader can open one without glmjax. There are no padding rows: N is exact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import numpy as np

from glmjax.errors import CheckpointError, InputError
from glmjax.formats import durable

FORMAT = 1
MANIFEST = "trace.json"
# dtype of each per-position array; rank-3 ones are [N, L, width].
DTYPES = {"ids": "int32", "weights": "float32", "tokens": "int32", "steps": "int64",
          "scores": "float32", "score_ids": "int32", "pilot": "int32", "pilot_scores": "float32"}
REQUIRED = ("ids", "weights", "tokens", "steps")
OPTIONAL = (("scores", "score_ids"), ("pilot", "pilot_scores"))
# Rows per chunk: at most 4096, fewer for wide rows so one chunk stays near 4 MiB.
_MAX_CHUNK_ROWS = 4096
_CHUNK_BYTES = 4 << 20


def _chunk_rows(row_bytes: int) -> int:
  rows = _MAX_CHUNK_ROWS
  while rows > 64 and rows * row_bytes > _CHUNK_BYTES:
    rows //= 2
  return rows


def _spec(path: str, dtype: str | None = None, shape=None, chunk_rows: int = 0) -> dict:
  """tensorstore spec of one trace array (with `shape`: the metadata to create it)."""
  spec: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}
  if shape is not None:
    chunk = [max(1, chunk_rows)] + [max(1, int(d)) for d in shape[1:]]
    spec["metadata"] = {
        "shape": [int(d) for d in shape], "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
        # ids compress several-fold; crc32c so a damaged chunk fails loudly instead of
        # replaying garbage.
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                   {"name": "zstd", "configuration": {"level": 3}}, {"name": "crc32c"}],
        "fill_value": 0}
  return spec


def _read(path: str, name: str) -> np.ndarray:
  import tensorstore as ts
  where = os.path.join(path, name)
  if not os.path.exists(os.path.join(where, "zarr.json")):
    raise CheckpointError(f"{where}: array {name!r} of the trace is missing")
  try:
    return np.asarray(ts.open(_spec(where)).result().read().result())
  except ValueError as e:
    raise CheckpointError(f"{where}: cannot read array {name!r}: {e}") from None


def _check_manifest(m: dict, where: str, err: type[Exception]) -> None:
  for key in ("moe_layers", "n_experts", "top_k"):
    if key not in m:
      raise err(f"{where}: manifest lacks {key!r}")
  if int(m["n_experts"]) < 1 or int(m["top_k"]) < 1:
    raise err(f"{where}: n_experts and top_k must be ≥ 1, got {m['n_experts']}/{m['top_k']}")


@dataclasses.dataclass(eq=False)
class Trace:
  """A routing trace in memory: numpy arrays plus the manifest fields.

  Treat it as immutable: request streams derived from it (see `glmjax.replay.simulate`) are
  cached on the object.
  """
  ids: np.ndarray                          # [N, L, K] int32, rank order
  weights: np.ndarray                      # [N, L, K] float32
  tokens: np.ndarray                       # [N] int32
  steps: np.ndarray                        # [N] int64
  seq_starts: np.ndarray                   # [S+1] int64
  n_experts: int
  moe_layers: list[int]
  expert_bytes: int = 0
  scores: np.ndarray | None = None         # [N, L, M] float32
  score_ids: np.ndarray | None = None      # [N, L, M] int32
  pilot: np.ndarray | None = None          # [N, L, P] int32, -1 where no prediction
  pilot_scores: np.ndarray | None = None   # [N, L, P] float32
  config: dict = dataclasses.field(default_factory=dict)
  options: dict = dataclasses.field(default_factory=dict)
  live: dict = dataclasses.field(default_factory=dict)
  _derived: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

  def __post_init__(self):
    for name, dtype in DTYPES.items():
      a = getattr(self, name)
      if a is not None:
        setattr(self, name, np.ascontiguousarray(a, dtype=dtype))
    self.seq_starts = np.ascontiguousarray(self.seq_starts, dtype=np.int64)
    self.n_experts, self.expert_bytes = int(self.n_experts), int(self.expert_bytes)
    self.moe_layers = [int(l) for l in self.moe_layers]
    self._validate()

  def _validate(self) -> None:
    ids, e = self.ids, self.n_experts
    if ids.ndim != 3:
      raise InputError(f"ids must be [N, L, K], got shape {ids.shape}")
    n, l, _ = ids.shape
    if e < 1:
      raise InputError(f"n_experts must be ≥ 1, got {e}")
    if len(self.moe_layers) != l:
      raise InputError(f"moe_layers has {len(self.moe_layers)} entries but ids has {l} layers")
    if ids.size and (ids.min() < 0 or ids.max() >= e):
      raise InputError(f"ids must lie in [0, {e}), got [{ids.min()}, {ids.max()}]")
    if self.weights.shape != ids.shape:
      raise InputError(f"weights shape {self.weights.shape} != ids shape {ids.shape}")
    for name in ("tokens", "steps"):
      if getattr(self, name).shape != (n,):
        raise InputError(f"{name} must be [{n}], got {getattr(self, name).shape}")
    if n and self.steps.min() < 0:
      raise InputError("steps must be ≥ 0")
    s = self.seq_starts
    if s.ndim != 1 or len(s) < 1 or s[0] != 0 or s[-1] != n or (n and np.any(np.diff(s) <= 0)):
      raise InputError(f"seq_starts must rise strictly from 0 to N={n}, got {s[:8]}...")
    for a, b in OPTIONAL:
      x, y = getattr(self, a), getattr(self, b)
      if (x is None) != (y is None):
        raise InputError(f"{a} and {b} come together: give both or neither")
      if x is None:
        continue
      if x.ndim != 3 or x.shape[:2] != (n, l) or y.shape != x.shape:
        raise InputError(f"{a}/{b} must be [{n}, {l}, width], got {x.shape}/{y.shape}")
      idname, lo = ("score_ids", 0) if a == "scores" else ("pilot", -1)  # -1: no prediction
      got = getattr(self, idname)
      if got.size and (got.min() < lo or got.max() >= e):
        raise InputError(f"{idname} must lie in [{lo}, {e}), got [{got.min()}, {got.max()}]")

  # --- shape -----------------------------------------------------------------------------

  @property
  def n_positions(self) -> int:
    return self.ids.shape[0]

  @property
  def n_layers(self) -> int:
    return self.ids.shape[1]

  @property
  def top_k(self) -> int:
    return self.ids.shape[2]

  def manifest(self) -> dict:
    """The trace.json document of this trace."""
    return {"format": FORMAT, "config": self.config, "moe_layers": self.moe_layers,
            "n_experts": self.n_experts, "top_k": self.top_k,
            "expert_bytes": self.expert_bytes, "options": self.options, "live": self.live}

  # --- construction ----------------------------------------------------------------------

  @classmethod
  def from_ids(cls, ids, *, n_experts: int | None = None, steps=None, expert_bytes: int = 0,
               weights=None, tokens=None, seq_starts=None, scores=None, score_ids=None,
               pilot=None, pilot_scores=None, moe_layers=None, config=None, options=None,
               live=None) -> "Trace":
    """A trace from top-k ids `[N, L, K]`. Defaults: each position its own step, one
    sequence, uniform weights 1/K, tokens 0, n_experts = max id + 1, moe_layers 0..L-1.
    `pilot` without `pilot_scores` gets zero scores (a uniform softmax)."""
    ids = np.asarray(ids)
    if ids.ndim != 3:
      raise InputError(f"ids must be [N, L, K], got shape {ids.shape}")
    n, l, k = ids.shape
    if pilot is not None and pilot_scores is None:
      pilot_scores = np.zeros(np.shape(pilot), np.float32)
    return cls(
        ids=ids,
        weights=np.full(ids.shape, 1.0 / max(k, 1), np.float32) if weights is None else weights,
        tokens=np.zeros(n, np.int32) if tokens is None else tokens,
        steps=np.arange(n) if steps is None else steps,
        seq_starts=np.array([0, n] if n else [0]) if seq_starts is None else seq_starts,
        n_experts=int(ids.max()) + 1 if n_experts is None else n_experts,
        moe_layers=list(range(l)) if moe_layers is None else moe_layers,
        expert_bytes=expert_bytes, scores=scores, score_ids=score_ids, pilot=pilot,
        pilot_scores=pilot_scores, config=dict(config or {}), options=dict(options or {}),
        live=dict(live or {}))

  @classmethod
  def open(cls, path: str) -> "Trace":
    """Reads the trace directory at `path`."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
      raise CheckpointError(f"{path}: no such trace directory")
    if not os.path.exists(mpath):
      raise CheckpointError(f"{path}: no {MANIFEST}: not a routing trace")
    try:
      with open(mpath, encoding="utf-8") as f:
        m = json.load(f)
    except (OSError, ValueError) as e:
      raise CheckpointError(f"{mpath}: corrupt manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
      raise CheckpointError(f"{mpath}: unsupported trace format "
                            f"{m.get('format') if isinstance(m, dict) else m!r}")
    _check_manifest(m, mpath, CheckpointError)
    arrays = {name: _read(path, name) for name in REQUIRED}
    arrays["seq_starts"] = _read(path, "seq_starts")
    for pair in OPTIONAL:
      present = [os.path.exists(os.path.join(path, p, "zarr.json")) for p in pair]
      if any(present):
        arrays.update({p: _read(path, p) for p in pair})  # a half pair fails in _read
    want = (len(m["moe_layers"]), int(m["top_k"]))
    for name, a in arrays.items():
      if a.dtype != np.dtype(DTYPES.get(name, "int64")):
        raise CheckpointError(f"{os.path.join(path, name)}: dtype {a.dtype}, "
                              f"expected {DTYPES.get(name, 'int64')}")
    for name in ("ids", "weights"):
      if arrays[name].ndim != 3 or arrays[name].shape[1:] != want:
        raise CheckpointError(f"{os.path.join(path, name)}: shape {arrays[name].shape} does "
                              f"not match the manifest's [N, {want[0]}, {want[1]}]")
    try:
      return cls(**arrays, n_experts=m["n_experts"], moe_layers=m["moe_layers"],
                 expert_bytes=m.get("expert_bytes", 0), config=m.get("config") or {},
                 options=m.get("options") or {}, live=m.get("live") or {})
    except InputError as e:
      raise CheckpointError(f"{path}: inconsistent trace: {e}") from None

  def save(self, path: str) -> None:
    """Writes the trace to the directory `path` (which must not exist) via a temporary
    sibling directory renamed into place, so `path` never holds a half-written trace."""
    widths = {a: getattr(self, a).shape[2] for a, _ in OPTIONAL if getattr(self, a) is not None}
    with TraceWriter(path, self.manifest(), self.n_positions, M=widths.get("scores"),
                     P=widths.get("pilot")) as w:
      s = self.seq_starts
      for a, b in zip(s[:-1], s[1:]):
        w.append(**{name: getattr(self, name)[a:b] for name in w.names})
        w.end_sequence()

  # --- the simulator's input -------------------------------------------------------------

  def step_index(self, per_token: bool = False) -> tuple[np.ndarray, int]:
    """([N] index of each position's step in step order, number of steps). With
    `per_token`, every position is its own step."""
    if per_token:
      return np.arange(self.n_positions), self.n_positions
    uniq, inv = np.unique(self.steps, return_inverse=True)
    return inv.reshape(-1), len(uniq)

  def union_csr(self, per_token: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The experts each (step, layer) read, flattened: (ids [T] int32, offsets [R+1] int64)
    with request r = step * L + j owning ids[offsets[r]:offsets[r+1]], sorted and unique."""
    key = ("union_csr", per_token)
    if key not in self._derived:
      s, n_steps = self.step_index(per_token)
      l, e = self.n_layers, self.n_experts
      # One int64 code per (step, layer, expert): np.unique sorts by request, then id.
      code = (s[:, None, None] * l + np.arange(l)[None, :, None]) * e + self.ids
      code = np.sort(code.reshape(-1))  # sort + dedupe: np.unique's hashing is far slower here
      code = code[np.concatenate([[True], code[1:] != code[:-1]])] if len(code) else code
      offsets = np.searchsorted(code // e, np.arange(n_steps * l + 1)).astype(np.int64)
      self._derived[key] = ((code % e).astype(np.int32), offsets)
    return self._derived[key]

  def step_unions(self, per_token: bool = False) -> list[list[np.ndarray]]:
    """Per step (in step order), per MoE layer: the sorted unique expert ids its positions
    chose (a forward of S tokens reads each of those experts once)."""
    ids, off = self.union_csr(per_token)
    if len(off) == 1:
      return []
    parts = np.split(ids, off[1:-1])
    l = self.n_layers
    return [parts[i:i + l] for i in range(0, len(parts), l)]


class TraceWriter:
  """Streams a trace to `path` in blocks of positions; usable as a context manager.

  Rows are buffered and written to preallocated zarr arrays of `capacity` rows whole chunks at
  a time (a one-row append never rewrites a chunk); `close()` shrinks the arrays to the rows
  written, writes seq_starts and the manifest, and renames the temporary sibling directory to
  `path`. `M`/`P`: widths of the optional scores/pilot arrays (absent when None).
  """

  def __init__(self, path: str, manifest: dict, capacity: int, M: int | None = None,
               P: int | None = None, chunk_rows: int | None = None):
    import tensorstore as ts
    _check_manifest(manifest, path, InputError)
    if os.path.lexists(path):
      raise InputError(f"{path}: already exists; a trace is never written over another")
    self.path = path
    self.manifest = {**manifest, "format": FORMAT}
    self.L, self.K = len(manifest["moe_layers"]), int(manifest["top_k"])
    e = int(manifest["n_experts"])
    widths = {"ids": self.K, "weights": self.K, "tokens": 0, "steps": 0}
    for (a, b), w in zip(OPTIONAL, (M, P)):
      if w is not None:
        if not 1 <= int(w) <= e:
          raise InputError(f"{path}: width of {a} must be in [1, {e}], got {w}")
        widths[a] = widths[b] = int(w)
    self.names = tuple(widths)
    self.capacity = max(int(capacity), 1)
    row_bytes = max(np.dtype(DTYPES[n]).itemsize * max(self.L * w, 1) for n, w in widths.items())
    self.chunk_rows = int(chunk_rows or _chunk_rows(row_bytes))
    # Built in a temporary sibling and renamed into place by close() (`formats.durable`; kill
    # points "trace.created", "trace.flush", "trace.publish"): a killed writer leaves nothing
    # at `path`, and the next writer of `path` removes its temporary.
    self._tmp = durable.staging_dir(path)
    self._shapes = {n: ((self.L, w) if w else ()) for n, w in widths.items()}
    try:
      self._arrays = {
          n: ts.open(_spec(os.path.join(self._tmp, n), DTYPES[n], (self.capacity, *shape),
                           self.chunk_rows), create=True).result()
          for n, shape in self._shapes.items()}
      durable.kill_point("trace.created")
    except BaseException:
      shutil.rmtree(self._tmp, ignore_errors=True)
      raise
    self._buf: dict[str, list[np.ndarray]] = {n: [] for n in self.names}
    self._n_buf = 0
    self._flushed = 0  # rows on disk; always a multiple of chunk_rows until close()
    self.rows = 0
    self._starts = [0]
    self._done = False

  def append(self, ids, weights, tokens, steps, scores=None, score_ids=None, pilot=None,
             pilot_scores=None) -> None:
    """Adds a block of n positions: ids/weights [n, L, K], tokens/steps [n], and the optional
    arrays [n, L, M] / [n, L, P] exactly when the writer was made with M / P."""
    given = dict(ids=ids, weights=weights, tokens=tokens, steps=steps, scores=scores,
                 score_ids=score_ids, pilot=pilot, pilot_scores=pilot_scores)
    n = int(np.shape(ids)[0]) if np.ndim(ids) else -1
    block = {}
    for name, a in given.items():
      if name not in self.names:
        if a is not None:
          raise InputError(f"{self.path}: {name} given but the writer was made without it")
        continue
      if a is None:
        raise InputError(f"{self.path}: {name} missing from append")
      a = np.asarray(a, dtype=DTYPES[name])
      if a.shape != (n, *self._shapes[name]):
        raise InputError(f"{self.path}: {name} must be {[n, *self._shapes[name]]}, "
                         f"got {list(a.shape)}")
      block[name] = a
    if n == 0:
      return
    if self.rows + n > self.capacity:  # zarr shape is metadata: growing costs nothing
      self._resize(max(2 * self.capacity, self.rows + n))
    for name, a in block.items():
      self._buf[name].append(a)
    self._n_buf += n
    self.rows += n
    if self._n_buf >= self.chunk_rows:
      self._flush(final=False)

  def end_sequence(self) -> None:
    """Marks the end of a sequence at the rows written so far (no-op for an empty one)."""
    if self.rows > self._starts[-1]:
      self._starts.append(self.rows)

  def _resize(self, rows: int) -> None:
    futures = [a.resize(exclusive_max=[rows] + [None] * (a.rank - 1), resize_metadata_only=True)
               for a in self._arrays.values()]
    self._arrays = dict(zip(self._arrays, (f.result() for f in futures)))
    self.capacity = rows

  def _flush(self, final: bool) -> None:
    n = self._n_buf if final else self._n_buf // self.chunk_rows * self.chunk_rows
    if n == 0:
      return
    futures = []
    for name, parts in self._buf.items():
      data = np.concatenate(parts) if len(parts) > 1 else parts[0]
      futures.append(self._arrays[name][self._flushed:self._flushed + n].write(data[:n]))
      self._buf[name] = [data[n:]] if n < len(data) else []
    for f in futures:
      f.result()
    self._flushed += n
    self._n_buf -= n
    durable.kill_point("trace.flush")

  def close(self) -> None:
    """Finishes the trace and moves it to `path`. Idempotent."""
    import tensorstore as ts
    if self._done:
      return
    try:
      self._flush(final=True)
      self._resize(self.rows)
      self.end_sequence()
      starts = np.asarray(self._starts, np.int64)
      ts.open(_spec(os.path.join(self._tmp, "seq_starts"), "int64", starts.shape,
                    len(starts)), create=True).result().write(starts).result()
      with open(os.path.join(self._tmp, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(self.manifest, f, indent=1)
      durable.publish_dir(self._tmp, self.path, point="trace.publish")
      self._done = True
    except BaseException:
      self.abort()
      raise

  def abort(self) -> None:
    """Drops everything written; nothing is left at `path`."""
    self._done = True
    shutil.rmtree(self._tmp, ignore_errors=True)

  def __enter__(self) -> "TraceWriter":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
    else:
      self.abort()
