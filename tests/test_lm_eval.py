"""lm-evaluation-harness itself (`local-completions`, lm-eval 0.4.13) against the server, on a
small local multiple-choice task: its accuracy and every choice's log-likelihood equal those
computed here with `Model.score`, split into context and continuation the way lm-eval splits
them. Two tokenizers: the model's own files through Hugging Face, and the server's remote
tokenizer, which lm-eval detects by itself (with batches of 4 prompts per request).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import numpy as np
import pytest

import glmjax
from glmjax.serving.app import create_app
from tests.test_serve import serving

SOURCE = '''import os
import sys


def read_lines(path):
  with open(path) as f:
    return f.read().splitlines()


def main(argv):
  for name in argv[1:]:
    for line in read_lines(name):
      print(line.strip())
  return 0
'''
N_DOCS = 4
WIDTH = 128  # tokens: every prompt of the task fits

# One process, two evaluations: lm-eval's import is the slow part.
RUNNER = r'''
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
base, tokenizer, task_dir = sys.argv[1:4]
out = {}
for name, args, batch in [
    ("huggingface", dict(tokenizer_backend="huggingface", tokenizer=tokenizer), 1),
    ("remote", {}, 4)]:
  r = lm_eval.simple_evaluate(
      model="local-completions", tasks=["glmjax_mc"], batch_size=batch, log_samples=True,
      model_args=dict(model="embedded_model", base_url=base + "/v1/completions", **args),
      task_manager=TaskManager(include_path=task_dir))
  samples = sorted(r["samples"]["glmjax_mc"], key=lambda s: s["doc_id"])
  out[name] = dict(acc=r["results"]["glmjax_mc"]["acc,none"],
                   ll=[[float(x[0]) for x in s["filtered_resps"]] for s in samples])
print("RESULT " + json.dumps(out))
'''


def _docs() -> list[dict]:
  """Multiple choice over the next line of SOURCE: the true line and three others."""
  lines = [l for l in SOURCE.splitlines() if l.strip()]
  rng = np.random.default_rng(0)
  docs = []
  for i in range(2, 2 + N_DOCS):
    true = lines[i].strip()
    others = [l.strip() for l in lines if l.strip() != true]
    choices = [true] + [others[j] for j in rng.choice(len(others), 3, replace=False)]
    order = rng.permutation(4)
    docs.append({"context": "\n".join(lines[:i]) + "\n",
                 "choices": [choices[j] for j in order], "label": int(np.argmin(order))})
  return docs


def _expected(model, docs) -> list[list[float]]:
  """Each choice's log-likelihood from Model.score with lm-eval's split: trailing whitespace
  of the context moves to the continuation (target delimiter " "), the whole is encoded, and
  the continuation is what follows the context's own encoding."""
  enc = model.tokenizer.encode
  out = []
  for d in docs:
    row = []
    for choice in d["choices"]:
      context, cont = d["context"], " " + choice
      stripped = context.rstrip()
      context, cont = stripped, context[len(stripped):] + cont
      whole, ctx = enc(context + cont), enc(context)
      n = len(whole) - 1  # padded to one width: one compiled shape; causal, so exact
      tokens, targets = np.zeros((2, 1, WIDTH), np.int32)
      tokens[0, :n], targets[0, :n] = whole[:-1], whole[1:]
      scores = model.score(tokens, targets)[0]
      row.append(float(scores[len(ctx) - 1:n].sum()))
    out.append(row)
  return out


@pytest.fixture(scope="module")
def server():
  model = glmjax.load(progress=False, max_context=256)
  # no API key: lm-eval sends an empty one; no warm-up (test_serve_warm: CPU the suite spares)
  app = create_app(model, max_batch=4, max_queue=8, warm_prefill=False)
  with serving(app) as port:
    yield dict(model=model, base=f"http://127.0.0.1:{port}")
  model.close()


def test_lm_eval_multiple_choice_equals_model_score(server, tmp_path):
  docs = _docs()
  with open(tmp_path / "mc.jsonl", "w") as f:
    f.writelines(json.dumps(d) + "\n" for d in docs)
  (tmp_path / "glmjax_mc.yaml").write_text(
      "task: glmjax_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
      f"    test: {tmp_path / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
      'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
      'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n')
  model = server["model"]
  env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="0",
             HF_DATASETS_CACHE=str(tmp_path / "hf"))
  proc = subprocess.run([sys.executable, "-c", RUNNER, server["base"], model.path,
                         str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-4000:]
  got = json.loads(lines[0][len("RESULT "):])
  want = _expected(model, docs)
  acc = float(np.mean([int(np.argmax(row)) == d["label"] for row, d in zip(want, docs)]))
  for backend in ("huggingface", "remote"):
    np.testing.assert_allclose(got[backend]["ll"], want, atol=1e-4, err_msg=backend)
    assert got[backend]["acc"] == acc, backend
