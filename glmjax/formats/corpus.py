"""The embedded model's corpus: the Python standard library's own source, with a fixed held-out split.

Everything here is stdlib-only and deterministic: the file list is sorted, the held-out modules
are named (they exist in CPython 3.10 to 3.13), and the bits-per-byte helpers define the metric
quoted in DESIGN.md §25 (total NLL in bits over a file's tokens / the file's UTF-8 bytes).
"""

from __future__ import annotations

import math
import os
import sysconfig
from typing import Callable, Iterable, Sequence

import numpy as np

# Held out of tokenizer and model training. Paths relative to the stdlib root.
HELD_OUT = (
    "json/decoder.py", "textwrap.py", "argparse.py", "fractions.py", "heapq.py", "shlex.py",
    "colorsys.py", "glob.py", "calendar.py", "sched.py",
)
# A small fixed slice of the held-out set, for fast tests.
HELD_OUT_SMALL = ("json/decoder.py", "shlex.py", "colorsys.py")

_SKIP_DIRS = ("test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
              "lib2to3", "ensurepip", "_vendor")
MAX_FILE_BYTES = 300_000  # skips generated tables and other outliers


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
  """Sorted stdlib-relative paths of every usable `.py` file (test suites and huge files skipped)."""
  root = root or stdlib_root()
  out = []
  for d, dirs, files in os.walk(root):
    dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("."))
    for f in files:
      if not f.endswith(".py"):
        continue
      full = os.path.join(d, f)
      if os.path.getsize(full) > MAX_FILE_BYTES:
        continue
      out.append(os.path.relpath(full, root).replace(os.sep, "/"))
  return sorted(out)


def read(rel: str, root: str | None = None) -> str | None:
  """The file's text, or None when it is not valid UTF-8."""
  try:
    with open(os.path.join(root or stdlib_root(), rel), encoding="utf-8") as f:
      return f.read()
  except (UnicodeDecodeError, OSError):
    return None


def split(root: str | None = None) -> tuple[list[str], list[str]]:
  """(train, held_out) relative paths; held_out keeps the HELD_OUT order, missing ones dropped."""
  files = stdlib_files(root)
  held = set(HELD_OUT)
  train = [f for f in files if f not in held]
  present = set(files)
  return train, [f for f in HELD_OUT if f in present]


def train_sample(seed: int = 0, root: str | None = None) -> list[str]:
  """The training split in a fixed shuffled order (calibration reads a prefix of it: the
  first files of the sorted list are all `_`-prefixed private modules)."""
  train = split(root)[0]
  return [train[i] for i in np.random.default_rng(seed).permutation(len(train))]


