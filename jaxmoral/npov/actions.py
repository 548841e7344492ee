"""The `jaxmoral npov` actions as library calls: `detect_file` (detect), `run` (evaluate) and
`train_error_classifier` (train-classifier); their flags are these functions' arguments."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from typing import Any, Mapping, Optional, Sequence

import gin

from jaxmoral import fileio
from jaxmoral import prompt_tuning
from jaxmoral.data import readers
from jaxmoral.npov import detect
from jaxmoral.npov import evaluate
from jaxmoral.npov import knowledge_base as kb_lib
from jaxmoral.npov import plots
from jaxmoral.npov import synthetic
from jaxmoral.npov import task
from jaxmoral.npov.detectors import classifier

logger = logging.getLogger(__name__)


def heatmap_file_name(example_id: str) -> str:
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
    hallucination_dir, coverage_dir: The two classifiers, each a prompt directory or a
      fine-tuned model directory (`classifier.load_classifier`).
    heatmap_dir: Salience only: writes `<id>.html` heatmaps (input x response words).
    roc_dir: With labelled input: writes results.json, table.txt and roc_input.png here.
    partitioner: The model-based detectors' mesh (the run's PARTITIONER; None: one device).
  """
  if heatmap_dir and detector != "salience":
    raise ValueError(f"heatmap_dir is for detector='salience' (heatmaps of its word map), "
                     f"not {detector!r}")
  examples = task.read_examples(input_path, require_response=True)  # Not empty.
  classifier_dirs = {error: directory for error, directory in (
      ("hallucination", hallucination_dir), ("coverage", coverage_dir)) if directory}
  det = detect.build_detector(detector, base_dir=base_dir, vocabulary_path=vocabulary_path,
                              generator_dir=generator_dir, classifier_dirs=classifier_dirs,
                              partitioner=partitioner)
  if heatmap_dir:
    fileio.makedirs(heatmap_dir)
    detections = []
    for e in examples:
      word_map = det.word_map(e)
      detections.append(det.detect_from_map(word_map))
      plots.salience_heatmap_html(word_map, detections[-1],
                                  fileio.join(heatmap_dir, heatmap_file_name(e.id)),
                                  title=e.query, example=e)
  else:
    detections = det.detect_batch(examples)
  records = [{"id": e.id, **d.to_json()} for e, d in zip(examples, detections, strict=True)]
  readers.write_jsonl(output_path, records)
  if roc_dir and any(e.hallucination is not None or e.coverage is not None for e in examples):
    results = {"input": {detector: evaluate.evaluate_slice(examples, detections)}}
    evaluate.write_results(results, roc_dir)
  elif roc_dir:
    logger.warning("npov detect: no ROC curves in %s: no example of %s has a hallucination or "
                   "coverage label", roc_dir, input_path)
  logger.info("npov detect: scored %d responses -> %s", len(records), output_path)
  return records


@gin.configurable
def run(*, output_dir: str, kb_path: Optional[str] = None, perspectrum_dir: Optional[str] = None,
        examples_path: Optional[str] = None, organic_path: Optional[str] = None,
        detectors: Sequence[str] = ("rouge",), generator_dir: Optional[str] = None,
        classifier_dirs: Optional[Mapping[str, str]] = None, prompts_dir: Optional[str] = None,
        base_dir: Optional[str] = None,
        vocabulary_path: Optional[str] = None, split: str = "test", seed: int = 0,
        max_examples: Optional[int] = None, partitioner: Any = None) -> dict[str, Any]:
  """Builds the test slices, runs the detectors, writes the table, JSON and ROC curves to
  `output_dir` and returns the results.

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
    prompts_dir: A run folder laid out like `demo.run_demo`'s (generator/prompt,
      classifier_<error>/prompt) for the dirs not given.
    base_dir, vocabulary_path, partitioner: As `detect_file`'s.
    split, seed: The topics to evaluate on; the sampling and synthetic-error seed.
    max_examples: Cap on source examples (quick runs).
  """
  if prompts_dir:
    generator_dir = generator_dir or os.path.join(prompts_dir, "generator", "prompt")
    classifier_dirs = classifier_dirs or {
        e: os.path.join(prompts_dir, f"classifier_{e}", "prompt") for e in classifier.ERROR_TYPES}
  topics, source = _topics_and_examples(
      action="evaluate", kb_path=kb_path, perspectrum_dir=perspectrum_dir,
      examples_path=examples_path, split=split, seed=seed, max_examples=max_examples)
  slices: dict[str, Sequence[task.NpovExample]] = dict(
      synthetic.make_test_slices(source, topics, seed=seed))
  if organic_path:
    slices["organic"] = task.read_examples(organic_path)
  built = {name: detect.build_detector(
      name, base_dir=base_dir, vocabulary_path=vocabulary_path, generator_dir=generator_dir,
      classifier_dirs=classifier_dirs, partitioner=partitioner) for name in detectors}
  results = evaluate.evaluate_detectors(built, slices)
  evaluate.write_results(results, output_dir)
  print(evaluate.format_table(results))
  return results


