"""T5's span-corruption pretraining objective as seqio preprocessors, and a Task that streams text.

The objective (Raffel et al. 2020, section 3.1.4): 15 % of a text's tokens, in spans of 3 on
average, are dropped from the inputs, each span replaced by one sentinel id (the vocabulary's
extra ids from the top, `<extra_id_0>` first); the targets are the dropped spans, each after
its sentinel (sentinels written <X>, <Y>)::

  original  Thank you for inviting me to your party last week .
  inputs    Thank you <X> me to your party <Y> week .
  targets   <X> for inviting <Y> last

A Task of `register_span_corruption_task` runs T5X's C4 span-corruption pipeline (raw text ->
tokenize -> concatenate -> chunk to fit `sequence_length["inputs"]` -> corrupt -> append EOS),
its files streamed; packing is left to `seqio.EncDecFeatureConverter(pack=True)`.
"""

from __future__ import annotations

import csv
import functools
import json
import os
import zlib
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

# isort: off
from jaxmoral.data import _tensorflow  # noqa: F401  (first: how TensorFlow starts)
import seqio
import tensorflow as tf
# isort: on

import gin

from jaxmoral import fileio
from jaxmoral.data import readers
from jaxmoral.data import vocab as vocab_lib

# A row of a .jsonl / .tsv / .csv file -> its text(s); None or "" skips the row.
TextFn = Callable[[Mapping[str, Any]], Optional[str | Sequence[str]]]
TEXT_SUFFIXES = (".txt", ".jsonl", ".tsv", ".csv")
DEFAULT_CONCAT_BATCH_SIZE = 128  # T5's reduce_concat_tokens default.


def _check_objective(noise_density: float, mean_noise_span_length: float) -> None:
  if not 0.0 < noise_density < 1.0:
    raise ValueError(f"noise_density must be in (0, 1), got {noise_density}")
  if mean_noise_span_length < 1.0:
    raise ValueError(f"mean_noise_span_length must be >= 1, got {mean_noise_span_length}")


def noise_counts(length: int, noise_density: float = 0.15,
                 mean_noise_span_length: float = 3.0) -> tuple[int, int]:
  """(noise tokens, noise spans) of a `length`-token sequence ((0, 0) below 2 tokens).

  Spans are at most the noise and the non-noise token counts (every span needs a token).
  Rounding is half to even in float64, exactly as `noise_span_mask` computes it in TensorFlow.
  """
  _check_objective(noise_density, mean_noise_span_length)
  if length < 2:
    return 0, 0
  num_noise = min(max(round(length * noise_density), 1), length - 1)
  num_spans = max(1, round(num_noise / mean_noise_span_length))
  return num_noise, min(num_spans, num_noise, length - num_noise)


def corrupted_lengths(tokens_length: int, noise_density: float = 0.15,
                      mean_noise_span_length: float = 3.0) -> tuple[int, int]:
  """(inputs, targets) lengths, EOS included, after corrupting `tokens_length` tokens."""
  num_noise, num_spans = noise_counts(tokens_length, noise_density, mean_noise_span_length)
  # Inputs: non-noise tokens + one sentinel per span; targets: noise + one sentinel per span.
  return tokens_length - num_noise + num_spans + 1, num_noise + num_spans + 1


def pre_corruption_length(inputs_length: int, noise_density: float = 0.15,
                          mean_noise_span_length: float = 3.0) -> int:
  """The most tokens whose corrupted inputs, with EOS, fit in `inputs_length`.

  T5's chunk length: 512 -> 568 (85 noise tokens in 28 spans: inputs 483 + 28 + EOS = 512,
  targets 85 + 28 + EOS = 114).
  """
  if inputs_length < 2:  # No room for a token and EOS.
    raise ValueError(f"inputs_length must be >= 2, got {inputs_length}")

  def fits(n: int) -> bool:
    return corrupted_lengths(n, noise_density, mean_noise_span_length)[0] <= inputs_length

  # Spans never outnumber noise tokens, so corruption never lengthens a sequence and
  # inputs_length - 1 tokens (+ EOS) always fit; the inputs length grows by 0 or 1 per token.
  tokens_length = inputs_length - 1
  while fits(tokens_length + 1):
    tokens_length += 1
  return tokens_length


