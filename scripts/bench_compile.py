"""Compile time of the resident steps against depth: does it grow with the layers?

  python scripts/bench_compile.py --layers=4,8,24 --fused_stores=/tmp/fused \
      --json=docs/bench_compile.json

For each total depth L (the tiny synthetic geometry: its one dense layer, then L - 1 MoE layers of
float experts, alternating full and shared indexers), the resident `prefill_fn` (one
--prefill_tokens chunk) and `decode_fn` (one token) over a --capacity-position cache run once
on random weights, the persistent cache off and the in-memory caches cleared before each of
--repeats rounds: the seconds JAX spends tracing, lowering and compiling (`CompileClock`) and
the first call's wall time. Reports medians and each depth's ratio to the first, side by side
for the layer steps (each decoder layer two jitted halves, `layer_step`: identical halves
compile once, DESIGN.md §4), the same steps inlined into one program, and what the executor
picks for the depth (`forward.entry_points`). `--glm5_layers=4,8,24,77 --layers=` lowers and
compiles the steps at GLM-5's dims instead, from abstract weights (nothing is allocated or run).
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before anything allocates: see scripts/_startup.py
  import _startup
  _startup.start()

import datetime
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from glmjax.bench.reporting import write_report
from glmjax.formats.synthetic import DENSE_LAYERS, synthetic_config
from glmjax.model import kvcache, weights
from glmjax.model.config import Config
from glmjax.model.forward import LAYER_STEPS, ONE_PROGRAM, entry_points
from glmjax.runtime.clock import CompileClock

FLAGS = flags.FLAGS
flags.DEFINE_list("layers", ["4", "24"], "Total decoder layers (depths) to compile.")
flags.DEFINE_integer("prefill_tokens", 64, "Tokens of the prefill chunk.", lower_bound=1)
flags.DEFINE_integer("capacity", 512, "Cache positions.", lower_bound=1)
flags.DEFINE_integer("repeats", 3, "Rounds per depth (medians reported).", lower_bound=1)
flags.DEFINE_string("json", None, "JSON output path (default: stdout only).")
flags.DEFINE_list("glm5_layers", [], "Also at GLM-5's dims (abstract weights, bfloat16 dense, "
                  "256 int4 experts a MoE layer; lowered and compiled, never run): these depths, "
                  "each distinct layer's step once, and one program at depths up to 24.")
flags.DEFINE_string("fused_stores", None, "Also time the offload engine's fused step: a tiny "
                    "store per depth (8 experts a layer) is made under this directory, every "
                    "expert held in the host cache, and a 13-token prompt generates 3 tokens "
                    "(the step's fused_compile_s: one 16-wide prefill and one decode shape).")


def model_at(layers: int):
  """(config, random weights) of the tiny geometry at `layers` total depth."""
  cfg = Config.from_dict(synthetic_config("tiny", moe_layers=layers - DENSE_LAYERS, mtp=False))
  return cfg, _put(weights.init(cfg, with_mtp=False))


def _put(x):
  """`x` committed to the device, as the executor puts every input (`Executor.put`): a jit
  compiles once per mix of committed and uncommitted arguments."""
  return jax.device_put(x, jax.local_devices()[0])


def first_steps(cfg: Config, w, fns: dict) -> dict:
  """Compile seconds and first-call wall seconds of one prefill chunk and one decode step
  through `fns` (`forward.LAYER_STEPS` or `forward.ONE_PROGRAM`)."""
  cache = kvcache.init_cache(cfg, 1, FLAGS.capacity)
  toks = np.arange(FLAGS.prefill_tokens, dtype=np.int32)[None] % cfg.vocab_size
  steps = {"prefill": lambda c: fns["prefill"](w, c, _put(toks), _put(np.int32(len(toks[0]))),
                                               cfg=cfg),
           "decode": lambda c: fns["decode"](w, c, _put(toks[:, :1]), cfg=cfg)}
  out = {}
  for name, step in steps.items():
    with CompileClock() as clock:
      t0 = time.perf_counter()
      cache = step(cache).cache
      jax.block_until_ready(cache)
    out[name] = {"compile_s": clock.seconds, "first_call_s": time.perf_counter() - t0}
  return out


def fused_compile(path: str, one_program: bool) -> float:
  """The fused step's compile seconds on the store at `path`, fully cached, as one program or
  two jitted halves per layer."""
  import glmjax
  with glmjax.load(path, progress=False, prefetch=False, device_cache_gb=0, host_cache_gb=1.0,
                   compile_cache=False, compile_unit="step" if one_program else "layer") as m:
    m.executor.warm_host()
    return m.generate(list(range(5, 18)), 3, stop_ids=[]).stats.get("fused_compile_s", 0.0)


def fused_rows(depths: list[int]) -> list[dict]:
  """Medians of the fused step's compile seconds per depth: one program, a step per layer,
  and what the engine picks (`FusedStep.one_program`, the resident rule)."""
  import os
  from glmjax.formats.synthetic import make_synthetic_store
  from glmjax.model.forward import ONE_PROGRAM
  paths = {d: os.path.join(FLAGS.fused_stores, f"tiny_{d}") for d in depths}
  for d, path in paths.items():
    if not os.path.exists(path):
      make_synthetic_store(path, geometry="tiny", moe_layers=d - DENSE_LAYERS, experts=8,
                           mtp=False, progress=False)
  rows = []
  for d in depths:
    times = {True: [], False: []}
    for _ in range(FLAGS.repeats):
      for one in (True, False):
        jax.clear_caches()
        times[one].append(fused_compile(paths[d], one))
    picked = entry_points(model_at(d)[1]) is ONE_PROGRAM
    rows.append({"layers": d, "one_program_s": statistics.median(times[True]),
                 "layer_steps_s": statistics.median(times[False]),
                 "picked": "one_program" if picked else "layer_steps"})
    print(f"fused step   L={d:3d}  one program {rows[-1]['one_program_s']:.2f} s  "
          f"layer steps {rows[-1]['layer_steps_s']:.2f} s  (picks {rows[-1]['picked']})")
  return rows


def _per_half(layers, cfg, x, cache, n_valid, mlp, extra, absorbed) -> tuple[float, int]:
  """Seconds to lower and compile each distinct half-layer program once, the executor's way:
  `attention_step` over each layer's attention half, then `mlp` (`mlp_step`, `fused_mlp`) over
  its MLP half with `extra(i)`; and the programs' count."""
  import dataclasses
  import functools
  from glmjax.model.forward import Chunk, attention_half, attention_step, mlp_half
  jax.clear_caches()  # JAX keeps compiled programs by their text: a depth before is no help
  seen, selection, t0 = set(), None, time.perf_counter()
  chunk = Chunk(x, cache.length, n_valid, None, cache.pages)
  for i, lw in enumerate(layers):
    attn_in = dataclasses.replace(chunk, selection=None if lw.attn.indexer is not None
                                  else selection)  # as `layer_step`
    halves = [(attention_step, (attention_half(lw), attn_in, cache.layers[i]),
               {"absorbed": absorbed}), (mlp, (mlp_half(lw), chunk, extra(i)), {})]
    for fn, args, kw in halves:
      key = (fn, jax.tree_util.tree_structure(args), tuple(
          (a.shape, a.dtype) for a in jax.tree_util.tree_leaves(args)))
      if key not in seen:
        seen.add(key)
        fn.lower(*args, cfg=cfg, **kw).compile()
    selection = jax.eval_shape(functools.partial(attention_step, cfg=cfg, absorbed=absorbed),
                               *halves[0][1])[1]
  return time.perf_counter() - t0, len(seen)


