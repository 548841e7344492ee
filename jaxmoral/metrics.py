"""Evaluation metrics shared by the methods: ROC AUC, ranking, diversity, Jensen–Shannon, and
percentile bootstrap confidence intervals of any of them.

Host-side functions take NumPy (or anything `np.asarray` accepts) and return float64 / Python
floats; no scikit-learn.
"""

from __future__ import annotations

import collections
import operator
import re
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from jaxmoral import validation


def _binary_inputs(name: str, labels: Any, scores: Any, *,
                   ndim: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Validated bool labels and float64 scores of one shape with `ndim` axes; with ndim 1,
  both classes present (with 2, rows are resamples, and one of a single class is NaN)."""
  labels = np.asarray(labels)
  scores = np.asarray(scores, dtype=np.float64)
  if labels.ndim != ndim or labels.shape != scores.shape:
    equal = "1-D of equal length" if ndim == 1 else f"{ndim}-D of equal shape"
    raise ValueError(f"{name}: labels and scores must be {equal}, got shapes "
                     f"{labels.shape} and {scores.shape}")
  if labels.dtype != bool:
    if not np.all(np.isin(labels, (0, 1))):
      raise ValueError(f"{name}: labels must be 0/1 or bool, got values {np.unique(labels)[:5]}")
    labels = labels.astype(bool)
  if not np.all(np.isfinite(scores)):
    raise ValueError(f"{name}: scores contain NaN or inf")
  if ndim == 1:
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
      raise ValueError(f"{name}: needs both classes, got {n_pos} positive and {n_neg} negative "
                       "labels (ROC is undefined for one class)")
  return labels, scores


def _mann_whitney_u(labels: np.ndarray, scores: np.ndarray, group_of_row: np.ndarray,
                    num_groups: int) -> tuple[np.ndarray, np.ndarray]:
  """`(U, n_pos * n_neg)` of each group, (num_groups,) each, from (N,) bool `labels`, `scores`
  and `group_of_row` in [0, num_groups): the (positive, negative) pairs of one group in which
  the positive outscores, ties 1/2, and the number of such pairs. A group of one class has 0.

  One pass for any number of groups: rows sorted by (group, score); each run of equal (group,
  score) gets its mean position, less its group's first position: the within-group average
  rank, from which U = sum of the positives' ranks - n_pos (n_pos + 1) / 2.
  """
  if not labels.size:  # Rows of no items: no pairs (their AUC is NaN).
    return np.zeros(num_groups), np.zeros(num_groups)
  order = np.lexsort((scores, group_of_row))
  group, score, positive = group_of_row[order], scores[order], labels[order]
  new_run = np.r_[True, (group[1:] != group[:-1]) | (score[1:] != score[:-1])]
  run_start = np.flatnonzero(new_run)
  run_end = np.r_[run_start[1:], group.size] - 1
  run_of_row = np.cumsum(new_run) - 1
  group_start = np.searchsorted(group, np.arange(num_groups))
  rank = (run_start[run_of_row] + run_end[run_of_row]) / 2.0 - group_start[group] + 1.0
  n_pos = np.bincount(group, weights=positive.astype(np.float64), minlength=num_groups)
  n_all = np.bincount(group, minlength=num_groups).astype(np.float64)
  rank_sum = np.bincount(group, weights=np.where(positive, rank, 0.0), minlength=num_groups)
  return rank_sum - n_pos * (n_pos + 1) / 2.0, n_pos * (n_all - n_pos)


def roc_auc(labels: Any, scores: Any) -> float:
  """Area under the ROC curve of (N,) 0/1 or bool `labels` and finite `scores` (high: positive).

  Equals the Mann–Whitney U statistic / (n_pos * n_neg): the probability that a random positive
  outscores a random negative, ties counting 1/2 (average ranks).

  Raises:
    ValueError: on shape mismatch, non-binary labels, non-finite scores or a single class.
  """
  labels, scores = _binary_inputs("roc_auc", labels, scores)
  u, pairs = _mann_whitney_u(labels, scores, np.zeros(labels.size, np.intp), 1)
  return float(u[0] / pairs[0])


def roc_auc_rows(labels: Any, scores: Any) -> np.ndarray:
  """`roc_auc` of every row of (B, N) `labels` and `scores` at once: (B,) float64, NaN for a
  row of one class. The metric of `bootstrap_ci(roc_auc_rows, ..., vectorized=True)`, whose
  resamples are its rows: a thousand resamples cost one sort instead of a thousand calls.

  Raises:
    ValueError: on shape mismatch, non-binary labels or non-finite scores.
  """
  labels, scores = _binary_inputs("roc_auc_rows", labels, scores, ndim=2)
  num_rows, row_size = labels.shape
  u, pairs = _mann_whitney_u(labels.ravel(), scores.ravel(),
                             np.repeat(np.arange(num_rows), row_size), num_rows)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(pairs > 0, u / np.where(pairs > 0, pairs, 1.0), np.nan)


def roc_auc_difference_rows(labels: Any, scores: Any, other_scores: Any) -> np.ndarray:
  """`roc_auc_rows(labels, scores) - roc_auc_rows(labels, other_scores)`: (B,), the paired
  difference of two detectors on the same resampled rows; the metric of
  `bootstrap_ci(roc_auc_difference_rows, labels, a, b, vectorized=True)`, whose interval
  excluding 0 says one detector beats the other on these examples.
  """
  return roc_auc_rows(labels, scores) - roc_auc_rows(labels, other_scores)


def grouped_roc_auc(labels: Any, scores: Any, groups: Any) -> float:
  """ROC AUC over the (positive, negative) pairs in the same group only, ties counting 1/2.

  With groups = the input's length it is a length-matched AUC (a score that only follows the
  length gets exactly 0.5); with groups = the example of each word, a within-example word AUC
  (every word of one example shares its input). Equals the pair-weighted mean of each group's
  `roc_auc`. `groups`: (N,) the group of each row (any values NumPy can sort).

  Raises:
    ValueError: on bad inputs (as `roc_auc`), or when no group holds both labels.
  """
  labels, scores = _binary_inputs("grouped_roc_auc", labels, scores)
  groups = np.asarray(groups)
  if groups.shape != labels.shape:
    raise ValueError(f"grouped_roc_auc: groups shape {groups.shape} != labels shape "
                     f"{labels.shape}")
  distinct, group_of_row = np.unique(groups, return_inverse=True)
  u, pairs_per_group = _mann_whitney_u(labels, scores, group_of_row.ravel(), distinct.size)
  pairs = float(pairs_per_group.sum())
  if not pairs:
    raise ValueError("grouped_roc_auc: no group holds both labels")
  return float(u.sum() / pairs)


def roc_curve(labels: Any, scores: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """ROC points at every distinct score threshold.

  Returns:
    (fpr, tpr, thresholds), float64 arrays of equal length: thresholds decreasing from +inf
    (nothing predicted positive: fpr = tpr = 0) to the lowest score (everything positive:
    fpr = tpr = 1); a point predicts positive for scores >= its threshold. The trapezoid area
    under (fpr, tpr) equals `roc_auc`.
  """
  labels, scores = _binary_inputs("roc_curve", labels, scores)
  order = np.argsort(-scores, kind="mergesort")
  scores, labels = scores[order], labels[order]
  # Last index of each run of equal scores: a threshold admits the whole run at once.
  last = np.r_[np.flatnonzero(scores[1:] != scores[:-1]), scores.size - 1]
  tps = np.cumsum(labels)[last]
  fps = (last + 1) - tps
  return np.r_[0.0, fps / fps[-1]], np.r_[0.0, tps / tps[-1]], np.r_[np.inf, scores[last]]


def ranking_metrics(scores_per_query: Sequence[Any],
                    relevant_per_query: Sequence[Any]) -> dict[str, float]:
  """Mean average precision, mean reciprocal rank and precision at 1 over queries, as
  `{"map", "mrr", "p@1", "num_queries"}` (num_queries: the queries averaged).

  Candidates of each query are ranked by decreasing score. Ties are broken pessimistically:
  among equal scores the non-relevant candidates rank first, so a constant scorer gets no
  credit. Queries without any relevant candidate are left out (they have no defined AP/RR).

  Args:
    scores_per_query: One (n_q,) array of candidate scores per query.
    relevant_per_query: One (n_q,) bool / 0-1 array per query.

  Raises:
    ValueError: on mismatched lengths or when no query has a relevant candidate.
  """
  if len(scores_per_query) != len(relevant_per_query):
    raise ValueError(f"ranking_metrics: {len(scores_per_query)} score arrays but "
                     f"{len(relevant_per_query)} relevance arrays")
  aps, rrs, p1s = [], [], []
  for i, (scores, relevant) in enumerate(zip(scores_per_query, relevant_per_query, strict=True)):
    scores = np.asarray(scores, np.float64).reshape(-1)
    relevant = np.asarray(relevant).reshape(-1).astype(bool)
    if scores.shape != relevant.shape:
      raise ValueError(f"ranking_metrics: query {i} has {scores.size} scores but "
                       f"{relevant.size} relevance labels")
    if not relevant.any():
      continue
    # lexsort: last key is primary; on equal -score, False (non-relevant) sorts first.
    ranked = relevant[np.lexsort((relevant, -scores))]
    hit_ranks = np.flatnonzero(ranked) + 1
    aps.append(float(np.mean(np.arange(1, hit_ranks.size + 1) / hit_ranks)))
    rrs.append(1.0 / hit_ranks[0])
    p1s.append(float(ranked[0]))
  if not aps:
    raise ValueError("ranking_metrics: no query has a relevant candidate")
  return {"map": float(np.mean(aps)), "mrr": float(np.mean(rrs)), "p@1": float(np.mean(p1s)),
          "num_queries": len(aps)}


def distinct_n(texts: Iterable[str], n: int) -> float:
  """Distinct-n: unique n-grams / all n-grams over the corpus (whitespace tokens; 0 if none)."""
  validation.positive_int(n, "distinct_n: n")
  grams = [tuple(tokens[i:i + n]) for tokens in (text.split() for text in texts)
           for i in range(len(tokens) - n + 1)]
  return len(set(grams)) / len(grams) if grams else 0.0


WH_WORDS = ("what", "why", "how", "who", "whom", "whose", "which", "when", "where")
_WORD = re.compile(r"[a-z']+")


def first_wh_word(question: str) -> str:
  """The question's first wh-word (case-insensitive, anywhere in it), or "other"."""
  return next((w for w in _WORD.findall(question.lower()) if w in WH_WORDS), "other")