def _noise_counts_tf(length: tf.Tensor, noise_density: float,
                     mean_noise_span_length: float) -> tuple[tf.Tensor, tf.Tensor]:
  """`noise_counts` for a scalar int32 tensor (float64 so rounding matches Python's)."""
  num_noise = tf.cast(tf.round(tf.cast(length, tf.float64) * noise_density), tf.int32)
  num_noise = tf.minimum(tf.maximum(num_noise, 1), length - 1)
  num_spans = tf.cast(tf.round(tf.cast(num_noise, tf.float64) / mean_noise_span_length),
                      tf.int32)
  num_spans = tf.minimum(tf.maximum(num_spans, 1), tf.minimum(num_noise, length - num_noise))
  short = length < 2
  return tf.where(short, 0, num_noise), tf.where(short, 0, num_spans)


def _random_segmentation(num_items: tf.Tensor, num_segments: tf.Tensor,
                         seed: tf.Tensor) -> tf.Tensor:
  """Lengths of a uniformly random split of `num_items` into `num_segments` positive parts:
  the cuts are a uniform random subset of the `num_items - 1` gaps (random keys, lowest first),
  so every composition is equally likely."""
  keys = tf.random.stateless_uniform([tf.maximum(num_items - 1, 0)], seed=seed)
  cuts = tf.sort(tf.argsort(keys)[:tf.maximum(num_segments - 1, 0)]) + 1
  bounds = tf.concat([[0], tf.cast(cuts, tf.int32), [num_items]], axis=0)
  # [:num_segments] empties the result for 0 segments (bounds is then [0, 0]).
  return (bounds[1:] - bounds[:-1])[:num_segments]


def noise_span_mask(length: int | tf.Tensor, noise_density: float = 0.15,
                    mean_noise_span_length: float = 3.0, *,
                    seed: Sequence[int] | tf.Tensor) -> tf.Tensor:
  """T5's noise mask: a [length] bool tensor, True at noise positions (none below 2 tokens).

  The noise and the non-noise tokens (`noise_counts`) are each split into that many spans at
  random, interleaved from non-noise (a sequence ends with noise, never starts with a sentinel).

  Args:
    length: Sequence length (a Python int or a scalar int tensor, e.g. inside `Dataset.map`).
    seed: A stateless seed, shape [2] int; the same seed gives the same mask.
  """
  _check_objective(noise_density, mean_noise_span_length)
  length = tf.cast(length, tf.int32)
  num_noise, num_spans = _noise_counts_tf(length, noise_density, mean_noise_span_length)
  seed = tf.cast(seed, tf.int64)
  noise_seed, nonnoise_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
  noise_lengths = _random_segmentation(num_noise, num_spans, noise_seed)
  nonnoise_lengths = _random_segmentation(length - num_noise, num_spans, nonnoise_seed)
  span_lengths = tf.reshape(tf.stack([nonnoise_lengths, noise_lengths], axis=1), [-1])
  # Index of the span covering each position: how many spans end at or before it.
  span_index = tf.searchsorted(tf.cumsum(span_lengths), tf.range(length), side="right")
  return tf.math.floormod(span_index, 2) == 1


def corrupt_spans(tokens: tf.Tensor, mask: tf.Tensor, vocab_size: int,
                  num_sentinels: Optional[int] = None) -> tuple[tf.Tensor, tf.Tensor]:
  """Replaces each noise span by a sentinel; the targets are the spans after their sentinels.

  Args:
    tokens: [n] int token ids.
    mask: [n] bool, True for noise (any mask; a span is a maximal run of True).
    vocab_size: The vocabulary size with extra ids: span i gets sentinel `vocab_size - 1 - i`.
    num_sentinels: The vocabulary's extra ids; more spans than that fail (they would take
      ordinary pieces as sentinels). None: not checked.

  Returns:
    (inputs, targets), int tensors of tokens' dtype.
  """
  tokens = tf.convert_to_tensor(tokens)
  mask = tf.cast(mask, tf.bool)
  previous_is_noise = tf.concat([[False], mask], axis=0)[:-1]  # Safe for empty.
  span_start = mask & ~previous_is_noise
  span_id = tf.cumsum(tf.cast(span_start, tokens.dtype)) - 1
  sentinel = tf.cast(vocab_size - 1, tokens.dtype) - span_id
  checks = [] if num_sentinels is None else [tf.debugging.assert_less_equal(
      tf.reduce_sum(tf.cast(span_start, tf.int32)), num_sentinels,
      message="more noise spans than sentinel (extra) ids")]
  with tf.control_dependencies(checks):
    # Inputs: a span's first token becomes its sentinel, its other tokens go.
    inputs = tf.boolean_mask(tf.where(span_start, sentinel, tokens), ~(mask & previous_is_noise))
  # Targets: (sentinel if a span starts here, token if noise) per position, -1 = nothing.
  slots = tf.stack([tf.where(span_start, sentinel, -1), tf.where(mask, tokens, -1)], axis=1)
  slots = tf.reshape(slots, [-1])
  return inputs, tf.boolean_mask(slots, slots >= 0)


