"""Sharded runs on CPU devices (`--xla_force_host_platform_device_count`) against one device.

The device count must be set before JAX starts, so each check runs in a subprocess: one script
(`_SCRIPT`) runs the single-device reference, both meshes, the store on a 2-device mesh (all
resident, then tiered) and the bad meshes, and prints one JSON line the tests assert on.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

_SCRIPT = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
import jax, numpy as np, glmjax
from glmjax import sharding
from jax.sharding import Mesh

store = sys.argv[1]
toks = np.array([[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]], np.int32)
prompt, n = [5, 6, 7], 6
out = {}

ref = glmjax.load(progress=False)
logits = ref.score(toks)
out["ref_tokens"] = ref.generate(prompt, n).tokens
# A 16-position chat cache has generate's shapes here: no extra compilation.
out["ref_chat"] = ref.chat(max_context=16).send("hi", 4).tokens

for name, sizes in (("expert4", {"expert": 4}), ("expert2_tensor2", {"expert": 2, "tensor": 2}),
                    ("data2_expert2", {"data": 2, "expert": 2})):
  m = glmjax.load(mesh=sharding.make_mesh(sizes), progress=False)
  got = m.score(toks)
  r = {"rel": float(np.max(np.abs(got - logits)) / np.max(np.abs(logits))),
       "bitwise": bool(np.array_equal(got, logits))}
  # Every routed-expert leaf: its sharding and the expert counts its addressable shards hold.
  r["experts"] = [
      (repr(a.sharding.spec), sorted({s.data.shape[0] for s in a.addressable_shards}), a.shape[0])
      for lw in m.weights.layers + [t.layer for t in m.weights.mtp]
      if hasattr(lw.mlp, "experts") for a in (lw.mlp.experts.gate_up, lw.mlp.experts.down)]
  r["q_b"] = repr(m.weights.layers[0].attn.q_b.sharding.spec)
  if "data" in sizes:  # score only: its batch of 2 is split along data
    out[name] = r
    continue
  # Each generation path once (compiling is most of the cost): speculative decoding on one
  # mesh, plain decoding and chat on the other (test_two_processes_on_loopback: expert:4 plain).
  if "tensor" in sizes:
    r["tokens"] = m.generate(prompt, n).tokens
    r["chat"] = m.chat(max_context=16).send("hi", 4).tokens
  else:
    r["draft"] = m.generate(prompt, n, draft=1).tokens
    # the server's decode batch on the mesh (serve.py --mesh): one row, greedy
    from glmjax.decoding.generation import new_request
    from glmjax.serving.batch import BatchDecoder
    batch = BatchDecoder(m, 1, context=16)
    req = new_request(m, np.asarray(prompt, np.int32), n)
    done = batch.admit(np.asarray(prompt, np.int32), req)
    while not done:
      done = bool(batch.step())
    r["batch"] = list(req.out)
  out[name] = r

# The expert store on a 2-device mesh against the same store on one device.
with glmjax.load(store, progress=False) as s1:
  s_logits = s1.score(toks)
two = Mesh(np.asarray(jax.devices()[:2]), ("expert",))
with glmjax.load(store, mesh=two, progress=False) as s2:
  pool = s2.weights.layers[2].mlp.experts.gate_up.packed
  out["store"] = {"bitwise": bool(np.array_equal(s2.score(toks), s_logits)),
                  "shards": [s.data.shape[0] for s in pool.addressable_shards]}

# The tiered engine on the 2-device mesh (3 pins per device and layer, a 16-expert host cache)
# against the tiered engine on one device with nothing cached: the layer-by-layer steps are one
# graph whatever the tiers hold (the one-jit resident run fuses the dense math differently).
GB = 1 << 30
chunk = json.load(open(os.path.join(store, "manifest.json")))["experts"]["main"]["layout"]["nbytes"]
with glmjax.load(store, progress=False, device_cache_gb=0, host_cache_gb=0) as t1:
  t_logits = t1.score(toks)
layers = len(t1.moe_layers)
with glmjax.load(store, mesh=two, progress=False, device_cache_gb=3 * layers * chunk / GB,
                 host_cache_gb=16 * chunk / GB, prefetch=False) as t2:
  eng = t2.engine
  first = t2.score(toks)
  tokens = t2.generate(prompt, n).tokens
  again = t2.score(toks)  # warm tiers: more pins and host hits, the same logits
  st = eng.stats
  out["tiered"] = {
      "bitwise": [bool(np.array_equal(x, t_logits)) for x in (first, again)],
      "tokens": tokens, "offloaded": not t2.executor.stateless,
      "counts": [st["expert_pin_hits"], st["expert_host_hits"], st["expert_misses"],
                 st["experts_used"]],
      # per layer, per device: the experts in its pool's slots, and the device it sits on
      "pins": [[(d, [e for e in sh.expert_in if e is not None],
                 sorted(str(s.device) for s in sh.pool.gate_up.packed.addressable_shards))
                for d, sh in enumerate(eng.device[l].shards)] for l in eng.moe_layers],
      "block": eng.device[eng.moe_layers[0]].block,
      "devices": [str(d) for d in two.devices]}
with glmjax.load(store, mesh=two, progress=False, device_cache_gb=0, host_cache_gb=0) as t0:
  zero = t0.score(toks)  # nothing pinned or cached: every expert read and run on the host
  out["tiered"]["bitwise"].append(bool(np.array_equal(zero, t_logits)))

# A host-slab expert admitted into a pin pool on another device (install_from's copy through
# the host, as on an accelerator): the slot holds the expert's bytes, on that device.
from glmjax.formats.store import ExpertStore
from glmjax.offload import tiers
es = ExpertStore(store)
layer = es.layers[0]
slab = tiers.DevicePool(layer, 2, tiers.empty_pool(es.layout(layer), 2, jax.devices()[0]))
want = es.read(layer, 5)
slab.install(5, want, 1)
pins = tiers.DevicePool(layer, 2, tiers.empty_pool(es.layout(layer), 2, jax.devices()[1]))
try:
  pins.install_from(5, slab.pool, 1, 0)
  got = pins.pool.gate_up.packed
  out["install_from"] = {"equal": bool(np.array_equal(np.asarray(got[0]), want.gate_up.packed)),
                         "devices": sorted(str(d) for d in got.devices()), "slot_of": pins.slot_of}
except Exception as e:  # reported by its own test, not as a failure of every test here
  out["install_from"] = repr(e)

errors = {}
bad = {"axis": Mesh(np.asarray(jax.devices()), ("experts",)),
       "divide": Mesh(np.asarray(jax.devices()[:3]), ("expert",)),
       "type": "expert:4"}
for key, mesh in bad.items():
  try:
    glmjax.load(mesh=mesh, progress=False)
    errors[key] = None
  except glmjax.GlmjaxError as e:
    errors[key] = str(e)
out["errors"] = errors
print("RESULT " + json.dumps(out))
"""


