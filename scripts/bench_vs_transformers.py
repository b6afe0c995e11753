"""The same weights through glmjax and through transformers, greedy, side by side in one run.

  python scripts/bench_vs_transformers.py                          # embedded model, 32 tokens
  python scripts/bench_vs_transformers.py --model=/models/tiny-glm5 --max_new_tokens=64 \\
      --json=/tmp/bench_vs_transformers.json

Both sides load the HF checkpoint in float32 (glmjax's resident path; transformers'
`GlmMoeDsaForCausalLM` in eager PyTorch, no torch.compile, --attn_implementation attention) and
generate --max_new_tokens greedy tokens after the tokenized --prompt (or --prompt_ids) with no
stop token, so both emit exactly that many. Each side first makes one warm-up call, kept out of
every rate and reported as `warmup_s` (glmjax compiles its steps there; torch pays its
first-call costs), then --runs timed calls, the two sides taking turns. Every call is timed the
same way on both sides, from a per-token callback (glmjax's `on_token`, a transformers
streamer): `wall_s` is the whole generate call, `tok_s` the new tokens over it, `ttft_s` the
time to the first new token (the prefill), `decode_tok_s` the rate over the remaining tokens.
Loading is `load_s`, outside every call. The report holds every run, the medians, glmjax's
speed-ups over transformers and the greedy token agreement (equal tokens and the first
divergence index, or null). transformers and torch are test extras: without them the script
says so and exits 1.
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import os
import sys
import time

# Runs from a checkout whether or not glmjax is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

from glmjax import cli  # noqa: E402
from glmjax.bench.side_by_side import TokenClock, agreement, measure  # noqa: E402

FLAGS = flags.FLAGS
cli.define_model_flag("an HF glm_moe_dsa checkpoint directory (transformers loads it too); "
                      "default: the embedded model")
flags.DEFINE_integer("max_new_tokens", 32, "Greedy tokens per call on each side.", lower_bound=2)
flags.DEFINE_string("prompt", "def parse(", "Prompt text (tokenized with the model's tokenizer).")
flags.DEFINE_list("prompt_ids", None, "Prompt token ids instead of --prompt (models without a "
                  "tokenizer).")
flags.DEFINE_integer("runs", 5, "Timed calls per side after the warm-up (medians reported).",
                     lower_bound=1)
flags.DEFINE_enum("attn_implementation", "eager", ["eager", "sdpa"],
                  "transformers attention implementation.")
flags.DEFINE_integer("torch_threads", 0, "torch intra-op threads; 0 keeps torch's default (one per "
                     "core). On a machine other processes share, 1 keeps torch from stalling at "
                     "its thread barriers.", lower_bound=0)
flags.DEFINE_string("json", None, "Also write the JSON report to this path.")


def _reference_libraries():
  """(torch, GlmMoeDsaForCausalLM, BaseStreamer), or a GlmjaxError naming what to install."""
  from glmjax.errors import GlmjaxError
  try:
    import torch
    from transformers import GlmMoeDsaForCausalLM
    from transformers.generation.streamers import BaseStreamer
  except ImportError as e:
    raise GlmjaxError(f"this benchmark needs transformers and torch (the test extras: "
                      f"pip install -e \".[test]\"): {e}") from None
  return torch, GlmMoeDsaForCausalLM, BaseStreamer


def glmjax_side(model, prompt_ids: list[int], n: int):
  """A function running one timed glmjax call: (tokens, timing, glmjax's own stats)."""
  def call():
    clock = TokenClock()
    r = model.generate(prompt_ids, n, temperature=0.0, stop_ids=[], on_token=clock.tick)
    return r.tokens, clock.timing(time.perf_counter()), r.stats
  return call


def transformers_side(ref, torch, base_streamer, prompt_ids: list[int], n: int):
  """A function running one timed transformers call: (tokens, timing, {})."""

  class Streamer(base_streamer):
    """generate() puts the prompt first, then each new token as it is chosen."""

    def __init__(self, clock):
      self.clock, self.prompt_seen = clock, False

    def put(self, value):
      if self.prompt_seen:
        self.clock.tick()
      self.prompt_seen = True

    def end(self):
      pass

  ids = torch.tensor([prompt_ids], dtype=torch.long)
  mask = torch.ones_like(ids)

  def call():
    clock = TokenClock()
    with torch.inference_mode():
      out = ref.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                         streamer=Streamer(clock), pad_token_id=0)
    end = time.perf_counter()
    return out[0, len(prompt_ids):].tolist(), clock.timing(end), {}
  return call


