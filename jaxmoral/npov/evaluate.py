"""ROC AUC of the detectors at example and word level, on the paper's test slices.

Slices that can be built here: synthetic errors on unparaphrased inputs, the same on
paraphrased inputs, and "organic" (a user's labelled responses, when given). Hallucination is
evaluated on the clean + hallucination examples of a slice, coverage on clean + coverage.

Word labels (synthetic errors), the same for every detector that scores words:
- hallucination: a response content word is positive when its stem occurs in the removed
  argument and nowhere in the remaining input (query and the arguments kept): the response
  states it and the input no longer supports it. Every other response word is negative, except
  the template's own words (`TEMPLATE_WORDS`), which are in neither class;
- coverage: an input-argument content word is positive when it belongs to the added argument
  and its stem occurs nowhere in the response (which never verbalises that argument); every
  other argument word is negative.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from jaxmoral import fileio
from jaxmoral import metrics
from jaxmoral.npov import plots
from jaxmoral.npov import task
from jaxmoral.npov import text as text_lib
from jaxmoral.npov.detectors import base

ERRORS = ("hallucination", "coverage")

# The content words `task.template_response` writes into every response whatever its input
# (its introduction "People disagree about the claim that ..." and the lead phrases of
# `task.TEMPLATE_LEADS`): never in the input, they are neither hallucinated nor supported, so
# they are left out of both classes of the hallucination word labels.
TEMPLATE_WORDS: tuple[str, ...] = tuple(dict.fromkeys(
    w.text.lower() for phrase in ("People disagree about the claim that",
                                  *(lead for leads in task.TEMPLATE_LEADS.values()
                                    for lead in leads))
    for w in text_lib.words(phrase) if not w.is_stopword))
TEMPLATE_STEMS = frozenset(text_lib.stem(w) for w in TEMPLATE_WORDS)


def hallucination_word_labels(example: task.NpovExample, words: Sequence[base.WordScore]
                              ) -> Optional[list[Optional[int]]]:
  """Labels of response words: 1, 0, or None for a template word (in neither class); None for
  all when the example carries no word-level truth."""
  if example.hallucination is None:
    return None
  if example.hallucination and example.removed_argument is None:
    return None  # organic error: no word-level annotation
  removed = set(text_lib.content_stems(example.removed_argument or ""))
  kept = {t for s in (example.query, *example.arguments) for t in text_lib.content_stems(s)}
  labels: list[Optional[int]] = []
  for w in words:
    stem = text_lib.stem(w.text)
    labels.append(None if stem in TEMPLATE_STEMS else
                  int(bool(example.hallucination) and stem in removed and stem not in kept))
  return labels


def coverage_word_labels(example: task.NpovExample, words: Sequence[base.WordScore]
                         ) -> Optional[list[Optional[int]]]:
  """Labels of input-argument words (None when the example carries no word-level truth)."""
  if example.coverage is None:
    return None
  if not example.coverage:
    return [0] * len(words)
  if example.added_argument is None:
    return None
  said = set(text_lib.content_stems(example.response))
  return [int(getattr(example, w.field)[w.index] == example.added_argument
              and text_lib.stem(w.text) not in said) for w in words]


def word_arrays(examples: Sequence[task.NpovExample], detections: Sequence[base.Detection],
                error: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(labels, scores, example index) of every labelled word of `error`'s examples (the
  examples its example-level AUC uses: clean ones and those with that error only); words in
  neither class are left out."""
  other = ERRORS[1 - ERRORS.index(error)]
  labels_fn = hallucination_word_labels if error == "hallucination" else coverage_word_labels
  labels, scores, units = [], [], []
  for i, (e, d) in enumerate(zip(examples, detections, strict=True)):
    if getattr(e, error) is None or getattr(e, other):
      continue
    words = d.response_words if error == "hallucination" else d.argument_words
    word_labels = labels_fn(e, words) if words else None
    if word_labels is None:  # No word-level truth (an organic error, or no words scored).
      continue
    for w, label in zip(words, word_labels, strict=True):
      if label is not None:
        labels.append(label)
        scores.append(w.score)
        units.append(i)
  return np.asarray(labels, int), np.asarray(scores, np.float64), np.asarray(units, int)


def within_example_word_auc(labels: Any, scores: Any, units: Any) -> float:
  """Word-level ROC AUC over the (positive, negative) word pairs of the same example only
  (`metrics.grouped_roc_auc`): every word of one example shares its input, so the input's
  length, which moves every score of an example together, drops out.

  Raises:
    ValueError: No example holds both labels.
  """
  return metrics.grouped_roc_auc(labels, scores, units)


def input_words(example: task.NpovExample) -> int:
  """Content words of the generator's input (query and arguments)."""
  return sum(not w.is_stopword for w in text_lib.words(task.format_input(example)))


def input_length_detections(examples: Sequence[task.NpovExample]) -> list[base.Detection]:
  """The input-length null as a detector: hallucination = shorter input, coverage error =
  longer input (a synthetic hallucination removes an argument, a coverage error adds one)."""
  return [base.Detection(-float(n), float(n)) for n in map(input_words, examples)]


