"""Calibration statistics and calibrated stores (issue 30): the statistics equal a direct numpy
computation over the same routed tokens (float checkpoint and quantized store); stores
converted with --quant=imatrix|gptq keep the format, record their method and statistics, load
and run bitwise identically across offload budgets; resuming with other statistics is refused;
the quality report is reproducible."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glmjax
from glmjax.errors import InputError
from glmjax.formats import calibration, convert as convert_mod
from glmjax.formats.convert import convert
from glmjax.model import forward
from glmjax.model.quant import ExpertPool, dequantize
from glmjax.formats import quality
from glmjax.formats.calibrate import Accumulator, collect, stats_fn
from hf_reference import make_hf

CFG = dict(n_routed_experts=8, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=32,
           index_topk=6, num_hidden_layers=3, indexer_types=["full", "shared", "full"])
GB = 1 << 30
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("calib_src"))
  make_hf(path, seed=41, std=0.05, **CFG)
  return path


def _batch(seed=0):
  toks = np.random.default_rng(seed).integers(1, 90, (2, 24)).astype(np.int32)
  return toks, np.array([24, 17], np.int32)  # the second row padded after 17 tokens


def _stats(model, seed=0) -> dict:
  toks, valid = _batch(seed)
  acc = Accumulator()
  acc.add(stats_fn(model.weights, jnp.asarray(toks), jnp.asarray(valid), forward.fresh_start(),
                   cfg=model.config))
  return acc.sums


@pytest.fixture(scope="module")
def float_model(src):
  return glmjax.load(src, progress=False)


@pytest.fixture(scope="module")
def stats_dir(float_model, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("calib") / "stats")
  calibration.save(path, _stats(float_model), {"moe_layers": float_model.moe_layers,
                                               "min_tokens": 4})
  return path


@pytest.fixture(scope="module")
def rtn_store(src, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("calib_rtn") / "s")
  convert(src, path, progress=False)
  return path


def _numpy_stats(model):
  """The statistics recomputed plainly (float64) from each MoE layer's routed inputs, caught
  on their way to the experts, and the experts' weights (dequantized for a store)."""
  toks, valid = _batch()

  @jax.jit
  def routed(w, toks, valid):  # each MoE layer's (normed inputs [T, D], ids [T, K])
    caught = {}

    def catch(layer, m, chunks):
      for r in chunks:
        caught[layer] = (r.flat, r.ids)
      yield from forward.resident_experts()(layer, m, chunks)

    forward.forward(w, toks, model.config, n_valid=valid, start=forward.fresh_start(),
                    drive=forward.Drive(catch))
    return caught

  caught = {l: (np.asarray(f, np.float64), np.asarray(i)) for l, (f, i) in
            routed(model.weights, jnp.asarray(toks), jnp.asarray(valid)).items()}
  real = (np.arange(toks.shape[1])[None] < valid[:, None]).reshape(-1)
  out = {k: [] for k in calibration.KEYS}
  for layer in model.moe_layers:
    flat, ids = caught[layer]
    ex = model.weights.layers[layer].mlp.experts
    gu, dn = ((dequantize(ex.gate_up), dequantize(ex.down)) if isinstance(ex, ExpertPool)
              else (ex.gate_up, ex.down))
    gu = np.asarray(gu, np.float64)
    rows = {k: [] for k in calibration.KEYS}
    for e in range(gu.shape[0]):
      x = flat[real & np.any(ids == e, axis=1)]
      g, u = np.split(x @ gu[e].T, 2, axis=1)
      a = g / (1 + np.exp(-g)) * u
      for k, v in (("count", len(x)), ("gate_up_sq", (x ** 2).sum(0)), ("down_sq", (a ** 2).sum(0)),
                   ("gate_up_gram", x.T @ x), ("down_gram", a.T @ a)):
        rows[k].append(v)
    for k in out:
      out[k].append(np.array(rows[k]))
  return {k: np.array(v) for k, v in out.items()}, real.sum()


@pytest.mark.parametrize("kind", ["float", "store"])
def test_statistics_equal_numpy_over_the_routed_tokens(kind, float_model, rtn_store):
  model = float_model if kind == "float" else glmjax.load(rtn_store, progress=False)
  got = _stats(model)
  want, n_real = _numpy_stats(model)
  k = model.config.num_experts_per_tok
  np.testing.assert_array_equal(got["count"].sum(1), k * n_real)  # padding never counted
  for key in calibration.KEYS:
    # float32 sums in the jit against float64 here: near-zero Gram entries get an absolute
    # tolerance at the matrix's scale
    np.testing.assert_allclose(got[key], want[key], rtol=2e-5,
                               atol=1e-6 * np.abs(want[key]).max(), err_msg=key)
  if kind == "store":  # the quantized model's statistics, not the float model's
    assert not np.allclose(got["down_sq"], _stats(float_model)["down_sq"], rtol=1e-4)