def texts_at(path: str) -> list[tuple[str, str]]:
  """(name, text) of a user corpus, in a fixed order: a directory of text files (recursively,
  sorted; files that are not UTF-8 skipped), one text file, or a JSONL file (`.jsonl`: one
  object per line with a "text" field; name `FILE:LINE`)."""
  import json
  from glmjax.errors import InputError
  if os.path.isfile(path) and path.endswith(".jsonl"):
    out = []
    with open(path, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        if line.strip():
          try:
            out.append((f"{path}:{n}", str(json.loads(line)["text"])))
          except (ValueError, KeyError, TypeError):
            raise InputError(f"{path}: line {n} is not a JSON object with a \"text\" field"
                             ) from None
    if not out:
      raise InputError(f"--corpus {path}: no texts")
    return out
  if os.path.isfile(path):
    files = [path]
  elif os.path.isdir(path):
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
  else:
    raise InputError(f"--corpus {path}: no such file or directory")
  out = []
  for f in files:
    try:
      with open(f, encoding="utf-8") as fh:
        out.append((f, fh.read()))
    except UnicodeDecodeError:
      continue  # not text
  if not out:
    raise InputError(f"--corpus {path}: no UTF-8 text files")
  return out


def rows_of(sequences: Sequence[np.ndarray], seq: int, limit: int):
  """(tokens [seq] padded with 0, real length, last row of its sequence) in order, `limit`
  positions at most (0: all): each sequence cut into rows of `seq` tokens."""
  left = limit or sum(len(s) for s in sequences)
  for ids in sequences:
    for start in range(0, len(ids), seq):
      if left <= 0:
        return
      chunk = ids[start:start + seq][:left]
      row = np.zeros(seq, np.int32)
      row[:len(chunk)] = chunk
      left -= len(chunk)
      yield row, len(chunk), start + seq >= len(ids) or left <= 0


REPO_HELD_OUT = ("api.py", "model/attention.py", "formats/checkpoint.py", "model/config.py",
                 "model/layers.py", "model/forward.py", "model/moe.py", "model/weights.py",
                 "decoding/text.py", "decoding/sampling.py")


def non_stdlib_files() -> list[str]:
  """Non-stdlib Python never trained on: this repo's own modules in REPO_HELD_OUT (absolute paths).

  JAX array code with type hints and long docstrings, a different style from the stdlib.
  """
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the glmjax package
  return [os.path.join(here, f) for f in REPO_HELD_OUT if os.path.exists(os.path.join(here, f))]


def numpy_files(n: int = 10) -> list[str]:
  """A fixed sample of the installed numpy package's Python source (absolute paths).

  Chosen deterministically: sorted non-test `.py` files between 4 and 60 kB, every k-th one.
  """
  import numpy
  root = os.path.dirname(numpy.__file__)
  out = []
  for d, dirs, files in os.walk(root):
    dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
    for f in sorted(files):
      full = os.path.join(d, f)
      if f.endswith(".py") and 4_000 <= os.path.getsize(full) <= 60_000:
        out.append(full)
  out.sort()
  step = max(len(out) // n, 1)
  return out[::step][:n]


# --- bits per byte ---------------------------------------------------------------------------

def windows(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
  """Scoring windows over a stream of `n_tokens` predicted positions.

  Returns (start, end, first_scored) triples: the model sees tokens [start, end) and scores the
  predictions for positions [first_scored, end) (each position scored exactly once, with at
  least `context - stride` tokens of left context after the first window).
  """
  stride = max(1, min(stride, context))
  out = []
  end = min(context, n_tokens)
  out.append((0, end, 0))
  while end < n_tokens:
    new_end = min(end + stride, n_tokens)
    out.append((max(new_end - context, 0), new_end, end))
    end = new_end
  return out


def file_nll_bits(score: Callable[[np.ndarray], np.ndarray], ids: Sequence[int], context: int,
                  stride: int, batch: int = 8) -> float:
  """Total NLL in bits of `ids[1:]` given their prefixes, scored in windows.

  `score` maps int32 tokens `[B, S]` to log-probabilities `[B, S, V]` (any equal-length batch).
  `ids[0]` is the document separator and is not itself scored.
  """
  ids = np.asarray(ids, np.int32)
  n = len(ids) - 1  # predicted positions 1..n, input positions 0..n-1
  wins = windows(n, context, stride)
  total = 0.0
  # group equal-length windows into batches
  by_len: dict[int, list] = {}
  for w in wins:
    by_len.setdefault(w[1] - w[0], []).append(w)
  for length, group in by_len.items():
    for i in range(0, len(group), batch):
      chunk = group[i:i + batch]
      x = np.stack([ids[s:e] for s, e, _ in chunk])
      logp = np.asarray(score(x))
      for row, (s, e, first) in enumerate(chunk):
        tgt = ids[s + 1:e + 1]
        lp = np.take_along_axis(logp[row], tgt[:, None], axis=-1)[:, 0]
        total -= float(np.sum(lp[first - s:]))
  return total / math.log(2)


def bits_per_byte(score, texts: Iterable[str], encode: Callable[[str], list[int]], sep_id: int,
                  context: int, stride: int, batch: int = 8) -> dict:
  """Aggregate bits/byte of `texts`: Σ NLL bits / Σ UTF-8 bytes (each text prefixed by sep_id)."""
  bits, nbytes, ntok = 0.0, 0, 0
  for text in texts:
    ids = [sep_id] + encode(text)
    bits += file_nll_bits(score, ids, context, stride, batch)
    nbytes += len(text.encode("utf-8"))
    ntok += len(ids) - 1
  return {"bits_per_byte": bits / max(nbytes, 1), "bytes": nbytes, "tokens": ntok,
          "bits_per_token": bits / max(ntok, 1)}