def glm5_rows(depths: list[int]) -> list[dict]:
  """Seconds to lower and compile a --prefill_tokens chunk and a decode step at GLM-5's dims
  per depth: each distinct half-layer program once (`layer_step`'s halves, what the executor
  compiles past ONE_PROGRAM_LAYERS_PER_KIND), the offload engine's fused step the same way
  (`fused_mlp` over a 256-slot host slab), and the whole step as one program at depths up to 24."""
  import dataclasses
  from glmjax.formats.store import ExpertLayout
  from glmjax.model.forward import mlp_step
  from glmjax.model.quant import ExpertPool
  from glmjax.offload.fused import fused_mlp
  from glmjax.offload.tiers import empty_pool
  rows = []
  for d in depths:
    cfg = Config.from_dict(synthetic_config("glm5", moe_layers=d - DENSE_LAYERS, mtp=False))
    sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
    w = jax.tree_util.tree_map(sds, weights.abstract(cfg, jnp.bfloat16, with_mtp=False),
                               is_leaf=weights.is_info)
    dense = weights.dense_only(w)
    layout = ExpertLayout.make(cfg.hidden_size, cfg.moe_intermediate_size, 4, 64)
    one = layout.unpack(np.zeros((1, layout.nbytes), np.uint8))
    pool = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct((cfg.n_routed_experts, *a.shape[1:]), a.dtype),
        ExpertPool(one.gate_up, one.down))
    w.layers = [lw if not hasattr(lw.mlp, "experts") else dataclasses.replace(
        lw, mlp=dataclasses.replace(lw.mlp, experts=pool)) for lw in w.layers]
    table = jax.ShapeDtypeStruct((cfg.n_routed_experts,), jnp.int32)
    slab = jax.eval_shape(lambda: empty_pool(layout, cfg.n_routed_experts, raw=True))
    tiers = lambda i: ({"pins": None, "pin": table, "slab": slab, "host": table}
                       if cfg.is_moe(i) else None)
    cache = jax.eval_shape(lambda: kvcache.init_cache(cfg, 1, FLAGS.capacity))
    row = {"layers": d}
    for phase, width in (("prefill", FLAGS.prefill_tokens), ("decode", 1)):
      x = jax.ShapeDtypeStruct((1, width, cfg.hidden_size), jnp.float32)
      n_valid = jax.ShapeDtypeStruct((), jnp.int32) if phase == "prefill" else None
      absorbed = True if phase == "decode" else None  # as the executor's
      row[f"{phase}_layer_steps_s"], row[f"{phase}_layer_programs"] = _per_half(
          w.layers, cfg, x, cache, n_valid, mlp_step, lambda i: None, absorbed)
      row[f"{phase}_fused_layers_s"], row[f"{phase}_fused_programs"] = _per_half(
          dense.layers, cfg, x, cache, n_valid, fused_mlp, tiers, width <= 4)
      if d <= 24:
        toks = jax.ShapeDtypeStruct((1, width), jnp.int32)
        jax.clear_caches()
        t0 = time.perf_counter()
        if phase == "prefill":
          ONE_PROGRAM["prefill"].lower(w, cache, toks, n_valid, cfg=cfg).compile()
        else:
          ONE_PROGRAM["decode"].lower(w, cache, toks, cfg=cfg).compile()
        row[f"{phase}_one_program_s"] = time.perf_counter() - t0
    rows.append(row)
    print(f"GLM-5 dims   L={d:3d}  " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()
                                                  if k.endswith("_s")))
  return rows