def wh_word_distribution(questions: Iterable[str]) -> dict[str, float]:
  """Fraction of questions by `first_wh_word`, for each of WH_WORDS and "other" (e.g. "Is it
  ...?", "Do you ...?"); ValueError for an empty list."""
  counts = collections.Counter(first_wh_word(q) for q in questions)
  total = sum(counts.values())
  if not total:
    raise ValueError("wh_word_distribution: no questions given")
  return {word: counts[word] / total for word in WH_WORDS + ("other",)}


def jensen_shannon(p: Any, q: Any, base: float = 2.0, axis: int = -1) -> np.ndarray | float:
  """Jensen–Shannon divergence (the squared JS distance) along `axis`, NumPy float64.

  `p` and `q` are normalised to sum to 1 first; zero probabilities contribute 0. With base 2
  the result lies in [0, 1]. Equals `scipy.spatial.distance.jensenshannon(p, q, base)**2`.

  Raises:
    ValueError: on shape mismatch, negative entries or an all-zero distribution.
  """
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  if p.shape != q.shape:
    raise ValueError(f"jensen_shannon: p and q shapes differ: {p.shape} vs {q.shape}")
  if (p < 0).any() or (q < 0).any() or not (np.isfinite(p).all() and np.isfinite(q).all()):
    raise ValueError("jensen_shannon: probabilities must be finite and >= 0")
  p_sum, q_sum = p.sum(axis=axis, keepdims=True), q.sum(axis=axis, keepdims=True)
  if (p_sum == 0).any() or (q_sum == 0).any():
    raise ValueError("jensen_shannon: a distribution sums to 0")
  p, q = p / p_sum, q / q_sum
  m = 0.5 * (p + q)

  def kl(a: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
      return np.sum(np.where(a > 0, a * np.log(a / m), 0.0), axis=axis)

  js = np.maximum(0.5 * (kl(p) + kl(q)) / np.log(base), 0.0)
  return float(js) if js.ndim == 0 else js


class BootstrapCI(tuple):
  """`(estimate, low, high)` of `bootstrap_ci`, with how the resampling went.

  Attributes:
    estimate: The metric on the data as given.
    low, high: The interval's ends.
    confidence: The interval's nominal coverage.
    num_resamples: Resamples drawn (skipped ones included).
    num_skipped: Resamples on which the metric was undefined (raised ValueError or gave a
      non-finite value, e.g. ROC AUC of a resample with one class); the interval is the
      percentiles of the others.
  """
  confidence: float
  num_resamples: int
  num_skipped: int

  def __new__(cls, estimate: float, low: float, high: float, *, confidence: float,
              num_resamples: int, num_skipped: int) -> BootstrapCI:
    self = super().__new__(cls, (estimate, low, high))
    self.confidence, self.num_resamples, self.num_skipped = confidence, num_resamples, num_skipped
    return self

  estimate = property(operator.itemgetter(0))
  low = property(operator.itemgetter(1))
  high = property(operator.itemgetter(2))

  def __repr__(self) -> str:
    return (f"BootstrapCI(estimate={self[0]:.6g}, low={self[1]:.6g}, high={self[2]:.6g}, "
            f"confidence={self.confidence}, num_resamples={self.num_resamples}, "
            f"num_skipped={self.num_skipped})")


def _unit_resamples(unit_of_row: np.ndarray, draws: np.ndarray) -> list[np.ndarray]:
  """Row indices of each resample: the rows of every drawn unit, unit after unit, each
  unit's rows in data order."""
  sizes = np.bincount(unit_of_row, minlength=draws.shape[1])
  rows_by_unit = np.argsort(unit_of_row, kind="stable")
  starts = np.r_[0, np.cumsum(sizes)[:-1]]
  # All resamples at once: expand every drawn unit into the range of its rows.
  lengths = sizes[draws].ravel()
  offsets = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
  flat = rows_by_unit[np.repeat(starts[draws].ravel(), lengths) + offsets]
  return np.split(flat, np.cumsum(sizes[draws].sum(axis=1))[:-1])


def bootstrap_ci(metric_fn: Callable[..., Any], *arrays: Any, num_resamples: int = 1000,
                 confidence: float = 0.95, seed: int = 0, units: Any = None,
                 vectorized: bool = False, max_batch_elements: int = 10_000_000) -> BootstrapCI:
  """Percentile bootstrap confidence interval of `metric_fn(*arrays)`.

  Each resample draws the examples (rows along axis 0 of every array), or with `units` whole
  units (e.g. situation ids: all rows of a drawn situation come together), with replacement,
  as many as there are. The indices come from one call, `np.random.default_rng(seed).integers(
  0, n, size=(num_resamples, n))` with n the number of rows (or of distinct units, in sorted
  order, a unit's rows then taken in data order), so a reference loop can redraw them.

  Args:
    metric_fn: The metric, e.g. `roc_auc` (labels, scores) or `np.mean`. It may raise
      ValueError (or return NaN) where undefined; such resamples are skipped and counted.
    confidence: Nominal coverage; the interval is the (1 - c) / 2 and (1 + c) / 2 percentiles
      (NumPy's linear interpolation) of the resampled metric.
    units: Optional (n,) group of each row.
    vectorized: `metric_fn` takes arrays with a leading resample axis, (B, n, ...) and returns
      (B,) values (e.g. `lambda x: x.mean(axis=1)`, or `roc_auc_rows`): one call per batch
      instead of one per resample (the estimate: a batch of one); a NaN value is an undefined
      resample, skipped and counted. Needs resamples of equal size (no `units`, or units of
      equal size).
    max_batch_elements: Rows times resamples per vectorised call (memory bound).

  Raises:
    ValueError: on bad arguments, arrays of different lengths, unequal units with
      `vectorized`, or when every resample is skipped.
  """
  if not arrays:
    raise ValueError("bootstrap_ci: give at least one array")
  if not 0.0 < confidence < 1.0:
    raise ValueError(f"bootstrap_ci: confidence must be in (0, 1), got {confidence}")
  if num_resamples < 1:
    raise ValueError(f"bootstrap_ci: num_resamples must be >= 1, got {num_resamples}")
  arrays = tuple(np.asarray(a) for a in arrays)
  if any(a.ndim == 0 for a in arrays):
    raise ValueError("bootstrap_ci: arrays must have a row axis (got a scalar)")
  n = len(arrays[0])
  if any(len(a) != n for a in arrays) or n == 0:
    raise ValueError(f"bootstrap_ci: arrays need the same, non-zero number of rows, got "
                     f"{[len(a) for a in arrays]}")
  if vectorized:  # The data as given are a batch of one resample.
    estimate = float(np.asarray(metric_fn(*(a[None] for a in arrays)), np.float64).reshape(-1)[0])
  else:
    estimate = float(metric_fn(*arrays))
  rng = np.random.default_rng(seed)
  if units is None:
    samples: np.ndarray | list[np.ndarray] = rng.integers(0, n, size=(num_resamples, n))
  else:
    units = np.asarray(units)
    if units.shape != (n,):
      raise ValueError(f"bootstrap_ci: units must have shape ({n},), got {units.shape}")
    _, unit_of_row = np.unique(units, return_inverse=True)
    num_units = int(unit_of_row.max()) + 1
    samples = _unit_resamples(unit_of_row, rng.integers(0, num_units,
                                                        size=(num_resamples, num_units)))
    if len({len(s) for s in samples}) == 1:
      samples = np.stack(samples)

  values = np.full(num_resamples, np.nan)
  if vectorized:
    if not isinstance(samples, np.ndarray):
      raise ValueError("bootstrap_ci: vectorized needs resamples of equal size, but the units "
                       "differ in size")
    batch = max(1, max_batch_elements // samples.shape[1])
    for start in range(0, num_resamples, batch):
      rows = samples[start:start + batch]
      out = np.asarray(metric_fn(*(a[rows] for a in arrays)), np.float64)
      if out.shape != (len(rows),):
        raise ValueError(f"bootstrap_ci: a vectorized metric_fn must return ({len(rows)},) "
                         f"values, got shape {out.shape}")
      values[start:start + len(rows)] = out
  else:
    for i, rows in enumerate(samples):
      try:
        values[i] = float(metric_fn(*(a[rows] for a in arrays)))
      except ValueError:
        pass  # Undefined on this resample (e.g. one class): stays NaN, counted below.
  valid = values[np.isfinite(values)]
  if not valid.size:
    raise ValueError(f"bootstrap_ci: the metric is undefined on all {num_resamples} resamples")
  tail = 100.0 * (1.0 - confidence) / 2.0
  low, high = np.percentile(valid, [tail, 100.0 - tail])
  return BootstrapCI(estimate, float(low), float(high), confidence=confidence,
                     num_resamples=num_resamples, num_skipped=num_resamples - valid.size)
