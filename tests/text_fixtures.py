"""Tiny tokenizer directories for tests: a byte-level BPE trained in well under a second."""

from __future__ import annotations

import os

from glmjax.decoding.text import GLM_SPECIAL_TOKENS, Tokenizer, train_bpe_tokenizer

# A GLM-5-like chat template, written for these tests: role tokens with no newline after them,
# and an assistant prompt that closes (thinking off) or opens (thinking on) the <think> block.
GLM_LIKE_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|system|>{{ m.content }}"
    "{% elif m.role == 'user' %}<|user|>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}"
    "{% elif m.role == 'tool' %}<|observation|>{{ m.content | tojson }}"
    "{% else %}{{ raise_exception('unknown role ' ~ m.role) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
    "{% else %}<think>{% endif %}"
    "{% endif %}"
)

_LINES = [
    "The quick brown fox jumps over the lazy dog while the kettle boils.",
    "Sampling picks the next token; greedy decoding always takes the most likely one.",
    "Café au lait, crème brûlée, piñata, naïve façade, Ångström, Øresund, Straße, Łódź.",
    "Les élèves étudient à l'école; où est la bibliothèque? Ça va très bien, merci.",
    "Ein Bär läuft über die Brücke. Grüße aus München und Zürich!",
    "日本語のテキストも少し含めます。東京は大きな都市です。",
    "中文文本：今天天气很好，我们去公园散步吧。模型正在生成文字。",
    "한국어 문장도 조금 넣습니다. 감사합니다.",
    "Emoji time: 😀 🎉 🚀 ❤️ 👍🏽 — and a family 👨‍👩‍👧 at the end.",
    "def add(a, b):\n    return a + b  # tiny helper\n\nprint(add(2, 3))",
    "for (int i = 0; i < n; ++i) { total += values[i]; }",
    "JSON: {\"name\": \"glm\", \"layers\": 78, \"experts\": [1, 2, 3]}",
    "Numbers 0123456789 and symbols ~!@#$%^&*()_+-=[]{}|;':\",./<>?",
    "Tabs\tand\nnewlines\n\nand   multiple   spaces are kept as they are.",
]


def training_texts(repeats: int = 12) -> list[str]:
  """A few KB of mixed-script text; repeated so BPE learns merges for the common words."""
  return [line for _ in range(repeats) for line in _LINES]


def make_tokenizer_dir(path: str | os.PathLike, chat_template: str | None = None,
                       vocab_size: int = 600) -> Tokenizer:
  """Trains the tiny BPE into `path` (tokenizer.json, tokenizer_config.json,
  generation_config.json) and returns it loaded through `Tokenizer.from_dir`."""
  return train_bpe_tokenizer(training_texts(), vocab_size, path, special_tokens=GLM_SPECIAL_TOKENS,
                             chat_template=chat_template)
