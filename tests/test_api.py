"""The public API on the embedded default model, and scripts/generate.py end to end."""

import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glmjax
from glmjax.errors import GlmjaxError, InputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model():
  return glmjax.load(progress=False)


def test_embedded_model_exercises_every_feature(model):
  cfg = model.config
  assert {"dense", "sparse"} == set(cfg.mlp_layer_types)
  assert {"full", "shared"} == set(cfg.indexer_types)
  assert cfg.index_topk < 1024  # smaller than the context, so DSA selection really runs
  assert cfg.n_group > 1 and len(model.weights.mtp) == 1


def test_generate_greedy_is_deterministic_and_consistent(model):
  prompt = list(range(3, 203))  # 200 tokens: longer than index_topk, so DSA selection runs
  assert len(prompt) > 1.5 * model.config.index_topk
  a = model.generate(prompt, 12, stop_ids=[])
  b = model.generate(prompt, 12, stop_ids=[])
  assert a.tokens == b.tokens and len(a.tokens) == 12
  assert all(isinstance(t, int) for t in a.tokens)
  for key in ("decode_tok_s", "prefill_s", "compile_s", "decode_compile_s", "prompt_tokens",
              "new_tokens"):
    assert isinstance(a.stats[key], float)
  assert a.stats["decode_tok_s"] > 0 and a.stats["new_tokens"] == 12
  # The first run compiles its steps; compile time (nested trace events counted once) is
  # taken out of the prefill time, which stays a time.
  assert a.stats["compile_s"] > 0 and a.stats["prefill_s"] >= 0 and b.stats["prefill_s"] >= 0
  # Greedy cached decoding picks the argmax of the teacher-forced logits at each position.
  logits = model.score(np.asarray([prompt + a.tokens]))
  np.testing.assert_array_equal(logits[0, len(prompt) - 1:-1].argmax(-1), a.tokens)


def test_compile_clock_counts_nested_events_once():
  """Nested compile events (an inner jit traced within an outer trace) overlap in time; the
  clock counts the union of their intervals, as a plain loop over the seconds would."""
  from glmjax.runtime.clock import CompileClock
  clock = CompileClock()
  clock._spans = [(0.0, 3.0), (1.0, 2.0), (2.5, 4.0), (5.0, 6.0), (5.5, 5.75)]
  covered = sum(1 for i in range(600) if any(a <= i / 100 < b for a, b in clock._spans))
  assert clock.seconds == pytest.approx(covered / 100) == pytest.approx(5.0)


def test_generate_stops_at_stop_token(model):
  prompt = list(range(3, 20))
  free = model.generate(prompt, 6, stop_ids=[])
  stop = free.tokens[3]
  r = model.generate(prompt, 6, stop_ids=[stop])
  first = free.tokens.index(stop)
  assert r.tokens == free.tokens[:first] and r.stop_reason == "stop_token"


@pytest.mark.parametrize("call, message", [
    (lambda m: m.score([[1, 2, 5000]]), "outside the vocabulary"),
    (lambda m: m.score([1, 2, 3]), "shape"),
    (lambda m: m.score([[0.5, 1.0]]), "integer"),
    (lambda m: m.generate([], 4), "non-empty"),
    (lambda m: m.generate([1, 2], -1), "max_new_tokens"),
    (lambda m: m.generate([1, 2], 10**7), "max_context"),
    (lambda m: m.generate([1, 2], 3, temperature=-1.0), "temperature"),
])
def test_bad_inputs(model, call, message):
  with pytest.raises(InputError, match=message):
    call(model)


def test_bad_options():
  with pytest.raises(InputError, match="unknown option"):
    glmjax.load(None, devcie_cache_gb=3)
  with pytest.raises(InputError, match="moe_kernel"):
    glmjax.load(None, moe_kernel="cuda")
  with pytest.raises(InputError, match="expert_compute"):
    glmjax.load(None, expert_compute="gpu")
  with pytest.raises(InputError, match="need an expert store"):
    glmjax.load(None, expert_compute="host")  # the embedded model is an HF checkpoint


def _run(*args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py"), *args],
                        capture_output=True, text=True, timeout=300, env=os.environ.copy())


def test_generate_script(model, tmp_path):
  out = tmp_path / "gen.json"
  r = _run("--prompt_ids=5,6,7,8", "--max_new_tokens=5", "--temperature=0", f"--json={out}")
  assert r.returncode == 0, r.stderr
  lines = r.stdout.strip().splitlines()
  want = model.generate([5, 6, 7, 8], 5).tokens
  assert lines[-2].split() == [str(t) for t in want]
  assert "tok/s" in lines[-1] and lines[-1].startswith(f"{len(want)} tokens")
  got = json.loads(out.read_text())  # --json: one process, no mesh
  assert got["tokens"] == want and got["mesh"] is None and isinstance(got["text"], str)
  assert got["stats"]["new_tokens"] == len(want) and got["stop_reason"] == "max_new_tokens"


