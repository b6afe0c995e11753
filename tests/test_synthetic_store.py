"""Synthetic expert stores (glmjax.formats.synthetic, scripts/make_synthetic_store.py): they load
and decode like converted stores, are deterministic per seed, skew routing on request, keep
activations sane at GLM-5's expert size, and refuse bad requests clearly."""

import filecmp
import json
import re
import os
import subprocess
import sys

import numpy as np
import pytest

import glmjax
from glmjax.errors import CheckpointError, GlmjaxError
from glmjax.formats import store, synthetic
from pallas_kernels.xla import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "make_synthetic_store.py")
TINY = dict(geometry="tiny", moe_layers=2, experts=8, progress=False)
PROMPT = "def parse(line):"


def make(path, **kw):
  return synthetic.make_synthetic_store(str(path), **{**TINY, **kw})


def script(*args):
  return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                        timeout=300)


def expert_files(path):
  """{relative path: full path} of every file of the store's expert arrays."""
  root = os.path.join(path, "experts")
  return {os.path.relpath(os.path.join(d, f), root): os.path.join(d, f)
          for d, _, fs in os.walk(root) for f in fs}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
  base = tmp_path_factory.mktemp("synthetic")
  paths = {"a": base / "a", "a2": base / "a2", "b": base / "b", "zipf": base / "zipf"}
  make(paths["a"], seed=0)
  make(paths["a2"], seed=0, workers=3)  # another worker count: same bytes regardless
  make(paths["b"], seed=1)
  make(paths["zipf"], seed=0, zipf=1.0)
  return {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def model_a(stores):
  with glmjax.load(stores["a"], progress=False) as m:
    yield m


def test_same_seed_same_bytes_other_seed_differs(stores):
  a, a2, b = (expert_files(stores[k]) for k in ("a", "a2", "b"))
  assert set(a) == set(a2) == set(b) and len(a) > 8
  chunks = [k for k in a if not k.endswith("zarr.json")]
  assert len(chunks) == 2 * 8 + 8  # main: 2 layers × 8 experts; mtp: 8
  _, mismatch, errors = filecmp.cmpfiles(stores["a"] + "/experts", stores["a2"] + "/experts",
                                         list(a), shallow=False)
  assert not mismatch and not errors
  _, mismatch, _ = filecmp.cmpfiles(stores["a"] + "/experts", stores["b"] + "/experts",
                                    chunks, shallow=False)
  assert sorted(mismatch) == sorted(chunks)
  ma, mb = (store.read_manifest(stores[k]) for k in ("a", "b"))
  assert ma["dense"] == store.read_manifest(stores["a2"])["dense"] != mb["dense"]


def test_manifest_is_the_converters(stores, embedded_store):
  m, conv = store.read_manifest(stores["a"]), store.read_manifest(embedded_store)
  assert set(m) - set(conv) == {"synthetic"} and set(conv) <= set(m)
  assert m["quant"].keys() == conv["quant"].keys() and m["experts"].keys() == conv["experts"].keys()
  assert m["experts"]["main"]["layout"]["bits"] == 4 and m["experts"]["mtp"]["layout"]["bits"] == 8
  assert m["moe_layers"] == [1, 2] and m["mtp_layers"] == [3]
  assert m["synthetic"] == {"geometry": "tiny", "moe_layers": 2, "experts": 8,
                            "vocab_size": 4096, "seed": 0, "zipf": 0.0, "mtp": True}
  assert not os.path.exists(os.path.join(stores["a"], store.PROGRESS))
  for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    assert os.path.isfile(os.path.join(stores["a"], f))


def test_loads_decodes_and_offload_matches(stores, model_a):
  logits = model_a.score([[5, 6, 7, 8, 9, 10, 11, 12]])
  assert np.isfinite(logits).all() and 0.3 < logits.std() < 3, logits.std()
  ref = model_a.generate(PROMPT, 8, stop_ids=[])
  assert len(ref.tokens) == 8 and isinstance(ref.text, str)
  # The same seed written again, run from disk through a small host cache: same greedy tokens.
  with glmjax.load(stores["a2"], progress=False, host_cache_gb=0.0001,
                   device_cache_gb=0) as m:
    assert not m.executor.stateless
    r = m.generate(PROMPT, 8, stop_ids=[])
  assert r.tokens == ref.tokens and r.stats["expert_misses"] > 0


def concentration(counts):
  """Share of all picks taken by the most used quarter of the experts."""
  c = np.sort(np.asarray(counts))[::-1]
  return c[:max(1, len(c) // 4)].sum() / c.sum()


def test_zipf_skews_routing(stores, model_a):
  toks = np.random.default_rng(0).integers(7, 4096, (4, 64)).astype(np.int32)
  with glmjax.load(stores["zipf"], progress=False) as mz:
    skewed = mz.record_routing(toks)["ids"]  # [L, T, K]
    biases = [np.asarray(l.mlp.bias) for l in mz.weights.layers[1:]]
    routers = [np.asarray(l.mlp.router) for l in mz.weights.layers[1:]]
  plain = model_a.record_routing(toks)["ids"]
  q = synthetic.zipf_target(8, 2, 1.0)
  for layer in range(2):
    cz = np.bincount(skewed[layer].ravel(), minlength=8)
    c0 = np.bincount(plain[layer].ravel(), minlength=8)
    assert concentration(cz) > concentration(c0) + 0.1, (cz, c0)
    # The experts the bias favours are the ones used most.
    rank = lambda v: np.argsort(np.argsort(v))
    assert np.corrcoef(rank(biases[layer]), rank(cz))[0, 1] > 0.7, (biases[layer], cz)
    # Straightforward routing in numpy (sigmoid + bias, top-2) of unit-rms Gaussian inputs
    # through the stored router: pick rates by bias rank follow the Zipf target (loosely at the
    # tail: 8 random router rows in 128 dims are not quite independent).
    x = np.random.default_rng(1).standard_normal((20000, routers[layer].shape[1]))
    x /= np.sqrt((x ** 2).mean(-1, keepdims=True))
    sel = 1 / (1 + np.exp(-x @ routers[layer].T)) + biases[layer]
    top = np.argpartition(-sel, 1, axis=1)[:, :2]
    rate = (np.bincount(top.ravel(), minlength=8) / len(x))[np.argsort(-biases[layer])]
    np.testing.assert_allclose(rate[:3], q[:3], rtol=0.1)
    assert abs(concentration(rate) - concentration(q)) < 0.03 and np.all(rate[2:] < rate[1])


def test_glm5_chunk_size_and_unit_variance():
  raw = synthetic.synthetic_config("glm5", moe_layers=1, experts=8, vocab_size=4096)
  assert raw["hidden_size"] == 6144 and raw["moe_intermediate_size"] == 2048
  _, _, groups = synthetic.store_bytes(raw)
  layout = groups["main"][1]
  assert layout.nbytes == 20_054_016 and (layout.bits, layout.group_size) == (4, 64)
  assert groups["mtp"][1].bits == 8
  e = layout.unpack(synthetic.expert_chunk(layout, synthetic._rng(0, 0, 1, 0)))
  gu, dn = np.asarray(dequantize(e.gate_up)), np.asarray(dequantize(e.down))
  x = np.random.default_rng(0).standard_normal((32, 6144)).astype(np.float32)
  g, u = np.split(x @ gu.T, 2, axis=1)
  y = (g / (1 + np.exp(-g)) * u) @ dn.T
  assert 0.8 < g.var() < 1.25 and 0.8 < u.var() < 1.25 and 0.7 < y.var() < 1.4, (g.var(), y.var())


def test_script_defaults(tmp_path):
  dst = str(tmp_path / "s")
  r = script(f"--dst={dst}", "--geometry=tiny")
  assert r.returncode == 0, r.stderr
  assert "synthetic store complete" in r.stdout
  m = store.read_manifest(dst)
  assert m["synthetic"] == {"geometry": "tiny", "moe_layers": 2, "experts": 8,
                            "vocab_size": 4096, "seed": 0, "zipf": 0.0, "mtp": True}
  r = script(f"--dst={dst}", "--geometry=tiny")  # the same store again: nothing to do
  assert r.returncode == 0 and "already complete" in r.stdout, r.stderr
  r = script(f"--dst={dst}", "--geometry=tiny", "--seed=3")
  assert r.returncode == 1 and "already holds a complete store" in r.stderr


def test_script_bad_flag(tmp_path):
  r = script(f"--dst={tmp_path / 's'}", "--geometry=tiny", "--experts=1")
  assert r.returncode == 1 and "error: experts=1 is below" in r.stderr, r.stderr
  assert not os.path.exists(tmp_path / "s")


@pytest.mark.parametrize("kw, msg", [
    (dict(moe_layers=-1), "moe_layers must be a positive integer"),
    (dict(experts=1), "below the tiny geometry's top-k"),
    (dict(vocab_size=100), "below the shipped tokenizer"),
    (dict(geometry="huge"), "geometry must be one of"),
    (dict(zipf=-1.0), "zipf must be"),
    (dict(seed=-2), "seed must be"),
    (dict(moe_layers=5000), "num_hidden_layers=5001 is outside"),
])
def test_bad_arguments(tmp_path, kw, msg):
  with pytest.raises(GlmjaxError, match=msg):
    make(tmp_path / "s", **kw)
  assert not os.path.exists(tmp_path / "s")


def test_refuses_foreign_dir_and_full_disk(tmp_path, monkeypatch):
  foreign = tmp_path / "foreign"
  foreign.mkdir()
  (foreign / "notes.txt").write_text("mine")
  with pytest.raises(CheckpointError, match=re.escape(f"{foreign}: not empty")):
    make(foreign)
  assert (foreign / "notes.txt").read_text() == "mine"
  monkeypatch.setattr(synthetic, "_free_bytes", lambda path: 10 << 20)
  with pytest.raises(CheckpointError, match="needs .* GB and the disk has"):
    make(tmp_path / "full")
  assert not os.path.exists(tmp_path / "full")


def test_interrupted_store_is_started_over(tmp_path, stores, monkeypatch):
  dst = tmp_path / "s"
  real, calls = synthetic.expert_chunk, []

  def failing(*args):  # dies mid-run, as a kill or a full disk would
    calls.append(1)
    if len(calls) > 5:
      raise OSError("simulated crash")
    return real(*args)

  monkeypatch.setattr(synthetic, "expert_chunk", failing)
  with pytest.raises(OSError, match="simulated crash"):
    make(dst, seed=0)
  monkeypatch.setattr(synthetic, "expert_chunk", real)
  assert not (dst / store.MANIFEST).exists() and (dst / store.PROGRESS).exists()
  with pytest.raises(CheckpointError, match="incomplete expert store"):
    glmjax.load(str(dst), progress=False)
  make(dst, seed=0)  # started over: the same bytes as an uninterrupted run
  _, mismatch, errors = filecmp.cmpfiles(stores["a"] + "/experts", str(dst / "experts"),
                                         list(expert_files(stores["a"])), shallow=False)
  assert not mismatch and not errors
  assert store.read_manifest(str(dst))["dense"] == store.read_manifest(stores["a"])["dense"]


@pytest.mark.parametrize("bits,first,group", [(8, None, None), (8, 8, 64), (4, None, None),
                                               (4, 8, None)])
def test_dense_bits_writes_the_converters_dense_format(stores, model_a, tmp_path, bits, first,
                                                       group):
  """`dense_bits` 8 / 4: the manifest and the declaration say so, the store loads its
  quantizable leaves as QArrays at `DENSE_RECIPES`' widths (the first layer's as given; 0: the
  plain store's bf16) and `group` (None: the recipe's), and each is the converter's quantizer
  applied to the bf16 leaf the plain store (same seed) holds; the rest is unchanged."""
  from glmjax.formats.quantize import quantize
  from glmjax.model.quant import QArray
  from glmjax.model.weights import DENSE_RECIPES
  want_group = {8: 128, 4: 64}[bits] if group is None else group  # the recipes' groups
  dst = str(tmp_path / f"d{bits}")
  m = make(dst, seed=0, dense_bits=bits, dense_first_layer_bits=first, dense_group_size=group)
  widths = dict(DENSE_RECIPES[bits], **({} if first is None else {"first_layer": first}))
  assert m["quant"]["dense_bits"] == bits and m["quant"]["dense_group_size"] == want_group
  assert m["synthetic"]["dense_bits"] == bits
  assert m["quant"]["dense_first_layer_bits"] == widths["first_layer"]
  dense, _, _ = synthetic.store_bytes(m["source_config"], bits, first, group)
  assert dense < synthetic.store_bytes(m["source_config"])[0]
  with glmjax.load(dst, progress=False) as mq:
    wq, wa = mq.weights, model_a.weights
    pairs = [(wq.layers[0].attn.kv_b, wa.layers[0].attn.kv_b, "first_layer"),
             (wq.layers[1].attn.kv_b, wa.layers[1].attn.kv_b, "matmul"),
             (wq.layers[1].mlp.shared.gate_up, wa.layers[1].mlp.shared.gate_up, "matmul"),
             (wq.lm_head, wa.lm_head, "head")]
    for q, plain, kind in pairs:
      if not widths[kind]:  # kept float: the plain store's bf16 values
        assert not isinstance(q, QArray)
        np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(plain, np.float32))
        continue
      assert isinstance(q, QArray) and (q.bits, q.group_size) == (widths[kind], want_group)
      want = quantize(np.asarray(plain), q.bits, want_group)
      np.testing.assert_array_equal(np.asarray(q.packed), want.packed)
      np.testing.assert_array_equal(np.asarray(q.scales), want.scales)
    assert not isinstance(wq.layers[1].mlp.router, QArray)
    np.testing.assert_array_equal(np.asarray(wq.layers[1].mlp.router),
                                  np.asarray(wa.layers[1].mlp.router))
    assert mq.generate(PROMPT, 4, stop_ids=[]).tokens  # decodes on the quantized weights
  with pytest.raises(GlmjaxError, match="dense_bits"):
    make(str(tmp_path / "bad"), dense_bits=2)
  with pytest.raises(GlmjaxError, match="dense_first_layer_bits"):
    make(str(tmp_path / "bad"), dense_first_layer_bits=0)  # needs dense_bits
  with pytest.raises(GlmjaxError, match="dense_group_size"):
    make(str(tmp_path / "bad"), dense_bits=8, dense_group_size=63)
