"""ROC AUC of the detectors at example and word level, on the paper's test slices.

Slices that can be built here: synthetic errors on unparaphrased inputs, the same on
paraphrased inputs, and "organic" (a user's labelled responses, when given). Hallucination is
evaluated on the clean + hallucination examples of a slice, coverage on clean + coverage.

Word labels (synthetic errors):
- hallucination: a response content word is positive when its stem occurs in the removed
  argument (the response verbalises that argument; the input no longer has it);
- coverage: an input-argument content word is positive when it belongs to the added argument
  (which the response never verbalises).
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


def hallucination_word_labels(example: task.NpovExample,
                              words: Sequence[base.WordScore]) -> Optional[list[int]]:
  """Labels of response words (None when the example carries no word-level truth)."""
  if example.hallucination is None:
    return None
  if not example.hallucination:
    return [0] * len(words)
  if example.removed_argument is None:
    return None  # organic error: no word-level annotation
  removed = set(text_lib.content_stems(example.removed_argument))
  return [int(text_lib.stem(w.text) in removed) for w in words]


def coverage_word_labels(example: task.NpovExample,
                         words: Sequence[base.WordScore]) -> Optional[list[int]]:
  """Labels of input-argument words (None when the example carries no word-level truth)."""
  if example.coverage is None:
    return None
  if not example.coverage:
    return [0] * len(words)
  if example.added_argument is None:
    return None
  return [int(getattr(example, w.field)[w.index] == example.added_argument) for w in words]


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
    ex_labels, ex_scores, w_labels, w_scores = [], [], [], []
    for e, d in zip(examples, detections):
      label = getattr(e, error)
      if label is None or getattr(e, other):
        continue
      ex_labels.append(int(label))
      ex_scores.append(getattr(d, error))
      words = d.response_words if error == "hallucination" else d.argument_words
      labels_fn = (hallucination_word_labels if error == "hallucination"
                   else coverage_word_labels)
      word_labels = labels_fn(e, words) if words else None
      if word_labels is not None:
        w_labels.extend(word_labels)
        w_scores.extend(w.score for w in words)
    out[error] = {"example_auc": _auc(ex_labels, ex_scores),
                  "example_auc_ci": _auc_ci(ex_labels, ex_scores),
                  "word_auc": _auc(w_labels, w_scores) if w_labels else None,
                  "num_examples": len(ex_labels), "num_positive": int(sum(ex_labels)),
                  "num_words": len(w_labels),
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
  lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
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
