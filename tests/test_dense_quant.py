"""Quantized dense weights (issue 28): the memory plan at GLM-5's full geometry from the one
declaration, and int8/int4 dense stores from `scripts/convert.py --dense_bits`.

The sharp check is `test_dense_store_equals_fake_quant_reference`: a store with int8 (or int4)
dense weights scores like a float model whose dense matmul weights and experts were quantized
and dequantized by an independent float64 rule, in the expanded (score) and absorbed (decode)
attention paths alike.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glmjax
from glmjax.formats import store
from glmjax.model import weights
from glmjax.model.config import Config
from glmjax.model.layers import as_f32, embed_rows, linear
from glmjax.model.quant import QArray
from glmjax.formats.quantize import quantize
from hf_reference import make_hf, rel_err, tokens
from test_config import GLM5
from test_store import CFG, convert

GiB = 1 << 30
# Done-when bounds of issue 28, in the project's GB (2^30 bytes, as `offload.budget` reports).
PLAN_MAX_GB = {"int8": 19.5, "int4": 10.5}
# Names of the dense tensors a quantized dense format stores as QArrays (routed experts aside).
QUANTIZED_NAMES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                   "indexer.wq_b", "indexer.wk", "gate_proj", "up_proj", "down_proj",
                   "eh_proj")
HEADS = ("lm_head", "shared_head.head")
EMBED_BITS = {8: 0, 4: 4}  # the embedding: bf16 under int8 dense, int4 under int4 dense
HEAD_BITS = 8  # the heads stay int8 under int4 dense
FIRST_LAYER_BITS = {8: 0, 4: 4}  # the first decoder layer's matrices: bf16 under int8 dense
GROUP = {8: 128, 4: 64}  # the recipes' input features per scale


def test_memory_plan_at_glm5_full_geometry():
  """At GLM-5's geometry (78 layers, 75 MoE, MTP) the planned resident dense bytes fit the
  issue's bounds, from abstract shapes only, and the shape structs are what the model runs on."""
  cfg = Config.from_dict(GLM5)
  plan = {f: weights.dense_plan(cfg, f)["total"] for f in weights.DENSE_FORMATS}
  assert plan["int8"] <= PLAN_MAX_GB["int8"] * GiB, plan["int8"] / GiB
  assert plan["int4"] <= PLAN_MAX_GB["int4"] * GiB, plan["int4"] / GiB
  assert plan["int4"] < plan["int8"] < plan["bfloat16"] < plan["float32"]
  # The int8 recipe's group (128) is what makes room for its bf16 first layer (19.45 GiB): at
  # group 64 that is over (19.70), and the first layer in int8 fits (19.34) but misses the KL
  # target (test_the_int8_recipe_meets_the_kl_target).
  at64 = {f: weights.dense_plan(cfg, "int8", 64, first_layer_bits=f)["total"] for f in (0, 8)}
  assert at64[8] <= PLAN_MAX_GB["int8"] * GiB < at64[0], at64
  # 18.9B dense parameters: about 75.5e9 bytes in float32 (the table).
  assert abs(plan["float32"] / 1e9 - 75.5) < 0.1

  # The same bytes by jax.eval_shape of the quantized tree: every leaf dequantizes (and the
  # embedding gathers) to its declared logical shape, and nothing is allocated.
  tree = weights.dense_only(weights.abstract(cfg, dense_bits=4))
  structs = weights.shapes(tree)
  assert weights.nbytes(structs) == plan["int4"]
  lay = structs.layers[6]  # a MoE layer with a full indexer and a shared expert
  out = jax.eval_shape(
      lambda w: [as_f32(x) for x in (w.attn.q_a, w.attn.q_b, w.attn.kv_b, w.attn.o,
                                     w.attn.indexer.wq_b, w.mlp.shared.gate_up, w.mlp.shared.down)],
      lay)
  info = tree.layers[6]
  want = [info.attn.q_a, info.attn.q_b, info.attn.kv_b, info.attn.o, info.attn.indexer.wq_b,
          info.mlp.shared.gate_up, info.mlp.shared.down]
  assert [o.shape for o in out] == [i.shape for i in want]
  x = jax.ShapeDtypeStruct((2, 1, cfg.hidden_size), np.float32)
  logits = jax.eval_shape(lambda w, x: linear(x, w.lm_head), structs, x)
  emb = jax.eval_shape(lambda w: embed_rows(w.embed, np.zeros((2, 3), np.int32)), structs)
  assert logits.shape == (2, 1, cfg.vocab_size) and emb.shape == (2, 3, cfg.hidden_size)
  assert structs.embed.bits == 4 and structs.lm_head.bits == 8 and not isinstance(structs.layers[3].mlp.router, QArray)
  assert not isinstance(weights.shapes(weights.abstract(cfg, dense_bits=8)).embed, QArray)


