"""A stand-in for `seqio` on accelerator images that lack TensorFlow (bench scripts only).

seqio needs TensorFlow, which cannot be installed on the lent GPU machines (no package index,
and its wheels are far over the 64 MiB a device call may carry). The PPO and generation
benchmarks use seqio only for `SentencePieceVocabulary.encode/decode`, so this module gives
exactly that, on the same `sentencepiece` model, with seqio's T5 conventions (pad 0, EOS 1,
UNK 2, `extra_ids` sentinels after the pieces). Put `bench/shims` on PYTHONPATH *only* where
the real seqio is missing; nothing in `jaxmoral` or its tests uses it.
"""

from __future__ import annotations

from typing import Iterable

import sentencepiece


class Vocabulary:
  """Marker base class (type annotations only)."""


class SentencePieceVocabulary(Vocabulary):
  """seqio.SentencePieceVocabulary's encode/decode on a SentencePiece model file."""

  def __init__(self, sentencepiece_model_file: str, extra_ids: int = 0):
    self.sentencepiece_model_file = sentencepiece_model_file
    self.extra_ids = extra_ids
    self._model = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model_file)
    self.pad_id = self._model.pad_id() if self._model.pad_id() >= 0 else 0
    self.eos_id = self._model.eos_id()
    self.unk_id = self._model.unk_id()

  @property
  def vocab_size(self) -> int:
    return self._model.get_piece_size() + self.extra_ids

  def encode(self, text: str) -> list[int]:
    return self._model.encode(text)

  def decode(self, ids: Iterable[int]) -> str:
    # seqio decodes up to the first EOS and maps ids outside the pieces (sentinels, padding
    # rows of a larger model vocabulary) to UNK.
    pieces = self._model.get_piece_size()
    out = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      out.append(i if 0 <= i < pieces else self.unk_id)
    return self._model.decode(out)
