"""Each test file's CPU seconds in a full run of the suite, for conftest's order of files.

  GLMJAX_TEST_CPU_LOG=/tmp/cpu python -m pytest -q -n 2 --dist loadfile tests
  python tests/file_seconds.py /tmp/cpu [/tmp/cpu2 ...]

writes tests/file_seconds.json: per file, the median over the runs given of the CPU seconds its
tests took (each test's worker and the processes it waited for: conftest's recorder).
"""

import collections
import glob
import json
import os
import statistics
import sys

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_seconds.json")


def run_seconds(log_dir: str) -> dict:
  """{file name: CPU seconds} of one run's recorder directory."""
  out = collections.Counter()
  for tsv in glob.glob(os.path.join(log_dir, "*.tsv")):
    with open(tsv, encoding="utf-8") as f:
      for line in f:
        node, seconds = line.split("\t")[:2]
        out[os.path.basename(node.split("::")[0])] += float(seconds)
  return out


def main(dirs: list[str]) -> None:
  runs = [run_seconds(d) for d in dirs]
  names = sorted({n for r in runs for n in r})
  seconds = {n: round(statistics.median(r.get(n, 0.0) for r in runs), 1) for n in names}
  with open(PATH, "w", encoding="utf-8") as f:
    json.dump(dict(sorted(seconds.items(), key=lambda kv: -kv[1])), f, indent=0)
    f.write("\n")


if __name__ == "__main__":
  main(sys.argv[1:])
