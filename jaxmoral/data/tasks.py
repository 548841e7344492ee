"""seqio Tasks for text-pair data, the demo Tasks and Mixture, and the indexed `TaskSource`.

A text-pair Task reads (input, target) strings from memory or from a TSV/CSV/JSONL file (read
and checked by `readers` at registration, so a bad row fails with its line number before any
training), tokenises both with a SentencePiece vocabulary and appends EOS after trimming, as T5
tasks do. Shuffled, it serves a new permutation of its whole split every epoch, whatever the
file's order. Training reads any Task or Mixture through `TaskSource`: seqio's own pipeline
runs once into an index cache, and batch `step` is read from it directly (resume at any step
without replay) with per-process sharding.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
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
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.data.pairs import Pairs
from jaxmoral.data.pipeline import BatchSource
from jaxmoral.data.pipeline import Features
from jaxmoral.data.source import DataSource

logger = logging.getLogger(__name__)
# The attribute of a seqio DataSource that fingerprints its data (set by this package's
# sources): a Task whose source has one keeps its index cache across runs.
FINGERPRINT_ATTRIBUTE = "jaxmoral_fingerprint"
# A Mixture's cache holds at least this many rows (its rates are then well sampled).
MIN_MIXTURE_ROWS = 2048



def _without_function_source_notice(record: logging.LogRecord) -> bool:
  """seqio warns that an uncached FunctionDataSource shuffles poorly after a restart; the
  text-pair source shuffles its whole split itself and a `TaskSource` reads a restarted run's
  batches by index from the rows of one seeded pass, so that does not apply to it."""
  return "uncached FunctionDataset" not in record.getMessage()


logging.getLogger("absl").addFilter(_without_function_source_notice)
DEMO_MIXTURE = "jaxmoral_demo_clarify"
DEMO_TASKS = ("jaxmoral_demo_clarify_question", "jaxmoral_demo_clarify_fusion",
              "jaxmoral_demo_clarify_judgment")


def _function_source(splits: Mapping[str, Pairs]) -> seqio.FunctionDataSource:
  """The pairs of each split; shuffled, a new permutation of the whole split every epoch.

  seqio's own shuffle, after the source, is a window of 1,000 examples: pairs stored in
  blocks (a multi-task file written task by task, a classifier file sorted by label) would
  reach training in blocks, one task or label per batch for hundreds of steps.
  """
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
  setattr(source, FINGERPRINT_ATTRIBUTE, hashlib.sha256(
      json.dumps({s: list(map(list, p)) for s, p in sorted(splits.items())}).encode("utf-8")
  ).hexdigest())
  return source


@gin.configurable
def register_text_pair_task(name: str, *, vocabulary: Any,
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
  """Registers the ClarifyDelphi demo Tasks (train/validation) and their Mixture.

  Tasks: `jaxmoral_demo_clarify_question` (situation -> clarification question),
  `..._fusion` (situation + question + answer -> updated situation), `..._judgment`
  (situation -> bad | ok | good). The Mixture mixes them by example count.
  """
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


def set_tfds_data_dir(data_dir: str) -> None:
  """Where every TFDS-backed seqio Task reads its prepared data, as T5X's `--tfds_data_dir`:
  a local folder or a bucket URL (read by TFDS and TensorFlow's own GCS client). It overrides
  each Task's own `tfds_data_dir`, for the rest of the process."""
  seqio.set_tfds_data_dir_override(data_dir)


def num_examples(task_name: str, split: str) -> Optional[int]:
  """Input examples of a Task split (summed over a Mixture's Tasks), when the source knows."""
  provider = seqio.get_mixture_or_task(task_name)
  tasks = provider.tasks if isinstance(provider, seqio.Mixture) else [provider]
  counts = [t.source.num_input_examples(split) if split in t.splits else 0 for t in tasks]
  return None if any(c is None for c in counts) else int(sum(counts))


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

  seqio's own pipeline (`get_dataset(shuffle, seed)`: a Mixture samples its Tasks at their
  rates; T5X's `EncDecFeatureConverter`: packing) runs once over the split, and its rows are
  written to an index cache (`index_cache`: one `.npy` per feature, memory-mapped). Batch
  `step` is then a gather of rows (`pipeline.BatchSource`, a new seeded permutation of the
  rows every epoch): the data position stays the step. Reading the cache needs NumPy only.

  What one pass is: a Task's split once, in seqio's seeded order (so the packing, and
  randomness such as span corruption's noise, is drawn once and kept in later epochs, which
  serve the same rows in another order); a Mixture's stream at its rates for as many examples
  as its Tasks have (at least `MIN_MIXTURE_ROWS` rows). A Task of this package (text pairs,
  span corruption) fingerprints its data, so its cache is kept under `cache_dir` and reused
  by every run of the same data; another Task's cache is built once per process in a
  temporary folder. `data_fingerprint` (a hash of the cached rows) goes into every
  checkpoint: a run resumed over other data stops with a one-line error.

  A Task of more than `max_cached_examples` examples (or a Mixture of Tasks of unknown size)
  is streamed instead. With `position_dir`, the stream's position (its tf.data iterator's
  state, as T5X checkpoints it: shuffle buffers and mixing included) is written there every
  `position_every` batches, each process its own shard's file, and a resume at step k
  restores the newest position at or before k and reads only the batches between; without a
  position it reads the k batches before its step (logged).

  Attributes (besides `DataSource`'s batch_size, shard_index, shard_count):
    task_name: A registered seqio Task or Mixture.
    split: The split.
    feature_lengths: `{"inputs": N, "targets": M}`.
    seed: Shuffling (and mixing) seed.
    shuffle: False serves the split in order (evaluation).
    pack: Pack several examples per row.
    cache_dir: Where index caches are kept (None: `index_cache.default_root()`,
      `$JAXMORAL_DATA_CACHE` or `~/.cache/jaxmoral/data`).
    max_cached_examples: Larger splits are streamed (see above).
    position_dir: Where a streamed split's positions are kept (the run sets
      MODEL_DIR/data_position); None: a resume replays.
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
    for key in ("inputs", "targets"):
      if key not in self.feature_lengths:
        raise ValueError(f"TaskSource.feature_lengths lacks {key!r}: "
                         f"{dict(self.feature_lengths)}")
    provider = seqio.get_mixture_or_task(self.task_name)
    tasks = provider.tasks if isinstance(provider, seqio.Mixture) else [provider]
    if not any(self.split in t.splits for t in tasks):
      raise ValueError(f"{self.task_name!r} has no split {self.split!r} (has "
                       f"{sorted({s for t in tasks for s in t.splits})})")
    object.__setattr__(self, "feature_lengths", dict(self.feature_lengths))
    object.__setattr__(self, "_rows", None)

  @property
  def num_examples(self) -> Optional[int]:
    """Input examples of the split (all shards), when the source knows."""
    return num_examples(self.task_name, self.split)

  def keeping_position(self, directory: str, every: int) -> TaskSource:
    """A streamed split's position kept under `directory` (MODEL_DIR/data_position)."""
    return dataclasses.replace(self, position_dir=directory, position_every=every)

  # -- the index cache --------------------------------------------------------------------------
  def _data_identity(self) -> Optional[dict[str, Any]]:
    """What the rows depend on, or None when a Task's data has no fingerprint."""
    provider = seqio.get_mixture_or_task(self.task_name)
    is_mixture = isinstance(provider, seqio.Mixture)
    tasks = provider.tasks if is_mixture else [provider]
    parts = []
    # The Tasks and their features share a vocabulary: each one is read once.
    digests: dict[int, Optional[str]] = {}
    for task in tasks:
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
                    "rate": provider.get_rate(task) if is_mixture else None})
    return {"tasks": parts}

  def _cacheable(self) -> bool:
    count = self.num_examples
    if isinstance(seqio.get_mixture_or_task(self.task_name), seqio.Mixture) and count is None:
      return False
    return count is None or count <= self.max_cached_examples

  def _pass_rows(self) -> Iterator[Features]:
    """One pass of seqio's stream (class docstring), in chunks of rows."""
    is_mixture = isinstance(seqio.get_mixture_or_task(self.task_name), seqio.Mixture)
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
    """The index cache of this split's rows, built first if there is none (the directory's
    name is the Task and a key of everything the rows depend on)."""
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
    if not self._cacheable():
      return None
    return self._cached_rows()[1]["sha256"][:16]

  def _index_source(self) -> BatchSource:
    features, _ = self._cached_rows()
    return BatchSource(features=features, batch_size=self.batch_size, seed=self.seed,
                       shuffle=self.shuffle, shard_index=self.shard_index,
                       shard_count=self.shard_count)

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

  def iterate(self, start_step: int = 0) -> Iterator[Features]:
    """This process's rows of batch `start_step`, `start_step + 1`, ... forever (a
    `DataSource`)."""
    if start_step < 0:
      raise ValueError(f"start_step must be >= 0, got {start_step}")
    if self._cacheable():
      yield from self._index_source().iterate(start_step)
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

  def _position_name(self) -> str:
    return f"process_{self.shard_index}-of-{self.shard_count}"

  def _saved_positions(self) -> list[int]:
    if not self.position_dir:
      return []
    try:
      names = fileio.listdir(self.position_dir)
    except OSError:
      return []
    return sorted(int(n) for n in names if n.isdigit() and fileio.exists(
        fileio.join(self.position_dir, n, self._position_name(), integrity.INTEGRITY_FILE)))

  def _save_position(self, iterator: Any, step: int) -> None:
    """Writes the iterator's state at batch `step` (local temp, then copied: a bucket too),
    with the sizes and checksums of its files (`integrity.write_integrity_manifest`)."""
    assert self.position_dir is not None
    folder = fileio.join(self.position_dir, str(step), self._position_name())
    with tempfile.TemporaryDirectory(prefix="jaxmoral-position-") as scratch:
      tf.train.Checkpoint(iterator=iterator).write(os.path.join(scratch, "iterator"))
      integrity.write_integrity_manifest(scratch)
      fileio.makedirs(folder)
      # The manifest last: a position is complete once it is there.
      for name in sorted(os.listdir(scratch), key=lambda n: n == integrity.INTEGRITY_FILE):
        fileio.upload(os.path.join(scratch, name), fileio.join(folder, name))
    for old in self._saved_positions()[:-self._POSITIONS_KEPT]:
      fileio.rmtree(fileio.join(self.position_dir, str(old), self._position_name()))

  def _restore_position(self, iterator: Any, step: int) -> int:
    """Restores the newest saved position at or before `step`; returns its step (0: none).

    Raises:
      integrity.CheckpointIntegrityError: A file of that position is missing or damaged
        (the one-line message names it).
    """
    saved = [p for p in self._saved_positions() if p <= step]
    if not saved:
      return 0
    assert self.position_dir is not None
    folder = fileio.join(self.position_dir, str(saved[-1]), self._position_name())
    integrity.verify_integrity(folder, what=f"{folder} (the data position at step "
                                 f"{saved[-1]})", step=saved[-1], unverified_ok=False)
    tf.train.Checkpoint(iterator=iterator).read(
        os.path.join(fileio.local_folder(folder), "iterator")).assert_consumed()
    return saved[-1]

  def eval_batches(self) -> Iterator[Features]:
    """One in-order pass over this shard's examples, the last batch zero-padded (its rows
    then have `decoder_loss_weights` 0 and add nothing to weighted sums)."""
    per = self.per_shard_batch_size
    for batch in self._dataset(repeat=False).as_numpy_iterator():
      rows = next(iter(batch.values())).shape[0]
      yield {k: np.pad(np.asarray(v, np.int32), [(0, per - rows)] + [(0, 0)] * (v.ndim - 1))
             for k, v in batch.items()}
