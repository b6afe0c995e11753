"""Decode and prefill cost against context length, sparse DSA beside the dense reference (JSON).

  python scripts/make_synthetic_store.py --geometry=glm5 --moe_layers=1 --experts=8 --dst=/tmp/g5
  python scripts/bench_context.py --model=/tmp/g5 --contexts=2048,8192,32768,131072 \\
      --json=out/bench_context.json --plot=out/bench_context.png

For each context length and attention path it builds a batch-1 KV cache of that many
positions and times decode steps after them (medians, the first step left out: it compiles).
By default the cache is filled with random latents and keys (`--fill=random`, what lets 128k
fit the benchmark's time); `--fill=prefill` prefills random tokens for real. Each decode step
is split into the indexer, the rest of attention and everything else, by timing the DSA
layers' indexer and attention as their own jits over the same cache.

The JSON is a list with one entry per context length: `context`, `decode_ms` (ms per decoded
token, sparse attention), `indexer_ms`, `attention_ms`, `rest_ms`, `fill`, `peak_rss_gb`,
`kv_bytes_per_token`, `prefill_tok_s` (lengths up to --prefill_max, a real prefill through
`Model.generate`), and `dense` (the same decode figures on the dense reference path).
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
import numpy as np  # noqa: E402

from glmjax import cli  # noqa: E402

FLAGS = flags.FLAGS
cli.define_model_flag(cli.MODEL_KINDS)
cli.define_load_flags(only=("prefill_chunk",))
flags.DEFINE_list("contexts", ["2048", "8192", "32768", "131072"], "Context lengths.")
flags.DEFINE_list("impls", ["sparse", "dense"], "Attention paths: sparse (DSA) and dense "
                  "(every key scored; the reference).")
flags.DEFINE_enum("fill", "random", ["random", "prefill"], "How the cache is filled before the "
                  "decode timing: random latents, or a real prefill of random tokens.")
flags.DEFINE_integer("prefill_max", 8192, "Contexts up to this are also prefilled for real "
                     "(Model.generate) for prefill tokens/s (0: none).", lower_bound=0)
flags.DEFINE_integer("steps", 6, "Decode steps per measurement (the first is left out).")
flags.DEFINE_string("json", None, "JSON output path (default: stdout only).")
flags.DEFINE_string("plot", None, "PNG of decode ms per token against context.")


class PeakRSS:
  """The process's peak resident memory since `reset`, polled every 20 ms."""

  def __init__(self):
    import psutil
    self.proc, self.peak = psutil.Process(), 0
    threading.Thread(target=self._poll, daemon=True).start()

  def _poll(self):
    while True:
      self.peak = max(self.peak, self.proc.memory_info().rss)
      time.sleep(0.02)

  def reset(self) -> None:
    self.peak = self.proc.memory_info().rss


def median_ms(fn, steps: int) -> float:
  """Median ms of `fn()` (which waits for its result) over `steps` calls, the first left out."""
  times = []
  for i in range(steps):
    t0 = time.perf_counter()
    fn()
    if i:
      times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


def random_cache(model, pool, pages, context: int):
  """The pool's pages filled with unit-normal latents, rope keys and indexer keys."""
  import jax
  key = jax.random.PRNGKey(context)
  layers = []
  for i, lc in enumerate(pool.layers):
    fill = lambda a, j: None if a is None else jax.random.normal(
        jax.random.fold_in(key, 3 * i + j), a.shape, a.dtype)
    layers.append(type(lc)(fill(lc.latent, 0), fill(lc.k_rope, 1), fill(lc.index_k, 2)))
  pool.layers = layers
  return pool.cache([pool.table(pages)], context, model.executor.put)


def layer_timers(model, cache, context: int, impl: str):
  """Jitted (indexer, attention) of the DSA layers over `cache` at `context`: ms of each."""
  import jax
  import jax.numpy as jnp
  from glmjax.model import attention as att
  from glmjax.model.config import Runtime
  from glmjax.model.kvcache import PagedLayer
  from glmjax.model.layers import LATENT_NORM_EPS, linear, rms_norm
  cfg, w = model.config, model.weights
  x = jax.random.normal(jax.random.PRNGKey(1), (1, 1, cfg.hidden_size), jnp.float32)
  pos = jnp.asarray([context], jnp.int32)

  @jax.jit
  def indexer(aw, lc, pages):
    view = att.KeyView(lc.latent, lc.k_rope, lc.index_k, pages)
    c, s = att.rope_angles(pos, cfg.qk_rope_head_dim, cfg.rope_theta)
    q_lat = rms_norm(linear(x, aw.q_a), aw.q_a_norm, LATENT_NORM_EPS)
    q, wts = att.indexer_queries(aw.indexer, x, q_lat, cfg, c[None], s[None])
    if impl == "dense":
      visible = jnp.arange(view.slots)[None, None] <= pos[None, :, None]
      return att.select_dense(q, wts, view.dense("index_k"), visible, cfg.index_topk)
    return att.select_blocked(view, q, wts, pos[None], cfg.index_topk,
                              att.index_block_pages(view, q.shape))

  # The layer's attention over the cache as decode runs it (absorbed; the cache donated and
  # carried from call to call, so no call copies the pools).
  attend = jax.jit(lambda aw, lc, pages: att.attention(
      aw, x, jnp.int32(context), cfg, PagedLayer(lc, pages), absorbed=True,
      runtime=Runtime(impl=impl))[:2], donate_argnums=(1,))
  dsa = [i for i, l in enumerate(w.layers) if l.attn.indexer is not None]
  layers = dict(enumerate(cache.layers))
  ix = lambda: jax.block_until_ready([indexer(w.layers[i].attn, layers[i], cache.pages)
                                      for i in dsa])

  def at():
    outs = []
    for i in dsa:
      out, layers[i] = attend(w.layers[i].attn, layers[i], cache.pages)
      outs.append(out)
    jax.block_until_ready(outs)
  return ix, at


