"""glmjax.decoding.sampling against a float64 numpy sort-based reference.

Kept sets are compared exactly. The implementation sums probabilities in float32, so random cases
place top_p / min_p away from the reference's cumulative-mass and ratio boundaries (see _mid_p and
_check_min_p_margin); ties and p = 1 / p ~ 0 are exercised deliberately.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.decoding import sampling as S

BIG_V = 154_880


# --- float64 reference ---------------------------------------------------------------------

def _softmax64(x):
  x = np.asarray(x, np.float64)
  m = np.max(x)
  e = np.exp(x - m) if np.isfinite(m) else np.zeros_like(x)
  return e / e.sum()


def temper(x, t):
  """Tempered float32 logits, rounded as glmjax does it (times the float32 reciprocal)."""
  return np.asarray(x, np.float32) * (np.float32(1) / np.float32(t))


def ref_keep_row(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
  """Kept mask of one row by the sort-based definitions (float32 tempering, float64 after)."""
  x = temper(logits, temperature).astype(np.float64)
  keep = x > -np.inf
  v = x.size
  if 0 < top_k < v:
    kth = np.sort(x)[::-1][top_k - 1]
    keep &= x >= kth
  if top_p < 1.0:
    xm = np.where(keep, x, -np.inf)
    pr = _softmax64(xm)
    order = np.argsort(-xm, kind="stable")
    cum = np.cumsum(pr[order])
    hit = np.nonzero(cum >= top_p)[0]
    last = hit[0] if hit.size else v - 1
    keep &= xm >= xm[order[last]]
  if min_p > 0.0:
    pr = _softmax64(np.where(keep, x, -np.inf))
    keep &= pr >= min_p * pr.max()
  return keep


def ref_keep(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
  logits = np.asarray(logits)
  if logits.ndim == 1:
    return ref_keep_row(logits, temperature, top_k, top_p, min_p)
  b = logits.shape[0]
  t, k, p, mp = (np.broadcast_to(np.asarray(a), (b,)) for a in (temperature, top_k, top_p, min_p))
  return np.stack([ref_keep_row(logits[i], float(t[i]), int(k[i]), float(p[i]), float(mp[i]))
                   for i in range(b)])


def _sorted_cum(x, top_k=0):
  x = np.asarray(x, np.float32).astype(np.float64)
  if top_k:
    x = np.where(x >= np.sort(x)[::-1][top_k - 1], x, -np.inf)
  return np.cumsum(np.sort(_softmax64(x))[::-1])


def _mid_p(x, target, top_k=0):
  """A top_p near `target` halfway between two reference cumulative masses, so float32
  summation (relative error ~1e-7 here) cannot move the boundary."""
  cum = _sorted_cum(x, top_k)
  i = int(np.searchsorted(cum, target))
  lo = cum[i - 1] if i > 0 else 0.0
  assert cum[i] - lo > 1e-6, "degenerate gap; pick another target"
  return float((lo + cum[i]) / 2)


def _check_min_p_margin(x, min_p, keep_before):
  pr = _softmax64(np.where(keep_before, np.asarray(x, np.float64), -np.inf))
  ratio = pr / pr.max()
  assert np.min(np.abs(ratio[keep_before] - min_p)) > 1e-5, "min_p too close to a ratio"


def kept(out):
  return np.asarray(out) > -np.inf


def _filter(logits, **kw):
  return kept(jax.jit(S.filter_logits, static_argnames=tuple(kw))(jnp.asarray(logits), **kw))


# --- filter_logits: random and adversarial ------------------------------------------------

RNG = np.random.default_rng(1234)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(top_k=1),
    dict(top_k=17),
    dict(temperature=0.7, top_k=40),
    dict(min_p=0.05),
    dict(temperature=1.3, min_p=0.2),
])
def test_random_logits_k_and_min_p(kw):
  x = RNG.standard_normal(1000).astype(np.float32) * 3
  if "min_p" in kw:
    _check_min_p_margin(temper(x, kw.get("temperature", 1.0)),
                        kw["min_p"], ref_keep(x, kw.get("temperature", 1.0), kw.get("top_k", 0)))
  np.testing.assert_array_equal(_filter(x, **kw), ref_keep(x, **kw))


@pytest.mark.parametrize("target,temperature,top_k", [
    (0.1, 1.0, 0), (0.5, 1.0, 0), (0.9, 1.0, 0), (0.95, 0.6, 0), (0.8, 1.0, 50), (0.99, 2.0, 0),
])
def test_random_logits_top_p(target, temperature, top_k):
  x = (RNG.standard_normal(2048) * 4).astype(np.float32)
  x_t = temper(x, temperature)
  p = _mid_p(x_t, target, top_k)
  want = ref_keep(x, temperature, top_k, p)
  np.testing.assert_array_equal(_filter(x, temperature=temperature, top_k=top_k, top_p=p), want)
  assert 0 < want.sum() < x.size


def test_combined_settings():
  x = (RNG.standard_normal(3000) * 2).astype(np.float32)
  t, k = np.float32(0.8), 200
  xt = temper(x, t)
  p = _mid_p(xt, 0.7, k)
  keep_before = ref_keep(x, 0.8, k, p)
  _check_min_p_margin(xt, 0.1, keep_before)
  want = ref_keep(x, 0.8, k, p, 0.1)
  assert 0 < want.sum() < keep_before.sum() < k  # every stage removed something
  np.testing.assert_array_equal(_filter(x, temperature=0.8, top_k=k, top_p=p, min_p=0.1), want)


def test_ties_at_top_k_boundary():
  x = np.array([3.0, 2.0, 2.0, 1.0, 2.0, 0.5], np.float32)
  np.testing.assert_array_equal(_filter(x, top_k=2), [1, 1, 1, 0, 1, 0])
  np.testing.assert_array_equal(_filter(x, top_k=2), ref_keep(x, top_k=2))
  np.testing.assert_array_equal(_filter(x, top_k=6), np.ones(6, bool))


def test_ties_at_top_p_boundary():
  x = np.array([0.0, 2.0, 1.0, 1.0, 1.0, -1.0, 1.0], np.float32)
  cum = _sorted_cum(x)
  # p lands inside the run of 1.0s: all four of them stay, the -1 and 0 go.
  p = float((cum[1] + cum[2]) / 2)
  want = np.array([0, 1, 1, 1, 1, 0, 1], bool)
  np.testing.assert_array_equal(ref_keep(x, top_p=p), want)
  np.testing.assert_array_equal(_filter(x, top_p=p), want)


def test_all_equal_and_one_hot():
  flat = np.zeros(500, np.float32)
  for kw in (dict(top_p=0.3), dict(top_k=5), dict(min_p=0.9), dict(top_k=3, top_p=0.01)):
    np.testing.assert_array_equal(_filter(flat, **kw), np.ones(500, bool))
  one_hot = np.zeros(500, np.float32)
  one_hot[123] = 30.0
  for kw in (dict(top_p=0.9), dict(top_k=1), dict(min_p=0.01), dict(top_p=0.5, top_k=10)):
    np.testing.assert_array_equal(_filter(one_hot, **kw), np.arange(500) == 123)


def test_neg_inf_entries_never_kept():
  x = (RNG.standard_normal(300)).astype(np.float32)
  x[::3] = -np.inf
  finite = np.isfinite(x)
  np.testing.assert_array_equal(_filter(x, top_p=1.0), finite)
  np.testing.assert_array_equal(_filter(x, top_k=299), finite)  # k beyond the finite count
  p = _mid_p(x, 0.9999)
  np.testing.assert_array_equal(_filter(x, top_p=p), ref_keep(x, top_p=p))
  lone = np.full(300, -np.inf, np.float32)
  lone[7] = -50.0
  for kw in (dict(), dict(top_p=0.5), dict(top_k=3), dict(min_p=0.5), dict(top_k=300, top_p=0.2)):
    np.testing.assert_array_equal(_filter(lone, **kw), np.arange(300) == 7)


def test_top_p_tiny_keeps_argmax_and_ties():
  x = (RNG.standard_normal(4096)).astype(np.float32)
  x[[5, 900, 3000]] = 9.0
  np.testing.assert_array_equal(_filter(x, top_p=1e-9), np.isin(np.arange(4096), [5, 900, 3000]))
  np.testing.assert_array_equal(_filter(x, top_p=1e-9), ref_keep(x, top_p=1e-9))


def test_top_p_one_keeps_everything_finite():
  x = (RNG.standard_normal(4096) * 20).astype(np.float32)  # tail probs underflow float32
  np.testing.assert_array_equal(_filter(x, top_p=1.0), np.ones(4096, bool))
  out = jax.jit(S.filter_logits)(jnp.asarray(x), top_p=jnp.float32(1.0))  # traced p = 1
  np.testing.assert_array_equal(kept(out), np.ones(4096, bool))


def test_tempering_value():
  x = (RNG.standard_normal(64)).astype(np.float32)
  out = np.asarray(S.filter_logits(jnp.asarray(x), temperature=0.7))
  np.testing.assert_array_equal(out, temper(x, 0.7))  # the documented rounding, exactly
  assert S.filter_logits(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.float32


def test_batch_with_per_row_params():
  b, v = 4, 5000
  x = (RNG.standard_normal((b, v)) * np.array([[1.0], [3.0], [0.3], [6.0]])).astype(np.float32)
  t = np.array([1.0, 0.7, 1.0, 1.5], np.float32)
  k = np.array([0, 300, 10, 0], np.int32)        # row 1: top_k > pre-selection (fallback)
  p = np.array([_mid_p(x[0], 0.9), _mid_p(temper(x[1], t[1]), 0.6, 300), 1.0,
                _mid_p(temper(x[3], t[3]), 0.2)], np.float32)
  mp = np.array([0.0, 0.0, 0.0, 0.0], np.float32)
  want = ref_keep(x, t, k, p, mp)
  got = jax.jit(S.filter_logits)(jnp.asarray(x), jnp.asarray(t), jnp.asarray(k), jnp.asarray(p),
                                 jnp.asarray(mp))
  np.testing.assert_array_equal(kept(got), want)
  assert want[0].sum() > S.PRESELECT  # row 0's nucleus exceeds the pre-selection (fallback)
  # Same rows one at a time with static knobs.
  for i in range(b):
    np.testing.assert_array_equal(
        _filter(x[i], temperature=float(t[i]), top_k=int(k[i]), top_p=float(p[i])), want[i])


def test_nucleus_larger_than_preselection_uses_exact_fallback():
  v = 3000
  x = (RNG.standard_normal(v) * 0.5).astype(np.float32)  # flat: the 0.8-nucleus is ~2200 tokens
  p = _mid_p(x, 0.8)
  want = ref_keep(x, top_p=p)
  assert want.sum() > 4 * S.PRESELECT
  np.testing.assert_array_equal(_filter(x, top_p=p), want)
  # The same kept set via the threshold search alone (which the fallback runs), in one jit
  thr = jax.jit(lambda x, p: S._largest_threshold(x[None], jax.nn.softmax(x)[None], p))(
      jnp.asarray(x), jnp.float32(p))
  np.testing.assert_array_equal(x >= np.asarray(thr)[0, 0], want)


def test_top_k_beyond_preselection():
  x = (RNG.standard_normal(20_000)).astype(np.float32)
  x[:50] = 1.25  # ties straddling the k boundary
  x[50:] = np.where(x[50:] == 1.25, 1.0, x[50:])
  order = np.sort(x)[::-1]
  k = int(np.nonzero(order == 1.25)[0][10]) + 1  # the k-th largest is inside the tie run
  want = ref_keep(x, top_k=k)
  assert want.sum() > k
  np.testing.assert_array_equal(_filter(x, top_k=k), want)               # static, pre-selected
  np.testing.assert_array_equal(_filter(x, top_k=5000), ref_keep(x, top_k=5000))  # static, search
  traced = jax.jit(S.filter_logits)(jnp.asarray(x), 1.0, jnp.int32(k))   # traced, search
  np.testing.assert_array_equal(kept(traced), want)


@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_large_vocab(shape):
  x = RNG.standard_normal(BIG_V).astype(np.float32)
  x = x * 8 if shape == "peaked" else x * 0.05
  for target in (0.5, 0.9):
    p = _mid_p(x, target)
    want = ref_keep(x, top_p=p)
    if shape == "peaked":
      assert want.sum() < S.PRESELECT
    else:
      assert want.sum() > 100 * S.PRESELECT
    np.testing.assert_array_equal(_filter(x, top_p=p), want)
  np.testing.assert_array_equal(_filter(x, top_k=40), ref_keep(x, top_k=40))


# --- sample / probs -------------------------------------------------------------------------

def test_greedy_is_argmax():
  x = jnp.asarray(RNG.standard_normal((6, 777)).astype(np.float32))
  key = jax.random.key(0)
  # Jitted with the Python temperatures static: the eager calls' paths, one compile each
  greedy = jax.jit(S.sample, static_argnames=("temperature",))
  np.testing.assert_array_equal(greedy(key, x, 0.0), np.argmax(np.asarray(x), -1))
  np.testing.assert_array_equal(greedy(key, x[2], -1.0), np.argmax(np.asarray(x[2])))
  t = jnp.asarray([0.0, 1.0, 0.0, 1.0, 0.0, 0.5])
  ids = np.asarray(jax.jit(S.sample)(key, x, t, 0, 1e-9))  # top_p ~ 0 -> also argmax
  np.testing.assert_array_equal(ids, np.argmax(np.asarray(x), -1))
  assert ids.dtype == np.int32
  pr = np.asarray(jax.jit(S.probs, static_argnames=("top_p",))(x, t, top_p=0.5))
  np.testing.assert_array_equal(pr[0], np.eye(777)[np.argmax(np.asarray(x[0]))])


def _chi2_bound(dof, z=4.5):
  """Wilson-Hilferty upper quantile of chi-square (z=4.5: false alarm ~3e-6)."""
  c = 2.0 / (9.0 * dof)
  return dof * (1 - c + z * np.sqrt(c)) ** 3


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.5, top_k=6, top_p=0.9, min_p=0.1),
])
def test_sample_frequencies_match_filtered_distribution(kw):
  x = np.array([2.0, 1.5, 1.5, 0.3, -0.2, -1.0, 0.9, -3.0], np.float32)
  want_keep = ref_keep(x, **kw)
  x_t = temper(x, kw["temperature"]).astype(np.float64)
  want = np.where(want_keep, _softmax64(np.where(want_keep, x_t, -np.inf)), 0.0)
  pr = np.asarray(jax.jit(S.probs, static_argnames=tuple(kw))(jnp.asarray(x), **kw))
  np.testing.assert_allclose(pr, want, atol=1e-6)
  n = 40_000
  ids = jax.jit(S.sample, static_argnames=tuple(kw))(
      jax.random.key(7), jnp.broadcast_to(jnp.asarray(x), (n, x.size)), **kw)
  counts = np.bincount(np.asarray(ids), minlength=x.size)
  assert counts[~want_keep].sum() == 0
  exp = want[want_keep] * n
  chi2 = float(np.sum((counts[want_keep] - exp) ** 2 / exp))
  assert chi2 < _chi2_bound(int(want_keep.sum()) - 1), (chi2, counts, exp)


# --- repetition penalty ----------------------------------------------------------------------

def _ref_penalty(logits, ids, penalty):
  out = np.array(logits, np.float32)
  for b in range(out.shape[0]):
    for t in set(int(i) for i in ids[b] if i >= 0):
      s = out[b, t]
      out[b, t] = s * penalty if s < 0 else s / penalty
  return out


def test_repetition_penalty_matches_loop():
  x = RNG.standard_normal((3, 50)).astype(np.float32)
  x[0, 4] = 0.0
  ids = np.array([[4, 7, 7, 49, -1], [0, 1, 2, 3, 4], [-1, -1, -1, -1, 10]], np.int32)
  got = np.asarray(S.apply_repetition_penalty(jnp.asarray(x), jnp.asarray(ids), 1.3))
  # XLA may divide by multiplying with the reciprocal: 1 ulp (1.2e-7 relative) of freedom.
  np.testing.assert_allclose(got, _ref_penalty(x, ids, np.float32(1.3)), rtol=2.4e-7, atol=0)
  changed = got != x
  np.testing.assert_array_equal(changed, _ref_penalty(x, ids, np.float32(1.3)) != x)
  mask = np.zeros((3, 50), bool)
  for b in range(3):
    mask[b, [i for i in ids[b] if i >= 0]] = True
  got_mask = np.asarray(jax.jit(S.apply_repetition_penalty)(jnp.asarray(x), jnp.asarray(mask),
                                                           jnp.float32(1.3)))
  np.testing.assert_array_equal(got_mask, got)
  single = np.asarray(S.apply_repetition_penalty(jnp.asarray(x[1]), jnp.asarray(ids[1]), 2.0))
  np.testing.assert_allclose(single, _ref_penalty(x[1:2], ids[1:2], np.float32(2.0))[0],
                             rtol=2.4e-7, atol=0)
  assert S.apply_repetition_penalty(x, ids, 1.0) is x


# --- SamplingParams ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"), (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
])
def test_sampling_params_validation(kw, match):
  with pytest.raises(ValueError, match=match):
    S.SamplingParams(**kw)


def test_filter_logits_validates_static_args():
  x = jnp.zeros(10)
  for kw, match in ((dict(temperature=0.0), "temperature"), (dict(top_p=0.0), "top_p"),
                    (dict(top_k=-2), "top_k"), (dict(min_p=-0.1), "min_p")):
    with pytest.raises(ValueError, match=match):
      S.filter_logits(x, **kw)
  with pytest.raises(ValueError, match="shape"):
    S.filter_logits(jnp.zeros((2, 2, 2)))


def test_from_generation_config():
  p = S.SamplingParams.from_generation_config(
      {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [1]})
  assert p == S.SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
  assert not p.greedy
  assert S.SamplingParams.from_generation_config({"do_sample": True}).top_k == 50  # HF default
  assert S.SamplingParams.from_generation_config({"do_sample": True, "top_k": None}).top_k == 50
  assert S.SamplingParams.from_generation_config({"do_sample": True, "top_k": 0}).top_k == 0
  assert S.SamplingParams.from_generation_config({"do_sample": False, "temperature": 0.6}).greedy
  assert S.SamplingParams.from_generation_config({"temperature": 0.6}).greedy  # HF: greedy
  assert S.SamplingParams.from_generation_config(None).greedy
  with pytest.raises(ValueError, match="top_p"):
    S.SamplingParams.from_generation_config({"do_sample": True, "top_p": 2})


def test_sample_with_params_applies_penalty():
  x = jnp.asarray([[5.0, 4.9, -1.0]])
  prm = S.SamplingParams(temperature=0.0, repetition_penalty=2.0)
  assert int(S.sample_with(jax.random.key(0), x, prm)[0]) == 0
  assert int(S.sample_with(jax.random.key(0), x, prm, jnp.asarray([[0]]))[0]) == 1


# --- TokenPicker: run-time knobs ----------------------------------------------------------------

PICKER_SETTINGS = [
    dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=0.9, top_p=0.8),
    dict(temperature=1.1, top_k=7, top_p=0.9, min_p=0.05), dict(temperature=0.6, min_p=0.2),
    dict(temperature=1.0, top_k=300), dict(temperature=0.8, repetition_penalty=1.7),
]


@pytest.mark.parametrize("kw", PICKER_SETTINGS)
def test_picker_equals_sampling_with_static_knobs(kw):
  """The picker passes its knobs at run time; its tokens, distribution and penalty are those of
  `sample` / `probs` / `apply_repetition_penalty` given the same settings as Python numbers."""
  params = S.SamplingParams(**kw)
  seen = [3, 17, 17, 400]
  picker = S.TokenPicker(params, 512, seen, seed=5)
  knobs = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
               min_p=params.min_p)
  static = tuple(knobs)
  penalize = jax.jit(S.apply_repetition_penalty, static_argnames=("penalty",))
  sample = jax.jit(S.sample, static_argnames=static)
  probs = jax.jit(S.probs, static_argnames=static)
  key = jax.random.PRNGKey(5)
  for row in RNG.standard_normal((6, 512)).astype(np.float32):
    x = jnp.asarray(row)
    pen = penalize(x, jnp.asarray(seen), penalty=params.repetition_penalty)
    np.testing.assert_array_equal(picker.probs(x), np.asarray(probs(pen, **knobs), np.float64))
    key, sub = jax.random.split(key)
    assert picker.pick(x) == int(sample(sub, pen, **knobs))


def test_picker_compiles_once_for_every_knob_value():
  """New temperature, top-p, min-p, top-k (within the pre-selection) and penalty values reuse
  the compiled sampler: only which filters are on is static."""
  x = jnp.asarray(RNG.standard_normal(512).astype(np.float32))

  def run(**kw):
    picker = S.TokenPicker(S.SamplingParams(**kw), 512, [1, 2], seed=0)
    picker.pick(x)
    picker.probs(x)

  run(temperature=0.5, top_k=10, top_p=0.9, min_p=0.01, repetition_penalty=1.1)
  sizes = [f._cache_size() for f in (S._sample_jit, S._probs_jit, S._penalize_jit)]
  for t, k, p, m, r in ((0.6, 11, 0.95, 0.02, 1.2), (1.7, 200, 0.3, 0.5, 3.0),
                        (0.01, 1, 0.999, 0.9, 1.01)):
    run(temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=r)
  assert [f._cache_size() for f in (S._sample_jit, S._probs_jit, S._penalize_jit)] == sizes
