"""A model with one MoE layer at GLM-5's real expert size, across cache budgets (JSON output).

  python scripts/bench_moe_model.py --out=out/bench_moe_model.json

Builds (once, under --work_dir) a 2-layer GLM-5-architecture checkpoint: a dense first layer
and one MoE layer of --experts experts (hidden 6144, expert intermediate 2048, top-8, bf16), and
converts it with scripts/convert.py's default flags (int4 G=64 experts, ~20 MB each). Then, side
by side in one run, for each placement:
  resident   automatic budgets: every expert on the device (one jit per step)
  host       no device tier, every expert in the host cache (the CPU kernel reads it there)
  none       no cache at all: every expert read from the store at every use
it reports greedy decode tok/s and the time to score --score_tokens tokens (medians over
--repeats), and whether logits and tokens are bitwise equal to the resident run's.
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
import numpy as np  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("work_dir", "/tmp/glmjax_bench_moe_model", "Where the model is built.")
flags.DEFINE_integer("experts", 16, "Routed experts in the MoE layer.")
flags.DEFINE_integer("top_k", 8, "Experts per token.")
flags.DEFINE_integer("vocab_size", 4096, "Vocabulary (small: the experts are what matter).")
flags.DEFINE_integer("decode_tokens", 16, "Tokens generated per decode run.")
flags.DEFINE_integer("score_tokens", 128, "Tokens scored per scoring run.")
flags.DEFINE_integer("repeats", 3, "Runs per measurement (median reported).")
flags.DEFINE_list("modes", ["resident", "host", "none"], "Placements to measure.")
flags.DEFINE_string("out", None, "JSON output path (default: stdout).")

GB = 1 << 30


def build(work: str) -> str:
  """The converted store (built once): HF bf16 checkpoint → default conversion."""
  import ml_dtypes
  from glmjax.formats import checkpoint
  from glmjax.model import weights
  from glmjax.model.config import Config
  store = os.path.join(work, "store")
  if os.path.exists(os.path.join(store, "manifest.json")):
    return store
  hf = os.path.join(work, "hf")
  cfg = Config.from_dict({
      "model_type": "glm_moe_dsa", "vocab_size": FLAGS.vocab_size, "hidden_size": 6144,
      "intermediate_size": 2048, "moe_intermediate_size": 2048, "num_hidden_layers": 2,
      "num_attention_heads": 16, "q_lora_rank": 1024, "kv_lora_rank": 512,
      "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
      "n_routed_experts": FLAGS.experts, "num_experts_per_tok": FLAGS.top_k,
      "n_shared_experts": 1, "first_k_dense_replace": 1, "index_topk": 2048,
      "index_head_dim": 128, "index_n_heads": 32, "num_nextn_predict_layers": 0})
  print(f"building {hf} (bf16, {FLAGS.experts} experts of 6144x2048)", file=sys.stderr)
  checkpoint.save_hf(weights.init(cfg, seed=0, with_mtp=False), cfg, hf,
                     dtype=ml_dtypes.bfloat16)
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "convert.py")
  subprocess.run([sys.executable, script, f"--src={hf}", f"--dst={store}"], check=True)
  return store


def measure(store: str, mode: str) -> dict:
  import glmjax
  host_all = 1.5 * FLAGS.experts * 21e6 / GB  # every ~20 MB expert, with room to spare
  options = {"resident": {}, "host": dict(device_cache_gb=0, host_cache_gb=host_all),
             "none": dict(device_cache_gb=0, host_cache_gb=0)}[mode]
  rng = np.random.default_rng(0)
  prompt = [int(t) for t in rng.integers(3, FLAGS.vocab_size, 8)]
  toks = rng.integers(3, FLAGS.vocab_size, (1, FLAGS.score_tokens)).astype(np.int32)
  with glmjax.load(store, progress=False, **options) as model:
    model.generate(prompt, 2, stop_ids=[])  # compile every step shape once
    model.score(toks)
    decode = [model.generate(prompt, FLAGS.decode_tokens, stop_ids=[])
              for _ in range(FLAGS.repeats)]
    score_s, logits = [], None
    for _ in range(FLAGS.repeats):
      t0 = time.perf_counter()
      logits = model.score(toks)
      score_s.append(time.perf_counter() - t0)
    stats = decode[-1].stats
    return {"mode": mode, "all_resident": bool(stats.get("all_resident")),
            "decode_tok_s": statistics.median(r.stats["decode_tok_s"] for r in decode),
            "score_s": statistics.median(score_s), "tokens": decode[-1].tokens,
            "experts_on_host": stats.get("experts_on_host", 0.0),
            "expert_bytes_read": stats.get("expert_bytes_read", 0.0), "logits": logits}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from glmjax.bench.reporting import store_geometry, write_report
  store = build(FLAGS.work_dir)
  rows = [measure(store, mode) for mode in FLAGS.modes]
  logits = [r.pop("logits") for r in rows]
  ref = rows[0]
  for r, lg in zip(rows, logits):
    r["bitwise_equal_logits"] = bool(np.array_equal(lg, logits[0]))
    r["same_tokens"] = r["tokens"] == ref["tokens"]
    r["score_vs_first"] = r["score_s"] / ref["score_s"]
    r["decode_vs_first"] = r["decode_tok_s"] / ref["decode_tok_s"]
  write_report({"store": store, **store_geometry(store), "rows": rows}, FLAGS.out)


if __name__ == "__main__":
  app.run(main)
