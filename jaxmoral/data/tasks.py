"""seqio Tasks for text-pair data, the demo Tasks and Mixture, and Task -> `BatchSource`.

A text-pair Task reads (input, target) strings from memory or from a TSV/CSV/JSONL file (read
eagerly by `readers`, so a bad row fails with its line number at registration), tokenises both
with a SentencePiece vocabulary and appends EOS after trimming, as T5 tasks do. The data are
small here, so `task_to_source` materialises the converted examples into numpy arrays and lets
`BatchSource` do the deterministic shuffling and batching.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

import gin
import numpy as np
import seqio
import tensorflow as tf

from jaxmoral.data import readers
from jaxmoral.data.pipeline import BatchSource, Features

Pairs = Sequence[tuple[str, str]]
DEMO_MIXTURE = "jaxmoral_demo_clarify"
DEMO_TASKS = ("jaxmoral_demo_clarify_question", "jaxmoral_demo_clarify_fusion",
              "jaxmoral_demo_clarify_judgment")


def read_pairs(path: str | os.PathLike, *, input_field: str, target_field: str,
               on_error: readers.OnError = "raise") -> list[tuple[str, str]]:
  """(input, target) pairs from a .tsv, .csv or .jsonl file with those columns / keys."""
  suffix = os.path.splitext(str(path))[1].lower()
  fields = [input_field, target_field]
  if suffix == ".tsv":
    rows = readers.read_tsv(path, columns=fields, on_error=on_error)
  elif suffix == ".csv":
    rows = readers.read_csv(path, columns=fields, on_error=on_error)
  elif suffix == ".jsonl":
    rows = readers.read_jsonl(path, required=fields, text=fields, on_error=on_error)
  else:
    raise ValueError(f"{path}: unknown data file type {suffix!r} (want .tsv, .csv or .jsonl)")
  return [(r[input_field], r[target_field]) for r in rows]


def split_pairs(pairs: Pairs, *, validation_every: int = 10) -> dict[str, list[tuple[str, str]]]:
  """A deterministic train/validation split: every `validation_every`-th pair validates."""
  if validation_every < 2:
    raise ValueError(f"validation_every must be >= 2, got {validation_every}")
  return {"train": [p for i, p in enumerate(pairs) if i % validation_every],
          "validation": [p for i, p in enumerate(pairs) if not i % validation_every]}


def _function_source(splits: Mapping[str, Pairs]) -> seqio.FunctionDataSource:
  data = {split: ([x for x, _ in pairs], [y for _, y in pairs]) for split, pairs in splits.items()}

  def dataset_fn(split: str, shuffle_files: bool, seed: Optional[int] = None) -> tf.data.Dataset:
    del shuffle_files, seed  # One in-memory "file"; BatchSource shuffles.
    inputs, targets = data[split]
    return tf.data.Dataset.from_tensor_slices(
        {"inputs": tf.constant(inputs, tf.string), "targets": tf.constant(targets, tf.string)})

  return seqio.FunctionDataSource(dataset_fn, splits=list(data),
                                  num_input_examples={s: len(p) for s, p in splits.items()})


@gin.configurable
def register_text_pair_task(name: str, *, vocabulary: seqio.Vocabulary,
                            examples: Optional[Pairs | Mapping[str, Pairs]] = None,
                            file: Optional[str | os.PathLike | Mapping[str, str]] = None,
                            input_field: str = "inputs", target_field: str = "targets",
                            add_eos: bool = True, overwrite: bool = True) -> seqio.Task:
  """Registers a seqio Task of (input, target) text pairs.

  Args:
    name: Task name.
    vocabulary: Vocabulary of both features (e.g. `vocab.get_vocabulary(...)`).
    examples: Pairs (one "train" split) or `{split: pairs}`.
    file: Instead of `examples`: a file (one "train" split) or `{split: file}`.
    input_field: Column / key of the input text in `file`.
    target_field: Column / key of the target text in `file`.
    add_eos: Append EOS (after trimming) to both features.
    overwrite: Replace a Task of the same name (re-registration in tests and notebooks).

  Returns:
    The registered `seqio.Task`.
  """
  if (examples is None) == (file is None):
    raise ValueError(f"register_text_pair_task({name!r}): give exactly one of examples, file")
  files: Mapping[str, str | os.PathLike] = {}
  if file is not None:
    files = file if isinstance(file, Mapping) else {"train": file}
    splits = {s: read_pairs(f, input_field=input_field, target_field=target_field)
              for s, f in files.items()}
  else:
    splits = dict(examples) if isinstance(examples, Mapping) else {"train": list(examples)}
  for split, pairs in splits.items():
    if not pairs:
      where = f" (file {files[split]} has no rows)" if split in files else ""
      raise ValueError(f"register_text_pair_task({name!r}): split {split!r} is empty{where}")
  if overwrite:
    seqio.TaskRegistry.remove(name)
  features = {k: seqio.Feature(vocabulary=vocabulary, add_eos=add_eos)
              for k in ("inputs", "targets")}
  return seqio.TaskRegistry.add(
      name, source=_function_source(splits), output_features=features,
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim])


@gin.configurable
def register_demo_tasks(*, vocabulary: seqio.Vocabulary) -> seqio.Mixture:
  """Registers the ClarifyDelphi demo Tasks (train/validation) and their Mixture.

  Tasks: `jaxmoral_demo_clarify_question` (situation -> clarification question),
  `..._fusion` (situation + question + answer -> updated situation), `..._judgment`
  (situation -> bad | ok | good). The Mixture mixes them by example count.
  """
  from jaxmoral.data import demo
  sources = {
      # Task prefixes tell the one model which task a mixed example is (T5 convention).
      DEMO_TASKS[0]: [("question: " + r["situation"], r["question"])
                      for r in demo.clarify_questions()],
      DEMO_TASKS[1]: [(r["input"], r["output"]) for r in demo.clarify_fusion()],
      DEMO_TASKS[2]: [("judge: " + r["situation"], r["judgment"])
                      for r in demo.clarify_judgments()],
  }
  for name, pairs in sources.items():
    register_text_pair_task(name, vocabulary=vocabulary, examples=split_pairs(pairs))
  seqio.MixtureRegistry.remove(DEMO_MIXTURE)
  return seqio.MixtureRegistry.add(DEMO_MIXTURE, [(t, len(sources[t])) for t in DEMO_TASKS])


def _mixed_counts(sizes: Sequence[int], rates: Sequence[float]) -> list[int]:
  """How many examples each Task gives to a materialised Mixture of sum(sizes) examples."""
  total_rate = float(sum(rates))
  if total_rate <= 0 or any(r < 0 for r in rates):
    raise ValueError(f"mixture rates must be >= 0 with a positive sum, got {list(rates)}")
  return [round(sum(sizes) * rate / total_rate) for rate in rates]


def _take(examples: Sequence[Any], count: int, rng: np.random.Generator) -> list[Any]:
  """`count` of `examples`: whole passes in order, then a seeded sample of the rest (kept in
  file order), so a count equal to the size gives every example once, in order."""
  passes, rest = divmod(count, len(examples))
  return list(examples) * passes + [examples[i] for i in
                                    sorted(rng.choice(len(examples), rest, replace=False))]


def task_examples(task_name: str, split: str, *, feature_lengths: Mapping[str, int],
                  pack: bool = False, seed: int = 0) -> Features:
  """All examples of a Task split, or a Mixture's, through `EncDecFeatureConverter`, stacked.

  A Mixture of Tasks with n_t examples and rates r_t gives N = sum(n_t) examples, of which
  round(N r_t / sum(r)) come from Task t: its examples repeated as often as that needs, the
  last part a sample drawn with `seed`. Shuffled by `BatchSource`, batches then draw each Task
  at its rate, as seqio's sampling does in expectation. A Mixture weighted by example count
  (the demo's) gives every example once. Tasks are mixed before the converter, so packing
  puts examples of different Tasks in one row, as seqio does.
  """
  provider = seqio.get_mixture_or_task(task_name)
  tasks = provider.tasks if isinstance(provider, seqio.Mixture) else [provider]
  per_task: list[list[dict[str, np.ndarray]]] = []
  for task in tasks:
    if split not in task.splits:
      raise ValueError(f"task {task.name!r} has no split {split!r} (has {list(task.splits)})")
    ds = task.get_dataset(sequence_length=dict(feature_lengths), split=split, shuffle=False,
                          num_epochs=1)
    per_task.append([{k: np.asarray(ex[k], np.int32) for k in task.output_features}
                     for ex in ds.as_numpy_iterator()])
    if not per_task[-1]:
      raise ValueError(f"task {task.name!r}: split {split!r} has no examples")
  if isinstance(provider, seqio.Mixture):
    counts = _mixed_counts([len(t) for t in per_task], [provider.get_rate(t) for t in tasks])
    rng = np.random.default_rng(seed)
    examples = [ex for part, count in zip(per_task, counts) for ex in _take(part, count, rng)]
  else:
    examples = per_task[0]
  keys = list(examples[0])
  ds = tf.data.Dataset.from_generator(
      lambda: iter(examples), output_signature={k: tf.TensorSpec([None], tf.int32) for k in keys})
  ds = seqio.EncDecFeatureConverter(pack=pack)(ds, dict(feature_lengths))
  rows: dict[str, list[np.ndarray]] = {}
  for ex in ds.as_numpy_iterator():
    for k, v in ex.items():
      rows.setdefault(k, []).append(np.asarray(v, np.int32))
  return {k: np.stack(v) for k, v in rows.items()}


@gin.configurable
def task_to_source(task_name: str, split: str = "train", *, feature_lengths: Mapping[str, int],
                   batch_size: int, seed: int = 0, shuffle: bool = True,
                   pack: bool = False) -> BatchSource:
  """Materialises a seqio Task / Mixture split into a deterministic `BatchSource`."""
  features = task_examples(task_name, split, feature_lengths=feature_lengths, pack=pack,
                           seed=seed)
  return BatchSource(features=features, batch_size=batch_size, seed=seed, shuffle=shuffle)
