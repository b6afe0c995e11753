"""The README's commands, run as a new user runs them: default flags, as subprocesses."""

import os
import re
import shlex
import subprocess
import sys

import jax
import numpy as np

import glmjax
from glmjax.formats import embedded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def bash_blocks(section: str) -> list[str]:
  """The ```bash blocks under the README heading `section`."""
  body = README.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```bash\n(.*?)```", body, re.S)


def run(argv, timeout=600):
  return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def python_part(command: str) -> list[str]:
  """The `python ...` command after `pip install ... &&` (the install is the test runner's)."""
  argv = shlex.split(command.split("&&")[-1])
  assert argv[0] == "python"
  return [sys.executable, *argv[1:]]


def test_quick_start_commands():
  generate, test = [b.strip() for b in bash_blocks("Quick start (fresh machine)")]
  assert generate.startswith("pip install -e . && python scripts/generate.py")
  r = run(python_part(generate))
  assert r.returncode == 0, r.stderr
  assert "tok/s" in r.stdout and len(r.stdout.split("\n")[0]) > len("def ")
  # The summary names the dense format dtype="auto" chose on this CPU (the embedded model's
  # weights are stored bfloat16, so they stay so), and its bytes.
  assert re.search(r"\| dense bfloat16 0\.01 GB \|", r.stdout), r.stdout[-500:]
  # CI runs exactly the README's test command.
  ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
  assert test in ci.splitlines()


def test_full_size_commands_with_defaults_on_the_embedded_model(tmp_path):
  """The 'Running a full-size GLM-5' lines, paths swapped for the embedded model and a temp dir."""
  convert, generate = bash_blocks("Running a full-size GLM-5")[0].strip().splitlines()
  src, dst = embedded.ensure(progress=False), str(tmp_path / "store")
  swap = lambda c: c.replace("/models/GLM-5-FP8", src).replace("/nvme/glm5-int4", dst)
  r = run(python_part(swap(convert)))
  assert r.returncode == 0, r.stderr
  r = run(python_part(swap(generate)))
  assert r.returncode == 0, r.stderr
  assert "tok/s" in r.stdout and "experts: all resident" in r.stdout  # automatic budgets


def heldout_tokens(model, n=384) -> np.ndarray:
  import json
  path = os.path.join(os.path.dirname(json.__file__), "encoder.py")
  ids = model.tokenizer.encode(open(path, encoding="utf-8").read())[:n]
  assert len(ids) == n
  return np.asarray([ids], np.int32)


def test_default_store_close_to_float_model(embedded_store):
  """Default conversion (int4 experts, bf16 dense): KL ≤ 5e-3 nats/token against the float
  embedded model on held-out code (the stdlib's json/encoder.py)."""
  ref = glmjax.load(progress=False)
  toks = heldout_tokens(ref)
  lp = jax.nn.log_softmax(ref.score(toks)[0], -1)
  with glmjax.load(embedded_store, progress=False) as store:
    lq = jax.nn.log_softmax(store.score(toks)[0], -1)
  kl = float(np.mean(np.sum(np.exp(lp) * (lp - lq), -1)))
  assert 0 < kl <= 5e-3, kl
