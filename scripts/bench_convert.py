"""Conversion throughput and peak memory on a multi-shard bf16 test checkpoint (JSON output).

  python scripts/bench_convert.py --experts=64 --moe_layers=4 --hidden=512 --out=convert.json

Builds a random GLM-5-architecture checkpoint, sharded, then runs scripts/convert.py in a
subprocess and reports source MB/s and the child's peak RSS against the largest shard. The
import baseline (python + jax + orbax + tensorstore, no work) is measured the same way, so the
memory the conversion itself holds is peak − baseline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import ml_dtypes
from absl import app, flags

from glmjax.reporting import write_report

FLAGS = flags.FLAGS
flags.DEFINE_integer("hidden", 512, "Model width D.")
flags.DEFINE_integer("intermediate", 512, "Expert width I.")
flags.DEFINE_integer("experts", 64, "Routed experts per layer.")
flags.DEFINE_integer("moe_layers", 4, "MoE layers (plus one dense layer).")
flags.DEFINE_integer("shard_mb", 64, "Source shard size in MB.")
flags.DEFINE_integer("workers", 2, "Converter worker threads.")
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


def main(argv):
  del argv
  from glmjax.formats import checkpoint
  from glmjax.model import weights
  from glmjax.model.config import Config
  work = FLAGS.workdir or tempfile.mkdtemp(prefix="bench_convert.")
  src, dst = os.path.join(work, "src"), os.path.join(work, "dst")
  raw = {"model_type": "glm_moe_dsa", "vocab_size": 4096, "hidden_size": FLAGS.hidden,
         "intermediate_size": 2 * FLAGS.hidden, "moe_intermediate_size": FLAGS.intermediate,
         "num_hidden_layers": FLAGS.moe_layers + 1, "num_attention_heads": 4, "q_lora_rank": 128,
         "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
         "n_routed_experts": FLAGS.experts, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
         "index_topk": 256, "index_head_dim": 64, "index_n_heads": 4}
  cfg = Config.from_dict(raw)
  if not os.path.exists(os.path.join(src, "config.json")):
    checkpoint.save_hf(weights.init(cfg, seed=0, with_mtp=False), cfg, src,
                       dtype=ml_dtypes.bfloat16, shard_bytes=FLAGS.shard_mb << 20)
  shards = [f for f in os.listdir(src) if f.endswith(".safetensors")]
  src_bytes = sum(os.path.getsize(os.path.join(src, f)) for f in shards)
  largest = max(os.path.getsize(os.path.join(src, f)) for f in shards)

  base_s, base_rss, _ = child_peak_rss(
      [sys.executable, "-c", "import glmjax.formats.convert, orbax.checkpoint, tensorstore, jax; "
       "jax.numpy.zeros(1)"])
  import shutil
  shutil.rmtree(dst, ignore_errors=True)
  secs, rss, rc = child_peak_rss([sys.executable, os.path.join(ROOT, "scripts", "convert.py"),
                                  f"--src={src}", f"--dst={dst}", f"--workers={FLAGS.workers}"])
  result = {
      "source_mb": src_bytes / 2**20, "shards": len(shards), "largest_shard_mb": largest / 2**20,
      "experts_total": FLAGS.experts * FLAGS.moe_layers, "workers": FLAGS.workers,
      "seconds": secs, "mb_per_s": src_bytes / 2**20 / secs, "peak_rss_mb": rss,
      "baseline_rss_mb": base_rss, "held_mb": rss - base_rss,
      "held_over_largest_shard": (rss - base_rss) / (largest / 2**20), "returncode": rc,
      "store_mb": sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst)
                      for f in fs) / 2**20,
  }
  write_report(result, FLAGS.out)


if __name__ == "__main__":
  app.run(main)
