"""`Seq2SeqData` (gin `runs.Seq2SeqData`), the `source.DataSpec` of (input, target) pairs: a
seqio Task or Mixture, or a pairs file (its dialogue sibling: `diamante.data.DialogueData`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Mapping, Optional

import gin
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

from jaxmoral import fileio
from jaxmoral.data import index_cache
from jaxmoral.data import pairs as pairs_lib
from jaxmoral.data import pipeline
from jaxmoral.data import source
from jaxmoral.data import vocab as vocab_lib

logger = logging.getLogger(__name__)

# A data cache folder (`Seq2SeqData.cache_dir`): what it holds, and its vocabulary.
CACHE_SPEC = "spec.json"
CACHE_VOCABULARY = "vocabulary.model"


def _seqio_tasks() -> Any:
  """`jaxmoral.data.tasks`, imported where a seqio Task is first needed (it loads seqio and
  TensorFlow, which a run from a DATA_CACHE never does)."""
  try:
    from jaxmoral.data import tasks  # pylint: disable=g-import-not-at-top
  except ModuleNotFoundError as error:
    raise ValueError(f"Seq2SeqData: {error.name} is not installed here; install it (pip "
                     "install 'jaxmoral[seqio]'), or train from a DATA_CACHE written by "
                     "`jaxmoral cache` where it is") from None
  return tasks


def _copy_folder(source: str, target: str) -> None:
  """Copies the files of local folder `source` to `target` (local or a bucket URL), whole:
  locally under a temporary name renamed into place."""
  if fileio.is_url(target):
    for name in sorted(os.listdir(source)):
      fileio.upload(os.path.join(source, name), fileio.join(target, name))
    return
  os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
  partial = f"{target}.tmp.{os.getpid()}"
  shutil.rmtree(partial, ignore_errors=True)
  shutil.copytree(source, partial)
  shutil.rmtree(target, ignore_errors=True)
  os.rename(partial, target)


# Registered under the module name the configs have always used (`runs.Seq2SeqData`).
@gin.configurable(module="jaxmoral.runs")
@dataclasses.dataclass(frozen=True, kw_only=True)
class Seq2SeqData(source.DataSpec):
  """(input, target) text pairs: a seqio Task or Mixture, or a data file.

  Attributes:
    mixture_or_task_name: A registered seqio Task or Mixture (T5X's MIXTURE_OR_TASK_NAME;
      "jaxmoral_demo*" are registered on demand, others by an import in the gin file).
    train_file: Instead of a task: a TSV/CSV/JSONL file of pairs (a bad row fails with its line).
    eval_file: Evaluation pairs for `train_file` (default: `heldout` pairs of it).
    vocabulary_path: A SentencePiece model (e.g. T5's spiece.model); None: the init
      checkpoint's, else the demo vocabulary.
    extra_ids: Sentinel ids after the pieces (T5: 100).
    pack: Pack several examples per row (T5X's `EncDecFeatureConverter(pack=True)`).
    heldout: How one pair in 10 of `train_file` is held out without `eval_file`
      (`pairs.HELDOUT_RULES`); a resumed run keeps the rule it started with (`resumed`).
    cache_dir: A folder (local or a bucket URL) of this data's rows as index caches
      (DATA_CACHE) for one TASK_FEATURE_LENGTHS and SEED, read with no seqio or TensorFlow
      import; written first when it has none (`jaxmoral cache` writes it without training).
  """
  mixture_or_task_name: Optional[str] = None
  train_file: Optional[str] = None
  eval_file: Optional[str] = None
  input_field: str = "inputs"
  target_field: str = "targets"
  vocabulary_path: Optional[str] = None
  extra_ids: int = vocab_lib.T5_EXTRA_IDS
  train_split: str = "train"
  eval_split: str = "validation"
  pack: bool = False
  heldout: str = "hash"
  cache_dir: Optional[str] = None
  FILE_FIELDS = ("train_file", "eval_file", "vocabulary_path")

  def __post_init__(self):
    if (self.mixture_or_task_name is None) == (self.train_file is None):
      raise ValueError("Seq2SeqData: give exactly one of mixture_or_task_name, train_file")
    if self.eval_file is not None and self.train_file is None:
      raise ValueError("Seq2SeqData.eval_file needs train_file")
    if self.heldout not in pairs_lib.HELDOUT_RULES:
      raise ValueError(f"Seq2SeqData.heldout must be one of {pairs_lib.HELDOUT_RULES}, got "
                       f"{self.heldout!r}")

  @property
  def _splits_file(self) -> bool:
    """Whether the held-out pairs come out of `train_file` (no `eval_file`)."""
    return self.train_file is not None and self.eval_file is None

  def resumed(self, saved: Mapping[str, Any]) -> Seq2SeqData:
    """Keeps the run's held-out rule; a seq2seq run that saved none held out by position (a
    model directory with no record of its data, e.g. a Hub checkpoint, changes nothing)."""
    if not self._splits_file or saved.get("kind") != "seq2seq":
      return self
    rule = saved.get("heldout", "position")
    if rule == self.heldout:
      return self
    logger.warning("Seq2SeqData: the resumed run holds out %r pairs of %s (it started so); "
                   "keeping that, not %r", rule, self.train_file, self.heldout)
    return dataclasses.replace(self, heldout=rule)

  def vocabulary(self, vocab_dir: str, *, fallback: Any = None) -> Any:
    if self.cache_dir is not None and self._cache_written():  # Its rows' vocabulary.
      return vocab_lib.get_vocabulary(fileio.join(self.cache_dir, CACHE_VOCABULARY),
                                      extra_ids=self.extra_ids)
    self.check_files()
    if self.vocabulary_path is not None:
      return vocab_lib.get_vocabulary(self.vocabulary_path, extra_ids=self.extra_ids)
    if fallback is not None:
      return fallback
    return vocab_lib.get_vocabulary(vocab_lib.build_demo_vocabulary(output_dir=vocab_dir),
                                    extra_ids=self.extra_ids)

  def task_name(self, vocabulary: Any) -> str:
    """Registers what is needed (demo tasks, file tasks) and returns the task/mixture name."""
    tasks = _seqio_tasks()
    self.check_files()
    if self.train_file is not None and self.eval_file is not None:
      tasks.register_text_pair_task(
          "jaxmoral_files", vocabulary=vocabulary, input_field=self.input_field,
          target_field=self.target_field,
          file={self.train_split: self.train_file, self.eval_split: self.eval_file})
      return "jaxmoral_files"
    if self.train_file is not None:
      pairs = pairs_lib.read_pairs(self.train_file, input_field=self.input_field,
                                   target_field=self.target_field)
      split = pairs_lib.split_pairs(pairs, rule=self.heldout)
      for part, what in (("train", "training"), ("validation", "held-out evaluation")):
        if not split[part]:  # Named here: the task only sees the pairs, not the file.
          raise ValueError(f"Seq2SeqData.train_file: {self.train_file} has {len(pairs)} "
                           f"pairs, none for {what} (add pairs, or give eval_file)")
      tasks.register_text_pair_task(
          "jaxmoral_files", vocabulary=vocabulary,
          examples={self.train_split: split["train"], self.eval_split: split["validation"]})
      return "jaxmoral_files"
    name = self.mixture_or_task_name
    assert name is not None  # A task name or train_file (checked in __post_init__).
    if name.startswith("jaxmoral_demo"):
      tasks.register_demo_tasks(vocabulary=vocabulary)
    try:
      import seqio  # pylint: disable=g-import-not-at-top
      seqio.get_mixture_or_task(name)
    except ValueError as error:
      raise ValueError(f"Seq2SeqData.mixture_or_task_name: {name!r} is not registered; "
                       f"import the module that registers it in your gin file") from error
    return name

  def sources(self, *, vocabulary: Any, batch_size: int, feature_lengths: Mapping[str, int],
              seed: int) -> tuple[Any, Optional[Any]]:
    if self.cache_dir is not None:
      return self._cached_sources(vocabulary=vocabulary, batch_size=batch_size,
                                  feature_lengths=feature_lengths, seed=seed)
    train = _seqio_tasks().TaskSource(self.task_name(vocabulary), self.train_split,
                                      feature_lengths, batch_size, seed=seed, pack=self.pack)
    return train, self.eval_source(vocabulary=vocabulary, batch_size=batch_size,
                                   feature_lengths=feature_lengths)

  def eval_source(self, *, vocabulary: Any, batch_size: int,
                  feature_lengths: Mapping[str, int]) -> Optional[Any]:
    """The evaluation split in order (None when the data has none)."""
    if self.cache_dir is not None:
      return self._cached_sources(vocabulary=vocabulary, batch_size=batch_size,
                                  feature_lengths=feature_lengths, seed=None)[1]
    tasks = _seqio_tasks()  # Not installed: an error, not "no evaluation data".
    try:
      return tasks.TaskSource(self.task_name(vocabulary), self.eval_split, feature_lengths,
                              batch_size, shuffle=False)
    except ValueError as error:
      logger.warning("Seq2SeqData: no evaluation data (%s)", error)
      return None

  # -- the index cache in cache_dir ---------------------------------------------------------
  def _cache_spec(self, feature_lengths: Mapping[str, int], seed: int) -> dict[str, Any]:
    """What the cached rows are of (files by name: the reading host need not have them)."""
    return {"task": self.mixture_or_task_name,
            "files": [None if f is None else os.path.basename(f)
                      for f in (self.train_file, self.eval_file)],
            "fields": [self.input_field, self.target_field],
            "splits": [self.train_split, self.eval_split], "heldout": self.heldout,
            "pack": self.pack, "extra_ids": self.extra_ids,
            "feature_lengths": {k: int(v) for k, v in sorted(feature_lengths.items())},
            "seed": seed}

  def _cache_written(self) -> bool:
    return self.cache_dir is not None and fileio.isfile(fileio.join(self.cache_dir, CACHE_SPEC))

  def write_cache(self, *, vocabulary: Any, feature_lengths: Mapping[str, int],
                  seed: int) -> dict[str, Any]:
    """Writes this data's rows into `cache_dir` through seqio: `train/` (one seeded pass, as
    `tasks.TaskSource` caches it), `eval/` (the evaluation split in order, if any), the
    vocabulary, and `spec.json` last (without it a cache is written again). Returns the spec."""
    tasks = _seqio_tasks()
    assert self.cache_dir is not None
    name = self.task_name(vocabulary)
    with tempfile.TemporaryDirectory(prefix="jaxmoral-cache-") as scratch:
      train = tasks.TaskSource(name, self.train_split, feature_lengths, 1, seed=seed,
                               pack=self.pack, cache_dir=scratch)
      folders = {"train": train.cache_directory()}
      evaluation = dataclasses.replace(self, cache_dir=None).eval_source(
          vocabulary=vocabulary, batch_size=256, feature_lengths=feature_lengths)
      if evaluation is not None:
        # The rows `eval_batches` streams, in order (a Mixture's too), their padding dropped.
        folders["eval"] = os.path.join(scratch, "eval")
        index_cache.write(folders["eval"], (
            {k: v[b["decoder_target_tokens"].any(-1)] for k, v in b.items()}
            for b in evaluation.eval_batches()), {"task": name, "split": self.eval_split})
      rows = {}
      for part, folder in folders.items():
        rows[part] = index_cache.read(folder)[1]["rows"]  # type: ignore[index]
        _copy_folder(folder, fileio.join(self.cache_dir, part))
    fileio.write_bytes(fileio.join(self.cache_dir, CACHE_VOCABULARY),
                       fileio.read_bytes(vocabulary.sentencepiece_model_file))
    spec = {**self._cache_spec(feature_lengths, seed), "rows": rows}
    fileio.write_text(fileio.join(self.cache_dir, CACHE_SPEC), json.dumps(spec, indent=1),
                      durable=True)
    return spec

  def _cached_sources(self, *, vocabulary: Any, batch_size: int,
                      feature_lengths: Mapping[str, int], seed: Optional[int]
                      ) -> tuple[Optional[pipeline.BatchSource], Optional[pipeline.BatchSource]]:
    """(train, eval) read from `cache_dir` (written first when it has no cache, by process 0
    of a multi-process job); `seed` None: the evaluation split only."""
    assert self.cache_dir is not None
    if not self._cache_written():
      if seed is None:
        raise ValueError(f"Seq2SeqData.cache_dir: {self.cache_dir} holds no data cache; write "
                         "it with `jaxmoral cache` and the run's gin flags")
      if jax.process_index() == 0:
        self.write_cache(vocabulary=vocabulary, feature_lengths=feature_lengths, seed=seed)
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jaxmoral.runs: data cache written")
    spec = fileio.read_json(fileio.join(self.cache_dir, CACHE_SPEC))
    want = self._cache_spec(feature_lengths, spec["seed"] if seed is None else seed)
    for key, value in want.items():
      if spec.get(key) != value:
        raise ValueError(f"Seq2SeqData.cache_dir: {self.cache_dir} holds rows for {key}="
                         f"{spec.get(key)!r}, this run has {value!r} (another DATA_CACHE, or "
                         "write this one anew with `jaxmoral cache`)")
    if vocab_lib.model_digest(vocabulary) != vocab_lib.model_digest(
        vocab_lib.get_vocabulary(fileio.join(self.cache_dir, CACHE_VOCABULARY))):
      raise ValueError(f"Seq2SeqData.cache_dir: {self.cache_dir} was tokenised with another "
                       "vocabulary than this run's")

    cache_dir = self.cache_dir

    def read(part: str, *, shuffle: bool) -> Optional[pipeline.BatchSource]:
      folder = fileio.join(cache_dir, part)
      if part not in spec["rows"]:
        return None
      found = index_cache.read(fileio.local_folder(folder))
      if found is None:
        raise ValueError(f"Seq2SeqData.cache_dir: {folder} is incomplete; write the cache "
                         "anew with `jaxmoral cache`")
      features, meta = found
      # Rows of other lengths (a folder from another cache) would train without a word.
      index_cache.check_feature_lengths(features, feature_lengths, where=folder)
      if int(meta["rows"]) != int(spec["rows"][part]):
        raise ValueError(f"data cache folder {folder} holds {meta['rows']} rows, its "
                         f"{CACHE_SPEC} {spec['rows'][part]}; write the cache anew with "
                         "`jaxmoral cache`")
      return pipeline.BatchSource(features=features, batch_size=batch_size,
                                  seed=spec["seed"], shuffle=shuffle,
                                  data_fingerprint=meta["sha256"][:16])

    evaluation = read("eval", shuffle=False)
    return (None if seed is None else read("train", shuffle=True)), evaluation

  def batch_shapes(self, *, batch_size: int, feature_lengths: Mapping[str, int]
                   ) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Global batch shapes and dtypes of the T5X seq2seq features (for `jaxmoral compile`)."""
    pipeline.check_lengths(feature_lengths)
    enc = (batch_size, int(feature_lengths["inputs"]))
    dec = (batch_size, int(feature_lengths["targets"]))
    names = {"encoder_input_tokens": enc, "decoder_input_tokens": dec,
             "decoder_target_tokens": dec, "decoder_loss_weights": dec}
    if self.pack:
      names.update({"encoder_segment_ids": enc, "encoder_positions": enc,
                    "decoder_segment_ids": dec, "decoder_positions": dec})
    return {k: (v, jnp.int32) for k, v in names.items()}

  def settings(self) -> dict[str, Any]:
    return {"kind": "seq2seq", **({"heldout": self.heldout} if self._splits_file else {})}