def _auc(labels: Sequence[int], scores: Sequence[float]) -> Optional[float]:
  if len(set(labels)) < 2:
    return None
  return float(metrics.roc_auc(np.asarray(labels), np.asarray(scores, np.float64)))


def _auc_ci(labels: Sequence[int], scores: Sequence[float]) -> Optional[list[float]]:
  """95 % percentile-bootstrap interval of the example-level ROC AUC over the examples
  (`metrics.bootstrap_ci`, as the experiments report), or None where the AUC is undefined."""
  if len(set(labels)) < 2:
    return None
  ci = metrics.bootstrap_ci(metrics.roc_auc, np.asarray(labels),
                            np.asarray(scores, np.float64))
  return [float(ci.low), float(ci.high)]


def evaluate_slice(examples: Sequence[task.NpovExample],
                   detections: Sequence[base.Detection]) -> dict[str, Any]:
  """ROC AUCs and the label/score arrays (for curves) of one detector on one slice."""
  if len(examples) != len(detections):
    raise ValueError(f"evaluate_slice: {len(examples)} examples, {len(detections)} detections")
  out: dict[str, Any] = {}
  for error in ERRORS:
    other = ERRORS[1 - ERRORS.index(error)]
    ex_labels, ex_scores = [], []
    for e, d in zip(examples, detections, strict=True):
      label = getattr(e, error)
      if label is None or getattr(e, other):
        continue
      ex_labels.append(int(label))
      ex_scores.append(getattr(d, error))
    w_labels, w_scores, w_units = word_arrays(examples, detections, error)
    try:
      within = within_example_word_auc(w_labels, w_scores, w_units) if w_labels.size else None
    except ValueError:
      within = None
    out[error] = {"example_auc": _auc(ex_labels, ex_scores),
                  "example_auc_ci": _auc_ci(ex_labels, ex_scores),
                  "word_auc": _auc(w_labels.tolist(), w_scores.tolist()) if w_labels.size
                  else None,
                  "within_example_word_auc": within,
                  "num_examples": len(ex_labels), "num_positive": int(sum(ex_labels)),
                  "num_words": int(w_labels.size),
                  "labels": ex_labels, "scores": [float(s) for s in ex_scores]}
  return out


def evaluate_detectors(detectors: Mapping[str, Any],
                       slices: Mapping[str, Sequence[task.NpovExample]]) -> dict[str, Any]:
  """{slice: {detector: evaluate_slice(...)}} for detectors with `detect_batch`."""
  results: dict[str, Any] = {}
  for name, examples in slices.items():
    results[name] = {}
    for det_name, det in detectors.items():
      start = time.time()
      results[name][det_name] = evaluate_slice(examples, det.detect_batch(examples))
      logging.info("npov evaluate: %s on %s (%d examples) in %.1f s", det_name, name,
                   len(examples), time.time() - start)
  return results


def format_table(results: Mapping[str, Any]) -> str:
  """A Table-1-like text table: rows = detectors, columns = slice / error / level, each cell
  the ROC AUC x 100 with its 95 % bootstrap interval (example level), and the row "n": the
  examples (positives) and words each column is measured on."""
  slices = list(results)
  detectors = list(next(iter(results.values()))) if results else []
  columns = [(s, e, lvl) for s in slices for e in ERRORS for lvl in ("example", "word")]
  header = ["detector"] + [f"{s}/{e}/{lvl}" for s, e, lvl in columns]
  rows = [header]
  for det in detectors:
    row = [det]
    for s, e, lvl in columns:
      r = results[s][det][e]
      auc = r[f"{lvl}_auc"]
      cell = "-" if auc is None else f"{100 * auc:.1f}"
      ci = r.get("example_auc_ci") if lvl == "example" else None
      if auc is not None and ci:
        cell += f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"
      row.append(cell)
    rows.append(row)
  if detectors:
    first = detectors[0]
    counts = ["n"]
    for s, e, lvl in columns:
      r = results[s][first][e]
      counts.append(f"{r['num_examples']} ({r['num_positive']} pos)" if lvl == "example"
                    else f"{r.get('num_words', '?')} words")
    rows.append(counts)
  widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows]
  lines.insert(1, "-" * len(lines[0]))
  return "\n".join(lines) + ("\n(ROC AUC x 100 [95 % bootstrap interval over the examples]; "
                             "example = example level, word = word level)")


def write_results(results: Mapping[str, Any], output_dir: str | os.PathLike, *,
                  plot: bool = True) -> dict[str, str]:
  """Writes results.json, table.txt and (plot=True) one ROC-curve PNG per slice."""
  output_dir = os.fspath(output_dir)
  fileio.makedirs(output_dir)
  paths = {"json": fileio.join(output_dir, "results.json"),
           "table": fileio.join(output_dir, "table.txt")}
  fileio.write_text(paths["json"], json.dumps(results, indent=1))
  fileio.write_text(paths["table"], format_table(results) + "\n")
  if plot:
    for name, by_detector in results.items():
      path = fileio.join(output_dir, f"roc_{name}.png")
      if plots.roc_curves_png(by_detector, path, title=name):
        paths[f"roc_{name}"] = path
  return paths
