"""Generates text (or token ids) with a GLM-5 model: the embedded default unless --model is given.

  python scripts/generate.py --prompt "def "
  python scripts/generate.py --chat
  python scripts/generate.py --prompt_ids=5,6,7 --max_new_tokens=32
  python scripts/generate.py --model=/nvme/glm5-int4 --host_cache_gb=64 --prompt "Hello"
  python scripts/generate.py --mesh=expert:2,tensor:2 --prompt_ids=5,6,7 --json=out.json
  python scripts/launch_local.py --processes=2 --devices_per_process=2 -- \
      scripts/generate.py --prompt_ids=5,6,7

With several processes (--coordinator, --num_processes, --process_id; glmjax.distributed) only
process 0 prints and writes --json; an expert store's counters are summed over the processes
(each reads, caches and counts only the experts its devices own).

  python scripts/launch_local.py --processes=2 --devices_per_process=1 -- \
      scripts/generate.py --model=STORE --host_cache_gb=2 --mesh=expert:2 --prompt_ids=5,6,7

Sampling flags left unset take the model's generation_config.json (greedy without one).
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import json
import os
import sys

from absl import app, flags, logging

import glmjax
from glmjax import cli, distributed
from glmjax.offload.owners import peers_named

FLAGS = flags.FLAGS
cli.define_model_flag("an HF checkpoint or expert store directory; default: the embedded "
                      "model. With several processes `{process}` in it becomes the process index "
                      "(a store copy per process, holding at least the experts it owns)")
flags.DEFINE_string("prompt", None, "Prompt text (needs a tokenizer).")
flags.DEFINE_string("prompt_ids", None, "Comma-separated prompt token ids (instead of --prompt).")
flags.DEFINE_string("prompt_file", None, "Read the prompt text from this file (long prompts).")
flags.DEFINE_bool("chat", False, "Interactive multi-turn chat (GLM chat template).")
flags.DEFINE_string("system", None, "System message for --chat.")
flags.DEFINE_bool("think", False, "Enable thinking in --chat (<think> instead of <think></think>).")
flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate at most.", lower_bound=0)
flags.DEFINE_float("temperature", None, "Sampling temperature; 0 is greedy.", lower_bound=0.0)
flags.DEFINE_integer("top_k", None, "Keep the k most likely tokens (0 = off).", lower_bound=0)
flags.DEFINE_float("top_p", None, "Nucleus mass (1 = off).")
flags.DEFINE_float("min_p", None, "Keep tokens with p ≥ min_p·p_max (0 = off).")
flags.DEFINE_float("repetition_penalty", None, "Penalty on already-seen tokens (1 = off).")
flags.DEFINE_multi_string("stop", [], "Stop string (repeatable).")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_string("trace", None, "Write a routing trace of this run to this directory "
                    "(glmjax.replay.Trace).")
flags.DEFINE_string("json", None, "Write tokens, text, stats and mesh of the generation to this "
                    "JSON file (process 0 only; not with --chat).")
distributed.define_flags()
flags.DEFINE_string("draft", "0", "MTP speculative decoding: 0 (off), drafts per step (1..16), "
                    "or 'auto' (chosen from live throughput).")
cli.define_load_flags()  # every glmjax.load option (glmjax.options.Options)


def parse_draft(text: str):
  if text == "auto":
    return "auto"
  try:
    return int(text)
  except ValueError:
    raise glmjax.InputError(f"--draft must be an integer or 'auto', got {text!r}") from None


def parse_ids(text: str) -> list[int]:
  try:
    ids = [int(t) for t in text.replace(" ", "").split(",") if t]
  except ValueError:
    raise glmjax.InputError(f"--prompt_ids must be comma-separated integers, got {text!r}") from None
  if not ids:
    raise glmjax.InputError("--prompt_ids is empty")
  return ids


def read_prompt(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise glmjax.InputError(f"--prompt_file {path}: cannot read it ({e})") from None


def sampling_kwargs(model) -> dict:
  """Flags that were set, over the model's generation_config defaults."""
  from glmjax.decoding.sampling import SamplingParams
  gen = model.tokenizer.generation_config if model.tokenizer is not None else {}
  p = SamplingParams.from_generation_config(gen or {})
  kw = dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
            repetition_penalty=p.repetition_penalty)
  for name in kw:
    if getattr(FLAGS, name) is not None:
      kw[name] = getattr(FLAGS, name)
  return kw