def test_generate_script_bad_input_is_clean():
  r = _run("--prompt_ids=5,banana")
  assert r.returncode == 1
  assert "error: --prompt_ids" in r.stderr and "Traceback" not in r.stderr
  r = _run("--model=/does/not/exist")
  assert r.returncode == 1 and "not found" in r.stderr and "Traceback" not in r.stderr
  r = _run("--mesh=experts:2")
  assert r.returncode == 1 and "unknown" in r.stderr and "Traceback" not in r.stderr
  r = _run("--mesh=expert:3")  # one CPU device here
  assert r.returncode == 1 and "needs 3 devices" in r.stderr and "Traceback" not in r.stderr


def test_load_turns_the_persistent_compile_cache_on(tmp_path):
  """A fresh process: `compile_cache=False` leaves JAX's cache off; a default load turns it
  on in $GLMJAX_CACHE, and the steps a generation compiles land there, small ones included.
  An already configured directory is kept."""
  code = (
      "import jax, os, glmjax\n"
      "m = glmjax.load(progress=False, compile_cache=False)\n"
      "assert not jax.config.jax_compilation_cache_dir\n"
      "m = glmjax.load(progress=False)\n"
      "assert jax.config.jax_compilation_cache_dir == os.environ['GLMJAX_CACHE']\n"
      "m.generate('def', 2)\n"
      "from glmjax.runtime import compile_cache\n"
      "assert compile_cache.enable('/elsewhere') == os.environ['GLMJAX_CACHE']\n")
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["GLMJAX_CACHE"] = str(tmp_path / "xla")
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert len(os.listdir(tmp_path / "xla")) >= 5  # every step of the generation, however small


def _compile_tiny(n: int) -> list:
  """`n` distinct tiny executables (each of its own shape), kept alive by JAX's caches."""
  return [jax.jit(lambda x: x * 3 + 1)(jnp.ones((i + 1, 3))) for i in range(n)]


def test_map_pressure_drops_compiled_executables(monkeypatch):
  """Compiled executables hold memory mappings until JAX's caches drop them: 100 of them take
  at least one each (~3, but the kernel merges neighbouring mappings: 185 in one suite run);
  under the threshold nothing is cleared, past it the caches are cleared and at least half of
  what they took comes back (a worker that kept them all crashed in XLA at vm.max_map_count)."""
  from glmjax.runtime import compile_cache
  start = compile_cache.mappings()
  if start is None:
    pytest.skip("no /proc/self/maps on this platform")
  _compile_tiny(100)
  grown = compile_cache.mappings()[0]
  added = grown - start[0]
  assert added >= 100
  compile_cache.relieve_map_pressure(fraction=(grown + 100) / start[1])  # under: kept
  assert compile_cache.mappings()[0] >= grown - 10
  with pytest.warns(RuntimeWarning, match="memory mappings"):
    compile_cache.relieve_map_pressure(fraction=(grown - 100) / start[1])
  assert compile_cache.mappings()[0] <= grown - added // 2


def test_map_pressure_that_clearing_cannot_relieve_is_an_error(monkeypatch):
  """A process still near the limit after the caches were cleared gets a GlmjaxError naming
  the limit, rather than the crash of XLA's next compile."""
  from glmjax.runtime import compile_cache
  monkeypatch.setattr(compile_cache, "mappings", lambda: (63_000, 65_530))
  with pytest.warns(RuntimeWarning), pytest.raises(GlmjaxError, match="vm.max_map_count"):
    compile_cache.relieve_map_pressure()
  monkeypatch.setattr(compile_cache, "mappings", lambda: (40_000, 65_530))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    compile_cache.relieve_map_pressure()  # under 75%: nothing to do, no warning


def test_a_session_compiles_few_steps_and_a_repeat_none():
  """Buckets bound the shapes a user meets (prefill and score lengths: powers of two). A
  scripted session (a 300-token prompt, generate, two chat turns, score) meets at most 8 step
  shapes; prompts of every length from 33 to 64 add at most one prefill (one bucket) and no
  decode; scores of every length from 17 to 32 compile at most 4 XLA programs (one bucket: the
  score and its log-softmax; one per length before); the same session again compiles nothing.
  (A pool that grows changes every step's shapes: the long prompt comes first, and the chat
  gives its pages back.)"""
  from glmjax.runtime import compile_cache
  with glmjax.load(progress=False) as m:
    def session():
      m.generate(list(range(7, 307)), max_new_tokens=4)
      m.generate("Hello there", max_new_tokens=8)
      chat = m.chat()
      chat.send("Hi", max_new_tokens=6)
      chat.send("And again, with more words this time?", max_new_tokens=6)
      chat.close()
      m.score([m.tokenizer.encode("one two three four five six")])
    session()
    first = m.executor.compiled()
    assert 2 <= len(first) <= 8 and first.count("decode_fn") == 1, first
    for n in range(33, 65):
      m.generate(list(range(7, 7 + n)), max_new_tokens=1)
    grown = m.executor.compiled()
    assert len(grown) <= len(first) + 1 and grown.count("decode_fn") == 1, grown
    before = compile_cache.compilations()
    for n in range(17, 33):
      ids = np.arange(7, 7 + n)[None]
      m.score(ids, ids, top_k=2)
    assert compile_cache.compilations() - before <= 4
    before = compile_cache.compilations()
    session()
    assert m.executor.compiled() == grown
    assert compile_cache.compilations() == before
