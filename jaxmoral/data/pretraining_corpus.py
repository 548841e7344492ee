"""A plain-text pretraining corpus from the project's data, and its span-corruption Task.

Texts (each once, whitespace normalised, one per line of the corpus file):

* `clarify`: δ-Clarify situations and questions (`delta_clarify/{split}.tsv`);
* `silver`: the silver defeasible updates: rules of thumb, updates, questions, situations
  (`delta_clarify_silver/*.tsv`);
* `fusion`: both sides of the fusion pairs (`fusion/*.csv`);
* `demo`: every text of the bundled demo corpus (`jaxmoral.data.demo`);

and those the method packages register (`corpus_sources`) when imported:

* `perspectrum`: PERSPECTRUM claims and their perspectives (`perspectrum/`;
  `jaxmoral.npov.knowledge_base`);
* `chitchat`: the utterances of the chitchat dialogue corpus's train conversations
  (`jaxmoral.diamante.chitchat`; needs the `dialogue` extra, so it is not a default source).

Held-out data stay out by default: only δ-Clarify's train split and PERSPECTRUM's train claims
are read (`clarify_splits`, `perspectrum_splits`), and chitchat's test conversations never
are, so pretraining never sees what the ClarifyDelphi, NPOV and Diamante evaluations test on.

`register_pretraining_mixture` writes `pretraining_corpus_{train,validation}.txt` (every
`validation_every`-th text validates) and a manifest into `output_dir`, rebuilding only when the
manifest's settings differ, then registers the streaming Task (`span_corruption`). For gin,
`pretraining_task_name()` registers (once) and returns the name, so a config can set
`MIXTURE_OR_TASK_NAME = @pretraining_corpus.pretraining_task_name()` (see
configs/core/pretrain_span_corruption.gin).
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


# -- texts of each source -------------------------------------------------------------------


def clarify_texts(data_dir: str | os.PathLike, *,
                  splits: Sequence[str] = ("train",)) -> Iterator[str]:
  """δ-Clarify situations and clarification questions of `splits` ("train", "dev")."""
  for split in splits:
    path = fileio.join(data_dir, "delta_clarify", f"{split}.tsv")
    if not fileio.isfile(path):
      raise FileNotFoundError(f"{path} not found (expected the δ-Clarify layout)")
    for row in readers.read_tsv(path, columns=["situation", "question"]):
      yield row["situation"]
      yield row["question"]


def silver_texts(data_dir: str | os.PathLike) -> Iterator[str]:
  """The silver defeasible updates: rule of thumb, update, question and situation of a row."""
  paths = _files(fileio.join(data_dir, "delta_clarify_silver"), "*.tsv")
  if not paths:
    raise FileNotFoundError(f"no silver TSV in {fileio.join(data_dir, 'delta_clarify_silver')}")
  fields = ["Hypothesis", "Update", "question_davinci", "situation"]
  for path in paths:
    for row in readers.read_tsv(path, columns=fields):
      yield from (row[f] for f in fields)


def fusion_texts(data_dir: str | os.PathLike) -> Iterator[str]:
  """Both sides of the fusion pairs: "SITUATION: s QUESTION: q ANSWER: a" and the fused
  situation (the first is the fusion model's input format, worth pretraining on too)."""
  paths = _files(fileio.join(data_dir, "fusion"), "*.csv")
  if not paths:
    raise FileNotFoundError(f"no fusion CSV in {fileio.join(data_dir, 'fusion')}")
  for path in paths:
    for row in readers.read_csv(path, columns=["input", "output"]):
      yield row["input"]
      yield row["output"]


def _files(folder: str, pattern: str) -> list[str]:
  """The files of `folder` (a path or URL) matching `pattern`, sorted; [] if it is missing."""
  return sorted(os.fspath(p) for p in fileio.path(folder).glob(pattern) if p.is_file())


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
    sources: Any of SOURCES.
    clarify_splits: δ-Clarify splits read.
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
  needs_dir = [s for s in sources
               if s != "demo" and (s not in registered or registered[s][1])]
  if needs_dir and data_dir is None:
    raise ValueError(f"corpus sources {needs_dir} need data_dir (e.g. ../shared/data)")
  if data_dir is not None and needs_dir and not fileio.isdir(data_dir):
    raise FileNotFoundError(f"data_dir {data_dir} is not a folder")
  readers_by_source: dict[str, Callable[[], Iterable[str]]] = {"demo": vocab_lib.demo_texts}
  if data_dir is not None:  # Without it, no source asked for reads these (checked above).
    readers_by_source.update({
        "clarify": lambda: clarify_texts(data_dir, splits=clarify_splits),
        "silver": lambda: silver_texts(data_dir),
        "fusion": lambda: fusion_texts(data_dir),
    })
  splits_of = {"perspectrum": perspectrum_splits}
  for name in registered:
    readers_by_source[name] = functools.partial(corpus_sources.read, name, data_dir,
                                                splits=splits_of.get(name))
  texts: dict[str, None] = {}
  for source in sources:
    before = len(texts)
    texts.update((t, None) for t in map(_clean, readers_by_source[source]()) if t)
    logging.info("pretraining corpus: %d new texts from %s", len(texts) - before, source)
  return list(texts)


# -- the corpus files -----------------------------------------------------------------------

CORPUS_ORDER_SEED = 0  # The order of the corpus files' texts (`build_corpus`).


def write_lines(path: str | os.PathLike, texts: Iterable[str]) -> int:
  """Writes one text per line, atomically (a reader never sees half a file: a local file is
  renamed into place, an object is stored whole when closed); returns the number of lines."""
  if fileio.is_url(path):
    count = 0
    with fileio.open(path, "w", encoding="utf-8") as f:
      for text in texts:
        f.write(_clean(text) + "\n")
        count += 1
    return count
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".tmp_{os.getpid()}_{path.name}")
  count = 0
  with open(tmp, "w", encoding="utf-8") as f:
    for text in texts:
      f.write(_clean(text) + "\n")
      count += 1
  os.replace(tmp, path)
  return count


