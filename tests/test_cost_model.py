"""The offload cost model: a hand-computed prediction, the closed-form calibration, bad input."""

import dataclasses
import math

import pytest

from glmjax.errors import InputError
from glmjax.studies.cost_model import Geometry, Hardware, Hits, calibrate, predict

GEO = Geometry(moe_layers=2, experts=16, top_k=6, expert_bytes=1e6, dense_s_per_token=0.01)
HW = Hardware(disk_gbs=1.0, h2d_gbs=4.0, cpu_kernel_gbs=2.0, device_kernel_gbs=10.0,
              layer_overhead_s=1e-4)


def test_predict_by_hand():
  # One expert is 1 MB: a read takes 1 ms, CPU compute 0.5 ms, device compute 0.1 ms,
  # an upload 0.25 ms.
  r = predict(GEO, HW, Hits(pin=1, host=2, miss=3))
  # Per layer: overhead 0.1 ms; pin 1 × 0.1 ms; host 2 × 0.5 ms; misses: reads set the pace,
  # 3 × 1 ms, and the last landed one's compute cannot hide: + 0.5 ms. So 4.7 ms per layer.
  assert r["overhead_s"] == pytest.approx(2e-4, rel=1e-12)
  assert r["pin_s"] == pytest.approx(2e-4, rel=1e-12)
  assert r["host_s"] == pytest.approx(2e-3, rel=1e-12)
  assert r["miss_s"] == pytest.approx(7e-3, rel=1e-12)
  assert (r["miss_read_s"], r["miss_compute_s"]) == pytest.approx((6e-3, 3e-3), rel=1e-12)
  assert r["s_per_token"] == pytest.approx(0.0194, rel=1e-12)
  assert r["tok_s"] == pytest.approx(1 / 0.0194, rel=1e-12)
  assert r["expert_bytes_read_per_token"] == pytest.approx(6e6, rel=1e-12)


def test_predict_device_placement_and_partial_miss():
  # Device placement: a held expert costs upload 0.25 + compute 0.1 = 0.35 ms. Half an
  # expected miss: max(0.5 × 1, 0.5 × 0.35) + 0.35 × 0.5 = 0.675 ms per layer.
  r = predict(GEO, HW, Hits(pin=0, host=2, miss=0.5), placement="device")
  assert r["host_s"] == pytest.approx(2 * 2 * 0.35e-3, rel=1e-12)
  assert r["miss_s"] == pytest.approx(2 * 0.675e-3, rel=1e-12)
  # Compute-bound misses: the slower stage (compute) sets the pace, one read cannot hide.
  fast_disk = dataclasses.replace(HW, disk_gbs=4.0)  # 0.25 ms per read
  r = predict(GEO, fast_disk, Hits(pin=0, host=0, miss=4))
  assert r["miss_s"] == pytest.approx(2 * (4 * 0.5e-3 + 0.25e-3), rel=1e-12)
  # No misses: nothing to read.
  assert predict(GEO, HW, Hits(pin=6, host=0, miss=0))["miss_s"] == 0.0
  # A stage with no cost (no bus on a CPU-only machine).
  free_bus = dataclasses.replace(HW, h2d_gbs=math.inf)
  assert predict(GEO, free_bus, Hits(0, 1, 0), placement="device")["host_s"] == pytest.approx(
      2 * 0.1e-3, rel=1e-12)


def test_hits_constructors():
  h = Hits.from_counts(pin=30, host=60, miss=90, layer_steps=30)
  assert (h.pin, h.host, h.miss) == (1, 2, 3)
  h = Hits.from_rates(hit_rate=0.5, pin_share=0.125, top_k=8)
  assert (h.pin, h.host, h.miss) == (1, 3, 4)


def test_calibrate_recovers_a_known_overhead():
  truth = dataclasses.replace(HW, layer_overhead_s=3.7e-4)
  hits = [Hits(0, 0, 6), Hits(0, 3, 3), Hits(2, 4, 0), Hits(1, 1.5, 2.25)]
  runs = [(h, predict(GEO, truth, h)["s_per_token"]) for h in hits]
  fit = calibrate(runs, GEO, dataclasses.replace(HW, layer_overhead_s=0.0))
  assert abs(fit["layer_overhead_s"] - 3.7e-4) < 1e-9
  assert fit["hardware"].layer_overhead_s == pytest.approx(3.7e-4, abs=1e-9)
  assert fit["max_abs_rel_error"] < 1e-9
  assert [r["measured_s"] for r in fit["runs"]] == [m for _, m in runs]
  assert abs(fit["miss_overhead_s"]) < 1e-9  # none in the truth, none fitted
  # Offsets that cancel, per-layer constant only: the fit is their mean, errors symmetric.
  runs2 = [(hits[0], runs[0][1] + 1e-3), (hits[1], runs[1][1] - 1e-3)]
  fit = calibrate(runs2, GEO, HW, per_miss=False)
  assert abs(fit["layer_overhead_s"] - 3.7e-4) < 1e-9 and fit["miss_overhead_s"] == 0.0
  errs = [r["rel_error"] for r in fit["runs"]]
  assert errs[0] < 0 < errs[1]


