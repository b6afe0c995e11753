"""A soak: a mixed workload against the OpenAI-compatible server for --minutes, then checks.

  python scripts/serve.py &                        # the embedded model on 127.0.0.1:8000
  python scripts/soak.py --minutes=10 --clients=6
  python scripts/serve.py --model=/tmp/store --host_cache_gb=0.002 --port=8001 &
  python scripts/soak.py --url=http://127.0.0.1:8001 --pid=$!

The load, its checks and its report: glmjax.bench.soak.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from absl import app, flags

from glmjax.bench.soak import Soak, SoakOptions

FLAGS = flags.FLAGS
flags.DEFINE_string("url", "http://127.0.0.1:8000", "The server (scripts/serve.py) to load.")
flags.DEFINE_integer("pid", None, "The server's process id, for its RSS (default: the process "
                     "listening on --url's port, if it is this machine's and this user's).")
flags.DEFINE_float("minutes", 10, "Duration of the load (the first pass always completes).")
flags.DEFINE_integer("clients", 4, "Concurrent clients.", lower_bound=1, upper_bound=64)
flags.DEFINE_integer("max_tokens", 16, "max_tokens of each request.", lower_bound=2)
flags.DEFINE_bool("tools", True, "Include chats offering a tool (needs server tools).")
flags.DEFINE_bool("json_schema", True, "Include json_schema response_format chats.")
flags.DEFINE_float("rss_every", 10, "Seconds between RSS samples.", lower_bound=0.1)
flags.DEFINE_float("max_rss_growth", 0.02, "Most RSS growth after warm-up (a fraction).")
flags.DEFINE_string("json", None, "Also write the JSON report here.")


def main(argv):
  del argv
  opts = SoakOptions(**{f.name: getattr(FLAGS, f.name) for f in dataclasses.fields(SoakOptions)})
  report = Soak(FLAGS.url, FLAGS.pid, opts).run()
  out = json.dumps(report, indent=2)
  print(out)
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      f.write(out + "\n")
  r, lat, rss = report, report["latency_s"], report["rss_mb"]
  print(f"soak: {r['requests']} requests in {r['load_s']} s, status {r['status']}, problems "
        f"{r['problems'] or 'none'}, p50/p99 {lat['p50']}/{lat['p99']} s, KV pages in use "
        f"{r['kv_after']['pages_in_use']}, RSS {rss['warm']} → {rss['final']} MB, failed "
        f"checks: {[k for k, v in r['checks'].items() if not v] or 'none'}", file=sys.stderr)
  return 0 if report["ok"] else 1


if __name__ == "__main__":
  app.run(main)
