"""A plain-text pretraining corpus from the project's data, and its span-corruption Task.

Its texts (each once, whitespace normalised, one per line) come from the built-in SOURCES and
from those the method packages register when imported (`corpus_sources`: `perspectrum`, and
`chitchat`, which needs the `dialogue` extra and so is not a default source). Held-out data stay
out by default: only δ-Clarify's train split and PERSPECTRUM's train claims are read, and
chitchat's test conversations never are, so pretraining never sees what the ClarifyDelphi,
NPOV and Diamante evaluations test on.

For gin, `MIXTURE_OR_TASK_NAME = @pretraining_corpus.pretraining_task_name()` builds the corpus
files (again only when their settings change) and registers their Task once
(configs/core/pretrain_span_corruption.gin).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import pathlib
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

# isort: off
from jaxmoral.data import _tensorflow  # noqa: F401  (first: how TensorFlow starts)
import seqio
# isort: on

import gin

from jaxmoral import fileio
from jaxmoral.data import corpus_sources
from jaxmoral.data import demo
from jaxmoral.data import readers
from jaxmoral.data import span_corruption
from jaxmoral.data import vocab as vocab_lib

PRETRAIN_TASK = "jaxmoral_pretrain_span_corruption"
SOURCES = ("clarify", "silver", "fusion", "demo")  # Built in; method packages add theirs.
# Sources that need no optional dependency.
DEFAULT_SOURCES = ("clarify", "silver", "fusion", "perspectrum", "demo")
SPLITS = ("train", "validation")
MANIFEST = "pretraining_corpus.json"

# Settings of the last registration per task name: `pretraining_task_name` is evaluated every
# time gin builds a `Seq2SeqData`, and must not rebuild or re-register each time.
_REGISTERED: dict[str, str] = {}


def _clean(text: str) -> str:
  """One line: newlines and runs of whitespace become single spaces."""
  return " ".join(text.split())


def clarify_texts(data_dir: str | os.PathLike, *,
                  splits: Sequence[str] = ("train",)) -> Iterator[str]:
  """δ-Clarify situations and clarification questions of `splits` ("train", "dev")."""
  for split in splits:
    path = fileio.join(data_dir, "delta_clarify", f"{split}.tsv")
    if not fileio.isfile(path):
      raise FileNotFoundError(f"{path} not found (expected the δ-Clarify layout)")
    for row in readers.read_tsv(path, columns=["situation", "question"]):
      yield from (row["situation"], row["question"])


def silver_texts(data_dir: str | os.PathLike) -> Iterator[str]:
  """The silver defeasible updates: rule of thumb, update, question and situation of a row."""
  return _folder_texts(fileio.join(data_dir, "delta_clarify_silver"), ".tsv",
                       ["Hypothesis", "Update", "question_davinci", "situation"], "silver TSV")


def fusion_texts(data_dir: str | os.PathLike) -> Iterator[str]:
  """Both sides of the fusion pairs: "SITUATION: s QUESTION: q ANSWER: a" and the fused
  situation (the first is the fusion model's input format, worth pretraining on too)."""
  return _folder_texts(fileio.join(data_dir, "fusion"), ".csv", ["input", "output"],
                       "fusion CSV")


def _folder_texts(folder: str, suffix: str, fields: Sequence[str], what: str) -> Iterator[str]:
  """The `fields` of each row of the `*{suffix}` files of `folder` (a path or URL), sorted;
  a FileNotFoundError names `what` when it has none."""
  paths = sorted(os.fspath(p) for p in fileio.path(folder).glob(f"*{suffix}") if p.is_file())
  if not paths:
    raise FileNotFoundError(f"no {what} in {folder}")
  read = readers.read_tsv if suffix == ".tsv" else readers.read_csv
  for path in paths:
    for row in read(path, columns=fields):
      yield from (row[f] for f in fields)


def _absolute(location: str | os.PathLike) -> str:
  """A local folder resolved (symlinks followed); a URL as given."""
  if fileio.is_url(location):
    return fileio.abspath(location)
  return str(pathlib.Path(location).resolve())


def corpus_texts(data_dir: Optional[str | os.PathLike], *,
                 sources: Sequence[str] = DEFAULT_SOURCES,
                 clarify_splits: Sequence[str] = ("train",),
                 perspectrum_splits: Optional[Sequence[str]] = ("train",)) -> list[str]:
  """The distinct, whitespace-normalised, non-empty texts of `sources`, in source order.

  Args:
    data_dir: A folder laid out like `../shared/data`; None allows only the "demo" source.
    sources: Any of SOURCES and of the registered sources.
    perspectrum_splits: PERSPECTRUM splits whose claims are read (None: all).

  Raises:
    ValueError: an unknown source, or a data source without `data_dir`.
    FileNotFoundError: a source's files are missing.
  """
  registered = corpus_sources.registered()
  known = (*SOURCES, *registered)
  unknown = [s for s in sources if s not in known]
  if unknown:
    raise ValueError(f"unknown corpus source(s) {unknown}; known: {known} (perspectrum and "
                     f"chitchat register when jaxmoral.npov.knowledge_base and "
                     f"jaxmoral.diamante.chitchat are imported)")
  needs_dir = [s for s in sources if s != "demo" and registered.get(s, (None, True))[1]]
  if needs_dir and data_dir is None:
    raise ValueError(f"corpus sources {needs_dir} need data_dir (e.g. ../shared/data)")
  if data_dir is not None and needs_dir and not fileio.isdir(data_dir):
    raise FileNotFoundError(f"data_dir {data_dir} is not a folder")
  readers_by_source: dict[str, Callable[[], Iterable[str]]] = {"demo": demo.all_texts}
  if data_dir is not None:  # Without it, no source asked for reads these (checked above).
    readers_by_source.update({
        "clarify": lambda: clarify_texts(data_dir, splits=clarify_splits),
        "silver": lambda: silver_texts(data_dir),
        "fusion": lambda: fusion_texts(data_dir),
    })
  readers_by_source.update({name: functools.partial(
      reader, data_dir, splits=perspectrum_splits if name == "perspectrum" else None)
      for name, (reader, _) in registered.items()})
  texts: dict[str, None] = {}
  for source in sources:
    before = len(texts)
    texts.update((t, None) for t in map(_clean, readers_by_source[source]()) if t)
    logging.info("pretraining corpus: %d new texts from %s", len(texts) - before, source)
  return list(texts)


CORPUS_ORDER_SEED = 0  # The order of the corpus files' texts (`build_corpus`).


def write_lines(path: str | os.PathLike, texts: Iterable[str]) -> int:
  """Writes one text per line, atomically (`fileio.write_text`); returns the number of lines."""
  lines = [_clean(text) + "\n" for text in texts]
  fileio.makedirs(os.path.dirname(os.fspath(path)) or ".")
  fileio.write_text(path, "".join(lines))
  return len(lines)


def corpus_paths(output_dir: str | os.PathLike) -> dict[str, str]:
  """{split: corpus file} inside `output_dir`."""
  return {s: fileio.join(output_dir, f"pretraining_corpus_{s}.txt") for s in SPLITS}


def installed_sources(sources: Sequence[str]) -> list[str]:
  """`sources` without "chitchat" when its package (the `dialogue` extra) is not installed,
  saying so: the manifest records the sources read, so installing it later rebuilds."""
  if "chitchat" in sources and importlib.util.find_spec("chitchat_dataset") is None:
    logging.warning("pretraining corpus: skipping the chitchat source, which needs the "
                    "dialogue extra (pip install -e '.[dialogue]')")
    return [s for s in sources if s != "chitchat"]
  return list(sources)


def build_corpus(*, data_dir: Optional[str | os.PathLike], output_dir: str | os.PathLike,
                 sources: Sequence[str] = DEFAULT_SOURCES,
                 clarify_splits: Sequence[str] = ("train",),
                 perspectrum_splits: Optional[Sequence[str]] = ("train",),
                 validation_every: int = 100) -> dict[str, str]:
  """Writes the train / validation corpus files unless a build with the same settings exists.

  The texts are written in a seeded random order (`CORPUS_ORDER_SEED`), of which every
  `validation_every`-th (the first included) validates: seqio shuffles a streamed file within
  a window of 1,000 texts, so a file in source order would serve one source at a time.
  Returns {split: corpus file}.
  """
  if validation_every < 2:
    raise ValueError(f"validation_every must be >= 2, got {validation_every}")
  sources = installed_sources(sources)
  paths = corpus_paths(output_dir)
  settings = {"data_dir": None if data_dir is None else _absolute(data_dir),
              "sources": list(sources), "clarify_splits": list(clarify_splits),
              "perspectrum_splits": None if perspectrum_splits is None
              else list(perspectrum_splits), "validation_every": validation_every,
              "order_seed": CORPUS_ORDER_SEED}
  manifest = fileio.join(output_dir, MANIFEST)
  if fileio.isfile(manifest) and all(fileio.isfile(p) for p in paths.values()):
    try:
      if fileio.read_json(manifest)["settings"] == settings:
        return paths
    except (ValueError, KeyError):
      pass  # An unreadable manifest: rebuild.
  texts = corpus_texts(data_dir, sources=sources, clarify_splits=clarify_splits,
                       perspectrum_splits=perspectrum_splits)
  texts = [texts[i] for i in np.random.default_rng(CORPUS_ORDER_SEED).permutation(len(texts))]
  counts = {
      "train": write_lines(paths["train"], (t for i, t in enumerate(texts)
                                            if i % validation_every)),
      "validation": write_lines(paths["validation"], texts[::validation_every]),
  }
  # The manifest last: files without it (an interrupted build) are rebuilt.
  write_lines(manifest, [json.dumps({"settings": settings, "texts": counts})])
  logging.info("pretraining corpus: %s texts in %s", counts, output_dir)
  return paths


@gin.configurable
def register_pretraining_mixture(
    *, data_dir: Optional[str | os.PathLike], vocabulary_path: Optional[str | os.PathLike],
    output_dir: str | os.PathLike, task_name: str = PRETRAIN_TASK,
    sources: Sequence[str] = DEFAULT_SOURCES, clarify_splits: Sequence[str] = ("train",),
    perspectrum_splits: Optional[Sequence[str]] = ("train",), validation_every: int = 100,
    extra_ids: int = vocab_lib.T5_EXTRA_IDS, noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
    concat_batch_size: int = span_corruption.DEFAULT_CONCAT_BATCH_SIZE) -> seqio.Task:
  """Builds the corpus (if missing) and registers its span-corruption Task (train, validation).

  Repeated calls with the same arguments return the registered Task without redoing anything.

  Args:
    data_dir: A folder laid out like `../shared/data` (None: "demo" source only).
    vocabulary_path: SentencePiece model, e.g. `../shared/vocab/t5_tokenizer/spiece.model`;
      None builds the demo vocabulary in `output_dir`.
    output_dir: Folder of the corpus files and manifest.
    sources, clarify_splits, perspectrum_splits, validation_every: The corpus (`build_corpus`).
    extra_ids: Sentinel ids of the vocabulary (T5: 100).
    noise_density, mean_noise_span_length, concat_batch_size: The objective
      (`span_corruption.register_span_corruption_task`).
  """
  key = json.dumps([str(data_dir), str(vocabulary_path), str(output_dir), list(sources),
                    list(clarify_splits), perspectrum_splits and list(perspectrum_splits),
                    validation_every, extra_ids, noise_density, mean_noise_span_length,
                    concat_batch_size])
  if _REGISTERED.get(task_name) == key and task_name in seqio.TaskRegistry.names():
    return seqio.TaskRegistry.get(task_name)
  paths = build_corpus(data_dir=data_dir, output_dir=output_dir, sources=sources,
                       clarify_splits=clarify_splits, perspectrum_splits=perspectrum_splits,
                       validation_every=validation_every)
  if vocabulary_path is None:
    vocabulary_path = vocab_lib.build_demo_vocabulary(output_dir=output_dir)
  vocabulary = vocab_lib.get_vocabulary(vocabulary_path, extra_ids=extra_ids)
  task = span_corruption.register_span_corruption_task(
      task_name, vocabulary=vocabulary, text_files={s: [p] for s, p in paths.items()},
      noise_density=noise_density, mean_noise_span_length=mean_noise_span_length,
      concat_batch_size=concat_batch_size)
  _REGISTERED[task_name] = key
  return task


@gin.configurable
def pretraining_task_name() -> str:
  """Registers the pretraining Task (`register_pretraining_mixture`, its arguments bound by
  gin) when gin builds `runs.Seq2SeqData`, before the run looks it up; returns its name."""
  return register_pretraining_mixture().name