def test_layer_sequential_statistics_are_the_gptq_stores_inputs(src, float_model, tmp_path):
  """Layer-sequential calibration (the default): the first MoE layer's statistics are the float
  model's; every layer's input statistics (count, Σx², Σxᵀx) are those a plain pass measures
  on the store `convert --quant=gptq` writes from them, so the earlier layers were quantized
  exactly as the converter quantizes them; after the first layer they are not the float
  model's. Every pass runs one program: a quantized layer's experts are placed as the leaves
  they replace (an uncommitted array made a new program per pass, one per MoE layer)."""
  from glmjax.formats.calibrate import stats_fn
  toks, valid = _batch()
  rows = [(toks[i], int(valid[i]), True) for i in range(len(toks))]
  stats_fn.clear_cache()  # this process's programs of it (the persistent cache keeps them)
  seq_sums = collect(float_model, rows, len(rows), gram=True, progress=False)
  assert stats_fn._cache_size() == 1  # pylint: disable=protected-access
  plain = collect(float_model, rows, len(rows), gram=True, progress=False, sequential=False)
  assert len(float_model.moe_layers) == 2
  for key in calibration.KEYS:
    np.testing.assert_array_equal(seq_sums[key][0], plain[key][0], err_msg=key)
  stats = str(tmp_path / "stats")
  calibration.save(stats, seq_sums, {"moe_layers": float_model.moe_layers,
                                     "min_tokens": calibration.MIN_TOKENS})
  convert(src, str(tmp_path / "gptq"), quant="gptq", calibration=stats, dense_dtype="float32",
          progress=False)  # float32 dense: the same routing as the float model
  with glmjax.load(str(tmp_path / "gptq"), progress=False) as store:
    on_store = collect(store, rows, len(rows), gram=True, progress=False, sequential=False)
  np.testing.assert_array_equal(on_store["count"], seq_sums["count"])
  for key in ("gate_up_sq", "gate_up_gram"):
    want = seq_sums[key]
    np.testing.assert_allclose(on_store[key], want, rtol=2e-5, atol=1e-6 * np.abs(want).max(),
                               err_msg=key)
  assert not np.allclose(seq_sums["gate_up_gram"][1], plain["gate_up_gram"][1], rtol=1e-3)


@pytest.mark.parametrize("quant", ["imatrix", "gptq"])
def test_calibrated_store_loads_and_is_bitwise_identical_across_budgets(
    quant, src, stats_dir, rtn_store, tmp_path):
  dst = str(tmp_path / quant)
  man = convert(src, dst, progress=False, quant=quant, calibration=stats_dir)
  meta = json.load(open(f"{stats_dir}/{calibration.META}"))
  assert man["quant"]["method"] == quant and man["quant"]["calibration"] == meta["sha256"]
  assert man["quant"]["fallback_experts"] == int((_stats_counts(stats_dir) < 4).sum())
  ref = glmjax.load(dst, progress=False)
  assert ref.engine.all_resident
  logits, tokens = ref.score(np.array([PROMPT])), ref.generate(PROMPT, 6, stop_ids=[]).tokens
  rtn = glmjax.load(rtn_store, progress=False).score(np.array([PROMPT]))
  assert not np.array_equal(logits, rtn)  # the calibrated quantizer changed the experts
  chunk = man["experts"]["main"]["layout"]["nbytes"]
  slot = len(man["moe_layers"]) * chunk / GB
  # all resident against a budget of its own per method (the budgets' rules are
  # test_offload's; what matters here is that the calibrated chunks flow through the tiers)
  dev, host = {"imatrix": (0, 0), "gptq": (2 * slot, 3 * chunk / GB)}[quant]
  m = glmjax.load(dst, progress=False, device_cache_gb=dev, host_cache_gb=host)
  assert not m.engine.all_resident
  np.testing.assert_array_equal(m.score(np.array([PROMPT])), logits)
  assert m.generate(PROMPT, 6, stop_ids=[]).tokens == tokens


def _stats_counts(path):
  return calibration.Calibration(path).arrays["count"]


