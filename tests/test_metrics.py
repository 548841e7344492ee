"""jaxmoral.metrics against brute force, hand-computed values and SciPy."""

import itertools

import numpy as np
import pytest
import scipy.stats
from scipy.spatial import distance

from jaxmoral import metrics


def brute_force_auc(labels, scores):
  pos = [s for l, s in zip(labels, scores) if l]
  neg = [s for l, s in zip(labels, scores) if not l]
  wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
  return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(5))
def test_roc_auc_matches_pair_count_with_ties(seed):
  rng = np.random.default_rng(seed)
  labels = rng.random(60) > 0.6
  labels[:2] = [True, False]
  scores = rng.integers(0, 8, size=60).astype(float)  # many ties
  assert metrics.roc_auc(labels, scores) == pytest.approx(brute_force_auc(labels, scores),
                                                          abs=1e-12)
  fpr, tpr, thr = metrics.roc_curve(labels.astype(int), scores)
  assert np.trapezoid(tpr, fpr) == pytest.approx(metrics.roc_auc(labels, scores), abs=1e-12)


def test_roc_auc_rows_is_roc_auc_of_each_row_and_nan_for_one_class():
  rng = np.random.default_rng(5)
  labels = rng.integers(0, 2, size=(40, 9))
  labels[0], labels[1] = 0, 1  # Rows of one class.
  scores = np.round(rng.normal(size=(40, 9)), 1)  # Ties.
  rows = metrics.roc_auc_rows(labels, scores)
  assert rows.shape == (40,) and np.isnan(rows[:2]).all()
  for label_row, score_row, auc in zip(labels[2:], scores[2:], rows[2:]):
    if label_row.min() == label_row.max():
      assert np.isnan(auc)
    else:
      assert auc == pytest.approx(_pairwise_auc(label_row, score_row), abs=1e-12)
  assert np.isnan(metrics.roc_auc_rows(np.zeros((3, 0)), np.zeros((3, 0)))).all()
  with pytest.raises(ValueError, match="roc_auc_rows: labels and scores must be 2-D"):
    metrics.roc_auc_rows([0, 1], [0.1, 0.2])
  with pytest.raises(ValueError, match="NaN or inf"):
    metrics.roc_auc_rows([[0, 1]], [[0.1, np.inf]])


def test_roc_auc_difference_rows_is_the_paired_difference_of_each_row():
  rng = np.random.default_rng(8)
  labels = rng.integers(0, 2, size=(30, 11))
  labels[:, :2] = [0, 1]  # Both classes in every row.
  better = labels + rng.normal(size=labels.shape)
  worse = rng.normal(size=labels.shape)
  diff = metrics.roc_auc_difference_rows(labels, better, worse)
  np.testing.assert_allclose(diff, [_pairwise_auc(y, a) - _pairwise_auc(y, b)
                                    for y, a, b in zip(labels, better, worse)], atol=1e-12)
  assert diff.mean() > 0


def test_roc_auc_extremes_and_errors():
  assert metrics.roc_auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
  assert metrics.roc_auc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4]) == 0.0
  assert metrics.roc_auc([0, 1, 0, 1], [0.5] * 4) == 0.5
  with pytest.raises(ValueError, match="both classes"):
    metrics.roc_auc([1, 1, 1], [0.1, 0.2, 0.3])
  with pytest.raises(ValueError, match="0/1"):
    metrics.roc_auc([0, 2, 1], [0.1, 0.2, 0.3])
  with pytest.raises(ValueError, match="equal length"):
    metrics.roc_auc([0, 1], [0.1, 0.2, 0.3])
  with pytest.raises(ValueError, match="NaN"):
    metrics.roc_auc([0, 1], [0.1, np.nan])


def test_roc_curve_points():
  fpr, tpr, thr = metrics.roc_curve([1, 0, 1, 0], [0.9, 0.8, 0.8, 0.1])
  assert thr[0] == np.inf and (fpr[0], tpr[0]) == (0.0, 0.0)
  assert (fpr[-1], tpr[-1]) == (1.0, 1.0)
  np.testing.assert_allclose(thr[1:], [0.9, 0.8, 0.1])
  np.testing.assert_allclose(tpr, [0, 0.5, 1.0, 1.0])
  np.testing.assert_allclose(fpr, [0, 0, 0.5, 1.0])


