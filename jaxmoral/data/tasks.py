"""seqio Tasks for text-pair data, the demo Tasks and Mixture, and the indexed `TaskSource`.

A text-pair Task reads (input, target) strings from memory or from a TSV/CSV/JSONL file
(checked by `readers` at registration, so a bad row fails with its line number before any
training), tokenises both and appends EOS after trimming, as T5 tasks do. Training reads any
Task or Mixture through `TaskSource`, by step from an index cache.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from typing import Any, Iterator, Mapping, Optional

import numpy as np

# isort: off
from jaxmoral.data import _tensorflow  # noqa: F401  (first: how TensorFlow starts)
import seqio
import tensorflow as tf
# isort: on

import gin

from jaxmoral import fileio
from jaxmoral import integrity
from jaxmoral.data import demo
from jaxmoral.data import index_cache
from jaxmoral.data import pairs as pairs_lib
from jaxmoral.data import pipeline
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.data.pairs import Pairs
from jaxmoral.data.source import DataSource

logger = logging.getLogger(__name__)
# The attribute of a seqio DataSource fingerprinting its data: its Task's cache is kept.
FINGERPRINT_ATTRIBUTE = "jaxmoral_fingerprint"
# A Mixture's cache holds at least this many rows (its rates are then well sampled).
MIN_MIXTURE_ROWS = 2048
DEMO_MIXTURE = "jaxmoral_demo_clarify"
DEMO_TASKS = ("jaxmoral_demo_clarify_question", "jaxmoral_demo_clarify_fusion",
              "jaxmoral_demo_clarify_judgment")


# seqio warns that an uncached FunctionDataSource shuffles poorly after a restart; not ours:
# the text-pair source shuffles its whole split and a `TaskSource` reads by index.
logging.getLogger("absl").addFilter(lambda r: "uncached FunctionDataset" not in r.getMessage())


def _function_source(splits: Mapping[str, Pairs]) -> seqio.FunctionDataSource:
  """The pairs of each split; shuffled, a new permutation of the whole split every epoch:
  seqio's own shuffle is a window of 1,000 examples, so pairs stored in blocks (task by task,
  sorted by label) would reach training one task or label per batch for hundreds of steps."""
  data = {split: ([x for x, _ in pairs], [y for _, y in pairs]) for split, pairs in splits.items()}

  def dataset_fn(split: str, shuffle_files: bool, seed: Optional[int] = None) -> tf.data.Dataset:
    inputs, targets = (tf.constant(texts, tf.string) for texts in data[split])
    count = len(data[split][0])
    order = tf.data.Dataset.range(count)
    if shuffle_files:  # seqio passes `shuffle` here; the permutation is of indices only.
      order = order.shuffle(count, seed=seed, reshuffle_each_iteration=True)
    return order.map(lambda i: {"inputs": tf.gather(inputs, i), "targets": tf.gather(targets, i)})

  source = seqio.FunctionDataSource(dataset_fn, splits=list(data),
                                    num_input_examples={s: len(p) for s, p in splits.items()})
  setattr(source, FINGERPRINT_ATTRIBUTE,
          index_cache.fingerprint({s: list(map(list, p)) for s, p in splits.items()}))
  return source


@gin.configurable
def register_text_pair_task(name: str, *, vocabulary: Any,
                            examples: Optional[Pairs | Mapping[str, Pairs]] = None,
                            file: Optional[str | os.PathLike | Mapping[str, str]] = None,
                            input_field: str = "inputs", target_field: str = "targets",
                            add_eos: bool = True, overwrite: bool = True) -> seqio.Task:
  """Registers a seqio Task of (input, target) text pairs.

  Args:
    vocabulary: Vocabulary of both features (e.g. `vocab.get_vocabulary(...)`).
    examples, file: The pairs, or instead a file: one "train" split, or `{split: pairs | file}`.
    overwrite: Replace a Task of the same name (re-registration in tests and notebooks).
  """
  if (examples is None) == (file is None):
    raise ValueError(f"register_text_pair_task({name!r}): give exactly one of examples, file")
  files: Mapping[str, str | os.PathLike] = {}
  if file is not None:
    files = file if isinstance(file, Mapping) else {"train": file}
    splits = {s: pairs_lib.read_pairs(f, input_field=input_field, target_field=target_field)
              for s, f in files.items()}
  else:
    assert examples is not None  # Exactly one of examples, file (checked above).
    splits = dict(examples) if isinstance(examples, Mapping) else {"train": list(examples)}
  for split, pairs in splits.items():
    if not pairs:
      where = f" (file {files[split]} has no rows)" if split in files else ""
      raise ValueError(f"register_text_pair_task({name!r}): split {split!r} is empty{where}")
  if overwrite:
    seqio.TaskRegistry.remove(name)
  features = {k: seqio.Feature(vocabulary=vocab_lib.as_seqio(vocabulary), add_eos=add_eos)
              for k in ("inputs", "targets")}
  return seqio.TaskRegistry.add(
      name, source=_function_source(splits), output_features=features,
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim])


@gin.configurable
def register_demo_tasks(*, vocabulary: Any) -> seqio.Mixture:
  """Registers the ClarifyDelphi demo Tasks (train/validation) and their Mixture (by example
  count): situation -> clarification question (`jaxmoral_demo_clarify_question`), situation +
  question + answer -> updated situation (`..._fusion`), situation -> bad | ok | good
  (`..._judgment`)."""
  sources = {
      # Task prefixes tell the one model which task a mixed example is (T5 convention).
      DEMO_TASKS[0]: [("question: " + r["situation"], r["question"])
                      for r in demo.clarify_questions()],
      DEMO_TASKS[1]: [(r["input"], r["output"]) for r in demo.clarify_fusion()],
      DEMO_TASKS[2]: [("judge: " + r["situation"], r["judgment"])
                      for r in demo.clarify_judgments()],
  }
  for name, pairs in sources.items():
    # A registered Task's splits are part of its definition: they never change.
    register_text_pair_task(name, vocabulary=vocabulary,
                            examples=pairs_lib.split_pairs(pairs, rule="position"))
  seqio.MixtureRegistry.remove(DEMO_MIXTURE)
  return seqio.MixtureRegistry.add(DEMO_MIXTURE, [(t, len(sources[t])) for t in DEMO_TASKS])


def _tasks(task_name: str) -> list[seqio.Task]:
  """The Tasks of a registered Task or Mixture."""
  provider = seqio.get_mixture_or_task(task_name)
  return provider.tasks if isinstance(provider, seqio.Mixture) else [provider]


def _advance(iterator: Any, count: int) -> None:
  """Reads `count` elements of a tf.data iterator inside TensorFlow (no Python per element)."""
  if count > 0:
    _advance_graph(iterator, tf.constant(count, tf.int64))


@tf.function
def _advance_graph(iterator: Any, count: Any) -> None:
  for _ in tf.range(count):
    iterator.get_next()


@gin.configurable
@dataclasses.dataclass(frozen=True, eq=False)
class TaskSource(DataSource):
  """Batches of a seqio Task or Mixture split, read by index from a cache seqio writes once.

  seqio's pipeline (`get_dataset(shuffle, seed)`, T5X's `EncDecFeatureConverter`) runs once
  over the split into an `index_cache` whose rows batch `step` gathers (`pipeline.BatchSource`),
  so the data position stays the step. One pass is a Task's split in seqio's seeded order
  (packing and noise drawn once, kept in later epochs), or a Mixture's stream at its rates for
  as many examples as its Tasks have (at least `MIN_MIXTURE_ROWS` rows).

  A split of more than `max_cached_examples` examples (or a Mixture of Tasks of unknown size)
  is streamed: with `position_dir` its tf.data iterator state is saved every `position_every`
  batches (one file per shard), and a resume at step k reads only the batches after the newest
  position at or before k (else all k, logged).

  Attributes (besides `DataSource`'s batch_size, shard_index, shard_count):
    feature_lengths: `{"inputs": N, "targets": M}`.
    seed: Shuffling (and mixing) seed.
    shuffle: False serves the split in order (evaluation).
    cache_dir: Where index caches are kept (None: `index_cache.default_root()`); a Task that
      does not fingerprint its data (this package's do) gets a cache of this process only.
    position_dir: Where a streamed split's positions are kept (MODEL_DIR/data_position).
    position_every: A position every this many batches (the run's checkpoint interval).
  """
  task_name: str
  split: str
  feature_lengths: Mapping[str, int]
  batch_size: int
  seed: int = 0
  shuffle: bool = True
  pack: bool = False
  shard_index: int = 0
  shard_count: int = 1
  cache_dir: Optional[str] = None
  max_cached_examples: int = 5_000_000
  position_dir: Optional[str] = None
  position_every: int = 0
  # Built on first use (`_cached_rows`).
  _rows: Optional[tuple[dict[str, np.ndarray], dict[str, Any]]] = dataclasses.field(
      default=None, init=False, repr=False)

  def __post_init__(self):
    self.check_shard()
    pipeline.check_lengths(self.feature_lengths, "TaskSource.feature_lengths")
    tasks = _tasks(self.task_name)
    if not any(self.split in t.splits for t in tasks):
      raise ValueError(f"{self.task_name!r} has no split {self.split!r} (has "
                       f"{sorted({s for t in tasks for s in t.splits})})")
    object.__setattr__(self, "feature_lengths", dict(self.feature_lengths))

  @property
  def num_examples(self) -> Optional[int]:
    """Input examples of the split (all shards, all of a Mixture's Tasks), when they know."""
    counts = [t.source.num_input_examples(self.split) if self.split in t.splits else 0
              for t in _tasks(self.task_name)]
    return None if any(c is None for c in counts) else int(sum(counts))

  def keeping_position(self, directory: str, every: int) -> TaskSource:
    return dataclasses.replace(self, position_dir=directory, position_every=every)

  @property
  def _is_mixture(self) -> bool:
    return isinstance(seqio.get_mixture_or_task(self.task_name), seqio.Mixture)

  # -- the index cache --------------------------------------------------------------------------
  def _data_identity(self) -> Optional[dict[str, Any]]:
    """What the rows depend on, or None when a Task's data has no fingerprint."""
    provider = seqio.get_mixture_or_task(self.task_name)
    parts = []
    # The Tasks and their features share a vocabulary: each one is read once.
    digests: dict[int, Optional[str]] = {}
    for task in _tasks(self.task_name):
      if self.split not in task.splits:
        continue
      fingerprint = getattr(task.source, FINGERPRINT_ATTRIBUTE, None)
      if fingerprint is None:
        return None
      for f in task.output_features.values():
        if id(f.vocabulary) not in digests:
          digests[id(f.vocabulary)] = vocab_lib.model_digest(f.vocabulary)
      vocabularies = {name: [type(f.vocabulary).__name__, digests[id(f.vocabulary)],
                             f.vocabulary.vocab_size, f.add_eos]
                      for name, f in sorted(task.output_features.items())}
      parts.append({"task": task.name, "data": fingerprint, "features": vocabularies,
                    "rate": provider.get_rate(task) if self._is_mixture else None})
    return {"tasks": parts}

  def _cacheable(self) -> bool:
    count = self.num_examples
    return not self._is_mixture if count is None else count <= self.max_cached_examples

  def _pass_rows(self) -> Iterator[pipeline.Features]:
    """One pass of seqio's stream (class docstring), in chunks of rows."""
    is_mixture = self._is_mixture
    ds = self._features(num_epochs=None if is_mixture else 1, shard_info=None, in_memory=False)
    want = max(self.num_examples or 0, 1)
    rows = examples = 0
    for batch in ds.batch(1024).as_numpy_iterator():
      chunk = {k: np.asarray(v, np.int32) for k, v in batch.items()}
      if is_mixture:  # Until the Tasks' examples are drawn (and enough rows for the rates).
        segments = chunk.get("decoder_segment_ids")
        per_row = (segments.max(-1) if segments is not None
                   else np.ones(len(chunk["decoder_target_tokens"]), np.int64))
        total = examples + np.cumsum(per_row)
        enough = (total >= want) & (rows + np.arange(1, len(per_row) + 1) >= MIN_MIXTURE_ROWS)
        if enough.any():
          cut = int(np.argmax(enough)) + 1
          yield {k: v[:cut] for k, v in chunk.items()}
          return
        examples, rows = int(total[-1]), rows + len(per_row)
      yield chunk

  def cache_directory(self) -> str:
    """The index cache of this split's rows (named by the Task and a key of what they depend
    on), built first if there is none."""
    data = self._data_identity()
    identity = {"version": 1, "task": self.task_name, "split": self.split,
                "lengths": self.feature_lengths, "pack": self.pack, "shuffle": self.shuffle,
                "seed": self.seed if self.shuffle else None, "data": data}
    if data is not None:
      root = self.cache_dir or index_cache.default_root()
    else:  # No fingerprint of the data: this process's own copy, built anew (another process
      # cannot know the data did not change), removed when it exits.
      root = fileio.local_folder_for("index caches")
    directory = os.path.join(os.fspath(root), f"{self.task_name}.{index_cache.key_of(identity)}")
    if self._rows is None:
      found = index_cache.read(directory)
      if found is None:
        logger.info("TaskSource: caching the rows of %s:%s in %s", self.task_name, self.split,
                    directory)
        found = index_cache.write(directory, self._pass_rows(), identity)
      object.__setattr__(self, "_rows", found)
    return directory

  def _cached_rows(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The split's rows (memory-mapped) and the cache's meta, built on first use."""
    if self._rows is None:
      self.cache_directory()
    assert self._rows is not None
    return self._rows

  @property
  def data_fingerprint(self) -> Optional[str]:
    """A hash of the rows the batches are drawn from (None for a streamed split); a
    checkpoint records it, so a run resumed over other data is refused."""
    return self._cached_rows()[1]["sha256"][:16] if self._cacheable() else None

  # -- batches ----------------------------------------------------------------------------------
  def _features(self, *, num_epochs: Optional[int], shard_info: Optional[seqio.ShardInfo],
                in_memory: bool) -> tf.data.Dataset:
    """seqio's stream of the split through T5X's `EncDecFeatureConverter`, in a fixed order."""
    ds = seqio.get_mixture_or_task(self.task_name).get_dataset(
        sequence_length=self.feature_lengths, split=self.split, shuffle=self.shuffle,
        seed=self.seed, shard_info=shard_info, num_epochs=num_epochs, try_in_mem_cache=in_memory)
    ds = seqio.EncDecFeatureConverter(pack=self.pack)(ds, self.feature_lengths)
    options = tf.data.Options()
    options.deterministic = True  # The rows must not depend on thread timing.
    return ds.with_options(options)

  def _dataset(self, *, repeat: bool) -> tf.data.Dataset:
    shard_info = (seqio.ShardInfo(self.shard_index, self.shard_count)
                  if self.shard_count > 1 else None)
    # In memory only in order: a cached epoch would replay the source's first permutation.
    return self._features(num_epochs=None if repeat else 1, shard_info=shard_info,
                          in_memory=not self.shuffle).batch(self.per_shard_batch_size,
                                                            drop_remainder=repeat)

  def iterate(self, start_step: int = 0) -> Iterator[pipeline.Features]:
    """This process's rows of batch `start_step`, `start_step + 1`, ... forever (a
    `DataSource`)."""
    if start_step < 0:
      raise ValueError(f"start_step must be >= 0, got {start_step}")
    if self._cacheable():
      yield from pipeline.BatchSource(
          features=self._cached_rows()[0], batch_size=self.batch_size, seed=self.seed,
          shuffle=self.shuffle, shard_index=self.shard_index,
          shard_count=self.shard_count).iterate(start_step)
      return
    iterator = iter(self._dataset(repeat=True))
    at = self._restore_position(iterator, start_step) if start_step else 0
    if start_step - at:
      logger.warning("TaskSource: %s:%s is streamed (more than max_cached_examples=%d "
                     "examples) and has no position saved at step %d: resuming reads the %d "
                     "batches from step %d", self.task_name, self.split,
                     self.max_cached_examples, start_step, start_step - at, at)
    _advance(iterator, start_step - at)
    step = start_step
    for batch in iterator:
      step += 1  # The iterator now stands at batch `step`.
      if self.position_dir and self.position_every > 0 and step % self.position_every == 0:
        self._save_position(iterator, step)
      yield {k: np.asarray(v, np.int32) for k, v in batch.items()}

  # -- a streamed split's position ---------------------------------------------------------------
  _POSITIONS_KEPT = 5

  def _position_folder(self, step: int) -> str:
    assert self.position_dir is not None
    return fileio.join(self.position_dir, str(step),
                       f"process_{self.shard_index}-of-{self.shard_count}")

  def _saved_positions(self) -> list[int]:
    if not self.position_dir:
      return []
    return [s for s in integrity.step_folders(self.position_dir) if fileio.exists(
        fileio.join(self._position_folder(s), integrity.INTEGRITY_FILE))]

  def _save_position(self, iterator: Any, step: int) -> None:
    """Writes the iterator's state at batch `step` with its integrity manifest (locally, then
    copied: to a bucket too)."""
    folder = self._position_folder(step)
    with tempfile.TemporaryDirectory(prefix="jaxmoral-position-") as scratch:
      tf.train.Checkpoint(iterator=iterator).write(os.path.join(scratch, "iterator"))
      integrity.write_integrity_manifest(scratch)
      fileio.makedirs(folder)
      # The manifest last: a position is complete once it is there.
      for name in sorted(os.listdir(scratch), key=lambda n: n == integrity.INTEGRITY_FILE):
        fileio.upload(os.path.join(scratch, name), fileio.join(folder, name))
    for old in self._saved_positions()[:-self._POSITIONS_KEPT]:
      fileio.rmtree(self._position_folder(old))

  def _restore_position(self, iterator: Any, step: int) -> int:
    """Restores the newest saved position at or before `step`; returns its step (0: none).

    Raises:
      integrity.CheckpointIntegrityError: A file of that position is missing or damaged.
    """
    saved = [p for p in self._saved_positions() if p <= step]
    if not saved:
      return 0
    folder = self._position_folder(saved[-1])
    integrity.verify_integrity(folder, what=f"{folder} (the data position at step "
                                 f"{saved[-1]})", step=saved[-1], unverified_ok=False)
    tf.train.Checkpoint(iterator=iterator).read(
        os.path.join(fileio.local_folder(folder), "iterator")).assert_consumed()
    return saved[-1]

  def eval_batches(self) -> Iterator[pipeline.Features]:
    """One in-order pass over this shard's examples, the last batch zero-padded
    (`pipeline.pad_batch`)."""
    for batch in self._dataset(repeat=False).as_numpy_iterator():
      yield pipeline.pad_batch({k: np.asarray(v, np.int32) for k, v in batch.items()},
                               self.per_shard_batch_size)