def concatenate_texts(dataset: tf.data.Dataset, *, batch_size: int = DEFAULT_CONCAT_BATCH_SIZE,
                      feature_key: str = "targets") -> tf.data.Dataset:
  """Joins the tokens of every `batch_size` consecutive examples into one (T5's
  reduce_concat_tokens), so short texts fill whole chunks; other features are dropped."""
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  dataset = dataset.map(lambda ex: ex[feature_key])
  dataset = dataset.filter(lambda tokens: tf.size(tokens) > 0)
  dataset = dataset.ragged_batch(batch_size)
  return dataset.map(lambda batch: {feature_key: batch.flat_values})


def split_into_chunks(dataset: tf.data.Dataset, sequence_length: Optional[Mapping[str, int]], *,
                      noise_density: float = 0.15, mean_noise_span_length: float = 3.0,
                      feature_key: str = "targets") -> tf.data.Dataset:
  """Cuts `feature_key` into chunks whose corrupted inputs fit `sequence_length["inputs"]`
  (`pre_corruption_length`); the last chunk of a sequence may be shorter."""
  if not sequence_length or "inputs" not in sequence_length:
    raise ValueError("span corruption needs sequence_length['inputs'] to size its chunks, got "
                     f"{sequence_length!r}")
  chunk = pre_corruption_length(int(sequence_length["inputs"]), noise_density,
                                mean_noise_span_length)

  def chunks(example: Mapping[str, tf.Tensor]) -> tf.data.Dataset:
    tokens = example[feature_key]
    num_chunks = (tf.size(tokens, out_type=tf.int64) + chunk - 1) // chunk
    return tf.data.Dataset.range(num_chunks).map(
        lambda i: {feature_key: tokens[i * chunk:(i + 1) * chunk]})

  return dataset.flat_map(chunks)


def span_corruption(dataset: tf.data.Dataset, output_features: Mapping[str, seqio.Feature], *,
                    noise_density: float = 0.15,
                    mean_noise_span_length: float = 3.0) -> tf.data.Dataset:
  """`{"targets": tokens}` -> `{"inputs": corrupted tokens, "targets": sentinels + spans}`.

  One stateless seed per example from seqio's map seeds, so `Task.get_dataset(seed=...)` is
  deterministic. The sentinels come from `output_features["targets"].vocabulary`.
  """
  _check_objective(noise_density, mean_noise_span_length)
  vocabulary = output_features["targets"].vocabulary
  num_sentinels = getattr(vocabulary, "extra_ids", None)

  def corrupt(example: Mapping[str, tf.Tensor], seed: tf.Tensor) -> dict[str, tf.Tensor]:
    tokens = example["targets"]
    mask = noise_span_mask(tf.size(tokens), noise_density, mean_noise_span_length, seed=seed)
    inputs, targets = corrupt_spans(tokens, mask, vocabulary.vocab_size, num_sentinels)
    return {"inputs": inputs, "targets": targets}

  return seqio.map_over_dataset(corrupt, num_seeds=1)(dataset)


def _suffix(path: str | os.PathLike) -> str:
  return os.path.splitext(os.fspath(path))[1].lower()


def _check_text_file(path: str, text_field: Optional[str], text_fn: Optional[TextFn]) -> str:
  """The suffix of a text file, checked: a known type, and a way to its rows' texts."""
  suffix = _suffix(path)
  if suffix not in TEXT_SUFFIXES:
    raise ValueError(f"{path}: unknown text file type {suffix!r} (want one of {TEXT_SUFFIXES})")
  if suffix != ".txt" and text_field is None and text_fn is None:
    raise ValueError(f"{path}: give text_field or text_fn to choose the text of a {suffix} row")
  return suffix


