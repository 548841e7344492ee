"""SentencePiece vocabularies, T5 style: train small ones, load any as a seqio vocabulary.

T5 conventions: pad = 0 (also the decoder start id), eos = 1, unk = 2, no bos; `extra_ids`
sentinels (`<extra_id_0>` = the highest id) sit after the SentencePiece pieces. The model's
`vocab_size` must be at least `pieces + extra_ids` (the released T5 models use 32,000 + 100,
padded to 32,128; the tiny demo uses 400 + 100 <= 512).
"""

from __future__ import annotations

import logging
import os
import pathlib
from typing import Iterable, Iterator, Optional

import gin
import seqio
import sentencepiece as spm

from jaxmoral import fileio
from jaxmoral.data import demo

DEMO_DIR = pathlib.Path(__file__).resolve().parent / "demo"
DEMO_VOCAB_SIZE = 400  # + 100 extra ids = 500 <= the tiny model's 512 rows.
T5_EXTRA_IDS = 100


def train_sentencepiece(texts: Iterable[str], *, output_prefix: str | os.PathLike,
                        vocab_size: int, model_type: str = "unigram",
                        character_coverage: float = 1.0, seed: int = 0,
                        hard_vocab_limit: bool = True) -> str:
  """Trains a T5-style SentencePiece model (pad=0, eos=1, unk=2, no bos), deterministically.

  Args:
    texts: Training sentences (one example each; newlines inside are fine).
    output_prefix: Writes `{output_prefix}.model` and `{output_prefix}.vocab`.
    vocab_size: Number of pieces, the 3 special ones included.
    model_type: "unigram" (T5) or "bpe".
    character_coverage: Fraction of characters covered; 1.0 keeps every character of a small
      corpus out of `unk`.
    seed: SentencePiece's random seed (training is also single-threaded and unshuffled, so a
      rerun gives the same pieces and scores).
    hard_vocab_limit: When False, a corpus too small for `vocab_size` gives fewer pieces
      instead of an error.

  Returns:
    The path of the `.model` file.

  Raises:
    ValueError: `texts` is empty, or `vocab_size` is too small or too large for the corpus.
  """
  if vocab_size < 4:
    raise ValueError(f"vocab_size must be >= 4 (3 special pieces + 1), got {vocab_size}")
  sentences = [t for t in texts if t and t.strip()]
  if not sentences:
    raise ValueError("train_sentencepiece: no non-empty texts to train on")
  prefix = pathlib.Path(output_prefix)
  prefix.parent.mkdir(parents=True, exist_ok=True)
  spm.set_random_generator_seed(seed)

  def sentence_iterator() -> Iterator[str]:
    yield from sentences

  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentence_iterator(),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
        # Determinism: one thread, the whole corpus in its given order.
        num_threads=1, input_sentence_size=0, shuffle_input_sentence=False,
        hard_vocab_limit=hard_vocab_limit,
        minloglevel=2,
    )
  except RuntimeError as e:  # SentencePiece reports bad sizes as RuntimeError.
    raise ValueError(f"train_sentencepiece(vocab_size={vocab_size}): {e}") from e
  return f"{prefix}.model"


@gin.configurable
def get_vocabulary(path: Optional[str | os.PathLike], *,
                   extra_ids: int = T5_EXTRA_IDS) -> seqio.SentencePieceVocabulary:
  """A seqio vocabulary for a SentencePiece model file.

  Args:
    path: The `.model` file; None builds (or reuses) the demo vocabulary in a temp folder.
    extra_ids: Sentinel ids appended after the pieces (T5: 100).

  Raises:
    FileNotFoundError: `path` does not exist.
  """
  if path is None:
    import tempfile
    path = build_demo_vocabulary(output_dir=os.path.join(tempfile.gettempdir(),
                                                         "jaxmoral_demo_vocab"))
  if not fileio.isfile(path):
    raise FileNotFoundError(f"SentencePiece model not found: {path}")
  # SentencePiece reads local files only: a model in a bucket is read through a local copy.
  vocab = seqio.SentencePieceVocabulary(fileio.local_copy(path), extra_ids=extra_ids)
  if vocab.pad_id != 0 or vocab.eos_id != 1:
    raise ValueError(f"{path}: not a T5-style model (pad={vocab.pad_id}, eos={vocab.eos_id}; "
                     "expected 0 and 1)")
  return vocab


def demo_texts() -> list[str]:
  """Every text field of the bundled demo corpus (the vocabulary's training data)."""
  return demo.all_texts()


@gin.configurable
def build_demo_vocabulary(*, output_dir: str | os.PathLike,
                          vocab_size: int = DEMO_VOCAB_SIZE) -> str:
  """Trains the demo vocabulary on the bundled corpus (reused when already built).

  Args:
    output_dir: Folder for `demo_spm_{vocab_size}.model`.
    vocab_size: Pieces; with 100 extra ids keep `vocab_size + 100 <= T5Config.vocab_size`.

  Returns:
    The `.model` path.
  """
  prefix = pathlib.Path(output_dir) / f"demo_spm_{vocab_size}"
  model = f"{prefix}.model"
  if os.path.isfile(model):
    return model
  # Train under a private name, then rename: concurrent builders never see a partial file.
  tmp_prefix = pathlib.Path(output_dir) / f".tmp_{os.getpid()}_demo_spm_{vocab_size}"
  trained = train_sentencepiece(demo_texts(), output_prefix=tmp_prefix, vocab_size=vocab_size)
  os.replace(f"{tmp_prefix}.vocab", f"{prefix}.vocab")
  os.replace(trained, model)
  logging.info("built demo vocabulary %s", model)
  return model


def check_t5_vocabulary(path: str | os.PathLike) -> None:
  """Raises ValueError unless `path` is the released T5 SentencePiece model (known ids)."""
  vocab = get_vocabulary(path)
  text = "translate English to German: That is good."
  expected = [13959, 1566, 12, 2968, 10, 466, 19, 207, 5]
  got = list(vocab.encode(text))
  if got != expected:
    raise ValueError(f"{path}: {text!r} encodes to {got}, expected {expected} (T5 vocabulary)")
  if vocab.vocab_size != 32100:
    raise ValueError(f"{path}: vocab_size {vocab.vocab_size} != 32100 with 100 extra ids")
