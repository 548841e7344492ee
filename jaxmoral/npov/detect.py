"""Run a detector on a user's own responses: `jaxmoral npov detect` as a library call.

`jaxmoral npov detect --input_path=... --output_path=... [--detector=...]` calls
`detect_file`; its flags are that function's arguments.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from typing import Any, Mapping, Optional

import gin
from jaxmoral import fileio
from jaxmoral.npov import task
from jaxmoral.npov.detectors import rouge

DETECTORS = ("rouge", "salience", "classifier")

logger = logging.getLogger(__name__)


def load_base(base_dir: str, *, vocabulary_path: Optional[str] = None,
              partitioner: Any = None) -> Any:
  """The base model: a `model_dirs.LoadedModel` of any model directory (or Hub id), with its
  vocabulary (or `vocabulary_path`'s), in the shardings of `partitioner`
  (`partitioning.inference_partitioner`: default one device)."""
  from jaxmoral import model_dirs  # pylint: disable=g-import-not-at-top
  return model_dirs.load_on_mesh(base_dir, vocabulary=vocabulary_path, partitioner=partitioner)


def build_detector(name: str, *, base_dir: Optional[str] = None,
                   vocabulary_path: Optional[str] = None, generator_dir: Optional[str] = None,
                   classifier_dirs: Optional[Mapping[str, str]] = None,
                   salience_config: Any = None, partitioner: Any = None) -> Any:
  """A detector by name; model-based ones need `base_dir` (and the generator's prompt, the
  classifiers' prompts or fine-tuned model directories: `classifier.load_classifier`).
  Their models are read into `partitioner`'s shardings and run on its mesh (`load_base`)."""
  if name not in DETECTORS:
    raise ValueError(f"unknown detector {name!r}; known: {DETECTORS}")
  if name == "rouge":
    return rouge.RougeDetector()
  if base_dir is None:
    raise ValueError(f"detector {name!r} needs base_dir (the base model's directory)")
  from jaxmoral import prompt_tuning  # pylint: disable=g-import-not-at-top
  from jaxmoral.models.t5 import T5  # pylint: disable=g-import-not-at-top
  base = load_base(base_dir, vocabulary_path=vocabulary_path, partitioner=partitioner)
  if base.vocabulary is None:
    raise ValueError(f"detector {name!r}: {base_dir} has no vocabulary (vocab/spiece.model); "
                     f"give the base model's SentencePiece model (--vocabulary_path)")
  model = T5(base.config)
  params = base.lm_params
  if name == "salience":
    from jaxmoral.npov.detectors import salience  # pylint: disable=g-import-not-at-top
    prompt = prompt_tuning.load_prompt(generator_dir)[0] if generator_dir else None
    return salience.SalienceDetector(
        model=model, params=params, tokenizer=salience.SentencePieceTokenizer(base.vocabulary),
        prompt=prompt, config=salience_config or salience.SalienceConfig(),
        partitioner=base.partitioner)
  from jaxmoral.npov.detectors import classifier  # pylint: disable=g-import-not-at-top
  dirs = dict(classifier_dirs or {})
  missing = [e for e in classifier.ERROR_TYPES if e not in dirs]
  if missing:
    raise ValueError(f"classifier detector needs classifier_dirs for {missing}")
  return classifier.ClassifierDetector(
      model=model, vocabulary=base.vocabulary,
      classifiers={e: classifier.load_classifier(dirs[e], base) for e in classifier.ERROR_TYPES},
      partitioner=base.partitioner)


def _file_name(example_id: str) -> str:
  """A file name of its own for each (unique) id: "topic 1/a" and "topic 1?a" must not meet."""
  safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", example_id)
  if safe != example_id:
    safe += "-" + hashlib.sha1(example_id.encode("utf-8")).hexdigest()[:8]
  return safe + ".html"


@gin.configurable
def detect_file(*, input_path: str, output_path: str, detector: str = "rouge",
                base_dir: Optional[str] = None, vocabulary_path: Optional[str] = None,
                generator_dir: Optional[str] = None, hallucination_dir: Optional[str] = None,
                coverage_dir: Optional[str] = None, heatmap_dir: Optional[str] = None,
                roc_dir: Optional[str] = None, partitioner: Any = None) -> list[dict[str, Any]]:
  """Scores every response of a JSONL file and writes one JSON line per example.

  Args:
    input_path: JSONL of `{"query", "pro": [...], "con": [...], "response"}` (+ optional
      "id", and "hallucination" / "coverage" 0/1 labels for ROC curves).
    output_path: JSONL: id, hallucination, coverage, response_words, argument_words.
    detector: "rouge", "salience" or "classifier".
    base_dir: The base model's directory, any format (salience, classifier).
    vocabulary_path: Its SentencePiece model (default: the one the directory carries).
    generator_dir: Generator prompt directory (salience of a prompt-tuned generator).
    hallucination_dir: The hallucination classifier: its prompt directory, or its fine-tuned
      model directory (`classifier.load_classifier`).
    coverage_dir: The coverage classifier, likewise.
    heatmap_dir: Salience only: writes `<id>.html` heatmaps (input x response words).
    roc_dir: With labelled input: writes results.json, table.txt and roc_input.png here.
    partitioner: The mesh the model-based detectors run on (the run's PARTITIONER, e.g.
      `--partitioner=%PARTITIONER` with a gin/partitioning fragment; None: one device).

  Returns:
    The written records.
  """
  if heatmap_dir and detector != "salience":
    raise ValueError(f"heatmap_dir is for detector='salience' (heatmaps of its word map), "
                     f"not {detector!r}")
  examples = task.read_examples(input_path, require_response=True)
  if not examples:
    raise ValueError(f"{input_path}: no examples")
  classifier_dirs = {error: directory for error, directory in (
      ("hallucination", hallucination_dir), ("coverage", coverage_dir)) if directory}
  det = build_detector(detector, base_dir=base_dir, vocabulary_path=vocabulary_path,
                       generator_dir=generator_dir, classifier_dirs=classifier_dirs,
                       partitioner=partitioner)
  records = []
  detections = []
  if heatmap_dir and detector == "salience":
    from jaxmoral.npov import plots  # pylint: disable=g-import-not-at-top
    fileio.makedirs(heatmap_dir)
    for e in examples:
      word_map = det.word_map(e)
      d = det.detect_from_map(word_map)
      plots.salience_heatmap_html(word_map, d, fileio.join(heatmap_dir, _file_name(e.id)),
                                  title=e.query, example=e)
      detections.append(d)
  else:
    detections = det.detect_batch(examples)
  fileio.makedirs(os.path.dirname(fileio.abspath(output_path)))
  with fileio.open(output_path, "w", encoding="utf-8") as f:
    for e, d in zip(examples, detections, strict=True):
      record = {"id": e.id, **d.to_json()}
      records.append(record)
      f.write(json.dumps(record, ensure_ascii=False) + "\n")
  if roc_dir and any(e.hallucination is not None or e.coverage is not None for e in examples):
    from jaxmoral.npov import evaluate  # pylint: disable=g-import-not-at-top
    results = {"input": {detector: evaluate.evaluate_slice(examples, detections)}}
    evaluate.write_results(results, roc_dir)
  logger.info("npov detect: scored %d responses -> %s", len(records), output_path)
  return records