def main(argv):
  del argv
  jax.config.update("jax_enable_compilation_cache", False)
  depths = [int(x) for x in FLAGS.layers]
  if depths and min(depths) <= DENSE_LAYERS:
    raise app.UsageError(f"--layers must exceed the geometry's {DENSE_LAYERS} dense layers")
  models = {d: model_at(d) for d in depths}
  modes = {"layer_steps": lambda w: LAYER_STEPS, "one_program": lambda w: ONE_PROGRAM,
           "executor": entry_points}  # the executor's pick for the depth
  rounds = {(m, d): [] for m in modes for d in depths}
  for _ in range(FLAGS.repeats):
    for d in depths:  # interleaved, so drift in the machine's load hits every depth alike
      for mode, pick in modes.items():
        jax.clear_caches()
        rounds[mode, d].append(first_steps(*models[d], pick(models[d][1])))
  report = {"date": datetime.date.today().isoformat(), "geometry": "tiny",
            "prefill_tokens": FLAGS.prefill_tokens, "capacity": FLAGS.capacity,
            "repeats": FLAGS.repeats}
  for mode in modes:
    rows = []
    for d in depths:
      med = {f"{step}_{k}": statistics.median(r[step][k] for r in rounds[mode, d])
             for step in ("prefill", "decode") for k in ("compile_s", "first_call_s")}
      med["total_s"] = med["prefill_compile_s"] + med["decode_compile_s"]
      rows.append({"layers": d, **med})
    for row in rows:
      row["ratio_to_first"] = row["total_s"] / rows[0]["total_s"]
      print(f"{mode:12s} L={row['layers']:3d}  compile {row['total_s']:6.2f} s  "
            f"(×{row['ratio_to_first']:.2f})  prefill {row['prefill_compile_s']:.2f} s  "
            f"decode {row['decode_compile_s']:.2f} s")
    report[mode] = rows
  if FLAGS.fused_stores:
    report["fused_step"] = fused_rows(depths)
  if FLAGS.glm5_layers:
    report["glm5_dims"] = glm5_rows([int(x) for x in FLAGS.glm5_layers])
  write_report(report, FLAGS.json)


if __name__ == "__main__":
  app.run(main)
