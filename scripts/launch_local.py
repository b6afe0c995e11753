"""Starts N processes of a script on this machine, joined by jax.distributed over loopback.

  python scripts/launch_local.py --processes=2 --devices_per_process=2 -- \
      scripts/generate.py --prompt_ids=5,6,7 --max_new_tokens=8

Each process gets M CPU devices (XLA_FLAGS --xla_force_host_platform_device_count), a free
loopback port for the coordinator, and --coordinator, --num_processes, --process_id appended to
the script's flags (glmjax.distributed reads them). Process 0's output passes through; the
others' is kept and shown only if one fails. The exit status is the first non-zero one.
SIGTERM or SIGINT to this launcher is passed to process 0 alone as SIGINT: it stops (a server
stops serving) and the others follow it out (glmjax.serving.follow).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("processes", 2, "Processes to start.", lower_bound=1)
flags.DEFINE_integer("devices_per_process", 1, "CPU devices in each process.", lower_bound=1)
flags.DEFINE_float("timeout_s", 600.0, "Kill every process after this long.")


def free_port() -> int:
  """A loopback port nobody listens on now (the OS picks it)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main(argv):
  script = argv[1:]
  if not script:
    print("usage: launch_local.py [flags] -- script.py [script flags]", file=sys.stderr)
    return 2
  n, port = FLAGS.processes, free_port()
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={FLAGS.devices_per_process}")
  env["JAX_PLATFORMS"] = "cpu"
  procs, logs = [], []
  for i in range(n):
    cmd = [sys.executable, *script, f"--coordinator=127.0.0.1:{port}", f"--num_processes={n}",
           f"--process_id={i}"]
    log = None if i == 0 else tempfile.TemporaryFile()
    procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
    logs.append(log)

  def stop_first(signum, frame):
    del signum, frame
    if procs[0].poll() is None:
      procs[0].send_signal(signal.SIGINT)
  signal.signal(signal.SIGTERM, stop_first)
  signal.signal(signal.SIGINT, stop_first)
  codes = []
  try:
    for p in procs:
      codes.append(p.wait(timeout=FLAGS.timeout_s))
  except subprocess.TimeoutExpired:
    print(f"launch_local: timed out after {FLAGS.timeout_s} s", file=sys.stderr)
    codes.append(124)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for i, (code, log) in enumerate(zip(codes, logs)):
    if code and log is not None:
      log.seek(0)
      tail = log.read().decode(errors="replace")[-4000:]
      print(f"--- process {i} exited {code} ---\n{tail}", file=sys.stderr)
  return next((c for c in codes if c), 0)


if __name__ == "__main__":
  app.run(main)