def test_resume_or_rerun_with_other_statistics_is_refused(src, float_model, stats_dir,
                                                         tmp_path, monkeypatch):
  other = str(tmp_path / "other")
  calibration.save(other, _stats(float_model, seed=1), {"moe_layers": float_model.moe_layers})
  dst = str(tmp_path / "s")
  real, calls = convert_mod._expert_chunk, []

  def dies(*a, **k):  # an interruption after a few experts
    calls.append(1)
    if len(calls) > 3:
      raise KeyboardInterrupt
    return real(*a, **k)

  monkeypatch.setattr(convert_mod, "_expert_chunk", dies)
  with pytest.raises(KeyboardInterrupt):
    convert(src, dst, progress=False, workers=1, quant="gptq", calibration=stats_dir)
  monkeypatch.setattr(convert_mod, "_expert_chunk", real)
  for kw in (dict(quant="gptq", calibration=other), dict(quant="imatrix", calibration=stats_dir)):
    with pytest.raises(InputError, match="other method or statistics"):
      convert(src, dst, progress=False, **kw)
  convert(src, dst, progress=False, quant="gptq", calibration=stats_dir)  # the same: resumes
  with pytest.raises(InputError, match="complete store"):
    convert(src, dst, progress=False, quant="gptq", calibration=other)
  with pytest.raises(InputError, match="needs --calibration"):
    convert(src, str(tmp_path / "t"), progress=False, quant="gptq")


def test_quant_report_is_reproducible(float_model, rtn_store):
  seqs = list(_batch()[0])  # one shape: one compile per weights variant
  store = glmjax.load(rtn_store, progress=False)
  first = quality.report(float_model, {"rtn": store}, seqs)
  assert first == quality.report(float_model, {"rtn": store}, seqs)
  row = first["rtn"]
  assert row["kl"] > 0 and 0 < row["top1_agreement"] <= 1
  assert sorted(row["layers"]) == [str(i) for i in store.moe_layers]
  assert all(0 < v < 10 * row["kl"] for v in row["layers"].values())


def test_readme_two_step_path_as_a_user_runs_it(tmp_path):
  """calibrate.py, convert.py --quant=imatrix and quant_report.py (each script's `main` with
  its flags parsed, `conftest.run_script`; test_kill_writers starts the first two as processes)
  on the embedded model, default flags but a small JSONL corpus (the default is 65,536 tokens
  of the training split, minutes here): the statistics' hash reaches the store's manifest, and
  the report's KL is the one `quality.report` gives for the same sequences."""
  from conftest import run_script
  from glmjax.formats import corpus, embedded, store as store_mod
  texts = [t[:3000] for t in (corpus.read(f) for f in corpus.train_sample()[:4]) if t]
  jsonl = tmp_path / "calib.jsonl"
  jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
  held = tmp_path / "held.jsonl"
  held.write_text(json.dumps({"text": corpus.read(corpus.HELD_OUT[0])}) + "\n")
  stats, dst, out = tmp_path / "stats", tmp_path / "store", tmp_path / "q.json"

  def script(name, *args):
    r = run_script(name, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r

  r = script("calibrate.py", f"--out={stats}", f"--corpus={jsonl}")
  meta = json.loads((stats / "calibration.json").read_text())
  assert meta["tokens"] > 0 and f"sha256 {meta['sha256'][:16]}" in r.stdout
  src = embedded.ensure(progress=False)
  script("convert.py", f"--src={src}", f"--dst={dst}", "--quant=imatrix",
         f"--calibration={stats}")
  quant = store_mod.read_manifest(str(dst))["quant"]
  assert quant["method"] == "imatrix" and quant["calibration"] == meta["sha256"]
  # 3,000 characters of 4 files: some expert sees under MIN_TOKENS and takes the pooled rule
  assert quant["fallback_experts"] == meta["fallback_experts"] >= 1
  script("quant_report.py", f"--stores={dst}", f"--corpus={held}", "--tokens=128",
         "--per_layer=false", f"--json={out}")
  got = json.loads(out.read_text())["stores"][str(dst)]
  with glmjax.load(src, progress=False) as ref, glmjax.load(str(dst), progress=False) as q:
    seq = np.asarray(ref.tokenizer.encode(corpus.read(corpus.HELD_OUT[0]))[:128], np.int32)
    want = quality.report(ref, {"s": q}, [seq], False)["s"]
  assert got["kl"] == pytest.approx(want["kl"], rel=1e-6) and got["kl"] > 0
  assert got["top1_agreement"] == want["top1_agreement"]


def test_calibration_and_the_report_refuse_an_offloaded_store(float_model, rtn_store):
  """Both need every expert at hand: a store loaded behind small caches is refused with an
  InputError naming it, before the store runs; the same store fully resident is taken."""
  from glmjax.formats import calibrate
  offloaded = glmjax.load(rtn_store, progress=False, device_cache_gb=0, host_cache_gb=0)
  with pytest.raises(InputError, match=f"{rtn_store}.*do not all fit in memory"):
    quality.report(float_model, {"rtn": offloaded}, list(_batch()[0]))
  with pytest.raises(InputError, match=f"{rtn_store}.*do not all fit in memory"):
    calibrate.calibrate(offloaded, ["unused"])
  offloaded.close()
  resident = glmjax.load(rtn_store, progress=False)
  assert resident.executor.resident_weights("unused") is resident.weights