def summary(result, memory=None) -> str:
  """The line after a generation; `memory` (the model's load-time plan) adds the dense part."""
  s = result.stats
  line = f"{int(s['new_tokens'])} tokens ({result.stop_reason}) | prefill {s['prefill_s']:.2f} s"
  if memory is not None:
    line += f" | dense {memory.dense_format} {memory.dense / (1 << 30):.2f} GB"
  if s.get("all_resident"):
    line += " | experts: all resident"
  elif "experts_used" in s and s["experts_used"]:
    used = s["experts_used"]
    pin, host = 100 * s["expert_pin_hits"] / used, 100 * s["expert_host_hits"] / used
    line += (f" | hit {pin + host:.1f}% (pin {pin:.1f} + host {host:.1f}) | "
             f"{s['expert_bytes_read'] / 1e9:.2f} GB read, {s['io_wait_s']:.2f} s waited")
  if s.get("draft_proposed"):
    line += (f" | draft accept {100 * s['draft_accepted'] / s['draft_proposed']:.0f}%, "
             f"{s['tokens_per_forward']:.2f} tok/forward")
  compile_s = s.get("compile_s", 0.0) + s.get("decode_compile_s", 0.0)
  compiled = f" (compiling {compile_s:.1f} s apart)" if compile_s >= 0.05 else ""
  return line + f" | {s['decode_tok_s']:.1f} tok/s{compiled}"


class ChatPrinter:
  """Prints a chat reply as it streams; with thinking on, the reasoning under a `thinking:`
  heading and the answer under `answer:`, so the two read apart."""

  def __init__(self, thinking: bool):
    from glmjax.decoding.glm_format import OutputSplitter
    self.split = OutputSplitter(thinking=thinking) if thinking else None
    self.heading = None

  def show(self, piece: str | None) -> None:
    """Prints `piece`; None at the end of the reply prints what the reader held back."""
    if self.split is None:
      print(piece or "", end="", flush=True)
      return
    d = self.split.feed(piece) if piece is not None else self.split.finish()
    for heading, part in (("thinking", d.reasoning), ("answer", d.content)):
      if part:
        if heading != self.heading:
          print(("\n" if self.heading else "") + f"{heading}: ", end="")
          self.heading = heading
        print(part, end="", flush=True)


def run(model) -> None:
  kw = dict(sampling_kwargs(model), seed=FLAGS.seed, stop=FLAGS.stop)
  if FLAGS.chat:
    session = model.chat(system=FLAGS.system, enable_thinking=FLAGS.think)
    print("chat: empty line or Ctrl-D to quit", flush=True)
    while True:
      try:
        user = input("> ")
      except EOFError:
        break
      if not user.strip():
        break
      printer = ChatPrinter(FLAGS.think)
      r = session.send(user, FLAGS.max_new_tokens, on_text=printer.show, **kw)
      printer.show(None)
      print(f"\n[{summary(r, model.memory)}]", flush=True)
    return
  if FLAGS.prompt_ids is not None:
    prompt = parse_ids(FLAGS.prompt_ids)
    print(f"prompt: {prompt}", flush=True)
    show = dict(on_token=lambda t: print(t, end=" ", flush=True))
  else:
    prompt = FLAGS.prompt if FLAGS.prompt is not None else "def "
    if FLAGS.prompt_file is not None:
      prompt = read_prompt(FLAGS.prompt_file)
    if model.tokenizer is None:
      raise glmjax.InputError("this model has no tokenizer: use --prompt_ids")
    print(prompt if len(prompt) <= 2000 else f"[{len(prompt)} characters of {FLAGS.prompt_file}]",
          end="", flush=True)
    show = dict(on_text=lambda t: print(t, end="", flush=True))
  result = model.generate(prompt, FLAGS.max_new_tokens, draft=parse_draft(FLAGS.draft), **kw,
                          trace=FLAGS.trace, **show)
  if model.executor.telemetry() is not None and distributed.process_count() > 1:
    # each process counted its own experts: process 0 reports the sums
    result.stats = model.executor.sum_over_processes(result.stats)
  print("\n" + summary(result, model.memory))
  if FLAGS.trace:
    print(f"trace: {FLAGS.trace}")
  if FLAGS.json and distributed.is_main():
    from glmjax import sharding
    with open(FLAGS.json, "w", encoding="utf-8") as f:
      json.dump(dict(tokens=[int(t) for t in result.tokens], text=result.text,
                     stats=result.stats, stop_reason=result.stop_reason,
                     mesh=sharding.describe(model.mesh)), f, indent=1)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # keep JAX's backend probing off the console
  try:
    if FLAGS.prompt_ids is not None:
      parse_ids(FLAGS.prompt_ids)  # fail before loading anything
    if FLAGS.prompt_file is not None:
      read_prompt(FLAGS.prompt_file)
    parse_draft(FLAGS.draft)
    if FLAGS.chat and FLAGS.json:
      raise glmjax.InputError("--json records one generation; it does not go with --chat")
    distributed.initialize()
    if not distributed.is_main():  # every process computes; process 0 alone speaks
      sys.stdout = open(os.devnull, "w")
    with peers_named("generate"), glmjax.load(
        distributed.per_process(FLAGS.model), mesh=distributed.mesh_from_flags(),
        **cli.load_options()) as model:
      run(model)
  except glmjax.GlmjaxError as e:
    print(f"\nerror: {e}", file=sys.stderr)
    distributed.exit_now(1)  # several processes: the others fail now rather than wait
    return 1
  except KeyboardInterrupt:
    print("\ninterrupted", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  app.run(main)
