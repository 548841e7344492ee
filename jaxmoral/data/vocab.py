"""SentencePiece vocabularies, T5 style: train small ones, load any without TensorFlow.

T5 conventions: pad = 0 (also the decoder start id), eos = 1, unk = 2, no bos; `extra_ids`
sentinels (`<extra_id_0>` = the highest id) sit after the pieces, so a model's `vocab_size`
must be at least `pieces + extra_ids` (T5: 32,000 + 100, padded to 32,128).

`SentencePieceVocabulary` is seqio's vocabulary of that name with no TensorFlow import, so
training from an index cache, evaluation and decoding run on an accelerator host without
TensorFlow (a CUDA jax often cannot share a host with it); `as_seqio` makes seqio's own object
where a seqio Task is defined.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import threading
from typing import Any, Iterable, Optional, Protocol, Sequence

import gin
import sentencepiece as spm

from jaxmoral import fileio
from jaxmoral.data import demo

DEMO_VOCAB_SIZE = 400  # + 100 extra ids = 500 <= the tiny model's 512 rows.
T5_EXTRA_IDS = 100


def train_sentencepiece(texts: Iterable[str], *, output_prefix: str | os.PathLike,
                        vocab_size: int, model_type: str = "unigram",
                        character_coverage: float = 1.0, seed: int = 0,
                        hard_vocab_limit: bool = True) -> str:
  """Trains a T5-style SentencePiece model (pad=0, eos=1, unk=2, no bos), deterministically.

  Args:
    texts: Training sentences (one example each; newlines inside are fine).
    output_prefix: Writes `{output_prefix}.model` (its path is returned) and `.vocab`.
    vocab_size: Number of pieces, the 3 special ones included.
    model_type: "unigram" (T5) or "bpe".
    character_coverage: Fraction of characters covered (1.0: none of a small corpus is `unk`).
    seed: SentencePiece's random seed (training is also single-threaded and unshuffled).
    hard_vocab_limit: False: a corpus too small for `vocab_size` gives fewer pieces.

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
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
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


