"""Checkpoint loading: lazy reads, the MTP layer, and clear errors for bad checkpoints."""

import json
import os
import shutil

import numpy as np
import pytest

import glmjax
from glmjax.formats import checkpoint
from glmjax.model import weights
from glmjax.model.config import Config
from glmjax.errors import CheckpointError
from glmjax.formats.safetensors_io import SafetensorsFile, write
from hf_reference import make_hf, tiny_config

SINGLE = "model.safetensors"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("good"))
  make_hf(path, seed=11)
  return path


def _copy(good, tmp_path):
  dst = str(tmp_path / "ckpt")
  shutil.copytree(good, dst)
  return dst


def _rewrite(path, edit):
  """Applies `edit(dict)` to the single-file checkpoint's tensors and writes it back."""
  f = SafetensorsFile(os.path.join(path, SINGLE))
  tensors = {k: np.array(f.read(k)) for k in f.keys()}
  del f
  edit(tensors)
  write(os.path.join(path, SINGLE), tensors)


def test_missing_tensor_named(good, tmp_path):
  path = _copy(good, tmp_path)
  name = "model.layers.2.mlp.experts.5.up_proj.weight"
  _rewrite(path, lambda t: t.pop(name))
  with pytest.raises(CheckpointError, match=f"missing tensor.*{name}"):
    glmjax.load(path, progress=False)


def test_unexpected_tensor_named(good, tmp_path):
  path = _copy(good, tmp_path)
  _rewrite(path, lambda t: t.update({"model.layers.1.mlp.mystery.weight": np.zeros(3, np.float32)}))
  with pytest.raises(CheckpointError, match=r"unexpected tensor.*model\.layers\.1\.mlp\.mystery"):
    glmjax.load(path, progress=False)


def test_shape_mismatch_named(good, tmp_path):
  path = _copy(good, tmp_path)
  name = "model.layers.0.self_attn.kv_b_proj.weight"
  _rewrite(path, lambda t: t.update({name: t[name][:-1]}))
  with pytest.raises(CheckpointError, match=f"{name}: shape"):
    glmjax.load(path, progress=False)


def test_truncated_shard_named(good, tmp_path):
  path = _copy(good, tmp_path)
  file = os.path.join(path, SINGLE)
  with open(file, "r+b") as f:
    f.truncate(os.path.getsize(file) - 100)
  with pytest.raises(CheckpointError, match="model.safetensors: truncated file"):
    glmjax.load(path, progress=False)


def test_corrupt_header_and_missing_files(good, tmp_path):
  path = _copy(good, tmp_path)
  with open(os.path.join(path, SINGLE), "r+b") as f:
    f.seek(8)
    f.write(b"\xff\xfe garbage")
  with pytest.raises(CheckpointError, match="corrupt safetensors header"):
    glmjax.load(path, progress=False)
  os.remove(os.path.join(path, SINGLE))
  with pytest.raises(CheckpointError, match="no model.safetensors"):
    glmjax.load(path, progress=False)
  with pytest.raises(CheckpointError, match="not found"):
    glmjax.load(str(tmp_path / "nowhere"), progress=False)


def test_missing_shard_named(good, tmp_path):
  from hf_reference import shard
  path = _copy(good, tmp_path)
  shard(path, n=2)
  os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
  with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: safetensors file not found"):
    glmjax.load(path, progress=False)


def test_fp8_tensor_refused_with_name(good, tmp_path):
  import ml_dtypes
  path = _copy(good, tmp_path)
  name = "model.layers.0.mlp.down_proj.weight"
  _rewrite(path, lambda t: t.update({name: t[name].astype(ml_dtypes.float8_e4m3fn)}))
  with pytest.raises(CheckpointError, match=f"{name} has dtype float8_e4m3fn"):
    glmjax.load(path, progress=False)


def test_mtp_layer_recognised_and_kept(tmp_path):
  """A checkpoint with layer num_hidden_layers (the MTP head) loads; the head is kept."""
  cfg = tiny_config(num_nextn_predict_layers=1)
  w = weights.init(cfg, seed=1)
  checkpoint.save_hf(w, cfg, str(tmp_path))
  # Real GLM-5 MTP layers also carry indexer tensors, which the MTP block never uses.
  _rewrite(str(tmp_path), lambda t: t.update(
      {"model.layers.2.self_attn.indexer.wk.weight": np.zeros((8, 32), np.float32)}))
  model = glmjax.load(str(tmp_path), progress=False)
  assert len(model.weights.mtp) == 1
  np.testing.assert_array_equal(model.weights.mtp[0].eh_proj, w.mtp[0].eh_proj)
  np.testing.assert_array_equal(model.weights.mtp[0].layer.mlp.experts.down,
                                w.mtp[0].layer.mlp.experts.down)
  # The main model is unaffected by the MTP layer's presence.
  np.testing.assert_array_equal(model.weights.layers[1].mlp.router, w.layers[1].mlp.router)


def test_save_load_round_trip_sharded(tmp_path):
  from glmjax.formats import embedded
  cfg = Config.from_dict(embedded.CONFIG)
  w = weights.init(cfg, seed=2)
  checkpoint.save_hf(w, cfg, str(tmp_path), shard_bytes=200_000)
  assert os.path.exists(tmp_path / checkpoint.INDEX)
  with open(tmp_path / checkpoint.INDEX) as f:
    assert len(set(json.load(f)["weight_map"].values())) > 2
  cfg2, w2 = checkpoint.load_hf(str(tmp_path), progress=False)
  assert cfg2 == cfg
  for a, b in zip(weights.leaves_with_info(w), weights.leaves_with_info(w2)):
    np.testing.assert_array_equal(a, b)