def _row_texts(row: Mapping[str, Any], path: str, line: int, text_field: Optional[str],
               text_fn: Optional[TextFn]) -> list[str]:
  if text_fn is not None:
    value = text_fn(row)
  else:
    if text_field is None or text_field not in row:
      raise readers.DataError(path, line, "no such field", str(text_field))
    value = row[text_field]
  if value is None:
    return []
  values = [value] if isinstance(value, str) else list(value)
  for v in values:
    if not isinstance(v, str):
      raise readers.DataError(path, line, f"expected text, got {type(v).__name__}",
                              str(text_field or "text_fn"))
  return values


def iterate_texts(path: str | os.PathLike, *, text_field: Optional[str] = None,
                  text_fn: Optional[TextFn] = None) -> Iterator[str]:
  """Streams the texts of one file, a row at a time (blank texts skipped).

  .txt: every line is a text. .jsonl (one JSON object a line), .tsv (one row a line, `""`
  quoting) and .csv (RFC 4180, rows may span lines), with a header row for the last two:
  `text_fn(row)` or `row[text_field]` gives the text(s) of a row.

  Raises:
    readers.DataError: naming the file and line of a malformed row.
  """
  path = os.fspath(path)
  suffix = _check_text_file(path, text_field, text_fn)
  with fileio.open(path, "r", encoding="utf-8", newline="") as f:
    rows: Iterator[tuple[int, Mapping[str, Any] | readers.DataError]]
    if suffix == ".txt":
      rows = ((n, {"text": t.rstrip("\r\n")}) for n, t in enumerate(f, 1))
      text_field, text_fn = "text", None
    elif suffix == ".jsonl":
      rows = ((n, readers.json_object(path, n, t)) for n, t in enumerate(f, 1) if t.strip())
    else:
      if suffix == ".tsv":
        values = ((n, next(csv.reader([t.rstrip("\r\n")], delimiter="\t")))
                  for n, t in enumerate(f, 1) if t.strip())
      else:
        reader = csv.reader(f)
        values = ((reader.line_num, v) for v in reader if v)
      header = [h.strip() for h in next(values, (0, []))[1]]
      rows = ((n, readers.columns_row(header, v, path, n)) for n, v in values)
    for number, row in rows:
      if isinstance(row, readers.DataError):
        raise row
      yield from (t for t in _row_texts(row, path, number, text_field, text_fn) if t.strip())


def _nonblank(text: tf.Tensor) -> tf.Tensor:
  return tf.strings.length(tf.strings.strip(text)) > 0


def text_file_dataset(files: Sequence[str | os.PathLike], *, text_field: Optional[str] = None,
                      text_fn: Optional[TextFn] = None) -> tf.data.Dataset:
  """Scalar tf.string texts of `files` in order, streamed (`iterate_texts` rules): a local
  .txt by `tf.data.TextLineDataset`, any other a row at a time through `jaxmoral.fileio` (the
  file layer, credentials and endpoint of every other file a run reads)."""
  parts = []
  for path in files:
    if _suffix(path) == ".txt" and not fileio.is_url(path):
      parts.append(tf.data.TextLineDataset(os.fspath(path)))
    else:
      generator = functools.partial(iterate_texts, path, text_field=text_field, text_fn=text_fn)
      parts.append(tf.data.Dataset.from_generator(
          generator, output_signature=tf.TensorSpec([], tf.string)))
  if not parts:
    raise ValueError("text_file_dataset: no files")
  return functools.reduce(tf.data.Dataset.concatenate, parts).filter(_nonblank)


def _text_source(*, files: Mapping[str, Sequence[str]], texts: Mapping[str, Sequence[str]],
                 text_field: Optional[str], text_fn: Optional[TextFn]) -> seqio.DataSource:
  def dataset_fn(split: str, shuffle_files: bool, seed: Optional[int] = None) -> tf.data.Dataset:
    if split in texts:
      dataset = tf.data.Dataset.from_tensor_slices(tf.constant(list(texts[split]), tf.string))
      if shuffle_files:  # In memory: the whole split, a new order each epoch (as text pairs).
        dataset = dataset.shuffle(len(texts[split]), seed=seed, reshuffle_each_iteration=True)
      dataset = dataset.filter(_nonblank)
    else:  # Streamed: the files' order, then seqio's window (`build_corpus` shuffles a corpus).
      split_files = list(files[split])
      if shuffle_files:
        np.random.default_rng(seed).shuffle(split_files)
      dataset = text_file_dataset(split_files, text_field=text_field, text_fn=text_fn)
    return dataset.map(lambda text: {"targets": text})

  return seqio.FunctionDataSource(
      dataset_fn, splits=[*files, *texts],
      num_input_examples={s: len(t) for s, t in texts.items()} if texts else None)


