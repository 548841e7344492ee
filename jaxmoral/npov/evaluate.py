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

import gin
from jaxmoral import fileio
from jaxmoral import metrics
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
    ex_labels, ex_scores, w_labels = [], [], []
    w_scores: list[float] = []
    for e, d in zip(examples, detections, strict=True):
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
    from jaxmoral.npov import plots  # pylint: disable=g-import-not-at-top
    for name, by_detector in results.items():
      path = fileio.join(output_dir, f"roc_{name}.png")
      if plots.roc_curves_png(by_detector, path, title=name):
        paths[f"roc_{name}"] = path
  return paths


@gin.configurable
def run(*, output_dir: str, kb_path: Optional[str] = None, perspectrum_dir: Optional[str] = None,
        examples_path: Optional[str] = None, organic_path: Optional[str] = None,
        detectors: Sequence[str] = ("rouge",), generator_dir: Optional[str] = None,
        classifier_dirs: Optional[Mapping[str, str]] = None, prompts_dir: Optional[str] = None,
        base_dir: Optional[str] = None,
        vocabulary_path: Optional[str] = None, split: str = "test", seed: int = 0,
        max_examples: Optional[int] = None, partitioner: Any = None) -> dict[str, Any]:
  """Builds the test slices, runs the detectors and writes the table, JSON and ROC curves.

  Args:
    output_dir: Where results.json, table.txt, roc_*.png go.
    kb_path: A JSONL knowledge base (`knowledge_base.read_kb_jsonl`); or
    perspectrum_dir: PERSPECTRUM's folder (`knowledge_base.read_perspectrum`).
    examples_path: Error-free examples (JSONL, `task.read_examples`) to derive the synthetic
      slices from; default: sampled from the knowledge base's `split` topics.
    organic_path: Labelled organic examples (JSONL with hallucination / coverage labels).
    detectors: Any of "rouge", "salience", "classifier".
    generator_dir: Prompt directory of the generator (salience); None: the base model alone.
    classifier_dirs: {"hallucination": dir, "coverage": dir} prompt directories.
    prompts_dir: Shortcut for a run folder laid out like `demo.run_demo`'s: generator/prompt,
      classifier_hallucination/prompt, classifier_coverage/prompt (explicit dirs win).
    base_dir: Exported base parameters (`checkpoints.export_params` with config.json).
    vocabulary_path: SentencePiece model of the base model.
    split: Topics to evaluate on ("test").
    seed: Sampling / synthetic-error seed.
    max_examples: Cap on source examples (quick runs).
    partitioner: The mesh the model-based detectors run on (the run's PARTITIONER, e.g.
      `--partitioner=%PARTITIONER` with a gin/partitioning fragment; None: one device).

  Returns:
    The results dict (also written to `output_dir`).
  """
  from jaxmoral.npov import detect as detect_lib  # pylint: disable=g-import-not-at-top
  from jaxmoral.npov import knowledge_base as kb_lib  # pylint: disable=g-import-not-at-top
  from jaxmoral.npov import synthetic  # pylint: disable=g-import-not-at-top
  if prompts_dir:
    generator_dir = generator_dir or os.path.join(prompts_dir, "generator", "prompt")
    classifier_dirs = classifier_dirs or {
        e: os.path.join(prompts_dir, f"classifier_{e}", "prompt") for e in ERRORS}
  if (kb_path is None) == (perspectrum_dir is None):
    raise ValueError("npov evaluate: give exactly one of kb_path, perspectrum_dir")
  if kb_path:
    topics = kb_lib.read_kb_jsonl(kb_path)
  else:
    assert perspectrum_dir is not None  # Exactly one of the two (checked above).
    topics = kb_lib.read_perspectrum(perspectrum_dir)
  topics = kb_lib.split_topics(topics)
  if examples_path:
    source = kb_lib.attach_clusters(task.read_examples(examples_path), topics)
    split_of = {t.id: t.split for t in topics}
    source = [e for e in source if split_of[e.topic] == split]
  else:
    source = kb_lib.sample_examples(topics, seed=seed, split=split)
  source = source[:max_examples] if max_examples else source
  if not source:
    raise ValueError(f"npov evaluate: no examples in split {split!r}")
  slices: dict[str, Sequence[task.NpovExample]] = dict(
      synthetic.make_test_slices(source, topics, seed=seed))
  if organic_path:
    slices["organic"] = task.read_examples(organic_path)
  built = {name: detect_lib.build_detector(
      name, base_dir=base_dir, vocabulary_path=vocabulary_path, generator_dir=generator_dir,
      classifier_dirs=classifier_dirs, partitioner=partitioner) for name in detectors}
  results = evaluate_detectors(built, slices)
  write_results(results, output_dir)
  print(format_table(results))
  return results