def test_declaration_marks_the_dense_matmuls():
  cfg = Config.from_dict(GLM5)
  tree = weights.abstract(cfg, dense_bits=8)
  marked = {n for i in weights.leaves_with_info(tree) if i.quantized for n in i.hf_names}
  plain = {n for i in weights.leaves_with_info(tree) if not i.quantized for n in i.hf_names}
  assert all(any(q in n for q in QUANTIZED_NAMES + HEADS) for n in marked)
  assert "model.embed_tokens.weight" in plain  # kept float under int8 (EMBED_BITS)
  assert not any(".mlp.experts.{e}" in n for n in marked)  # routed experts: the expert store's
  for n in ("model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
            "model.layers.0.self_attn.indexer.weights_proj.weight", "model.norm.weight",
            "model.layers.0.self_attn.indexer.k_norm.bias"):
    assert n in plain
  assert {i.bits for i in weights.leaves_with_info(weights.abstract(cfg))} == {0}
  with pytest.raises(ValueError):
    weights.abstract(cfg, dense_bits=2)
  # The first decoder layer is its own kind: at the recipe's width, or as asked.
  for bits, first, want in ((4, None, (4, 4)), (8, None, (0, 8)), (8, 8, (8, 8)),
                            (4, 8, (8, 4))):
    t = weights.abstract(cfg, dense_bits=bits, dense_first_layer_bits=first)
    for layer, w in zip((t.layers[0], t.layers[1], t.layers[3]), (want[0], want[1], want[1])):
      kinds = {i.quantizable: i.bits for i in weights.leaves_with_info(layer) if i.quantizable}
      assert set(kinds.values()) == {w}, (bits, first, kinds)
  assert weights.dense_settings(4) == {"dense_bits": 4, "dense_group_size": 64,
                                       "dense_first_layer_bits": 4}
  assert weights.dense_settings(8, 32, 0)["dense_first_layer_bits"] == 0
  assert weights.dense_settings(0, 32) == {}
  with pytest.raises(ValueError, match="needs dense_bits"):
    weights.dense_settings(0, 32, 0)
  for group in (63, 0, 64.0):  # the group of a quantized format: an even int >= 2
    with pytest.raises(ValueError, match="dense_group_size must be an even number"):
      weights.dense_settings(8, group)
  with pytest.raises(ValueError, match="dense_first_layer_bits"):
    weights.abstract(cfg, dense_bits=4, dense_first_layer_bits=2)


# --- stores --------------------------------------------------------------------------------

