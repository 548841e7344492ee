"""Tiny end-to-end NPOV run on the bundled demo corpus (CPU, minutes; part of `make demo`).

1. demo vocabulary, knowledge base and examples; topic-disjoint train/test split;
2. a tiny base T5 briefly trained on the generator task (no pretrained model is bundled);
3. a generator soft prompt and two classifier prompts tuned over that one frozen base;
4. ROUGE, salience and classifier detectors on the synthetic test slices (unparaphrased,
   paraphrased): Table-1-style ROC AUCs, results.json, ROC curves; plus `detect_file` on the
   test responses with salience heatmaps.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Mapping, Optional, Sequence

import gin

from jaxmoral import demo as demo_lib
from jaxmoral import optimizers
from jaxmoral import partitioning
from jaxmoral import prompt_tuning
from jaxmoral import runs
from jaxmoral.data import demo as demo_data
from jaxmoral.data import readers
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import trainable
from jaxmoral.models.config import t5_config
from jaxmoral.npov import actions
from jaxmoral.npov import detect
from jaxmoral.npov import evaluate
from jaxmoral.npov import knowledge_base as kb_lib
from jaxmoral.npov import synthetic
from jaxmoral.npov import task
from jaxmoral.npov.detectors import classifier

DEMO_KB = demo_data.DEMO_DIR / "npov_kb.jsonl"
DEMO_EXAMPLES = demo_data.DEMO_DIR / "npov_examples.jsonl"


def summary_table(results: Mapping[str, Any]) -> str:
  """`evaluate.format_table`'s numbers within 100 columns: a row per slice and detector with,
  per error type, the example-level ROC AUC x 100 (95 % interval) and the word-level one; then
  what each slice's numbers are measured on."""
  rows = [["slice", "detector", "hallucination", "word", "coverage", "word"]]
  counts = []
  for slice_name, by_detector in results.items():
    for detector, by_error in by_detector.items():
      rows.append([slice_name, detector] + [
          cell for error in classifier.ERROR_TYPES
          for cell in (evaluate.auc_cell(by_error[error]["example_auc"],
                                         by_error[error].get("example_auc_ci")),
                       evaluate.auc_cell(by_error[error]["word_auc"]))])
    first = next(iter(by_detector.values()), None)
    if first is not None:
      for error in classifier.ERROR_TYPES:
        n = first[error]["num_examples"]
        counts.append(f"n, {slice_name} {error}: {n} example{'' if n == 1 else 's'} "
                      f"({first[error]['num_positive']} with the error), "
                      f"{first[error].get('num_words', '?')} words")
  return "\n".join([
      "ROC AUC x 100 [95 % bootstrap interval over the examples], example level; word: word "
      "level", *evaluate.aligned_lines(rows), *counts])