@gin.configurable
def register_span_corruption_task(
    name: str, *, vocabulary: Any,
    text_files: Optional[Sequence[str | os.PathLike] | Mapping[str, Sequence[str]]] = None,
    texts: Optional[Mapping[str, Sequence[str]] | Sequence[str]] = None,
    text_field: Optional[str] = None, text_fn: Optional[TextFn] = None,
    noise_density: float = 0.15, mean_noise_span_length: float = 3.0,
    concat_batch_size: int = DEFAULT_CONCAT_BATCH_SIZE, overwrite: bool = True) -> seqio.Task:
  """Registers a span-corruption pretraining Task over raw text (module docstring).

  Args:
    vocabulary: Vocabulary of both features; its extra ids are the sentinels.
    text_files: Files (one "train" split) or `{split: files}`, streamed (`iterate_texts`).
    texts: Instead of files: in-memory texts (one "train" split) or `{split: texts}`.
    text_field: Key / column of the text in .jsonl / .tsv / .csv files.
    text_fn: Instead of `text_field`: row -> text(s) or None (skip the row).
    noise_density, mean_noise_span_length: The objective (`noise_span_mask`).
    concat_batch_size: Texts concatenated before chunking (T5: 128).

  Returns:
    The registered `seqio.Task`; its `get_dataset` needs `sequence_length["inputs"]`.
  """
  where = f"register_span_corruption_task({name!r})"
  if (text_files is None) == (texts is None):
    raise ValueError(f"{where}: give exactly one of text_files, texts")
  _check_objective(noise_density, mean_noise_span_length)
  files: dict[str, list[str]] = {}
  split_texts: dict[str, list[str]] = {}
  if text_files is not None:
    by_split = text_files if isinstance(text_files, Mapping) else {"train": text_files}
    for split, paths in by_split.items():
      files[split] = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike))
                                             else paths)]
      if not files[split]:
        raise ValueError(f"{where}: split {split!r} has no files")
      for path in files[split]:
        if not fileio.isfile(path):  # Fail at registration, not in the middle of training.
          raise FileNotFoundError(f"{where}: no such file {path}")
        _check_text_file(path, text_field, text_fn)
  else:
    assert texts is not None  # Exactly one of text_files, texts (checked above).
    by_split = texts if isinstance(texts, Mapping) else {"train": texts}
    split_texts = {s: list(t) for s, t in by_split.items()}
    for split, values in split_texts.items():
      if not any(t.strip() for t in values):
        raise ValueError(f"{where}: split {split!r} has no texts")
  if overwrite:
    seqio.TaskRegistry.remove(name)
  objective: dict[str, Any] = dict(noise_density=noise_density,
                                   mean_noise_span_length=mean_noise_span_length)
  source = _text_source(files=files, texts=split_texts, text_field=text_field, text_fn=text_fn)
  # What the rows depend on, for `tasks.TaskSource`'s index cache: the files as they are now
  # (a changed file gets a new cache), the texts, how they are read and corrupted.
  source.jaxmoral_fingerprint = json.dumps({
      "files": {s: [[p, *fileio.version(p)] for p in paths]
                for s, paths in sorted(files.items())},
      "texts": zlib.crc32(json.dumps(split_texts, sort_keys=True).encode("utf-8")),
      "read": [text_field, getattr(text_fn, "__qualname__", None)],
      "objective": objective, "concat_batch_size": concat_batch_size})
  features = {k: seqio.Feature(vocabulary=vocab_lib.as_seqio(vocabulary), add_eos=True)
              for k in ("inputs", "targets")}
  return seqio.TaskRegistry.add(
      name, source=source, output_features=features,
      preprocessors=[
          functools.partial(seqio.preprocessors.tokenize, copy_pretokenized=False),
          functools.partial(concatenate_texts, batch_size=concat_batch_size),
          functools.partial(split_into_chunks, **objective),
          functools.partial(span_corruption, **objective),
          seqio.preprocessors.append_eos_after_trim,
      ])
