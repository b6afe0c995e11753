"""A driver for tests/test_multiprocess_offload.py: loads an expert store at several budget
pairs and writes, per process, what the test checks. Run alone for the one-process reference,
or through scripts/launch_local.py with --mesh=expert:N for the multi-process run.

  python tests/offload_processes.py --store=S --out=DIR --budgets=3:4,0:0
  python scripts/launch_local.py --processes=2 -- tests/offload_processes.py --store=S \
      --out=DIR --budgets=3:4,0:0 --mesh=expert:2

--budgets: pairs `device:host`, in experts: pins per device and MoE layer, host-cache chunks.
Each process writes DIR/p{index}.json (tokens, its read log, tier contents, host bytes,
counters) and DIR/p{index}_{i}.npy (the scored logits of budget pair i).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np
from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import glmjax  # noqa: E402
from glmjax import distributed  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("store", None, "Expert store (`{process}` in it: the process index).",
                    required=True)
flags.DEFINE_string("out", None, "Output directory.", required=True)
flags.DEFINE_string("budgets", "3:4", "device:host expert counts, comma-separated.")
flags.DEFINE_integer("tokens", 4, "Greedy tokens to generate per budget pair.")
flags.DEFINE_string("draft", "0", "MTP drafts per step (0: off).")
flags.DEFINE_integer("die", -1, "This process index kills itself (SIGKILL) after a first scored "
                     "batch: the others' next one must fail with an error naming it.")
distributed.define_flags()

GB = 1 << 30
TOKS = np.array([[5, 6, 7, 8, 9, 10, 11, 12]], np.int32)
PROMPT = [5, 6, 7]


def one_pair(store: str, dev: int, host: int, chunk: int, n_layers: int, mesh,
             own_copy: bool) -> tuple:
  """(record, logits) of one budget pair: fresh usage statistics, so every run starts alike."""
  import jax
  from jax.experimental import multihost_utils
  if jax.process_count() > 1:  # every process has closed its last model (and saved)
    multihost_utils.sync_global_devices("closed")
  for name in ("usage.json", "couple.npy"):  # each store by one process
    if os.path.exists(os.path.join(store, name)) and (distributed.is_main() or own_copy):
      os.remove(os.path.join(store, name))
  if jax.process_count() > 1:  # before anyone loads
    multihost_utils.sync_global_devices("fresh")
  with glmjax.load(store, mesh=mesh, progress=False,
                   device_cache_gb=dev and (dev * n_layers * chunk + chunk // 2) / GB,
                   host_cache_gb=host and (host * chunk + chunk // 2) / GB) as m:
    eng = m.engine
    if FLAGS.die >= 0:
      # Every process compiles and scores once, then one dies: the others' next, compiled,
      # step meets the closed connection at its first collective. (Dying at load raced the
      # others' first compile, seconds of tracing and kernel self-tests on a loaded machine,
      # against the coordination service's heartbeat, which then ended them without the error.)
      m.score(TOKS)
      if FLAGS.die == jax.process_index():
        os.kill(os.getpid(), signal.SIGKILL)
    logits = np.asarray(m.score(TOKS))
    result = m.generate(PROMPT, FLAGS.tokens, temperature=0.0, draft=int(FLAGS.draft))
    tokens = [int(t) for t in result.tokens]
    st = {**eng.telemetry(), **{k: v for k, v in result.stats.items() if k.startswith("draft")}}
    rec = {
        "tokens": tokens, "reads": sorted(set(eng.read_log)),
        "n_reads": len(eng.read_log), "owned": np.flatnonzero(eng.tiers.owned).tolist(),
        "pins": {str(l): [e for e in d.expert_in if e is not None]
                 for l, d in eng.device.items()},
        "host": [list(k) for k in eng.host.keys()], "host_used": eng.host.used,
        "host_budget": eng.host.budget,
        "counts": {k: st.get(k, 0.0) for k in ("experts_used", "expert_pin_hits",
                                               "expert_host_hits", "expert_misses",
                                               "draft_proposed", "draft_accepted")}}
  return rec, logits


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  distributed.initialize()
  import jax
  mesh = distributed.mesh_from_flags()
  me = jax.process_index()
  store = distributed.per_process(FLAGS.store)  # `{process}`: a copy per process
  with open(os.path.join(store, "manifest.json"), encoding="utf-8") as f:
    manifest = json.load(f)
  chunk = manifest["experts"]["main"]["layout"]["nbytes"]
  n_layers = len(manifest["moe_layers"])
  os.makedirs(FLAGS.out, exist_ok=True)
  records = []
  for i, pair in enumerate(FLAGS.budgets.split(",")):
    dev, host = (int(x) for x in pair.split(":"))
    try:
      rec, logits = one_pair(store, dev, host, chunk, n_layers, mesh, store != FLAGS.store)
    except glmjax.GlmjaxError as e:
      print(f"error: {e}", file=sys.stderr)
      distributed.exit_now(1)
      return 1
    records.append(rec)
    np.save(os.path.join(FLAGS.out, f"p{me}_{i}.npy"), logits)
  with open(os.path.join(FLAGS.out, f"p{me}.json"), "w", encoding="utf-8") as f:
    json.dump({"process": me, "processes": jax.process_count(), "runs": records}, f)
  return 0


if __name__ == "__main__":
  app.run(main)