def _topics_and_examples(*, action: str, kb_path: Optional[str],
                         perspectrum_dir: Optional[str], examples_path: Optional[str],
                         split: str, seed: int, max_examples: Optional[int]
                         ) -> tuple[list[kb_lib.Topic], list[task.NpovExample]]:
  """The knowledge base's topics (split) and the error-free examples of its `split` topics:
  `examples_path`'s, or sampled from the topics."""
  if (kb_path is None) == (perspectrum_dir is None):
    raise ValueError(f"npov {action}: give exactly one of kb_path, perspectrum_dir")
  topics = kb_lib.split_topics(kb_lib.read_kb_jsonl(kb_path) if kb_path is not None
                              else kb_lib.read_perspectrum(str(perspectrum_dir)))
  if examples_path:
    source = kb_lib.attach_clusters(task.read_examples(examples_path), topics)
    split_of = {t.id: t.split for t in topics}
    source = [e for e in source if split_of[e.topic] == split]
  else:
    source = kb_lib.sample_examples(topics, seed=seed, split=split)
  source = source[:max_examples] if max_examples else source
  if not source:
    where = kb_path if kb_path is not None else perspectrum_dir
    in_split = [t for t in topics if t.split == split]
    usable = [t for t in in_split if t.cluster_ids("pro") and t.cluster_ids("con")]
    if examples_path:
      cause = f"{examples_path} has no example of its topics"
    elif not usable:
      # An example needs a topic with arguments on both sides (`sample_examples`).
      cause = (f"none of its {len(in_split)} topics there has both a pro and a con argument "
               f"(of {len(topics)} topics, {sum(bool(t.clusters) for t in topics)} have any "
               "argument)")
    else:
      cause = "max_examples leaves none"
    raise ValueError(f"npov {action}: no examples in split {split!r} of {where}: {cause}")
  return topics, source


@gin.configurable
def train_error_classifier(*, model_dir: str, base_dir: str, error: str,
                           kb_path: Optional[str] = None, perspectrum_dir: Optional[str] = None,
                           examples_path: Optional[str] = None, split: str = "train",
                           train_steps: int = 300, batch_size: int = 16,
                           learning_rate: float = 0.1, warmup_steps: int = 30,
                           max_input_length: int = 512, tuning: str = "prompt", seed: int = 0,
                           max_examples: Optional[int] = None,
                           partitioner: Any = None) -> dict[str, Any]:
  """Trains the YES/NO classifier of one error type over a base.

  Its examples are the synthetic errors of the knowledge base's `split` topics with their
  error-free originals (`synthetic.training_examples`), as the NPOV experiment and demo train
  theirs; the optimizer is the paper's (`prompt_tuning.paper_optimizer`).

  Args:
    model_dir: The classifier's run directory (`detect --hallucination_dir` takes it).
    base_dir: The base model (any model directory or Hub id), as `detect --base_dir`.
    error: "hallucination" or "coverage".
    kb_path, perspectrum_dir, examples_path, max_examples: As `run`'s.
    split: Topics to train on ("train"; `evaluate` tests on "test").
    learning_rate: Peak learning rate of the prompt.
    warmup_steps: Linear warm-up steps (capped below `train_steps`).
    max_input_length: Encoder length (tokens) of query, arguments and response.
    tuning: "prompt" (the paper: a soft prompt on the frozen base) or "full" (every weight).
    seed: Sampling, synthetic-error and training seed.
    partitioner: The run's PARTITIONER (None: data parallel).

  Returns:
    `{"model_dir", "error", "examples"}` (examples: the training pairs' source examples).
  """
  if error not in classifier.ERROR_TYPES:
    raise ValueError(f"npov train-classifier: error must be one of "
                     f"{', '.join(classifier.ERROR_TYPES)}, got {error!r}")
  topics, source = _topics_and_examples(
      action="train-classifier", kb_path=kb_path, perspectrum_dir=perspectrum_dir,
      examples_path=examples_path, split=split, seed=seed, max_examples=max_examples)
  examples = synthetic.training_examples(source, topics, seed=seed)
  classifier.train_classifier(
      model_dir=model_dir, base_dir=base_dir, examples=examples, error=error,
      train_steps=train_steps, batch_size=batch_size, max_input_length=max_input_length,
      tuning=tuning, partitioner=partitioner, seed=seed,
      optimizer=prompt_tuning.paper_optimizer(train_steps=train_steps,
                                              learning_rate=learning_rate,
                                              warmup_steps=warmup_steps),
      checkpoint_every=train_steps)
  return {"model_dir": model_dir, "error": error, "examples": len(examples)}