def corpus_paths(output_dir: str | os.PathLike) -> dict[str, str]:
  """{split: corpus file} inside `output_dir`."""
  return {s: fileio.join(output_dir, f"pretraining_corpus_{s}.txt") for s in SPLITS}


def installed_sources(sources: Sequence[str]) -> list[str]:
  """`sources` without "chitchat" when its package (the `dialogue` extra) is not installed,
  saying so in one line: a corpus without it is still a corpus, and the manifest records the
  sources actually read (installing the extra later rebuilds the corpus with it)."""
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
  `validation_every`-th (the first included) goes to validation. The train file is streamed
  and seqio shuffles within a window of 1,000 texts, so a file in source order would serve
  one source at a time (the 30,000 δ-Clarify texts, then silver, ..., the 116,000 chitchat
  turns last): as T5's corpora, the file itself is shuffled.

  Returns:
    {split: corpus file}.
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
      if json.loads(fileio.read_text(manifest))["settings"] == settings:
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


# -- registration ---------------------------------------------------------------------------


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
    task_name: Name of the registered Task.
    sources: Corpus sources (SOURCES).
    clarify_splits: δ-Clarify splits in the corpus.
    perspectrum_splits: PERSPECTRUM splits in the corpus (None: all).
    validation_every: Every N-th text validates.
    extra_ids: Sentinel ids of the vocabulary (T5: 100).
    noise_density: Fraction of tokens corrupted.
    mean_noise_span_length: Mean corrupted span length.
    concat_batch_size: Texts concatenated before chunking.

  Returns:
    The registered `seqio.Task`.
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
  gin) and returns its name: `MIXTURE_OR_TASK_NAME = @pretraining_corpus.pretraining_task_name()`
  registers when gin builds `runs.Seq2SeqData`, before the run looks the Task up."""
  return register_pretraining_mixture().name