@gin.configurable
def run_demo(*, workdir: str, kb_path: str = str(DEMO_KB),
             examples_path: str = str(DEMO_EXAMPLES), base_steps: int = 150,
             prompt_steps: int = 60, classifier_steps: int = 60, batch_size: int = 16,
             base_learning_rate: float = 0.01, prompt_learning_rate: float = 0.1,
             warmup_steps: int = 20, test_fraction: float = 0.3,
             max_input_length: int = 256, max_target_length: int = 192,
             max_test_examples: Optional[int] = 5,
             detectors: Sequence[str] = ("rouge", "salience", "classifier"),
             seed: int = 0) -> dict[str, Any]:
  """Runs the whole NPOV pipeline on the bundled corpus.

  Everything goes under `workdir`: vocab/, data/, base_run/, generator/,
  classifier_{hallucination,coverage}/ (prompt-tuning runs, each with prompt/), eval/ (table,
  JSON, ROC PNGs), detect/ (scores.jsonl, heatmaps/). Every model is trained by the core run
  (`runs.train_run`); a rerun resumes or finds its runs finished.

  Args:
    kb_path: JSONL knowledge base (default: the bundled demo one).
    examples_path: Error-free examples (JSONL) of its topics (default: the bundled ones).
    base_steps, prompt_steps, classifier_steps: Training steps of the tiny base T5, of the
      generator prompt and of each classifier prompt.
    base_learning_rate, prompt_learning_rate: Peak learning rates of the base and the prompts.
    warmup_steps: Warm-up steps of every schedule.
    test_fraction: Fraction of the topics held out for the test slices.
    max_input_length, max_target_length: Encoder and decoder lengths (tokens).
    max_test_examples: Held-out source examples the detectors are evaluated on (None: all).
    detectors: Any of "rouge", "salience", "classifier".
    seed: Seed of sampling, synthetic errors and training.

  Returns:
    A summary: output paths (str values) and every ROC AUC as
    `"auc/<slice>/<detector>/<error>/<example|word>"` (None where undefined).
  """
  workdir = os.fspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  topics = kb_lib.split_topics(kb_lib.read_kb_jsonl(kb_path), dev_fraction=0.0,
                               test_fraction=test_fraction)
  split_of = {t.id: t.split for t in topics}
  examples = kb_lib.attach_clusters(task.read_examples(examples_path), topics)
  train_examples = [e for e in examples if split_of[e.topic] == "train"]
  test_examples = [e for e in examples if split_of[e.topic] == "test"]
  if not train_examples or not test_examples:
    raise ValueError(f"run_demo: split gave {len(train_examples)} train and "
                     f"{len(test_examples)} test examples; change test_fraction")
  logging.info("npov demo: %d train / %d test examples", len(train_examples), len(test_examples))
  config = t5_config(size="tiny")
  lengths = {"inputs": max_input_length, "targets": max_target_length}
  partitioner = partitioning.PjitPartitioner(num_partitions=1)
  pairs = readers.write_jsonl(os.path.join(workdir, "data", "generator.jsonl"), (
      {"inputs": task.format_input(e), "targets": e.response} for e in train_examples))
  run = functools.partial(runs.train_run, batch_size=batch_size, partitioner=partitioner,
                          seed=seed, log_every=50)

  # 2. Base model: full training on the generator task (stands in for a pretrained LM).
  base_dir = os.path.join(workdir, "base_run")
  vocab_path = vocab_lib.build_demo_vocabulary(output_dir=os.path.join(workdir, "vocab"))
  run(model_dir=base_dir, model=trainable.Seq2SeqModel(config=config),
      data=runs.Seq2SeqData(train_file=pairs, vocabulary_path=vocab_path),
      train_steps=base_steps, feature_lengths=lengths, checkpoint_every=base_steps,
      optimizer=optimizers.make_optimizer(name="adamw", learning_rate=optimizers.make_schedule(
          name="warmup_linear_decay", base_learning_rate=base_learning_rate,
          warmup_steps=warmup_steps, total_steps=base_steps)))

  # 3a. Generator prompt on the frozen base (the core run, base as init_checkpoint).
  generator_dir = os.path.join(workdir, "generator")
  prompt_optimizer = lambda steps: prompt_tuning.paper_optimizer(  # noqa: E731
      train_steps=steps, learning_rate=prompt_learning_rate, warmup_steps=warmup_steps)
  run(model_dir=generator_dir, model=prompt_tuning.PromptTuningModel(
          config=config, prompt=prompt_tuning.PromptConfig(vocab_sample_size=config.vocab_size),
          metadata={"task": "npov_generator"}),
      data=runs.Seq2SeqData(train_file=pairs), train_steps=prompt_steps, feature_lengths=lengths,
      checkpoint_every=prompt_steps, optimizer=prompt_optimizer(prompt_steps),
      init_checkpoint=base_dir)
  # 3b. Classifier prompts, trained on synthetic errors of the training topics.
  train_synthetic = synthetic.training_examples(train_examples, topics, seed=seed + 1)
  classifier_dirs = {error: classifier.train_classifier(
      model_dir=os.path.join(workdir, f"classifier_{error}"), base_dir=base_dir,
      examples=train_synthetic, error=error, train_steps=classifier_steps,
      optimizer=prompt_optimizer(classifier_steps), batch_size=batch_size,
      max_input_length=max_input_length + max_target_length, partitioner=partitioner,
      seed=seed, checkpoint_every=classifier_steps, log_every=50)
      for error in classifier.ERROR_TYPES}

  # 4. Detectors on the synthetic test slices (the first `max_test_examples` held-out
  # examples: salience is a backward pass per output chunk, the demo keeps it to minutes).
  test_slices = synthetic.make_test_slices(test_examples[:max_test_examples], topics, seed=seed + 2)
  built = {name: detect.build_detector(
      name, base_dir=base_dir, generator_dir=generator_dir, classifier_dirs=classifier_dirs)
           for name in detectors}
  logging.info("npov demo: evaluating %s on %s examples", list(built),
               {k: len(v) for k, v in test_slices.items()})
  results = evaluate.evaluate_detectors(built, test_slices)
  paths = evaluate.write_results(results, os.path.join(workdir, "eval"))
  print(summary_table(results))
  print(f"(every slice, level and count: {paths['table']})")
  aucs = {f"auc/{slice_name}/{det}/{error}/{level}": by_error[error][f"{level}_auc"]
          for slice_name, by_detector in results.items()
          for det, by_error in by_detector.items()
          for error in classifier.ERROR_TYPES for level in ("example", "word")}
  truth = demo_lib.npov_truth_lines(results, test_slices)  # printed once, by demo.run_all
  # The user-facing path: a responses file in, scores and heatmaps out.
  detect_dir = os.path.join(workdir, "detect")
  responses = os.path.join(detect_dir, "responses.jsonl")
  task.write_examples(test_slices["unparaphrased"][:6], responses)
  if "salience" in detectors:
    paths.update(scores=os.path.join(detect_dir, "scores.jsonl"),
                 heatmaps=os.path.join(detect_dir, "heatmaps"))
    actions.detect_file(input_path=responses, output_path=paths["scores"], detector="salience",
                        base_dir=base_dir, generator_dir=generator_dir,
                        heatmap_dir=paths["heatmaps"], roc_dir=detect_dir)
  return {**paths, **aucs, "truth": truth}