def test_calibrate_recovers_a_known_per_miss_cost():
  """Both overheads come back from runs that differ in misses; with one miss count the
  per-miss cost cannot be told from the per-layer one and stays 0."""
  truth = dataclasses.replace(HW, layer_overhead_s=2.0e-4, miss_overhead_s=2.5e-4)
  hits = [Hits(0, 0, 6), Hits(0, 3, 3), Hits(2, 4, 0)]
  runs = [(h, predict(GEO, truth, h)["s_per_token"]) for h in hits]
  fit = calibrate(runs, GEO, HW)
  assert fit["layer_overhead_s"] == pytest.approx(2.0e-4, abs=1e-10)
  assert fit["miss_overhead_s"] == pytest.approx(2.5e-4, abs=1e-10)
  assert fit["max_abs_rel_error"] < 1e-9
  same = calibrate([(hits[0], runs[0][1]), (hits[0], runs[0][1])], GEO, HW)
  assert same["miss_overhead_s"] == 0.0
  assert same["layer_overhead_s"] == pytest.approx(2.0e-4 + 6 * 2.5e-4, abs=1e-10)


@pytest.mark.parametrize("make, name", [
    (lambda: Geometry(0, 16, 6, 1e6, 0.01), "moe_layers"),
    (lambda: Geometry(2, 16, 17, 1e6, 0.01), "top_k"),
    (lambda: Geometry(2, 16, 6, -1, 0.01), "expert_bytes"),
    (lambda: Geometry(2, 16, 6, 1e6, math.nan), "dense_s_per_token"),
    (lambda: Geometry(2.5, 16, 6, 1e6, 0.01), "moe_layers"),
    (lambda: Hardware(0, 1, 1, 1), "disk_gbs"),
    (lambda: Hardware(1, 1, -2, 1), "cpu_kernel_gbs"),
    (lambda: Hardware(1, 1, 1, "fast"), "device_kernel_gbs"),
    (lambda: Hardware(1, 1, 1, 1, -1e-3), "layer_overhead_s"),
    (lambda: Hits(-1, 0, 0), "pin"),
    (lambda: Hits(0, math.inf, 0), "host"),
    (lambda: predict(GEO, HW, Hits(8, 8, 1)), "hits"),
    (lambda: predict(GEO, HW, (1, 2, 3)), "hits"),
    (lambda: predict(HW, HW, Hits(1, 2, 3)), "geometry"),
    (lambda: predict(GEO, GEO, Hits(1, 2, 3)), "hardware"),
    (lambda: predict(GEO, HW, Hits(1, 2, 3), placement="gpu"), "placement"),
    (lambda: Hits.from_counts(1, 2, 3, 0), "layer_steps"),
    (lambda: Hits.from_rates(1.2, 0.1, 8), "hit_rate"),
    (lambda: Hits.from_rates(0.5, 0.6, 8), "pin_share"),
    (lambda: calibrate([], GEO, HW), "at least one"),
    (lambda: calibrate([(Hits(1, 2, 3), 0.0)], GEO, HW), "runs[0]"),
    (lambda: calibrate([(Hits(1, 2, 3), 0.1), ((1, 2, 3), 0.1)], GEO, HW), "runs[1]"),
])
def test_bad_input(make, name):
  with pytest.raises(InputError, match=name.replace("[", r"\[").replace("]", r"\]")):
    make()


def test_published_figures_carry_their_sources():
  """Every figure of the GLM-5.2 prediction comes from the package's data file with a source
  that names a public document, not a path outside the repository."""
  from glmjax.studies.glm52 import glm52_prediction, published_figures
  figures = published_figures()
  assert {"moe_layers", "experts", "top_k", "expert_bytes", "disk_gbs", "measured_tok_s",
          "cross_row"} <= set(figures)
  for name, f in figures.items():
    assert set(f) == {"value", "source", "kind"}, name
    assert f["source"].strip() and "../" not in f["source"] and ".md §" not in f["source"], name
  r = glm52_prediction()
  assert r["measured_tok_s"] == figures["measured_tok_s"]["value"]
  assert all(a["source"] and "../" not in a["source"] for a in r["assumptions"])
  assert 0 < r["prediction"]["tok_s"] and math.isfinite(r["prediction"]["tok_s"])
  # Changing a figure in the data changes the prediction: the numbers are read, not copied.
  slower = {**figures, "disk_gbs": {**figures["disk_gbs"], "value": 1.0}}
  assert glm52_prediction(slower)["prediction"]["tok_s"] < r["prediction"]["tok_s"]