def measure(model, context: int, impl: str, peak: PeakRSS) -> dict:
  """One entry: decode ms per token and its split, at `context` with `impl`."""
  import jax
  from glmjax.decoding.pages import KVPool
  peak.reset()
  layout = model.kv_layout()
  pool = KVPool(layout)
  pages = pool.alloc(layout.pages_for(context + FLAGS.steps + 1))
  runner = model.executor.with_attention(impl)
  entry = dict(context=context, attention=impl, fill=FLAGS.fill,
               kv_bytes_per_token=layout.page_bytes() / layout.page_size)
  if FLAGS.fill == "prefill":
    ids = np.random.default_rng(context).integers(100, model.config.vocab_size, context)
    cache = pool.cache([pool.table(pages)], 0, runner.put)
    t0 = time.perf_counter()
    _, _, cache = runner.prefill(cache, ids.astype(np.int32), 0)
    jax.block_until_ready(cache.layers)
    entry["prefill_tok_s"] = context / (time.perf_counter() - t0)
  else:
    cache = random_cache(model, pool, pages, context)
  state = {"cache": cache}

  def step():
    logits, _, state["cache"] = runner.step(state["cache"], [[5]], context)
    logits.block_until_ready()
  entry["decode_ms"] = median_ms(step, FLAGS.steps)
  ix, at = layer_timers(model, state["cache"], context, impl)
  entry["indexer_ms"] = median_ms(ix, FLAGS.steps)
  entry["attention_ms"] = max(0.0, median_ms(at, FLAGS.steps) - entry["indexer_ms"])
  entry["rest_ms"] = max(0.0, entry["decode_ms"] - entry["indexer_ms"] - entry["attention_ms"])
  entry["peak_rss_gb"] = peak.peak / 1e9
  print(f"{impl:6s} {context:>7d}: {entry['decode_ms']:8.1f} ms/token (indexer "
        f"{entry['indexer_ms']:.1f}, attention {entry['attention_ms']:.1f}, rest "
        f"{entry['rest_ms']:.1f}); peak RSS {entry['peak_rss_gb']:.2f} GB", flush=True)
  return entry


def plot(entries: list, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for impl in ("sparse", "dense"):
    pts = [(e["context"], e["decode_ms"] if impl == "sparse" else e["dense"]["decode_ms"])
           for e in entries if impl == "sparse" or "dense" in e]
    if pts:
      ax.plot(*zip(*sorted(pts)), marker="o", label=f"{impl} attention")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("context (tokens)")
  ax.set_ylabel("decode ms per token")
  ax.set_title(os.path.basename(os.path.normpath(FLAGS.model or "embedded")))
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import glmjax
  from glmjax.bench import reporting
  try:
    contexts = sorted(int(c) for c in FLAGS.contexts)
  except ValueError:
    print("error: --contexts takes integers", file=sys.stderr)
    return 1
  peak = PeakRSS()
  with glmjax.load(FLAGS.model, **cli.load_options(), progress=False,
                   max_context=max(contexts) + FLAGS.steps + 1) as model:
    entries = []
    for c in contexts:
      entry = measure(model, c, "sparse", peak)
      if "dense" in FLAGS.impls:
        dense = measure(model, c, "dense", peak)
        entry["dense"] = {k: dense[k] for k in ("decode_ms", "indexer_ms", "attention_ms",
                                                 "rest_ms", "peak_rss_gb")}
      if c <= FLAGS.prefill_max:
        peak.reset()
        ids = np.random.default_rng(c).integers(100, model.config.vocab_size, c)
        r = model.generate(ids.tolist(), 1)
        entry.update(prefill_tok_s=c / r.stats["prefill_s"], prefill_s=r.stats["prefill_s"],
                     prefill_chunks=r.stats["prefill_chunks"],
                     prefill_peak_rss_gb=peak.peak / 1e9)
        print(f"prefill {c:>7d}: {entry['prefill_tok_s']:.1f} tok/s "
              f"({r.stats['prefill_s']:.1f} s)", flush=True)
      entry.update(prefill_chunk=model.options.prefill_chunk,
                   kv_dtype=model.options.kv_dtype_name)
      entries.append(entry)
  if FLAGS.plot:
    plot(entries, FLAGS.plot)
  if FLAGS.json:
    reporting.write_report(entries, FLAGS.json)
  return 0


if __name__ == "__main__":
  app.run(main)
