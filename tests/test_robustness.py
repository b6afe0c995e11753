"""Failures leave everything usable; nothing leaks; bad weights are refused at load.

Each test here reproduces a defect found when the first slice was tried as a new user would
(see DESIGN.md §27): it failed on that code.
"""

import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest

import glmjax
from glmjax.formats import embedded, store
from glmjax.offload import tiers
from glmjax.errors import CheckpointError, GlmjaxError, InputError
from glmjax.offload.expert_io import ExpertIOError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1 << 30
OFFLOAD = dict(progress=False, device_cache_gb=0, host_cache_gb=0, prefetch=False)


def io_threads() -> int:
  gc.collect()  # engines of earlier tests, kept only by reference cycles, are finalized here
  return sum(t.name.startswith("glmjax-io") for t in threading.enumerate())


@pytest.fixture
def private_store(embedded_store, tmp_path):
  """A copy of the default-converted embedded store that a test may damage."""
  dst = str(tmp_path / "store")
  shutil.copytree(embedded_store, dst)
  return dst


def faulty_reader(model, bad_layer):
  """Makes every read of `bad_layer` fail; returns a function that restores the reader."""
  reader = model.engine.reader
  read = reader.read_fn

  def faulty(layer, expert):
    if layer == bad_layer:
      raise OSError(5, "Input/output error")
    return read(layer, expert)

  reader.read_fn = faulty
  return lambda: setattr(reader, "read_fn", read)


def test_failed_turn_leaves_the_session_as_before(embedded_store):
  """An ExpertIOError part-way through a forward (after earlier layers consumed the cache):
  the failed turn is forgotten and the next send equals a fresh session's."""
  model = glmjax.load(embedded_store, **OFFLOAD)
  kw = dict(max_new_tokens=8, stop_ids=[])
  chat = model.chat()
  chat.send("def add(a, b):", **kw)
  before = list(chat.messages)
  restore = faulty_reader(model, model.engine.moe_layers[-1])  # the last MoE layer fails
  with pytest.raises(ExpertIOError, match=r"layer \d+ expert \d+"):
    chat.send("def sub(a, b):", **kw)
  assert chat.messages == before
  restore()
  again = chat.send("def mul(a, b):", **kw)
  fresh = model.chat()
  fresh.send("def add(a, b):", **kw)
  want = fresh.send("def mul(a, b):", **kw)
  assert again.tokens == want.tokens and again.text == want.text
  assert chat.tokens == fresh.tokens


def test_failed_generate_and_score_leave_the_model_usable(embedded_store):
  model = glmjax.load(embedded_store, **OFFLOAD)
  toks = [[5, 6, 7, 8, 9, 10, 11, 12]]
  ref_logits, ref = model.score(toks), model.generate("def ", 6, stop_ids=[]).tokens
  restore = faulty_reader(model, model.engine.moe_layers[1])
  with pytest.raises(ExpertIOError):
    model.generate("def ", 6, stop_ids=[])
  with pytest.raises(ExpertIOError):
    model.score(toks)
  restore()
  np.testing.assert_array_equal(model.score(toks), ref_logits)
  assert model.generate("def ", 6, stop_ids=[]).tokens == ref


