"""Which request fields each route reads, and which it accepts without effect.

A field the server neither uses nor lists here is a 400 naming it: a field silently ignored
is a silent wrong answer (an agent cannot tell that its tools never reached the model). The
accepted-without-effect lists hold only what real clients send that does not change the
output: bookkeeping for the caller (`user`, `metadata`), storage and billing hints
(`store`, `service_tier`), and prompt-cache hints (`cache_control`; this server's prefix cache
needs none).
"""

from __future__ import annotations

from glmjax.serving.protocol import ApiError

SAMPLING = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "stop", "seed", "n", "stream",
             "stream_options"}
COMPLETION = {"model", "prompt", "logprobs", "echo"} | SAMPLING
CHAT = {"model", "messages", "max_completion_tokens",
        "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
        "chat_template_kwargs", "reasoning_effort", "response_format"} | SAMPLING
# Sent by the openai SDK when the caller sets them, by agents for their own bookkeeping; none
# changes what the model generates.
OPENAI_IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key",
                  "safety_identifier")
# `stream_options`: include_obfuscation pads chunks against length side channels (OpenAI's);
# its absence changes no text.
STREAM_OPTIONS = {"include_usage"}
STREAM_OPTIONS_IGNORED = ("include_obfuscation",)
TOKENIZE = {"prompt", "add_special_tokens"}
DETOKENIZE = {"tokens"}
TOKENIZER_IGNORED = ("model",)  # vLLM's tokenizer routes take it; one model is served here
CHAT_MESSAGE = {"role", "content", "tool_calls", "tool_call_id", "reasoning_content"}
MESSAGE_IGNORED = ("name",)  # a participant's name: GLM's templates do not render it
CONTENT_PART = {"type", "text"}
PART_IGNORED = ("cache_control",)

ANTHROPIC = {"model", "messages", "system", "max_tokens", "stop_sequences", "temperature",
             "top_p", "top_k", "stream", "tools", "tool_choice", "thinking"}
ANTHROPIC_COUNT = {"model", "messages", "system", "tools", "tool_choice", "thinking"}
ANTHROPIC_IGNORED = ("metadata", "service_tier")
MAX_STOP_SEQUENCES = 16  # Anthropic's `stop_sequences`: each is matched at every token
ANTHROPIC_BLOCK_IGNORED = ("cache_control", "citations")
# Variables a request may hand the chat template (`chat_template_kwargs`); any other is a 400,
# since a template variable can change the prompt in ways the server does not check.
TEMPLATE_KWARGS = ("enable_thinking",)


def check(obj: dict, supported: set, ignored: tuple = (), where: str = "") -> None:
  """A 400 naming the first key of `obj` that is neither `supported` nor `ignored`. A null
  value asks for nothing (SDKs dump unset fields of a block they send back as null)."""
  for key, value in obj.items():
    if value is not None and key not in supported and key not in ignored:
      raise ApiError(400, f"{where}{key} is not supported by this server (supported: "
                     f"{', '.join(sorted(supported))}; accepted without effect: "
                     f"{', '.join(ignored) or 'none'})", where + key, "unsupported_field")