def test_ranking_metrics_hand_computed():
  scores = [np.array([0.9, 0.5, 0.7, 0.1]),   # ranking: a(0) c(0) b(1) d(1)
            np.array([0.2, 0.8, 0.4]),        # ranking: b(1) c(0) a(1)
            np.array([0.3, 0.3]),             # tie: pessimistic -> irrelevant first
            np.array([0.1, 0.2])]             # no relevant item: left out
  relevant = [np.array([0, 1, 0, 1]), np.array([1, 1, 0]), np.array([True, False]),
              np.array([0, 0])]
  out = metrics.ranking_metrics(scores, relevant)
  ap = [(1 / 3 + 2 / 4) / 2, (1 + 2 / 3) / 2, 1 / 2]
  rr = [1 / 3, 1.0, 1 / 2]
  assert out["map"] == pytest.approx(np.mean(ap))
  assert out["mrr"] == pytest.approx(np.mean(rr))
  assert out["p@1"] == pytest.approx(1 / 3)
  assert out["num_queries"] == 3
  with pytest.raises(ValueError, match="query 0"):
    metrics.ranking_metrics([np.array([1.0, 2.0])], [np.array([1])])
  with pytest.raises(ValueError, match="no query"):
    metrics.ranking_metrics([np.array([1.0])], [np.array([0])])


def test_distinct_n_hand_example():
  texts = ["the cat sat", "the cat ran", ""]
  assert metrics.distinct_n(texts, 1) == pytest.approx(4 / 6)
  assert metrics.distinct_n(texts, 2) == pytest.approx(3 / 4)
  assert metrics.distinct_n(texts, 3) == pytest.approx(2 / 2)
  assert metrics.distinct_n(["a"], 2) == 0.0
  with pytest.raises(ValueError, match="positive int"):
    metrics.distinct_n(texts, 0)


def test_wh_word_distribution():
  dist = metrics.wh_word_distribution(
      ["What do you mean?", "Why?", "Do you know WHY he left?", "Is it yours?", "how so"])
  assert dist["what"] == dist["how"] == pytest.approx(0.2)
  assert dist["why"] == pytest.approx(0.4)
  assert dist["other"] == pytest.approx(0.2)
  assert sum(dist.values()) == pytest.approx(1.0)
  with pytest.raises(ValueError, match="no questions"):
    metrics.wh_word_distribution([])


def _random_distributions(rng, n, k):
  p = rng.random((n, k))
  p[rng.random((n, k)) < 0.3] = 0.0
  p[:, 0] += 0.1  # no all-zero rows
  return p / p.sum(-1, keepdims=True)


def test_jensen_shannon_matches_scipy():
  rng = np.random.default_rng(7)
  p, q = _random_distributions(rng, 50, 6), _random_distributions(rng, 50, 6)
  q[0] = p[0]
  p[1], q[1] = [1, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0]  # disjoint: exactly 1 bit
  ref = np.array([distance.jensenshannon(a, b, base=2) ** 2 for a, b in zip(p, q)])
  np.testing.assert_allclose(metrics.jensen_shannon(p, q), ref, atol=1e-12)
  assert metrics.jensen_shannon(p[1], q[1]) == pytest.approx(1.0)
  ref_e = distance.jensenshannon(p[2], q[2], base=np.e) ** 2
  assert metrics.jensen_shannon(p[2] * 3, q[2], base=np.e) == pytest.approx(ref_e)  # normalises
  with pytest.raises(ValueError, match=">= 0"):
    metrics.jensen_shannon([0.5, -0.5], [0.5, 0.5])
  with pytest.raises(ValueError, match="shapes differ"):
    metrics.jensen_shannon([0.5, 0.5], [1.0])


# -- bootstrap ------------------------------------------------------------------------------