def test_corrupt_chunk_on_disk_is_named_and_the_session_goes_on(private_store):
  """Damage an expert chunk file itself (the crc32c codec catches it), then restore it."""
  model = glmjax.load(private_store, **OFFLOAD)
  kw = dict(max_new_tokens=6, stop_ids=[])
  chat = model.chat()
  chat.send("import os", **kw)
  layer = model.engine.moe_layers[0]
  row = model.engine.store.where[layer][1]
  chunks = os.path.join(private_store, "experts", "main", "c", str(row))
  saved = {}
  for e in os.listdir(chunks):  # every expert of that layer: whichever is used is damaged
    f = os.path.join(chunks, e, "0")
    saved[f] = open(f, "rb").read()
    damaged = bytearray(saved[f])
    damaged[len(damaged) // 2] ^= 0xFF
    open(f, "wb").write(bytes(damaged))
  with pytest.raises(GlmjaxError, match=rf"layer {layer} expert \d+"):
    chat.send("import sys", **kw)
  for f, data in saved.items():
    open(f, "wb").write(data)
  again = chat.send("import re", **kw)
  fresh = model.chat()
  fresh.send("import os", **kw)
  assert again.tokens == fresh.send("import re", **kw).tokens


def test_close_joins_io_threads_and_is_idempotent(embedded_store):
  base = io_threads()
  for _ in range(3):
    with glmjax.load(embedded_store, **OFFLOAD) as model:
      assert io_threads() == base + 4
      model.generate("x = ", 2, stop_ids=[])
    assert io_threads() == base
  model.close()  # again: a no-op
  with pytest.raises(InputError, match="closed"):
    model.generate("x = ", 2)
  with pytest.raises(InputError, match="closed"):
    model.score([[5, 6]])


def test_dropped_models_release_threads_and_memory(embedded_store):
  base = io_threads()
  refs = []
  for _ in range(5):
    model = glmjax.load(embedded_store, **OFFLOAD)
    model.generate("x = ", 2, stop_ids=[])
    refs.append(weakref.ref(model.engine))
    del model
    gc.collect()
  assert all(r() is None for r in refs)  # engines (dense weights, pools, host cache) freed
  assert io_threads() == base


def test_generate_zero_tokens_with_draft():
  model = glmjax.load(progress=False)
  for draft in (2, "auto"):
    r = model.generate("def ", 0, draft=draft)
    assert r.tokens == [] and r.stop_reason == "max_new_tokens"


def _nan_source(tmp_path):
  from glmjax.formats.safetensors_io import SafetensorsFile, write
  src = embedded.ensure(progress=False)
  dst = str(tmp_path / "nan")
  shutil.copytree(src, dst)
  f = SafetensorsFile(os.path.join(src, "model.safetensors"))
  key = "model.layers.0.post_attention_layernorm.weight"
  tensors = {k: np.array(f.read(k)) for k in f.keys()}
  tensors[key] = tensors[key].copy()
  tensors[key][3] = np.nan
  write(os.path.join(dst, "model.safetensors"), tensors)
  return dst, key


def test_nan_weight_refused_loading_hf(tmp_path):
  path, key = _nan_source(tmp_path)
  with pytest.raises(CheckpointError, match=rf"{key}.*NaN"):
    glmjax.load(path, progress=False)


def test_nan_weight_refused_loading_store(private_store):
  """A store whose dense part holds a NaN (checksums made to match, so only the finiteness
  check can catch it)."""
  import orbax.checkpoint as ocp
  part = os.path.join(private_store, "dense", "layer_000")
  ckptr = ocp.StandardCheckpointer()
  arrays = {k: np.asarray(v) for k, v in ckptr.restore(os.path.abspath(part)).items()}
  arrays[".mlp_norm"] = arrays[".mlp_norm"].copy()
  arrays[".mlp_norm"][3] = np.nan
  shutil.rmtree(part)
  ckptr.save(os.path.abspath(part), arrays)
  ckptr.wait_until_finished()
  mpath = os.path.join(private_store, "manifest.json")
  manifest = json.load(open(mpath))
  manifest["dense"]["layer_000"][".mlp_norm"] = store.crc(arrays[".mlp_norm"])
  json.dump(manifest, open(mpath, "w"))
  with pytest.raises(CheckpointError,
                     match=r"layer_000.*model\.layers\.0\.post_attention_layernorm\.weight.*NaN"):
    glmjax.load(private_store, progress=False)


def test_chat_capacity_within_max_context():
  """A chat takes pages as it grows, up to the model's max_context and no further."""
  model = glmjax.load(progress=False, max_context=1000)
  chat = model.chat()
  assert chat.max_context == 1000 and chat.pages == []
  chat.send("def f(x):", 8)
  held = len(chat.pages)
  assert 1 <= held <= model.kv.layout.pages_for(1000)
  with pytest.raises(InputError, match="max_context"):
    chat.send("x" * 10, 1000)
  assert len(chat.pages) == held and len(chat.messages) == 2  # the refused turn left no trace


def test_send_rejects_unknown_arguments_before_generating():
  model = glmjax.load(progress=False)
  chat = model.chat()
  seen = []
  with pytest.raises(InputError, match="temprature"):
    chat.send("hello", 4, on_token=seen.append, temprature=0.5)
  assert seen == [] and chat.messages == [] and chat.tokens == []


def test_statistics_files_use_unique_temporary_names(tmp_path, monkeypatch):
  """Two processes sharing a store must not write through one fixed temporary path."""
  renamed = []
  real = os.replace
  monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append((a, b)), real(a, b))[1])
  path = str(tmp_path / "usage.json")
  tiers.Heat({(1, 2): 3.0}).save(path)
  tiers.Heat({(1, 2): 4.0}).save(path)
  table = str(tmp_path / "couple.npy")
  tiers.atomic_write(table, lambda f: np.save(f, np.ones(3)))
  sources = [a for a, _ in renamed]
  assert len(set(sources)) == 3 and path + ".tmp" not in sources
  assert [b for _, b in renamed] == [path, path, table]
  assert tiers.Heat.load(path)[(1, 2)] == 4.0 and np.load(table).sum() == 3
  assert sorted(os.listdir(tmp_path)) == ["couple.npy", "usage.json"]  # no temporaries left


def test_generate_script_takes_every_load_option(embedded_store):
  script = os.path.join(ROOT, "scripts", "generate.py")
  base = [sys.executable, script, f"--model={embedded_store}", "--prompt_ids=5,6,7,8"]
  flags = ["--max_new_tokens=3", "--pilot_k=2", "--couple_k=0", "--io_timeout_s=30",
           "--max_context=64", "--cache_route", "--route_keep=1", "--route_rank=8",
           "--device_cache_gb=0", "--host_cache_gb=0.001"]
  r = subprocess.run(base + flags, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  assert "3 tokens" in r.stdout
  r = subprocess.run(base + ["--max_context=6", "--max_new_tokens=3"], capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 1 and "exceeds max_context 6" in r.stderr


def test_generate_writes_no_statistics_until_close(embedded_store, tmp_path):
  """Offload statistics (20 MB at GLM-5's size) reach the store at close, not on every call."""
  import shutil
  store = tmp_path / "store"
  shutil.copytree(embedded_store, store)
  for name in ("usage.json", "couple.npy"):
    if os.path.exists(store / name):
      os.remove(store / name)
  with glmjax.load(str(store), progress=False, host_cache_gb=0.001) as m:
    m.generate("def ", 4)
    m.generate("import os\n", 4)
    assert not os.path.exists(store / "usage.json")
  assert os.path.exists(store / "usage.json") and os.path.exists(store / "couple.npy")
