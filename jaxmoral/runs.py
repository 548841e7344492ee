"""Gin-bound entry points of the core commands: `jaxmoral train | eval | infer | export`.

`train_run` is the one training entry point of every supervised method (T5X's `train`): gin
injects what is trained (`model`: a `jaxmoral.models.trainable.TrainableModel` such as
`Seq2SeqModel`, `diamante.DiamanteModel` or `prompt_tuning.PromptTuningModel`) and the
data it reads (`data`: a `DataSpec` such as `Seq2SeqData` or `diamante.data.DialogueData`), so
every method gets `init_checkpoint`, resume, run files and per-host data sharding from here.

`compile_run` builds the step `train_run` trains, from abstract inputs (`jaxmoral compile`).
What a run writes into MODEL_DIR, and `eval`, `infer` and `export` read: `jaxmoral.run_dirs`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import math
import numbers
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Mapping, Optional, Protocol, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from jaxmoral import aot
from jaxmoral import decoding
from jaxmoral import fileio
from jaxmoral import gin_utils
from jaxmoral import losses
from jaxmoral import model_dirs
from jaxmoral import partitioning
from jaxmoral import run_dirs
from jaxmoral import token_rows
from jaxmoral import train as train_lib
from jaxmoral import trainer as trainer_lib
from jaxmoral.data import index_cache
from jaxmoral.data import pairs as pairs_lib
from jaxmoral.data import pipeline
from jaxmoral.data import readers
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import t5
from jaxmoral.models import trainable

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
      fileio.write_bytes(fileio.join(target, name), open(os.path.join(source, name), "rb").read())
    return
  os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
  partial = f"{target}.tmp.{os.getpid()}"
  shutil.rmtree(partial, ignore_errors=True)
  shutil.copytree(source, partial)
  shutil.rmtree(target, ignore_errors=True)
  os.rename(partial, target)


class DataSpec(Protocol):
  """Where a run's batches come from (gin injects one into `train_run`)."""

  def vocabulary(self, vocab_dir: str, *, fallback: Any = None) -> Any:
    """The vocabulary: the one the data names, else `fallback` (the init checkpoint's), else
    one built into `vocab_dir`."""

  def sources(self, *, vocabulary: Any, batch_size: int, feature_lengths: Mapping[str, int],
              seed: int) -> tuple[Any, Any]:
    """(train source, eval source or None); sources have `iterate(start_step)`,
    `eval_batches()`, `shard(index, count)`, `batch_size` and `num_examples` (or None)."""

  def settings(self) -> dict[str, Any]:
    """What inference needs to know about the data (saved in settings.json["data"])."""

  def resumed(self, saved: Mapping[str, Any]) -> DataSpec:
    """This data as a resumed run reads it, given the run's saved `settings()` ({} when it
    saved none): what fixes a run's examples (its held-out split) stays the run's own."""

  def batch_shapes(self, *, batch_size: int, feature_lengths: Mapping[str, int]
                   ) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Global batch shapes and dtypes, as `sources` would batch (`jaxmoral compile`)."""


def seq2seq_batch_shapes(*, batch_size: int, feature_lengths: Mapping[str, int],
                         pack: bool = False) -> dict[str, tuple[tuple[int, ...], Any]]:
  """Global batch shapes and dtypes of the T5X seq2seq features."""
  for key in ("inputs", "targets"):
    if key not in feature_lengths:
      raise ValueError(f"feature_lengths needs {key!r}, got {dict(feature_lengths)}")
  enc = (batch_size, int(feature_lengths["inputs"]))
  dec = (batch_size, int(feature_lengths["targets"]))
  names = {"encoder_input_tokens": enc, "decoder_input_tokens": dec,
           "decoder_target_tokens": dec, "decoder_loss_weights": dec}
  if pack:
    names.update({"encoder_segment_ids": enc, "encoder_positions": enc,
                  "decoder_segment_ids": dec, "decoder_positions": dec})
  return {k: (v, jnp.int32) for k, v in names.items()}


@gin.configurable
@dataclasses.dataclass(frozen=True, kw_only=True)
class Seq2SeqData:
  """(input, target) text pairs: a seqio Task or Mixture, or a data file.

  Attributes:
    mixture_or_task_name: A registered seqio Task or Mixture (T5X's MIXTURE_OR_TASK_NAME).
      Names starting with "jaxmoral_demo" are the bundled demo tasks, registered on demand.
      Your own tasks: `import my_tasks` at the top of the gin file, as in T5X.
    train_file: Instead of a task: a TSV/CSV/JSONL file of pairs (a bad row fails with its line).
    eval_file: Evaluation pairs for `train_file` (default: one pair in 10 is held out, see
      `heldout`).
    input_field: Column / key of the inputs in the files.
    target_field: Column / key of the targets in the files.
    vocabulary_path: A SentencePiece model (e.g. T5's spiece.model); None: the init
      checkpoint's, else the demo vocabulary built from the bundled corpus.
    extra_ids: Sentinel ids after the pieces (T5: 100).
    train_split: Split used for training.
    eval_split: Split used for evaluation.
    pack: Pack several examples per row (T5X's `EncDecFeatureConverter(pack=True)`).
    heldout: Which pairs of `train_file` are held out when there is no `eval_file`
      (`pairs.HELDOUT_RULES`): "hash" (by the pair's text, whatever the file's order) or
      "position" (every 10th; runs started before "hash" existed). A resumed run keeps the
      rule it started with (`resumed`), so it goes on training on the same pairs.
    cache_dir: A folder (local or a bucket URL) holding this data's rows as index caches
      (DATA_CACHE): read from there when it has them, with no seqio or TensorFlow import (an
      accelerator host that has no TensorFlow trains and evaluates from it); written there
      first when it has none (`jaxmoral cache` writes it without training). It is for one
      TASK_FEATURE_LENGTHS and SEED: another is refused in one line.
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

  def _check_files(self) -> None:
    """The files it names exist (checked when used: `jaxmoral compile` needs no data)."""
    for name in ("train_file", "eval_file", "vocabulary_path"):
      value = getattr(self, name)
      if value is not None and not fileio.isfile(value):
        raise ValueError(f"Seq2SeqData.{name}: no such file {value!r}")

  def vocabulary(self, vocab_dir: str, *, fallback: Any = None) -> Any:
    if self.cache_dir is not None and self._cache_written():  # Its rows' vocabulary.
      return vocab_lib.get_vocabulary(fileio.join(self.cache_dir, CACHE_VOCABULARY),
                                      extra_ids=self.extra_ids)
    self._check_files()
    if self.vocabulary_path is not None:
      return vocab_lib.get_vocabulary(self.vocabulary_path, extra_ids=self.extra_ids)
    if fallback is not None:
      return fallback
    return vocab_lib.get_vocabulary(vocab_lib.build_demo_vocabulary(output_dir=vocab_dir),
                                    extra_ids=self.extra_ids)

  def task_name(self, vocabulary: Any) -> str:
    """Registers what is needed (demo tasks, file tasks) and returns the task/mixture name."""
    tasks = _seqio_tasks()
    self._check_files()
    if self.train_file is not None:
      files = {self.train_split: self.train_file}
      if self.eval_file is not None:
        files[self.eval_split] = self.eval_file
        tasks.register_text_pair_task("jaxmoral_files", vocabulary=vocabulary, file=files,
                                      input_field=self.input_field,
                                      target_field=self.target_field)
      else:
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
    tasks = _seqio_tasks()
    name = self.task_name(vocabulary)
    train = tasks.TaskSource(name, self.train_split, feature_lengths, batch_size, seed=seed,
                             pack=self.pack)
    return train, self.eval_source(vocabulary=vocabulary, batch_size=batch_size,
                                   feature_lengths=feature_lengths)

  def eval_source(self, *, vocabulary: Any, batch_size: int,
                  feature_lengths: Mapping[str, int]) -> Optional[Any]:
    """The evaluation split in order (None when the data has none)."""
    if self.cache_dir is not None:
      return self._cached_sources(vocabulary=vocabulary, batch_size=batch_size,
                                  feature_lengths=feature_lengths, seed=None)[1]
    tasks = _seqio_tasks()
    try:
      return tasks.TaskSource(self.task_name(vocabulary), self.eval_split, feature_lengths,
                              batch_size, shuffle=False)
    except ValueError as error:
      logger.warning("Seq2SeqData: no evaluation data (%s)", error)
      return None

  # -- the index cache in cache_dir ---------------------------------------------------------
  def _cache_spec(self, feature_lengths: Mapping[str, int], seed: int) -> dict[str, Any]:
    """What the cached rows are of. Files by name only: the host that reads the cache need
    not have them."""
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
    """Writes this data's rows into `cache_dir` through seqio (TensorFlow): `train/` (one
    seeded pass, as `tasks.TaskSource` caches it), `eval/` (the evaluation split in order,
    when there is one), the vocabulary, and `spec.json` last (a cache without it is
    incomplete and written again). Returns the spec."""
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
    spec = json.loads(fileio.read_text(fileio.join(self.cache_dir, CACHE_SPEC)))
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
    """Global batch shapes (for `jaxmoral compile`)."""
    return seq2seq_batch_shapes(batch_size=batch_size, feature_lengths=feature_lengths,
                                pack=self.pack)

  def settings(self) -> dict[str, Any]:
    return {"kind": "seq2seq", **({"heldout": self.heldout} if self._splits_file else {})}


# The T5Config fields that decide the parameters' shapes: a resume with another value cannot
# restore the checkpoint (the others, dtype, remat, attention kernels, may change).
_SHAPE_FIELDS = ("vocab_size", "d_model", "d_kv", "d_ff", "num_heads", "num_encoder_layers",
                 "num_decoder_layers", "relative_attention_num_buckets", "feed_forward_proj",
                 "tie_word_embeddings")


# MODEL_DIR/data_position/<step>/process_<i>-of-<n>/: a streamed split's tf.data position.
DATA_POSITION_DIR = "data_position"


def _keeping_position(source: Any, model_dir: str, every: int) -> Any:
  """A streamed seqio split keeps its position with the run, at each checkpoint step: a
  resume restores it instead of replaying the batches before its step."""
  if dataclasses.is_dataclass(source) and not isinstance(source, type) and any(
      f.name == "position_dir" for f in dataclasses.fields(source)):
    return dataclasses.replace(source, position_dir=fileio.join(model_dir, DATA_POSITION_DIR),
                               position_every=every)
  return source


def _check_same_model(model_dir: str, config: Any) -> None:
  """Refuses a resume whose model differs from the run's (`model_config.json`) in a field
  that shapes the parameters, naming it, before Orbax meets the mismatch."""
  path = fileio.join(model_dir, run_dirs.MODEL_CONFIG_FILE)
  if config is None or not fileio.isfile(path):
    return
  saved = json.loads(fileio.read_text(path))
  now = config.to_dict()
  differ = [f"{name}={saved[name]!r} there, {now[name]!r} here" for name in _SHAPE_FIELDS
            if name in saved and name in now and saved[name] != now[name]]
  if differ:
    raise ValueError(f"train: {model_dir} holds a run of another model ({path}: "
                     f"{'; '.join(differ)}); resume with the run's config.gin, or give a new "
                     "MODEL_DIR")


def _check_vocab_fits(config: Any, vocabulary: Any) -> None:
  if vocabulary.vocab_size > config.vocab_size:
    raise ValueError(f"vocabulary has {vocabulary.vocab_size} ids (with extra ids) but "
                     f"T5Config.vocab_size is {config.vocab_size}")


def make_trainer(*, model: trainable.TrainableModel, optimizer: optax.GradientTransformation,
                 partitioner: partitioning.PjitPartitioner,
                 num_microbatches: int = 1) -> trainer_lib.Trainer:
  """The `Trainer` of a run: the model's init, loss and trainable filter on the mesh."""
  return trainer_lib.Trainer(
      init_params_fn=model.init_params, loss_fn=model.loss_fn(), optimizer=optimizer,
      partitioner=partitioner, trainable_mask=model.trainable_patterns,
      num_microbatches=num_microbatches,
      # T5X logs the learning rate; an optimizer from `make_optimizer` knows its schedule.
      learning_rate_fn=getattr(optimizer, "learning_rate", None))


def _run_vocabulary(model_dir: str, data: DataSpec, init_info: Optional[model_dirs.ModelInfo]
                    ) -> Any:
  """The run's vocabulary: a resumed run keeps its own; else the data's (falling back to the
  init checkpoint's)."""
  own = model_dirs.load_vocabulary(model_dir)
  if own is not None:
    return own
  fallback = init_info.vocabulary if init_info is not None else None
  return data.vocabulary(vocabulary_build_dir(model_dir), fallback=fallback)


def vocabulary_build_dir(model_dir: str) -> str:
  """Where a run's vocabulary is built: MODEL_DIR/vocab, or for a bucket run the process's
  private local folder for that run (SentencePiece writes local files; `save_run_files` copies
  the model into the bucket, and a resumed run reads it there). One folder shared by all
  bucket runs would hand one run a vocabulary trained on another's data."""
  if fileio.is_url(model_dir):
    return fileio.local_folder_for(model_dir, "_vocab")
  return os.path.join(model_dir, run_dirs.VOCAB_DIR)


# train_run's counts: (parameter, the gin macro gin/runs/*.gin binds it to, least value).
_RUN_COUNTS = (("train_steps", "TRAIN_STEPS", 1), ("batch_size", "BATCH_SIZE", 1),
               ("checkpoint_every", "CHECKPOINT_EVERY", 1), ("eval_every", "EVAL_EVERY", 0),
               ("eval_steps", "EVAL_STEPS", 0), ("num_microbatches", None, 1),
               ("keep_checkpoints", None, 1), ("log_every", None, 1))


def _is_int(value: object) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_run_arguments(**values: Any) -> None:
  """Raises a ValueError naming the parameter and its macro for a count out of type or range.

  A mistyped flag (--gin.TRAIN_STEPS=abc reaches here as the string 'abc') would otherwise
  fail deep inside the loop, or after the run files and vocabulary were written.
  """
  for name, macro, least in _RUN_COUNTS:
    if name not in values or (name == "eval_steps" and values[name] is None):
      continue
    value = values[name]
    if not _is_int(value) or value < least:
      kind = "a positive integer" if least else "an integer >= 0"
      where = f" ({macro})" if macro else ""
      raise ValueError(f"train_run: {name}{where} must be {kind}, got {value!r}")
  lengths = values["feature_lengths"]
  if not isinstance(lengths, Mapping) or not all(_is_int(v) and v > 0
                                                 for v in lengths.values()):
    raise ValueError(f"train_run: feature_lengths (TASK_FEATURE_LENGTHS) must map feature "
                     f"names to positive integers, got {lengths!r}")


@gin.configurable
def train_run(*, model_dir: str, model: trainable.TrainableModel, data: DataSpec,
              train_steps: int, batch_size: int, feature_lengths: Mapping[str, int],
              optimizer: optax.GradientTransformation,
              partitioner: Optional[partitioning.PjitPartitioner] = None,
              num_microbatches: int = 1, eval_every: int = 0, eval_steps: Optional[int] = None,
              checkpoint_every: int = 1000, keep_checkpoints: int = 3, log_every: int = 50,
              seed: int = 0, init_checkpoint: Optional[str] = None,
              hooks: Sequence[train_lib.TrainHook] = ()) -> dict[str, float]:
  """Trains `model` on `data` (T5X's `train`): resumes MODEL_DIR if it has checkpoints.

  Args:
    model_dir: Run directory (MODEL_DIR).
    model: What is trained (MODEL): module, loss, trainable filter.
    data: Where batches come from (a `DataSpec`, e.g. `Seq2SeqData`).
    train_steps: Total steps of the run (TRAIN_STEPS).
    batch_size: Global batch size (BATCH_SIZE).
    feature_lengths: `{"inputs": N, "targets": M}` (TASK_FEATURE_LENGTHS).
    optimizer: From a gin/optimizers fragment (OPTIMIZER).
    partitioner: Mesh and rules (PARTITIONER); default: data parallel over all devices.
    num_microbatches: Gradient accumulation steps per global batch.
    eval_every: Evaluate every N steps (0: only at the end).
    eval_steps: Evaluation batches (None: the whole eval split; 0: no evaluation at all,
      for runs evaluated separately with `eval`).
    checkpoint_every: Save every N steps (and at the end).
    keep_checkpoints: Checkpoints kept.
    log_every: Progress line / TensorBoard every N steps.
    seed: Parameter init, shuffling and dropout seed.
    init_checkpoint: Fine-tune from this model directory or Hub id (any format of
      `jaxmoral.model_dirs`: Hugging Face, T5X, export, run, one step of a run); its
      parameters are created directly in the partitioner's shardings. Ignored on resume.
    hooks: Extra `train.TrainHook`s (the model's own come first).

  Returns:
    Final metrics.

  Raises:
    ValueError: A count is not an integer in range (naming its gin macro, e.g. TRAIN_STEPS),
      or a resume that does not continue the run (another model shape, data, SEED,
      BATCH_SIZE, or TRAIN_STEPS behind it), before anything is written.
    OSError: MODEL_DIR cannot be written (before anything is done).
  """
  _check_run_arguments(train_steps=train_steps, batch_size=batch_size,
                       feature_lengths=feature_lengths, num_microbatches=num_microbatches,
                       eval_every=eval_every, eval_steps=eval_steps,
                       checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
                       log_every=log_every)
  partitioner = partitioner or partitioning.PjitPartitioner()
  fileio.check_writable(model_dir, directory=True)
  if fileio.is_url(model_dir):
    run_dirs.make_run_dir(model_dir)  # Bucket, credentials, endpoint: checked first.
    created = not fileio.exists(model_dir)  # (It leaves no object behind.)
  else:
    created = not fileio.exists(model_dir)
    run_dirs.make_run_dir(model_dir)
  training = False
  try:
    # Held from before the run files are written: a second run into this folder is refused
    # before it changes anything (`train.train` takes the same lock again, re-entrantly).
    with run_dirs.RunDirLock(model_dir):
      resuming = bool(run_dirs.saved_steps(model_dir))
      init_info = None
      if init_checkpoint and not resuming:  # A resumed run starts from its own checkpoint.
        init_info = model_dirs.inspect(init_checkpoint)
      if resuming:  # Its files are checked and read only; written once the resume is accepted.
        run_dirs.verify_run_files(model_dir)
        _check_same_model(model_dir, model.config)
        data = data.resumed(run_dirs.read_settings(model_dir).get("data", {}))
      # Process 0 builds a vocabulary where one is built (a fresh run's demo vocabulary); the
      # others then find it in the run directory.
      if jax.process_index() == 0:
        vocabulary = _run_vocabulary(model_dir, data, init_info)
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jaxmoral.runs.train_run: vocabulary ready")
        if jax.process_index() != 0:
          vocabulary = _run_vocabulary(model_dir, data, init_info)
      _check_vocab_fits(model.config, vocabulary)

      def write_run_files(resumed_step: Optional[int]) -> None:
        """After every check of `train.train` passed: a refused resume changes nothing."""
        del resumed_step
        if jax.process_index() == 0:
          if gin.config_str():
            gin_utils.write_operative_config(model_dir)
          run_dirs.save_run_files(model_dir, config=model.config, vocabulary=vocabulary,
                                  settings={"model": model.settings(),
                                            "data": data.settings(),
                                            "feature_lengths": dict(feature_lengths)})
        if jax.process_count() > 1:
          multihost_utils.sync_global_devices("jaxmoral.runs.train_run: run files written")

      train_source, eval_source = data.sources(vocabulary=vocabulary, batch_size=batch_size,
                                               feature_lengths=feature_lengths, seed=seed)
      if eval_steps == 0:
        eval_source = None
      if jax.process_count() > 1:
        train_source = train_source.shard(jax.process_index(), jax.process_count())
        if eval_source is not None:
          eval_source = eval_source.shard(jax.process_index(), jax.process_count())
      train_source = _keeping_position(train_source, model_dir, checkpoint_every)
      trainer = make_trainer(model=model, optimizer=optimizer, partitioner=partitioner,
                             num_microbatches=num_microbatches)

      def init_params() -> Any:
        assert init_checkpoint is not None  # Called only with init_info.
        loaded = model_dirs.load(init_checkpoint, partitioner=partitioner)
        return model.params_from_checkpoint(loaded, jax.random.fold_in(jax.random.PRNGKey(seed), 1))

      examples = train_source.num_examples
      # A packed source's rows each hold several examples.
      features = getattr(train_source, "features", None)
      packed = isinstance(features, Mapping) and "encoder_segment_ids" in features
      logger.info("train_run: %s on %s (%s train %s), batch %d, %d steps -> %s%s",
                  trainable.describe(model), type(data).__name__,
                  "?" if examples is None else examples,
                  "packed rows" if packed else "examples", batch_size, train_steps, model_dir,
                  f", from {init_info.describe()}" if init_info else "")
      training = True
      return train_lib.train(model_dir=model_dir, trainer=trainer, train_source=train_source,
                             train_steps=train_steps, eval_source=eval_source,
                             eval_every=eval_every, eval_steps=eval_steps,
                             checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
                             log_every=log_every, seed=seed,
                             init_params=init_params if init_info is not None else None,
                             hooks=[*model.hooks(model_dir), *hooks],
                             on_checked=write_run_files)
  except BaseException:
    # A run that failed before its first step (bad data, a vocabulary that does not fit, an
    # unreadable init_checkpoint) leaves no folder it created behind.
    if created and not training and jax.process_index() == 0:
      with contextlib.suppress(OSError):
        fileio.rmtree(model_dir)
    raise


def compile_run(*, model: trainable.TrainableModel, data: DataSpec,
                optimizer: optax.GradientTransformation, batch_size: int,
                feature_lengths: Mapping[str, int],
                partitioner: Optional[partitioning.PjitPartitioner] = None,
                num_microbatches: int = 1) -> aot.CompileProgram:
  """The step `train_run` trains (arguments as its), as `jaxmoral compile` lowers it for a
  topology: the run's own `make_trainer` and jitted step, from the data's batch shapes. Nothing
  is read or allocated (neither MODEL_DIR nor the data files); a count out of range is a
  ValueError naming its gin macro."""
  _check_run_arguments(batch_size=batch_size, feature_lengths=feature_lengths,
                       num_microbatches=num_microbatches)
  partitioner = partitioner or partitioning.PjitPartitioner()
  trainer = make_trainer(model=model, optimizer=optimizer, partitioner=partitioner,
                         num_microbatches=num_microbatches)
  shapes = data.batch_shapes(batch_size=batch_size, feature_lengths=feature_lengths)
  args = trainer.train_step_args(shapes)
  total, trainable_count = trainer.initializer.num_params()
  encoder_tokens = math.prod(shapes["encoder_input_tokens"][0])
  encoder_tokens += batch_size * getattr(getattr(model, "prompt", None), "length", 0)
  decoder_tokens = math.prod(shapes["decoder_target_tokens"][0])
  config = model.config
  shown = ", ".join(f"{k.split('_')[0]} {'x'.join(map(str, v[0][1:]))}"
                    for k, v in shapes.items() if k in ("encoder_input_tokens",
                                                        "decoder_target_tokens"))
  # A step that trains every weight is about 3 forward passes; frozen weights skip their
  # weight gradients (about 2).
  passes = 3.0 if trainable_count == total else 2.0
  return aot.CompileProgram(
      stages=(aot.Stage("step", trainer.train_step_function, args, persistent=args[0]),),
      partitioner=partitioner,
      description=(f"{type(model).__name__} T5 d_model={config.d_model} layers="
                   f"{config.num_encoder_layers}+{config.num_decoder_layers} "
                   f"({total / 1e6:.1f}M params, dtype {config.dtype}, remat {config.remat}), "
                   f"batch {batch_size} x ({shown})"),
      num_params=total, num_trainable_params=trainable_count,
      tokens_per_step=encoder_tokens + decoder_tokens,
      model_flops_per_step=passes * aot.t5_forward_flops(
          config, encoder_tokens=encoder_tokens, decoder_tokens=decoder_tokens))


def _compile_train_run() -> aot.CompileProgram:
  """`jaxmoral compile`'s default target, "train_run": `compile_run` given what the gin config
  binds `train_run` (MODEL, DATA, OPTIMIZER, BATCH_SIZE, ...), the step that run trains."""
  wanted = inspect.signature(compile_run).parameters
  bound = gin.get_bindings(train_run, resolve_references=False)
  missing = [name for name, p in wanted.items() if p.default is p.empty and name not in bound]
  if missing:
    raise ValueError(f"compile: the gin config binds no runs.train_run.{missing[0]} (the "
                     f"target \"train_run\" compiles the step that run trains)")
  # Copying resolves the references (gin.get_bindings' own way), those compile_run takes only.
  return compile_run(**copy.deepcopy({k: v for k, v in bound.items() if k in wanted}))


aot.register_compile_target("train_run", _compile_train_run)


@gin.configurable
def cache_run(*, data: Seq2SeqData, feature_lengths: Mapping[str, int], seed: int = 0,
              init_checkpoint: Optional[str] = None) -> dict[str, Any]:
  """Writes a config's data into its DATA_CACHE folder, without training (`jaxmoral cache`).

  Run it where seqio and TensorFlow are installed, with the flags the training run will
  have (TASK_FEATURE_LENGTHS, SEED, the data): a run given the same DATA_CACHE then reads
  its batches from there and imports neither (an accelerator host without TensorFlow).

  Args:
    data: The run's data; its `cache_dir` (DATA_CACHE) is where the rows go.
    feature_lengths: TASK_FEATURE_LENGTHS.
    seed: SEED (the one seeded pass of the training split depends on it).
    init_checkpoint: INIT_CHECKPOINT: its vocabulary is the data's when the data names none.

  Returns:
    The cache's spec (what it holds, and its rows per part).

  Raises:
    ValueError: No DATA_CACHE was given.
  """
  if data.cache_dir is None:
    raise ValueError("cache: give the folder to write as --gin.DATA_CACHE=\"'/path'\" "
                     "(runs.Seq2SeqData.cache_dir)")
  fileio.check_writable(data.cache_dir, directory=True)
  fallback = model_dirs.inspect(init_checkpoint).vocabulary if init_checkpoint else None
  with tempfile.TemporaryDirectory(prefix="jaxmoral-vocab-") as build_dir:
    vocabulary = dataclasses.replace(data, cache_dir=None).vocabulary(build_dir,
                                                                      fallback=fallback)
    spec = data.write_cache(vocabulary=vocabulary, feature_lengths=feature_lengths, seed=seed)
  print(f"cache: {spec['rows']} rows written to {data.cache_dir}; train from it with "
        f"--gin.DATA_CACHE=\"'{data.cache_dir}'\" (no TensorFlow needed)", flush=True)
  return spec


@gin.configurable
def eval_run(*, model_dir: str, data: Seq2SeqData, feature_lengths: Mapping[str, int],
             batch_size: int = 16, step: Optional[int] = None,
             decode_examples: int = 8, max_decode_length: Optional[int] = None,
             partitioner: Optional[partitioning.PjitPartitioner] = None) -> dict[str, Any]:
  """Evaluates a run's checkpoint: loss/accuracy on the eval split and greedy decodes.

  The loss is the run's own (its label smoothing, z-loss and loss normalizing factor, from
  settings.json), so it equals what training's evaluation reported for the same step and data.

  A run trained on a pairs file is evaluated on the pairs it held out (`Seq2SeqData.resumed`).
  The parameters are read into `partitioner`'s shardings and every batch is sharded over its
  "data" axis, as in training (gin binds the run's PARTITIONER; None: one device).

  Writes MODEL_DIR/eval_<step>.json and prints the metrics and a few decoded examples.

  Raises:
    OSError: The report cannot be written (checked before anything is loaded or computed).
  """
  out_path = fileio.path(model_dir) / f"eval_{step if step is not None else 'latest'}.json"
  fileio.require_reachable(model_dir, "MODEL_DIR")
  if fileio.isdir(model_dir):  # A missing model dir: model_dirs.load says so.
    fileio.check_writable(out_path)
  loaded = model_dirs.load_on_mesh(model_dir, partitioner=partitioner, step=step)
  partitioner = loaded.partitioner
  model, params, vocabulary = t5.T5(loaded.config), loaded.lm_params, loaded.vocabulary
  data = data.resumed(loaded.settings.get("data", {}))  # The pairs the run held out.
  source = data.eval_source(vocabulary=vocabulary, batch_size=batch_size,
                            feature_lengths=feature_lengths)
  if source is None:
    raise ValueError(f"eval: the data has no evaluation split {data.eval_split!r}")
  # The loss the run trained and evaluated (its settings.json): the same loss and z_loss as
  # training's own evaluation of this step. A model directory that is not a seq2seq run
  # (an export, a Hugging Face folder) has none: plain token NLL, no z-loss.
  saved = loaded.settings.get("model", {})
  loss_fn = losses.seq2seq_loss_fn(
      model, label_smoothing=saved.get("label_smoothing", 0.0), z_loss=saved.get("z_loss", 0.0),
      loss_normalizing_factor=saved.get("loss_normalizing_factor"))
  eval_step = model_dirs.jit_with_params(lambda p, batch: loss_fn(p, batch, None)[1],
                                         loaded.config, partitioner, replicated=(False,))
  results = [jax.device_get(eval_step(params, partitioner.shard_inputs(batch)))
             for batch in source.eval_batches()]
  metrics = trainer_lib.average_metrics(results)
  first = next(source.eval_batches(), None)
  samples = []
  if first is not None and decode_examples:
    inputs = first["encoder_input_tokens"][:decode_examples]
    sampler = decoding.make_sampler(
        model, max_decode_length=max_decode_length or feature_lengths["targets"], greedy=True,
        eos_id=loaded.config.eos_token_id, partitioner=partitioner)
    out = sampler(params, partitioner.shard_inputs(inputs), rng=jax.random.PRNGKey(0),
                  decode_weights=model_dirs.decode_weights(model, params, partitioner))
    eos = loaded.config.eos_token_id
    for i in range(len(inputs)):
      samples.append({
          "input": vocabulary.decode(token_rows.text_ids(inputs[i], eos)),
          "target": vocabulary.decode(token_rows.text_ids(first["decoder_target_tokens"][i],
                                                          eos)),
          "prediction": vocabulary.decode(token_rows.text_ids(out.tokens[i, 0], eos))})
  report = {"metrics": metrics, "samples": samples}
  out_path.write_text(json.dumps(report, indent=2))
  print(json.dumps(metrics, indent=2))
  for s in samples:
    print(f"  input: {s['input']}\n  target: {s['target']}\n  prediction: {s['prediction']}\n")
  print(f"wrote {out_path}")
  return report


def _read_infer_inputs(input_file: str, input_field: Optional[str]) -> list[str]:
  """The inputs of `infer_run`: one per line of a text file (a blank line gives ""), or one
  per object of a JSONL file."""
  if input_file.endswith(".jsonl"):
    field = input_field or "input"
    return [r[field] for r in readers.read_jsonl(input_file, required=[field], text=[field])]
  rows = readers.read_lines(input_file)
  # read_lines keeps the non-blank lines with their numbers; the blank ones are put back so
  # that output line N answers input line N.
  with fileio.open(input_file, "rb") as f:
    texts = [""] * sum(1 for _ in f)
  for row, line in zip(rows, rows.lines, strict=False):
    texts[line - 1] = row["text"]
  return texts


@gin.configurable
def infer_run(*, model_dir: str, input_file: Optional[str], output_file: Optional[str],
              input_field: Optional[str] = None, input_length: int = 128,
              batch_size: int = 16,
              sample_config: Optional[decoding.SampleConfig] = None,
              beam_config: Optional[decoding.BeamSearchConfig] = None,
              step: Optional[int] = None, seed: int = 0,
              partitioner: Optional[partitioning.PjitPartitioner] = None) -> str:
  """Decodes every input of a file with a run's checkpoint; writes JSONL predictions.

  Args:
    model_dir: Run directory.
    input_file: Plain text (one input a line) or JSONL (`input_field` names the key); the
      CLI's INFER_INPUT.
    output_file: JSONL of {"input", "predictions": [...], "scores": [...]}, one record per
      input, in order; INFER_OUTPUT. A blank line of a text input gives a record with an
      empty input and no predictions (nothing is decoded for it), so that output line N
      answers input line N.
    input_field: JSONL key of the input text.
    input_length: Encoder length: longer inputs are truncated to it (EOS kept); stderr says
      how many were.
    batch_size: Rows per decoding call (the last batch is padded; one compile).
    sample_config: Sampling settings (default greedy, 64 tokens).
    beam_config: Use beam search instead of sampling.
    step: Checkpoint step (default latest).
    seed: Sampling seed.
    partitioner: The mesh the parameters are read onto and decoded on, batches sharded over
      its "data" axis (gin binds the run's PARTITIONER; None: one device).

  Returns:
    The output path.

  Raises:
    OSError: `output_file` cannot be written (checked before the model is loaded).
  """
  for value, macro in ((input_file, "INFER_INPUT"), (output_file, "INFER_OUTPUT")):
    if not value:
      raise ValueError(f"infer_run: no {macro.lower().replace('infer_', '')} file: give "
                       f"--gin.{macro}=PATH (input: plain text, one input a line, or JSONL; "
                       f"output: JSONL)")
  assert input_file is not None and output_file is not None  # Checked just above.
  if fileio.is_within(output_file, input_file):
    raise ValueError(f"infer_run: INFER_OUTPUT {output_file} is the INFER_INPUT file; writing "
                     "it would replace the inputs: give another output file")
  texts = _read_infer_inputs(input_file, input_field)
  fileio.check_writable(output_file)
  loaded = model_dirs.load_on_mesh(model_dir, partitioner=partitioner, step=step)
  partitioner = loaded.partitioner
  model, vocabulary = t5.T5(loaded.config), loaded.vocabulary
  params = loaded.lm_params
  weights = model_dirs.decode_weights(model, params, partitioner)
  sample_config = sample_config or decoding.SampleConfig(max_decode_length=64, greedy=True)
  if beam_config is not None:
    beam_search = decoding.make_beam_search(model, **dataclasses.asdict(beam_config),
                                            partitioner=partitioner)
  else:
    sampler = decoding.make_sampler(model, **dataclasses.asdict(sample_config),
                                    partitioner=partitioner)
  # (line index, token ids) of the inputs to decode; blank lines have none.
  todo = [(i, list(vocabulary.encode(text))) for i, text in enumerate(texts) if text.strip()]
  long = [len(ids) + 1 for _, ids in todo if len(ids) + 1 > input_length]  # + 1: EOS.
  if long:
    # Said before decoding starts: a long run can be stopped and rerun with more room.
    print(f"infer_run: {len(long)} of {len(todo)} inputs are longer than input_length="
          f"{input_length} tokens (the longest: {max(long)}, EOS included) and are truncated "
          f"to {input_length}; set --gin.runs.infer_run.input_length=N to keep more",
          file=sys.stderr)
  rng = jax.random.PRNGKey(seed)
  start = time.time()

  def blank_record(text: str) -> str:
    return json.dumps({"input": text, "predictions": [], "scores": []}) + "\n"

  with fileio.open(output_file, "w", encoding="utf-8") as out:
    written = 0  # Records written: the next input line to answer.
    for begin in range(0, len(todo), batch_size):
      chunk = todo[begin:begin + batch_size]
      tokens = np.zeros((batch_size, input_length), np.int32)
      for i, (_, ids) in enumerate(chunk):
        ids = ids[:input_length - 1] + [1]
        tokens[i, :len(ids)] = ids
      tokens = partitioner.shard_inputs(tokens)
      if beam_config is not None:
        seqs, scores = beam_search(params, tokens, decode_weights=weights)
        seqs, scores = np.asarray(seqs), np.asarray(scores)
      else:
        rng, key = jax.random.split(rng)
        result = sampler(params, tokens, rng=key, decode_weights=weights)
        seqs = np.asarray(result.tokens)
        scores = np.asarray((result.logprobs * result.mask).sum(-1))
      for i, (index, _) in enumerate(chunk):
        for blank in range(written, index):
          out.write(blank_record(texts[blank]))
        out.write(json.dumps({
            "input": texts[index],
            "predictions": [vocabulary.decode(token_rows.text_ids(s, loaded.config.eos_token_id))
                            for s in seqs[i]],
            "scores": [float(x) for x in scores[i]]}) + "\n")
        written = index + 1
      logger.info("infer_run: %d/%d inputs (%.1f/s)", begin + len(chunk), len(todo),
                  (begin + len(chunk)) / max(time.time() - start, 1e-9))
    for blank in range(written, len(texts)):
      out.write(blank_record(texts[blank]))
  blanks = len(texts) - len(todo)
  print(f"wrote {len(texts)} predictions to {output_file}"
        + (f" ({blanks} blank input lines have none)" if blanks else ""))
  return output_file


def export_run(*, model_dir: str, output_dir: str, step: Optional[int] = None,
               dtype: Optional[str] = None, output_format: str = "jaxmoral",
               overwrite: bool = False,
               partitioner: Optional[partitioning.PjitPartitioner] = None) -> str:
  """`jaxmoral export`: see `model_dirs.export_model` (its output checked writable first)."""
  model_dirs.refuse_output_inside(model_dir, output_dir)
  fileio.require_reachable(model_dir, "--model_dir")
  fileio.require_reachable(output_dir, "--output")
  fileio.check_writable(output_dir, directory=True)
  return model_dirs.export_model(model_dir, output_dir, step=step, dtype=dtype,
                                 output_format=output_format, overwrite=overwrite,
                                 partitioner=partitioner)