def _prompt_ids(model) -> list[int]:
  from glmjax.errors import InputError
  if FLAGS.prompt_ids is not None:
    try:
      ids = [int(t) for t in FLAGS.prompt_ids]
    except ValueError:
      raise InputError(f"--prompt_ids must be integers, got {FLAGS.prompt_ids}") from None
    bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
    if not ids or bad:
      raise InputError(f"--prompt_ids must be non-empty ids below the vocabulary size "
                       f"{model.config.vocab_size}, got {FLAGS.prompt_ids}")
    return ids
  if model.tokenizer is None:
    raise InputError(f"{model.path}: no tokenizer.json; give --prompt_ids")
  ids = model.tokenizer.encode(FLAGS.prompt)
  if not ids:
    raise InputError("--prompt tokenizes to nothing")
  return ids


def run() -> dict:
  torch, hf_model_cls, base_streamer = _reference_libraries()  # before any slow work
  import glmjax
  from glmjax.formats import embedded, store
  path = FLAGS.model or embedded.ensure(progress=False)
  if not os.path.isdir(path):
    raise glmjax.CheckpointError(f"--model {path}: no such directory")
  if store.is_store(path):
    raise glmjax.InputError(f"--model {path}: an expert store; transformers needs the HF "
                            "checkpoint it was converted from")
  n = FLAGS.max_new_tokens
  load_before = os.getloadavg()  # a shared machine's load moves both sides' figures
  t0 = time.perf_counter()
  model = glmjax.load(path, dtype="float32", progress=False)
  glmjax_load_s = time.perf_counter() - t0
  prompt_ids = _prompt_ids(model)
  if FLAGS.torch_threads:
    torch.set_num_threads(FLAGS.torch_threads)
  t0 = time.perf_counter()
  ref = hf_model_cls.from_pretrained(path, dtype=torch.float32,
                                     attn_implementation=FLAGS.attn_implementation).eval()
  # No stop token on either side (glmjax gets stop_ids=[]): both emit exactly n tokens.
  ref.generation_config.eos_token_id = None
  hf_load_s = time.perf_counter() - t0

  sides = measure({"glmjax": glmjax_side(model, prompt_ids, n),
                   "transformers": transformers_side(ref, torch, base_streamer, prompt_ids, n)},
                  FLAGS.runs)
  model.close()
  ours, theirs = sides["glmjax"], sides["transformers"]
  ours["load_s"], theirs["load_s"] = glmjax_load_s, hf_load_s
  theirs["attn_implementation"] = FLAGS.attn_implementation
  theirs["torch_threads"] = torch.get_num_threads()
  # Every entry is a speed-up, above 1 when glmjax is faster: rates divided, the prefill time
  # inverted (wall_s would only repeat tok_s: both sides emit the same number of tokens).
  speedup = {k: ours[k] / theirs[k] if theirs[k] else None for k in ("tok_s", "decode_tok_s")}
  speedup["ttft_s"] = theirs["ttft_s"] / ours["ttft_s"] if ours["ttft_s"] else None
  import jax
  import transformers
  return {
      "model": path, "prompt": FLAGS.prompt if FLAGS.prompt_ids is None else None,
      "prompt_ids": prompt_ids, "prompt_tokens": len(prompt_ids),
      "max_new_tokens": n, "dtype": "float32", "runs": FLAGS.runs,
      "timed": ("each side: one warm-up call (warmup_s: compilation/first-call costs, not in any "
                "rate), then `runs` identical greedy generate calls, the two sides taking turns, "
                "medians reported. wall_s: the whole call; tok_s: new tokens / wall_s; ttft_s: "
                "call start to the first new token (prefill); decode_tok_s: (new tokens - 1) / "
                "time from the first to the last new token. Model loading is load_s, outside "
                "every call."),
      "glmjax": ours, "transformers": theirs,
      "speedup_glmjax_over_transformers": speedup,
      "agreement": agreement(ours["tokens"], theirs["tokens"]),
      "versions": {"jax": jax.__version__, "torch": torch.__version__,
                   "transformers": transformers.__version__, "backend": jax.default_backend()},
      "machine": {"cpus": os.cpu_count(), "loadavg_1m_before": load_before[0],
                  "loadavg_1m_after": os.getloadavg()[0]},
  }


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from glmjax.errors import GlmjaxError
  from glmjax.bench.reporting import write_report
  try:
    report = run()
  except GlmjaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  write_report(report, FLAGS.json)
  return 0


if __name__ == "__main__":
  app.run(main)