def _pairwise_auc(labels, scores):
  """ROC AUC by counting (positive, negative) pairs: the reference."""
  pos, neg = scores[labels == 1], scores[labels == 0]
  diff = pos[:, None] - neg[None, :]
  return float(np.mean((diff > 0) + 0.5 * (diff == 0)))


@pytest.mark.parametrize("vectorized", [False, True], ids=["roc_auc", "roc_auc_rows"])
def test_bootstrap_roc_auc_matches_reference_loop_and_counts_skips(vectorized):
  rng = np.random.default_rng(3)
  labels = (np.arange(14) < 3).astype(int)  # 3 positives: ~10 % of resamples have none.
  scores = np.round(rng.normal(size=14) + labels, 1)  # Rounded: ties.
  metric = metrics.roc_auc_rows if vectorized else metrics.roc_auc
  ci = metrics.bootstrap_ci(metric, labels, scores, num_resamples=500, seed=11,
                            vectorized=vectorized)
  ref_rng = np.random.default_rng(11)
  stats, skipped = [], 0
  for rows in ref_rng.integers(0, 14, size=(500, 14)):
    if labels[rows].min() == labels[rows].max():
      skipped += 1
      continue
    stats.append(_pairwise_auc(labels[rows], scores[rows]))
  assert skipped > 10 and ci.num_skipped == skipped and ci.num_resamples == 500
  np.testing.assert_allclose(ci, [_pairwise_auc(labels, scores),
                                  *np.percentile(stats, [2.5, 97.5])], rtol=1e-12)
  assert ci.low <= ci.estimate <= ci.high and ci.low < ci.high
  estimate, low, high = ci  # Unpacks as a plain triple.
  assert (estimate, low, high) == (ci.estimate, ci.low, ci.high)


def test_bootstrap_mean_vectorized_equals_loop_and_reference():
  x = np.random.default_rng(0).exponential(size=37)
  loop = metrics.bootstrap_ci(np.mean, x, num_resamples=300, confidence=0.9, seed=4)
  # A small batch bound: several vectorised calls.
  vec = metrics.bootstrap_ci(lambda a: a.mean(axis=1), x, num_resamples=300, confidence=0.9,
                             seed=4, vectorized=True, max_batch_elements=37 * 7)
  draws = np.random.default_rng(4).integers(0, 37, size=(300, 37))
  means = [float(np.sum(x[rows]) / 37) for rows in draws]
  np.testing.assert_allclose(loop, [x.mean(), *np.percentile(means, [5, 95])], rtol=1e-12)
  np.testing.assert_allclose(vec, loop, rtol=1e-12)
  assert loop.num_skipped == 0


def test_bootstrap_mean_coverage_is_near_nominal():
  rng = np.random.default_rng(2024)
  true_mean, covered = 1.3, 0
  for i in range(200):
    x = rng.normal(true_mean, 2.0, size=80)
    ci = metrics.bootstrap_ci(lambda a: a.mean(axis=1), x, seed=i, vectorized=True)
    covered += ci.low <= true_mean <= ci.high
  assert 0.90 <= covered / 200 <= 0.99


def _groups_intact(group, position, size):
  """1.0 if the rows form whole groups, each complete and in order, else 0.0."""
  i = 0
  while i < len(group):
    n = size[i]
    if not (np.all(group[i:i + n] == group[i]) and
            np.array_equal(position[i:i + n], np.arange(n))):
      return 0.0
    i += n
  return 1.0


