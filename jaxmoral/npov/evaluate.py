"""ROC AUC of the detectors at example and word level, on the paper's test slices.

Slices: synthetic errors on unparaphrased inputs, the same on paraphrased inputs, and
"organic" (a user's labelled responses, when given). Hallucination is evaluated on the clean +
hallucination examples of a slice, coverage on clean + coverage.

Word labels (synthetic errors), the same for every detector that scores words: a response word
is positive when its stem occurs in the removed argument and nowhere in the remaining input
(the response states it, the input no longer supports it); an argument word is positive when
it belongs to the added argument and its stem occurs nowhere in the response; the template's
own words (`TEMPLATE_WORDS`) are in neither class; every other word is negative.
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

# The content words `task.template_response` writes into every response whatever its input:
# never in the input, they are neither hallucinated nor supported.
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
  stems = [text_lib.stem(w.text) for w in words]
  return [None if s in TEMPLATE_STEMS else
          int(bool(example.hallucination) and s in removed and s not in kept) for s in stems]


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


def _counts_for(example: task.NpovExample, error: str) -> bool:
  """Whether `error`'s AUCs use the example: clean ones and those with that error only."""
  other = base.ERRORS[1 - base.ERRORS.index(error)]
  return getattr(example, error) is not None and not getattr(example, other)


def word_arrays(examples: Sequence[task.NpovExample], detections: Sequence[base.Detection],
                error: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(labels, scores, example index) of every labelled word of the examples `error`'s
  example-level AUC uses; words in neither class are left out."""
  labels_fn = hallucination_word_labels if error == "hallucination" else coverage_word_labels
  labels, scores, units = [], [], []
  for i, (e, d) in enumerate(zip(examples, detections, strict=True)):
    if not _counts_for(e, error):
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


def evaluate_slice(examples: Sequence[task.NpovExample],
                   detections: Sequence[base.Detection]) -> dict[str, Any]:
  """ROC AUCs and the label/score arrays (for curves) of one detector on one slice."""
  if len(examples) != len(detections):
    raise ValueError(f"evaluate_slice: {len(examples)} examples, {len(detections)} detections")
  out: dict[str, Any] = {}
  for error in base.ERRORS:
    pairs = [(int(getattr(e, error)), getattr(d, error))
             for e, d in zip(examples, detections, strict=True) if _counts_for(e, error)]
    ex_labels, ex_scores = [label for label, _ in pairs], [score for _, score in pairs]
    # The example-level AUC's 95 % percentile-bootstrap interval, as the experiments report.
    ci = (metrics.bootstrap_ci(metrics.roc_auc_rows, np.asarray(ex_labels),
                               np.asarray(ex_scores, np.float64), vectorized=True)
          if len(set(ex_labels)) > 1 else None)
    w_labels, w_scores, w_units = word_arrays(examples, detections, error)
    try:  # Pairs of words of one example only: they share its input, and so its length.
      within = metrics.grouped_roc_auc(w_labels, w_scores, w_units) if w_labels.size else None
    except ValueError:  # No example holds both labels.
      within = None
    out[error] = {"example_auc": _auc(ex_labels, ex_scores),
                  "example_auc_ci": None if ci is None else [float(ci.low), float(ci.high)],
                  "word_auc": _auc(w_labels.tolist(), w_scores.tolist()),
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


def auc_cell(auc: Optional[float], ci: Optional[Sequence[float]] = None) -> str:
  """A table cell: the ROC AUC x 100, with its 95 % interval when given; "-" where undefined."""
  if auc is None:
    return "-"
  return f"{100 * auc:.1f}" + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")


def aligned_lines(rows: Sequence[Sequence[str]]) -> list[str]:
  """Rows of cells as left-aligned columns, with a rule under the first row (the header)."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows]
  return [lines[0], "-" * len(lines[0]), *lines[1:]]


def format_table(results: Mapping[str, Any]) -> str:
  """A Table-1-like text table: rows = detectors, columns = slice / error / level, each cell
  the ROC AUC x 100 with its 95 % bootstrap interval (example level), and the row "n": the
  examples (positives) and words each column is measured on."""
  detectors = list(next(iter(results.values()))) if results else []
  columns = [(s, e, lvl) for s in results for e in base.ERRORS for lvl in ("example", "word")]
  rows = [["detector"] + [f"{s}/{e}/{lvl}" for s, e, lvl in columns]]
  for det in detectors:
    rows.append([det] + [auc_cell(results[s][det][e][f"{lvl}_auc"],
                                  results[s][det][e].get("example_auc_ci")
                                  if lvl == "example" else None) for s, e, lvl in columns])
  if detectors:
    counts = [results[s][detectors[0]][e] for s, e, _ in columns]
    rows.append(["n"] + [f"{r['num_examples']} ({r['num_positive']} pos)" if lvl == "example"
                         else f"{r.get('num_words', '?')} words"
                         for r, (_, _, lvl) in zip(counts, columns, strict=True)])
  return "\n".join(aligned_lines(rows)) + (
      "\n(ROC AUC x 100 [95 % bootstrap interval over the examples]; "
      "example = example level, word = word level)")


def write_results(results: Mapping[str, Any], output_dir: str | os.PathLike) -> dict[str, str]:
  """Writes results.json, table.txt and one ROC-curve PNG per slice (that has a curve)."""
  fileio.makedirs(output_dir)
  paths = {"json": fileio.join(output_dir, "results.json"),
           "table": fileio.join(output_dir, "table.txt")}
  fileio.write_text(paths["json"], json.dumps(results, indent=1))
  fileio.write_text(paths["table"], format_table(results) + "\n")
  for name, by_detector in results.items():
    path = fileio.join(output_dir, f"roc_{name}.png")
    if plots.roc_curves_png(by_detector, path, title=name):
      paths[f"roc_{name}"] = path
  return paths