class Vocabulary(Protocol):
  """Text <-> ids: what the methods need of a vocabulary (`SentencePieceVocabulary` or seqio's)."""

  def encode(self, s: str) -> Sequence[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class SentencePieceVocabulary:
  """A SentencePiece model with seqio's T5 conventions (`seqio.SentencePieceVocabulary`).

  The sentinels are user-defined pieces `▁<extra_id_N>`, the first one last, as seqio loads a
  model, so `encode` reads "<extra_id_0>" in a text as that sentinel and `decode` writes it
  back. Equality is by (`sentencepiece_model_file`, `extra_ids`), as seqio's.
  """

  # SentencePiece's proto loading is not thread-safe (seqio holds a lock for it too).
  _load_lock = threading.Lock()

  def __init__(self, sentencepiece_model_file: str | os.PathLike, extra_ids: int = 0):
    self.sentencepiece_model_file = os.fspath(sentencepiece_model_file)
    self.extra_ids = int(extra_ids or 0)
    self._processor: Optional[spm.SentencePieceProcessor] = None

  def __getstate__(self) -> dict[str, Any]:  # Picklable: the processor is rebuilt on use.
    return {"sentencepiece_model_file": self.sentencepiece_model_file,
            "extra_ids": self.extra_ids, "_processor": None}

  def __eq__(self, other: object) -> bool:
    return (isinstance(other, SentencePieceVocabulary)
            and (self.sentencepiece_model_file, self.extra_ids)
            == (other.sentencepiece_model_file, other.extra_ids))

  def __hash__(self) -> int:
    return hash((self.sentencepiece_model_file, self.extra_ids))

  def __repr__(self) -> str:
    return (f"SentencePieceVocabulary(file={self.sentencepiece_model_file}, "
            f"extra_ids={self.extra_ids})")

  @property
  def tokenizer(self) -> spm.SentencePieceProcessor:
    """The SentencePiece processor, sentinels included."""
    if self._processor is None:
      self._processor = _load_processor(self.sentencepiece_model_file, self.extra_ids)
    return self._processor

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def eos_id(self) -> int:
    return self.tokenizer.eos_id()

  @property
  def unk_id(self) -> int:
    return self.tokenizer.unk_id()

  @property
  def vocab_size(self) -> int:
    """Ids: the pieces (pad, eos, unk included) and the sentinels."""
    return self.tokenizer.GetPieceSize()

  def encode(self, s: str) -> list[int]:
    """Token ids of `s`, no EOS appended."""
    return self.tokenizer.EncodeAsIds(s)

  def decode(self, ids: Iterable[int]) -> str:
    """The text of `ids` up to the first EOS; ids outside the vocabulary (a model's padding
    rows) read as UNK, as seqio decodes."""
    size, unk, eos = self.vocab_size, self.unk_id, self.eos_id
    clean = [unk if int(i) >= size else int(i) for i in ids]
    if eos in clean:
      clean = clean[:clean.index(eos) + 1]
    return self.tokenizer.DecodeIds(clean)


def _model_proto(path: str) -> Any:
  from sentencepiece import sentencepiece_model_pb2  # pylint: disable=import-outside-toplevel
  return sentencepiece_model_pb2.ModelProto.FromString(  # type: ignore[attr-defined]
      fileio.read_bytes(path))


@functools.cache
def _load_processor(path: str, extra_ids: int) -> spm.SentencePieceProcessor:
  model = _model_proto(path)
  user_defined = type(model).SentencePiece.USER_DEFINED
  for i in reversed(range(extra_ids)):  # <extra_id_0> gets the highest id (span corruption).
    model.pieces.add(piece=f"▁<extra_id_{i}>", score=0.0, type=user_defined)
  processor = spm.SentencePieceProcessor()
  with SentencePieceVocabulary._load_lock:  # pylint: disable=protected-access
    processor.LoadFromSerializedProto(model.SerializeToString())
  return processor


def as_seqio(vocabulary: Any) -> Any:
  """seqio's vocabulary for `vocabulary`, for a seqio Task's features (imports TensorFlow):
  one object per file and sentinels, so seqio's caches see one vocabulary; anything but a
  `SentencePieceVocabulary` is returned as it is."""
  if isinstance(vocabulary, SentencePieceVocabulary):
    return _seqio_vocabulary(vocabulary.sentencepiece_model_file, vocabulary.extra_ids)
  return vocabulary


@functools.cache
def _seqio_vocabulary(path: str, extra_ids: int) -> Any:
  import seqio  # pylint: disable=import-outside-toplevel
  return seqio.SentencePieceVocabulary(path, extra_ids=extra_ids)


def model_digest(vocabulary: Any) -> Optional[str]:
  """A digest of what a SentencePiece vocabulary tokenises, not of its path or training (the
  model records its training paths): runs that each build or copy the same vocabulary share
  one data cache. None for a vocabulary that is not a SentencePiece model."""
  path = getattr(vocabulary, "sentencepiece_model_file", None)
  if path is None:
    return None
  model = _model_proto(path)
  model.ClearField("trainer_spec")
  return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


@gin.configurable
def get_vocabulary(path: Optional[str | os.PathLike], *,
                   extra_ids: int = T5_EXTRA_IDS) -> SentencePieceVocabulary:
  """The vocabulary of a SentencePiece model file.

  Args:
    path: The `.model` file; None builds the demo vocabulary (0.1 s) in this process's private
      folder (not a shared temp folder, which another user could have filled first).
    extra_ids: Sentinel ids appended after the pieces (T5: 100).
  """
  if path is None:
    path = build_demo_vocabulary(output_dir=fileio.local_folder_for("demo vocabulary"))
  if not fileio.isfile(path):
    raise FileNotFoundError(f"SentencePiece model not found: {path}")
  # SentencePiece reads local files only: a model in a bucket is read through a local copy.
  vocab = SentencePieceVocabulary(fileio.local_copy(path), extra_ids=extra_ids)
  try:
    vocab.tokenizer.GetPieceSize()  # Loads the model: a bad file fails here, naming it.
  except (RuntimeError, ValueError, OSError) as e:  # protobuf's DecodeError is a ValueError.
    raise ValueError(f"{path}: not a SentencePiece model ({e})") from None
  if vocab.eos_id != 1:
    raise ValueError(f"{path}: not a T5-style model (pad={vocab.tokenizer.pad_id()}, "
                     f"eos={vocab.eos_id}; expected 0 and 1)")
  return vocab


@gin.configurable
def build_demo_vocabulary(*, output_dir: str | os.PathLike,
                          vocab_size: int = DEMO_VOCAB_SIZE) -> str:
  """Trains the demo vocabulary on the bundled corpus (reused when already built).

  Args:
    output_dir: Folder for `demo_spm_{vocab_size}.model` (returned).
    vocab_size: Pieces; with 100 extra ids keep `vocab_size + 100 <= T5Config.vocab_size`.
  """
  if fileio.is_url(output_dir):
    # SentencePiece writes local files: built in a local folder, then uploaded.
    model = fileio.join(output_dir, f"demo_spm_{vocab_size}.model")
    if not fileio.isfile(model):
      local = build_demo_vocabulary(output_dir=fileio.local_folder_for(output_dir),
                                    vocab_size=vocab_size)
      fileio.upload(local[:-len(".model")] + ".vocab", model[:-len(".model")] + ".vocab")
      fileio.upload(local, model)  # Last: its presence means the build is complete.
    return model
  prefix = pathlib.Path(output_dir) / f"demo_spm_{vocab_size}"
  model = f"{prefix}.model"
  if os.path.isfile(model):
    return model
  # Train under a private name, then rename: concurrent builders never see a partial file.
  tmp_prefix = pathlib.Path(output_dir) / f".tmp_{os.getpid()}_demo_spm_{vocab_size}"
  trained = train_sentencepiece(demo.all_texts(), output_prefix=tmp_prefix, vocab_size=vocab_size)
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