def test_bootstrap_units_resample_whole_groups():
  sizes = [1, 3, 2, 4, 2, 1, 3]
  group = np.repeat(np.array([5, 2, 9, 0, 7, 3, 8]), sizes)
  position = np.concatenate([np.arange(s) for s in sizes])
  size = np.repeat(sizes, sizes)
  # Shuffle the rows: a unit's rows need not be adjacent in the data.
  perm = np.random.default_rng(1).permutation(group.size)
  group, position, size = group[perm], position[perm], size[perm]
  order = np.lexsort((position, group))  # Rows grouped, in position order: intact.
  args = (group[order], position[order], size[order])
  assert _groups_intact(*args) == 1.0
  grouped = metrics.bootstrap_ci(_groups_intact, *args, units=args[0], num_resamples=200)
  assert tuple(grouped) == (1.0, 1.0, 1.0)
  rows_only = metrics.bootstrap_ci(_groups_intact, *args, num_resamples=200)
  assert rows_only.low == 0.0  # Row resampling splits groups: the check can fail.
  # Against a reference loop over the sorted unit ids.
  value = group.astype(float) + position
  ci = metrics.bootstrap_ci(np.mean, value, units=group, num_resamples=200, seed=5)
  unit_ids = np.unique(group)
  means = []
  for draw in np.random.default_rng(5).integers(0, unit_ids.size, size=(200, unit_ids.size)):
    rows = np.concatenate([np.flatnonzero(group == unit_ids[u]) for u in draw])
    means.append(value[rows].mean())
  np.testing.assert_allclose(ci, [value.mean(), *np.percentile(means, [2.5, 97.5])],
                             rtol=1e-12)
  with pytest.raises(ValueError, match="units differ in size"):
    metrics.bootstrap_ci(lambda a: a.mean(axis=1), value, units=group, vectorized=True)
  # Equal units can be vectorised, and agree with the loop.
  pairs = np.repeat(np.arange(10), 2)
  y = np.random.default_rng(2).normal(size=20)
  np.testing.assert_allclose(
      metrics.bootstrap_ci(lambda a: a.mean(axis=1), y, units=pairs, vectorized=True),
      metrics.bootstrap_ci(np.mean, y, units=pairs), rtol=1e-12)


def test_bootstrap_errors():
  with pytest.raises(ValueError, match="same, non-zero number of rows"):
    metrics.bootstrap_ci(metrics.roc_auc, [0, 1], [0.1, 0.2, 0.3])
  with pytest.raises(ValueError, match="undefined on all"):
    metrics.bootstrap_ci(lambda a: np.nan if a.size else 0.0, np.ones(3), num_resamples=5)
  with pytest.raises(ValueError, match="confidence"):
    metrics.bootstrap_ci(np.mean, np.ones(3), confidence=1.0)


def test_grouped_roc_auc_counts_only_pairs_within_a_group():
  rng = np.random.default_rng(5)
  n = 60
  labels = rng.integers(0, 2, n)
  scores = np.round(rng.normal(size=n), 1)  # ties, counted 1/2
  groups = rng.integers(0, 6, n)
  # Reference: every (positive, negative) pair of one group, by enumeration.
  pairs = [float(scores[a] > scores[b]) + 0.5 * float(scores[a] == scores[b])
           for a in range(n) for b in range(n)
           if labels[a] == 1 and labels[b] == 0 and groups[a] == groups[b]]
  assert metrics.grouped_roc_auc(labels, scores, groups) == pytest.approx(np.mean(pairs))
  assert metrics.grouped_roc_auc(labels, scores, np.array(["g%d" % g for g in groups])) == (
      pytest.approx(np.mean(pairs)))  # Groups of any sortable values.
  # The pair-weighted mean of each group's Mann-Whitney AUC (SciPy).
  total = weight = 0.0
  for g in np.unique(groups):
    pos, neg = scores[(groups == g) & (labels == 1)], scores[(groups == g) & (labels == 0)]
    if pos.size and neg.size:
      total += scipy.stats.mannwhitneyu(pos, neg).statistic
      weight += pos.size * neg.size
  assert metrics.grouped_roc_auc(labels, scores, groups) == pytest.approx(total / weight)
  # A score that is only the group's value tells nothing within groups; one group is roc_auc.
  assert metrics.grouped_roc_auc(labels, groups.astype(float), groups) == 0.5
  assert metrics.grouped_roc_auc(labels, scores, np.zeros(n)) == pytest.approx(
      metrics.roc_auc(labels, scores))
  with pytest.raises(ValueError, match="no group holds both labels"):
    metrics.grouped_roc_auc(labels, scores, np.arange(n))