def fake_quant(w, bits, g=64):
  """float64 reference of the group-wise rule: bf16(amax/qmax) scale per (row, group), round
  to nearest, clamp to [-8, 7] (int4) or [-127, 127] (int8); K padded with zeros."""
  import ml_dtypes
  qmax, qmin = {4: (7, -8), 8: (127, -127)}[bits]
  w = np.asarray(w, np.float64)
  o, k = w.shape
  kp = -(-k // g) * g
  grp = np.pad(w, ((0, 0), (0, kp - k))).reshape(o, kp // g, g)
  s = (np.abs(grp).max(-1, keepdims=True) / qmax).astype(ml_dtypes.bfloat16).astype(np.float64)
  q = np.clip(np.rint(np.divide(grp, s, out=np.zeros_like(grp), where=s != 0)), qmin, qmax)
  return (q * s).reshape(o, kp)[:, :k].astype(np.float32)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("src"))
  make_hf(path, seed=21, std=0.05, **CFG)
  return path


@pytest.fixture(scope="module", params=[(8, None, None), (4, None, None), (8, 8, 64)],
                ids=["int8", "int4", "int8-first-layer-int8-g64"])
def dense_store(request, src, tmp_path_factory):
  """(bits, the first layer's bits, group, path): the recipes (flags at their defaults), and
  int8 with its first layer int8 at group 64."""
  bits, first, group = request.param
  path = str(tmp_path_factory.mktemp(f"dense{bits}") / "s")
  flags = [f"--dense_bits={bits}", "--dense_dtype=float32"]
  if first is not None:
    flags += [f"--dense_first_layer_bits={first}", f"--dense_group_size={group}"]
  r = convert(src, path, *flags)
  assert r.returncode == 0, r.stderr
  return (bits, FIRST_LAYER_BITS[bits] if first is None else first,
          GROUP[bits] if group is None else group, path)


def _reference(src, dst, bits, first, group):
  """A float checkpoint: experts int4 fake-quant (G64), the quantized dense tensors `bits`
  fake-quant in groups of `group` (layer 0's `first`, 0: float), the heads int8 and the
  embedding as `EMBED_BITS` says."""
  from glmjax.formats.safetensors_io import SafetensorsFile, write
  shutil.copytree(src, dst)
  f = SafetensorsFile(os.path.join(src, "model.safetensors"))
  out = {}
  for k in f.keys():
    a = np.array(f.read(k))
    if ".mlp.experts." in k:
      a = fake_quant(a, 4)
    elif any(h in k for h in HEADS):
      a = fake_quant(a, HEAD_BITS, group)
    elif k == "model.embed_tokens.weight":
      a = fake_quant(a, EMBED_BITS[bits], group) if EMBED_BITS[bits] else a
    elif a.ndim == 2 and any(q in k for q in QUANTIZED_NAMES) and ".mlp.gate.weight" not in k:
      width = first if k.startswith("model.layers.0.") else bits
      a = fake_quant(a, width, group) if width else a
    out[k] = a
  write(os.path.join(dst, "model.safetensors"), out)
  return dst


def test_dense_store_equals_fake_quant_reference(src, dense_store, tmp_path):
  bits, first, group, path = dense_store
  quant = store.read_manifest(path)["quant"]
  assert (quant["dense_bits"], quant["dense_group_size"], quant["dense_first_layer_bits"]) == (
      bits, group, first)
  ref = glmjax.load(_reference(src, str(tmp_path / "fq"), bits, first, group), progress=False)
  model = glmjax.load(path, progress=False)
  w = model.engine.dense if model.engine is not None else model.weights
  kv_b = w.layers[1].attn.kv_b
  assert isinstance(kv_b, QArray) and (kv_b.bits, kv_b.group_size) == (bits, group)
  for m in (w.layers[0].attn.kv_b, w.layers[0].attn.o, w.layers[0].mlp.down):
    assert (m.bits if isinstance(m, QArray) else 0) == first
  assert isinstance(w.embed, QArray) == bool(EMBED_BITS[bits])
  assert not isinstance(w.layers[1].mlp.router, QArray)
  toks = tokens(1, 2, 12)
  assert rel_err(model.score(toks), ref.score(toks)) <= 1e-5  # expanded attention
  # Greedy decoding runs the absorbed attention path (kv_b folded into query and output).
  prompt = [5, 6, 7, 8, 9, 10]
  got = model.generate(prompt, 8, stop_ids=[]).tokens
  assert got == ref.generate(prompt, 8, stop_ids=[]).tokens


def test_dense_store_bytes_match_the_plan(dense_store):
  bits, first, group, path = dense_store
  cfg, tree = store.dense_abstract(path)
  _, dense = store.load_dense(path, progress=False)
  assert weights.nbytes(dense) == weights.nbytes(tree)
  # The plan's float quantizable leaves (the embedding under int8, the first layer's matrices
  # at first = 0) are bf16 (the converter's default); this store's are float32.
  floats = [i for i in weights.leaves_with_info(tree) if i.quantizable and not i.quantized]
  layer0 = [i for i in weights.leaves_with_info(tree.layers[0]) if i.quantizable]
  assert layer0 and all((i in floats) == (not first) for i in layer0)
  assert (tree.embed in floats) == (not EMBED_BITS[bits])
  extra = sum(i.nbytes // 2 for i in floats)
  assert weights.nbytes(tree) == weights.dense_plan(
      cfg, f"int{bits}", group, with_mtp=bool(tree.mtp), first_layer_bits=first)["total"] + extra


def test_quantized_leaves_stored_as_packed_and_scales(dense_store):
  bits, first, group, path = dense_store
  manifest = store.read_manifest(path)
  keys = manifest["dense"]["layer_001"]
  assert ".attn.kv_b#packed" in keys and ".attn.kv_b#scales" in keys and ".attn.kv_b" not in keys
  assert ".attn_norm" in keys  # norms stay float
  assert (".attn.kv_b#packed" in manifest["dense"]["layer_000"]) == bool(first)
  assert ("['embed']#packed" in manifest["dense"]["global"]) == bool(EMBED_BITS[bits])
  assert "['lm_head']#packed" in manifest["dense"]["global"]


def test_damaged_quantized_part_is_refused(dense_store, tmp_path):
  """The crc32 of each stored array covers the packed weights and the scales."""
  from glmjax.errors import CheckpointError
  bits, first, group, path = dense_store
  bad = str(tmp_path / "bad")
  shutil.copytree(path, bad)
  mpath = os.path.join(bad, store.MANIFEST)
  m = json.load(open(mpath))
  m["dense"]["layer_001"][".attn.kv_b#scales"] ^= 1
  json.dump(m, open(mpath, "w"))
  with pytest.raises(CheckpointError, match="kv_b#scales"):
    store.load_dense(bad, progress=False)


def test_dense_bits_flag_is_checked(src, tmp_path):
  r = convert(src, str(tmp_path / "x"), "--dense_bits=3")
  assert r.returncode != 0
  r = convert(src, str(tmp_path / "y"), "--dense_first_layer_bits=0")  # needs --dense_bits
  assert r.returncode == 1 and "dense_first_layer_bits needs dense_bits" in r.stderr, r.stderr
  assert not os.path.exists(tmp_path / "y" / store.MANIFEST)
  r = convert(src, str(tmp_path / "z"), "--dense_bits=8", "--dense_group_size=63")
  assert r.returncode == 1 and "dense_group_size must be an even number" in r.stderr, r.stderr
  assert not os.path.exists(tmp_path / "z" / store.MANIFEST)


def test_a_store_from_before_the_first_layer_kind_reads_as_written(src, tmp_path):
  """A manifest without `dense_first_layer_bits` (stores converted before the first layer had
  its own width) declares layer 0 at `dense_bits`, as those converters wrote it: an int4 store,
  the key then removed, loads and scores as before."""
  old = str(tmp_path / "old")
  r = convert(src, old, "--dense_bits=4")
  assert r.returncode == 0, r.stderr
  toks = tokens(1, 2, 12)
  with glmjax.load(old, progress=False) as m:
    want = m.score(toks)
  mpath = os.path.join(old, store.MANIFEST)
  m = json.load(open(mpath))
  assert m["quant"].pop("dense_first_layer_bits") == 4
  json.dump(m, open(mpath, "w"))
  _, tree = store.dense_abstract(old)
  assert tree.layers[0].attn.kv_b.bits == 4 and tree.layers[1].attn.kv_b.bits == 4
  with glmjax.load(old, progress=False) as m:
    np.testing.assert_array_equal(m.score(toks), want)
  q = quantize(np.ones((2, 64), np.float32), 8)
  assert as_f32(q).shape == (2, 64)


# --- quality on the embedded model -----------------------------------------------------------

# Measured on json/encoder.py's first 384 tokens: the default store (int4 experts, bf16 dense)
# is at KL 2.39e-3 of the float model. Added to it: int8 dense (the recipe: G128, its first
# layer bf16) 3.8e-5; int8 G64 with its first layer int8 (the recipe before) 6.8e-4; int4 dense
# (heads int8) 1.58e-2, with its first layer int8 1.16e-2. The bounds hold the measured figures
# at about 2x, as the other quality tests do; the order checks that the first layer's width is
# what buys the quality.
INT8_ADDED_MAX, INT8_FIRST_INT8_ADDED_MAX, INT4_ADDED_MAX = 3e-4, 1.5e-3, 3e-2
STORES = {"int8": ("--dense_bits=8",), "int8 G64, first layer int8": (
    "--dense_bits=8", "--dense_group_size=64", "--dense_first_layer_bits=8"),
    "int4": ("--dense_bits=4",),
    "int4, first layer int8": ("--dense_bits=4", "--dense_first_layer_bits=8")}
# Issue 28's target: int8 dense adds at most 1e-4 to the default store's KL, mean over the ten
# held-out files' first 384 tokens (scripts/dense_kl.py: -1.59e-4 with the int8 recipe;
# +2.45e-4 at G64 with the first layer int8).
TARGET_ADDED_MAX = 1e-4


@pytest.fixture(scope="module")
def embedded_dense(tmp_path_factory):
  """The embedded model converted as `STORES` says (other flags default): {name: path}."""
  from conftest import convert_store
  from glmjax.formats import embedded
  out = {}
  for name, flags in STORES.items():
    dst = str(tmp_path_factory.mktemp("embedded_dense") / "s")
    r = convert_store(embedded.ensure(progress=False), dst, *flags)
    assert r.returncode == 0, r.stderr
    out[name] = dst
  return out


def _kl(ref_logits, logits) -> float:
  lp, lq = jax.nn.log_softmax(ref_logits, -1), jax.nn.log_softmax(logits, -1)
  return float(np.mean(np.sum(np.exp(lp) * (lp - lq), -1)))


def _scores(path, toks: list) -> list:
  with glmjax.load(path, progress=False) as m:
    return [m.score(t)[0] for t in toks]


def test_dense_formats_kl_on_the_embedded_model(embedded_store, embedded_dense):
  from test_readme import heldout_tokens
  ref = glmjax.load(progress=False)
  toks = [heldout_tokens(ref)]
  logits = ref.score(toks[0])[0]
  base = _kl(logits, _scores(embedded_store, toks)[0])
  added = {name: _kl(logits, _scores(path, toks)[0]) - base
           for name, path in embedded_dense.items()}
  first_int8 = added["int8 G64, first layer int8"]
  assert 0 < added["int8"] <= INT8_ADDED_MAX, added
  assert added["int8"] < first_int8 <= INT8_FIRST_INT8_ADDED_MAX, added
  assert first_int8 < added["int4, first layer int8"] < added["int4"] <= INT4_ADDED_MAX, added


def test_the_int8_recipe_meets_the_kl_target(embedded_store, embedded_dense):
  """Issue 28's quality target on the held-out files: `--dense_bits=8` (G128, the first layer
  bf16) adds at most 1e-4 to the default store's KL, mean over the ten files' first 384 tokens;
  with its first layer int8 (G64, the recipe before) it adds more."""
  from glmjax.formats import corpus
  texts = [t for t in (corpus.read(f) for f in corpus.HELD_OUT) if t]
  assert len(texts) == 10
  ref = glmjax.load(progress=False)
  toks = [np.asarray([ref.tokenizer.encode(t)[:384]], np.int32) for t in texts]
  want = [ref.score(t)[0] for t in toks]
  kl = {name: np.mean([_kl(w, g) for w, g in zip(want, _scores(path, toks))])
        for name, path in (("default", embedded_store),
                           ("int8", embedded_dense["int8"]),
                           ("first layer int8", embedded_dense["int8 G64, first layer int8"]))}
  added = {k: v - kl["default"] for k, v in kl.items()}
  assert added["int8"] <= TARGET_ADDED_MAX < added["first layer int8"], added


def test_a_bf16_store_stays_bf16_on_a_cpu(embedded_store):
  """dtype="auto" (the default) keeps a default store's bfloat16 dense weights bfloat16 on a
  CPU (the numba kernel, float32 accumulation) with a float32 KV cache; the values equal a
  float32 load's up to summation order, and greedy decoding agrees."""
  from test_readme import heldout_tokens
  with glmjax.load(embedded_store, progress=False) as m, \
      glmjax.load(embedded_store, dtype="float32", progress=False) as f32:
    assert (m.options.dtype, m.options.kv_dtype_name) == ("bfloat16", "float32")
    assert m.weights.layers[0].attn.q_a.dtype == jnp.bfloat16
    assert f32.weights.layers[0].attn.q_a.dtype == jnp.float32
    assert m.memory.dense < 0.6 * f32.memory.dense  # the plan follows the dtype
    toks = heldout_tokens(m, n=128)
    assert rel_err(m.score(toks), f32.score(toks)) < 1e-5
    prompt = [int(t) for t in toks[0, :24]]
    got = m.generate(prompt, max_new_tokens=16, temperature=0.0)
    want = f32.generate(prompt, max_new_tokens=16, temperature=0.0)
    assert got.tokens == want.tokens


def test_int4_dense_store_fuses_speculates_and_serves_bitwise(embedded_dense):
  """The int4-dense embedded store (int4 matmuls, int8 head) through the offload engine's
  fused steps (a pin tier and a warmed host cache of every expert) and MTP speculation gives
  the resident model's logits and greedy tokens bit for bit; the server, asked by the openai
  SDK at temperature 0, answers with the same text as `generate`."""
  import openai
  from glmjax.bench.reporting import store_geometry
  from glmjax.serving.app import create_app
  from test_serve import serving
  path = embedded_dense["int4"]
  prompt = "def parse_args(argv):\n    "
  with glmjax.load(path, progress=False) as m:
    assert m.engine.all_resident and m.weights.layers[2].attn.q_b.bits == 4
    ids = m.tokenizer.encode(prompt)
    logits, plain = m.score(np.array([ids])), m.generate(ids, 12, stop_ids=[]).tokens
  total = store_geometry(path)["expert_bytes_total"]
  with glmjax.load(path, progress=False, device_cache_gb=0.3 * total / GiB,
                   host_cache_gb=2 * total / GiB) as m:
    eng = m.engine
    assert not eng.all_resident
    eng.warm_host()
    spec = m.generate(ids, 12, stop_ids=[], draft=3)
    assert spec.tokens == plain and spec.stats["draft_proposed"] > 0
    np.testing.assert_array_equal(m.score(np.array([ids])), logits)
    assert eng.telemetry().get("fused_steps", 0) > 0
    app = create_app(m, max_batch=2, max_queue=2, warm_prefill=False)
    with serving(app) as port:
      client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                             max_retries=0)
      got = client.completions.create(model=app.state.model_name, prompt=prompt,
                                      max_tokens=8, temperature=0)
    want = m.generate(prompt, 8).text
    assert got.choices[0].text == want


def test_mtp_own_head_follows_the_head_recipe(tmp_path):
  """A checkpoint whose MTP layer has its own shared_head.head: stored and read back as a head
  (int8 under int4 dense), not as the embedding (int4); the store scores and drafts."""
  from glmjax.formats import checkpoint
  from glmjax.formats.safetensors_io import SafetensorsFile, write
  from hf_reference import tiny_config
  cfg = tiny_config(num_nextn_predict_layers=1)
  own = str(tmp_path / "own")
  checkpoint.save_hf(weights.init(cfg, seed=1), cfg, own)
  fname = os.path.join(own, "model.safetensors")
  f = SafetensorsFile(fname)
  tensors = {k: np.array(f.read(k)) for k in f.keys()}
  del f
  tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"] * 0.5
  write(fname, tensors)
  dst = str(tmp_path / "s")
  r = convert(own, dst, "--dense_bits=4")
  assert r.returncode == 0, r.stderr
  assert store.read_manifest(dst)["mtp_has_head"]
  _, dense = store.load_dense(dst, progress=False)
  assert dense.mtp[0].head.bits == HEAD_BITS and dense.embed.bits == EMBED_BITS[4]
  with glmjax.load(dst, progress=False) as m:
    assert np.isfinite(m.score(tokens(1, 1, 8, vocab=64))).all()


_MESH_RUN = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
import numpy as np, glmjax
from glmjax import sharding
path = sys.argv[1]
toks = np.arange(3, 40, dtype=np.int32)[None]
with glmjax.load(path, progress=False) as m:
  a, g1 = m.score(toks), m.generate([5, 6, 7, 8], 6, stop_ids=[]).tokens
for sizes in ({"tensor": 2, "expert": 2},):  # rows split along tensor, experts along expert
  with glmjax.load(path, mesh=sharding.make_mesh(sizes), progress=False) as m:
    b, g2 = m.score(toks), m.generate([5, 6, 7, 8], 6, stop_ids=[]).tokens
    assert float(np.max(np.abs(a - b)) / np.max(np.abs(a))) <= 1e-5 and g1 == g2, sizes
    assert len(m.weights.layers[1].attn.q_b.packed.sharding.device_set) == 4
print("ok")
"""


def test_int8_dense_store_on_a_mesh(tmp_path):
  """An int8-dense store on 4 CPU devices (tensor × expert): the QArrays are placed by
  the plan (rows split as the float matrix's), and the results are those of one device."""
  import subprocess
  import sys
  from glmjax.formats import embedded
  dst = str(tmp_path / "s8")
  r = convert(embedded.ensure(progress=False), dst, "--dense_bits=8")
  assert r.returncode == 0, r.stderr
  r = subprocess.run([sys.executable, "-c", _MESH_RUN, dst], capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_dense_store_offloaded_equals_resident(dense_store):
  """With no expert cache the offload engine runs the layer steps (each its own jit) on the
  quantized dense weights: the same logits and greedy tokens as the resident model."""
  bits, first, group, path = dense_store
  toks = tokens(1, 2, 12)
  with glmjax.load(path, progress=False) as m:
    want, greedy = m.score(toks), m.generate([5, 6, 7, 8, 9, 10], 8, stop_ids=[]).tokens
  with glmjax.load(path, progress=False, device_cache_gb=0, host_cache_gb=0) as m:
    assert not m.executor.stateless and isinstance(m.engine.dense.layers[1].attn.kv_b, QArray)
    np.testing.assert_array_equal(m.score(toks), want)
    assert m.generate([5, 6, 7, 8, 9, 10], 8, stop_ids=[]).tokens == greedy
