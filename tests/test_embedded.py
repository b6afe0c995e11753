"""The shipped embedded model: loads by default, is still trained, matches transformers, is small."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glmjax
from glmjax.formats import corpus, embedded
from glmjax.model.forward import forward
from glmjax.decoding.text import Tokenizer
from hf_reference import rel_err

# bits/byte of the shipped model on corpus.HELD_OUT_SMALL, measured when it was exported
# (context 1024, stride 512); the bound allows 10% for platform differences. A model that lost
# its training (random or corrupted weights) scores ≈ 3.5 bits/byte or worse.
MEASURED_SMALL_BPB = 1.646
BOUND_SMALL_BPB = MEASURED_SMALL_BPB * 1.10
MAX_SHIPPED_BYTES = 25 * 1000 * 1000


@pytest.fixture(scope="module")
def model():
  return glmjax.load(progress=False)


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.from_dir(embedded.ensure())


def test_default_load_is_the_shipped_model(model):
  assert os.path.samefile(model.path, embedded.PATH)
  cfg = model.config
  assert cfg.n_routed_experts >= 32 and cfg.num_experts_per_tok >= 4
  assert len(cfg.moe_layers) >= 4 and cfg.max_position_embeddings >= 1024
  assert cfg.index_topk < cfg.max_position_embeddings
  assert len(model.weights.mtp) == 1


def test_eos_is_endoftext(model, tok):
  eos = tok.token_id("<|endoftext|>")
  assert model.config.eos_token_ids == (eos,)
  assert tok.generation_config["eos_token_id"] in (eos, [eos])


def test_tokenizer_round_trips(tok):
  texts = [corpus.read("json/decoder.py"), "def f(x):\n\treturn x ** 2  # ünïcödé ✓ 日本\n",
           "  \n\n   trailing   "]
  for text in texts:
    assert tok.decode(tok.encode(text)) == text
  code = corpus.read("shlex.py")
  assert len(code.encode()) / len(tok.encode(code)) > 2.5  # the BPE learned Python


def test_heldout_bits_per_byte(model, tok):
  cfg, w = model.config, model.weights

  @jax.jit
  def logp(x):
    return jax.nn.log_softmax(forward(w, x, cfg)[0], axis=-1)

  def padded(x):  # every window scored as [4, context]: one compiled shape, not one per tail
    # window length and batch size. The model is causal, so positions past a window's end
    # change nothing before it.
    b, s = x.shape
    full = np.zeros((4, cfg.max_position_embeddings), np.int32)
    full[:b, :s] = x
    return np.asarray(logp(jnp.asarray(full)))[:b, :s]

  texts = [corpus.read(f) for f in corpus.HELD_OUT_SMALL]
  res = corpus.bits_per_byte(padded, texts, tok.encode,
                             tok.token_id("<|endoftext|>"), cfg.max_position_embeddings, 512,
                             batch=4)
  assert res["bits_per_byte"] <= BOUND_SMALL_BPB, res


def test_matches_transformers(model, tok):
  import torch  # a test dependency: missing torch must fail, not skip
  from transformers import GlmMoeDsaForCausalLM
  ref = GlmMoeDsaForCausalLM.from_pretrained(embedded.PATH, dtype=torch.float32).eval()
  # Longer than index_topk, so the DSA selection is active on both sides.
  ids = tok.encode(corpus.read("shlex.py"))[:model.config.index_topk + 72]
  toks = np.asarray([ids], np.int32)
  with torch.no_grad():
    want = ref(torch.as_tensor(toks, dtype=torch.long)).logits.float().numpy()
  got = model.score(toks)
  assert rel_err(got, want) <= 1e-4


def test_shipped_size():
  total = sum(os.path.getsize(os.path.join(embedded.PATH, f)) for f in os.listdir(embedded.PATH))
  assert total <= MAX_SHIPPED_BYTES, total
  with open(os.path.join(embedded.PATH, "config.json")) as f:
    assert json.load(f)["model_type"] == "glm_moe_dsa"


def _teacher_forced(w, toks, cfg):
  from glmjax.model.mtp import mtp_logits
  logits, h, _ = forward(w, toks[:, :-1], cfg)  # h[:, i] sees t_0..t_i
  return logits, h, mtp_logits(w, h, toks[:, 1:], cfg)[0]  # [1, 40, V], predicting t_{i+2}


def test_mtp_cached_steps_match_teacher_forced(model, tok):
  from glmjax.model.forward import mtp_fn
  from glmjax.model.mtp import init_mtp_cache
  cfg, w = model.config, model.weights
  toks = jnp.asarray([tok.encode(corpus.read("colorsys.py"))[:41]], jnp.int32)
  # The teacher-forced references in one jit: eagerly, every primitive compiles on its own
  logits, h, want = jax.jit(_teacher_forced, static_argnums=2)(w, toks, cfg)
  cache = init_mtp_cache(cfg, 1, 64)
  first, _, cache = mtp_fn(w, h[:, :32], toks[:, 1:33], cache, jnp.int32(0), cfg=cfg)
  outs = [first]
  for i in range(32, 40):
    out, _, cache = mtp_fn(w, h[:, i:i + 1], toks[:, i + 1:i + 2], cache, jnp.int32(i), cfg=cfg)
    outs.append(out)
  got = jnp.concatenate(outs, axis=1)
  assert rel_err(np.asarray(got), np.asarray(want)) <= 1e-4
  # Greedy acceptance: the head's argmax for t_{i+2} equals the main model's argmax at i+1
  # (0.65 over the held-out files; an untrained head agrees ~never).
  draft = np.asarray(jnp.argmax(want[0, :-1], -1))
  main = np.asarray(jnp.argmax(logits[0, 1:], -1))
  assert float(np.mean(draft == main)) > 0.3, float(np.mean(draft == main))
