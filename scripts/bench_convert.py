"""Conversion throughput and peak memory on a multi-shard bf16 test checkpoint (JSON output).

  python scripts/bench_convert.py --hidden=6144 --intermediate=2048 --experts=16 --moe_layers=2 \
      --shard_mb=1024 --workdir=/tmp/bc --out=convert.json

Builds a random GLM-5-architecture bf16 checkpoint shard by shard (never the whole model in
memory; reused when `--workdir` already holds one), then runs scripts/convert.py in a
subprocess with its default flags (plus `--workers` only when given) and reports source MB/s
(source bytes over the wall time of the whole command, start-up included) and the child's peak
RSS against the largest shard. The import baseline (python + jax + orbax + tensorstore, no work)
is measured the same way, so the memory the conversion itself holds is peak − baseline.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np
from absl import app, flags

from glmjax.bench.reporting import write_report

FLAGS = flags.FLAGS
flags.DEFINE_integer("hidden", 512, "Model width D.")
flags.DEFINE_integer("intermediate", 512, "Expert width I.")
flags.DEFINE_integer("experts", 64, "Routed experts per layer.")
flags.DEFINE_integer("moe_layers", 4, "MoE layers (plus one dense layer).")
flags.DEFINE_bool("mtp", False, "Add an MTP layer (its experts are stored int8).")
flags.DEFINE_integer("shard_mb", 64, "Source shard size in MB.")
flags.DEFINE_integer("workers", None, "Converter worker threads (default: convert.py's default).")
flags.DEFINE_integer("repeats", 1, "Conversions to time (the report gives each and the median).")
flags.DEFINE_string("workdir", None, "Where to build the checkpoint (default: a temp dir).")
flags.DEFINE_string("out", None, "JSON output path (default: stdout).")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_peak_rss(cmd) -> tuple[float, float, int]:
  """(wall seconds, peak RSS MiB, return code) of a child process, measured by a wrapper."""
  wrapper = ("import resource, subprocess, sys, time, json; t = time.perf_counter(); "
             "rc = subprocess.call(sys.argv[1:]); "
             "print(json.dumps([time.perf_counter() - t, "
             "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, rc]))")
  out = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True)
  return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def write_source(cfg, raw: dict, path: str, shard_bytes: int, mtp: bool, seed: int = 0) -> None:
  """A random bf16 HF checkpoint of `cfg`, generated and written one shard at a time."""
  from glmjax.formats.checkpoint import INDEX
  from glmjax.formats.safetensors_io import write
  from glmjax.model import weights
  os.makedirs(path, exist_ok=True)
  rng = np.random.default_rng(seed)
  tensors = []  # (name, shape, dtype) in checkpoint order
  for info in weights.leaves_with_info(weights.abstract(cfg, with_mtp=mtp)):
    per = len(info.hf_names)
    shape = info.shape[1:] if info.per_expert else info.shape
    shape = (shape[0] // per, *shape[1:])
    f32 = info.hf_names[0].endswith(("gate.weight", "e_score_correction_bias",
                                     "weights_proj.weight"))
    fmts = [{"e": e} for e in range(cfg.n_routed_experts)] if info.per_expert else [{}]
    tensors += [(n.format(**fmt), shape, np.float32 if f32 else ml_dtypes.bfloat16)
                for fmt in fmts for n in info.hf_names]
  shards, cur, size = [], [], 0
  for t in tensors:
    nbytes = int(np.prod(t[1])) * np.dtype(t[2]).itemsize
    if cur and size + nbytes > shard_bytes:
      shards.append(cur)
      cur, size = [], 0
    cur.append(t)
    size += nbytes
  shards.append(cur)
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    write(os.path.join(path, fname), {
        name: (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
        for name, shape, dtype in shard}, {"format": "pt"})
    weight_map.update({name: fname for name, _, _ in shard})
  with open(os.path.join(path, INDEX), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(raw, f, indent=2)


def main(argv):
  del argv
  from glmjax.model.config import Config
  work = FLAGS.workdir or tempfile.mkdtemp(prefix="bench_convert.")
  src, dst = os.path.join(work, "src"), os.path.join(work, "dst")
  raw = {"model_type": "glm_moe_dsa", "vocab_size": 4096, "hidden_size": FLAGS.hidden,
         "intermediate_size": 2 * FLAGS.hidden, "moe_intermediate_size": FLAGS.intermediate,
         "num_hidden_layers": FLAGS.moe_layers + 1, "num_attention_heads": 4, "q_lora_rank": 128,
         "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
         "n_routed_experts": FLAGS.experts, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
         "index_topk": 256, "index_head_dim": 64, "index_n_heads": 4,
         "num_nextn_predict_layers": int(FLAGS.mtp)}
  cfg = Config.from_dict(raw)
  if not os.path.exists(os.path.join(src, "config.json")):
    write_source(cfg, raw, src, FLAGS.shard_mb << 20, FLAGS.mtp)
  shards = [f for f in os.listdir(src) if f.endswith(".safetensors")]
  src_bytes = sum(os.path.getsize(os.path.join(src, f)) for f in shards)
  largest = max(os.path.getsize(os.path.join(src, f)) for f in shards)

  base_s, base_rss, _ = child_peak_rss(
      [sys.executable, "-c", "import glmjax.formats.convert, orbax.checkpoint, tensorstore, jax; "
       "jax.numpy.zeros(1)"])
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "convert.py"), f"--src={src}",
         f"--dst={dst}"] + ([f"--workers={FLAGS.workers}"] if FLAGS.workers else [])
  runs = []
  for _ in range(FLAGS.repeats):
    shutil.rmtree(dst, ignore_errors=True)
    runs.append(child_peak_rss(cmd))
  secs, rss, rc = sorted(runs)[len(runs) // 2]  # the median run by time
  result = {
      "source_mb": src_bytes / 2**20, "shards": len(shards), "largest_shard_mb": largest / 2**20,
      "experts_total": FLAGS.experts * (FLAGS.moe_layers + int(FLAGS.mtp)),
      "workers": FLAGS.workers or "default", "command": " ".join(cmd),
      "seconds": secs, "mb_per_s": src_bytes / 2**20 / secs, "peak_rss_mb": rss,
      "peak_rss_over_largest_shard": rss / (largest / 2**20),
      "runs_mb_per_s": [src_bytes / 2**20 / s for s, _, _ in runs],
      "runs_peak_rss_mb": [r for _, r, _ in runs],
      "baseline_s": base_s, "baseline_rss_mb": base_rss, "held_mb": rss - base_rss,
      "held_over_largest_shard": (rss - base_rss) / (largest / 2**20), "returncode": rc,
      "store_mb": sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst)
                      for f in fs) / 2**20,
  }
  write_report(result, FLAGS.out)


if __name__ == "__main__":
  app.run(main)
