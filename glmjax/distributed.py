"""Multi-process setup for the scripts: shared flags, `jax.distributed` init, the mesh.

  python scripts/generate.py --mesh=expert:4 ...                    # one process, 4 devices
  python scripts/launch_local.py --processes=2 --devices_per_process=2 -- \
      scripts/generate.py --prompt_ids=5,6,7                        # 2 processes on loopback

Every process runs the same program on the same inputs (JAX's multi-controller model); the
collectives between processes are JAX's own (gloo on CPU). Only process 0 prints and writes.
"""

from __future__ import annotations

import os
import sys

import jax
from absl import flags

from glmjax import sharding
from glmjax.errors import InputError

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines --coordinator, --num_processes, --process_id and --mesh (once per program)."""
  if "num_processes" in FLAGS:
    return
  flags.DEFINE_string("coordinator", None, "host:port of process 0's coordinator (multi-process "
                      "runs; scripts/launch_local.py sets it).")
  flags.DEFINE_integer("num_processes", 1, "Processes in the run.", lower_bound=1)
  flags.DEFINE_integer("process_id", 0, "This process's index, 0..num_processes-1.", lower_bound=0)
  flags.DEFINE_integer("heartbeat_timeout_s", 30, "Several processes: a process that stops "
                       "sending heartbeats to the coordination service for this long is "
                       "declared dead, and the others stop instead of waiting.", lower_bound=1)
  flags.DEFINE_string("mesh", None, "Device mesh as axis:size pairs over every global device, "
                      "axes from expert, tensor, data (e.g. expert:4 or expert:2,tensor:2). "
                      "Default: one device, or with several processes every device on expert.")


def initialize() -> None:
  """`jax.distributed.initialize` from the flags when more than one process runs (call before
  anything touches a JAX device)."""
  if FLAGS.num_processes == 1:
    return
  if not FLAGS.coordinator:
    raise InputError("--num_processes > 1 needs --coordinator=host:port")
  if FLAGS.process_id >= FLAGS.num_processes:
    raise InputError(f"--process_id={FLAGS.process_id} must be below --num_processes="
                     f"{FLAGS.num_processes}")
  # Cross-process collectives on CPU devices (the loopback tests, CPU-only hosts).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # A dead peer: its gloo connections close, so the next collective fails at once (the
  # engine names the peers, `owners.peers_named`); the coordination service's heartbeat bounds
  # what the sockets do not show (a vanished host), and the shutdown barrier's wait at exit.
  jax.distributed.initialize(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id,
                             heartbeat_timeout_seconds=FLAGS.heartbeat_timeout_s,
                             shutdown_timeout_seconds=FLAGS.heartbeat_timeout_s)


def mesh_from_flags():
  """The Mesh --mesh asks for; without it None on one process, else every global device on
  `expert`."""
  if FLAGS.mesh:
    return sharding.make_mesh(sharding.parse(FLAGS.mesh))
  if jax.process_count() > 1:
    return sharding.make_mesh({"expert": jax.device_count()})
  return None


def process_count() -> int:
  """Processes in this run (1 without jax.distributed)."""
  return jax.process_count()


def exit_now(code: int) -> None:
  """Several processes: leaves at once with `code` (stdio flushed), skipping the shutdown
  barrier, so that the peers' next collective fails instead of waiting for this process."""
  if jax.process_count() > 1:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def per_process(path: str | None) -> str | None:
  """`path` with `{process}` replaced by this process's index: each host (or each local
  process) may open its own copy of a store, which needs to hold only the chunks of the
  experts that process owns (glmjax.offload.owners)."""
  return None if path is None else path.replace("{process}", str(jax.process_index()))


def is_main() -> bool:
  """Whether this process prints and writes files (process 0)."""
  return jax.process_index() == 0