def _env():
  return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
              JAX_PLATFORMS="cpu")


@pytest.fixture(scope="module")
def runs(embedded_store):
  r = subprocess.run([sys.executable, "-c", _SCRIPT, embedded_store], capture_output=True,
                     text=True, timeout=600, env=_env())
  assert r.returncode == 0, r.stderr[-3000:]
  line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")][-1]
  return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("name", ["expert4", "expert2_tensor2", "data2_expert2"])
def test_score_matches_one_device(runs, name):
  assert runs[name]["rel"] <= 1e-5


def test_greedy_tokens_match_one_device(runs):
  assert runs["expert2_tensor2"]["tokens"] == runs["ref_tokens"]


def test_expert_mesh_is_bitwise(runs):
  # Each (token, rank) term has one owner and the psum adds it to exact zeros; with no tensor
  # axis nothing else is partitioned.
  assert runs["expert4"]["bitwise"]


def test_routed_experts_split_along_expert(runs):
  four = runs["expert4"]["experts"]
  assert len(four) == 2 * 5  # gate_up and down of 4 MoE layers and the MTP layer
  for spec, local, total in four:
    assert spec == "P('expert', None, None)" and local == [total // 4]
  for spec, local, total in runs["expert2_tensor2"]["experts"]:
    assert local == [total // 2]
  assert runs["expert4"]["q_b"] == "P(None, None)"
  assert runs["expert2_tensor2"]["q_b"] == "P('tensor', None)"  # heads on tensor


def test_speculative_and_chat_on_a_mesh(runs):
  assert runs["expert4"]["draft"] == runs["ref_tokens"]  # greedy drafting changes no token
  assert runs["expert2_tensor2"]["chat"] == runs["ref_chat"]


def test_the_servers_decode_batch_on_a_mesh(runs):
  assert runs["expert4"]["batch"] == runs["ref_tokens"]


def test_store_on_two_devices(runs):
  s = runs["store"]
  assert s["bitwise"]
  assert s["shards"] == [16, 16]  # each device's pool holds only its own experts


def test_bad_meshes(runs):
  e = runs["errors"]
  assert "unknown" in e["axis"]
  assert "divide" in e["divide"] and "32" in e["divide"]
  assert "jax.sharding.Mesh" in e["type"]


def test_tiered_store_on_two_devices(runs):
  t = runs["tiered"]
  assert t["offloaded"]
  # Pinned terms by their owners (psum with exact zeros), host terms by the same CPU kernel.
  assert t["bitwise"] == [True, True, True]
  assert t["tokens"] == runs["ref_tokens"]  # as the one-device store (and the checkpoint) give
  pin, host, miss, used = t["counts"]
  assert pin + host + miss == used and pin > 0 and host > 0 and miss > 0
  block = t["block"]
  assert block == 16
  for layer in t["pins"]:
    assert [d for d, _, _ in layer] == [0, 1]
    for d, experts, where in layer:
      assert 0 < len(experts) <= 3
      assert all(e // block == d for e in experts)  # only experts this device owns
      assert where == [t["devices"][d]]  # on that device only


def test_admission_from_the_host_slab_to_another_devices_pool(runs):
  # gather_slot raised TypeError on every call here (and on every accelerator upload).
  assert runs["install_from"] == {"equal": True, "devices": ["cpu:1"], "slot_of": {"5": 0}}


def test_two_processes_on_loopback(runs, tmp_path):
  """scripts/launch_local.py: 2 processes × 2 CPU devices, all 4 on `expert` by default (the
  expert:4 mesh's generation check); process 0 alone writes --json, with the single-process
  greedy tokens."""
  out = tmp_path / "gen.json"
  r = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "launch_local.py"), "--processes=2",
       "--devices_per_process=2", "--", os.path.join(ROOT, "scripts", "generate.py"),
       "--prompt_ids=5,6,7", "--max_new_tokens=6", "--temperature=0", f"--json={out}"],
      capture_output=True, text=True, timeout=600, env=_env())
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(out.read_text())
  assert got["tokens"] == runs["ref_tokens"]
  assert got["mesh"] == {"expert": 4}
  assert got["stats"]["new_tokens"] == 6 and isinstance(got["text"], str)
  assert r.stdout.count("prompt: [5, 6, 7]") == 1  # only process 0 prints


def test_mesh_flag_parsing():
  from glmjax import sharding
  from glmjax.errors import InputError
  assert sharding.parse("expert:2,tensor:2") == {"expert": 2, "tensor": 2}
  assert sharding.parse("data:1") == {"data": 1}
  for bad, why in (("expert", "axis:size"), ("expert:0", "axis:size"), ("gpu:2", "unknown"),
                   ("expert:2,expert:2", "twice"), ("", "empty")):
    with pytest.raises(InputError, match=why):
      sharding.parse(bad)
