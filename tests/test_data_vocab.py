"""Tests for jaxmoral.data.vocab: T5-style SentencePiece training and loading."""

import pathlib

import sentencepiece as spm
import pytest

from jaxmoral.data import demo, vocab
from jaxmoral.models.config import t5_config


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
  return vocab.build_demo_vocabulary(output_dir=tmp_path_factory.mktemp("vocab"))


def test_special_ids_and_fit_in_tiny_model(demo_model):
  sp = spm.SentencePieceProcessor(model_file=demo_model)
  assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)
  assert sp.get_piece_size() == vocab.DEMO_VOCAB_SIZE
  v = vocab.get_vocabulary(demo_model)
  assert v.vocab_size == vocab.DEMO_VOCAB_SIZE + 100
  assert v.vocab_size <= t5_config(size="tiny").vocab_size
  ids = [i for text in demo.all_texts() for i in v.encode(text)]
  assert max(ids) < vocab.DEMO_VOCAB_SIZE and min(ids) >= 2  # Never pad / eos in text.
  # The highest id is the first sentinel, as in T5.
  assert v.encode("<extra_id_0>")[-1] == v.vocab_size - 1


def test_round_trip(demo_model):
  v = vocab.get_vocabulary(demo_model)
  for text in demo.all_texts()[::37]:
    assert v.decode(v.encode(text)) == text
  # Unseen characters become unk rather than failing.
  assert vocab.get_vocabulary(demo_model).encode("\u65e5")[-1] == 2


def test_training_is_deterministic_and_cached(tmp_path, demo_model):
  texts = demo.all_texts()
  paths = [vocab.train_sentencepiece(texts, output_prefix=tmp_path / f"r{i}" / "m",
                                     vocab_size=300) for i in range(2)]
  models = [spm.SentencePieceProcessor(model_file=p) for p in paths]
  pieces = [[(m.id_to_piece(i), m.get_score(i)) for i in range(m.get_piece_size())]
            for m in models]
  assert pieces[0] == pieces[1]
  again = vocab.build_demo_vocabulary(output_dir=pathlib.Path(demo_model).parent)
  assert again == demo_model


def test_bad_inputs(tmp_path):
  with pytest.raises(ValueError, match="no non-empty texts"):
    vocab.train_sentencepiece(["", "  "], output_prefix=tmp_path / "x", vocab_size=50)
  with pytest.raises(ValueError, match="vocab_size=5000"):
    vocab.train_sentencepiece(["a tiny corpus"] * 3, output_prefix=tmp_path / "y",
                              vocab_size=5000)
  with pytest.raises(FileNotFoundError, match="nope.model"):
    vocab.get_vocabulary(tmp_path / "nope.model")


def test_real_t5_vocabulary(shared_dir):
  path = shared_dir / "vocab" / "t5_tokenizer" / "spiece.model"
  if not path.is_file():
    pytest.skip(f"{path} not present")
  vocab.check_t5_vocabulary(path)  # Raises on a mismatch.
  v = vocab.get_vocabulary(path)
  assert v.encode("translate English to German: That is good.") == [
      13959, 1566, 12, 2968, 10, 466, 19, 207, 5]


def test_the_vocabulary_is_seqios_without_tensorflow(demo_model):
  """The same ids, texts and sizes as seqio's SentencePieceVocabulary on the same model
  (sentinels, unknown characters, ids past the vocabulary, text after EOS); `as_seqio`
  gives seqio's own object for Task features; it pickles."""
  import pickle  # pylint: disable=g-import-not-at-top
  import seqio  # pylint: disable=g-import-not-at-top
  ours = vocab.get_vocabulary(demo_model)
  theirs = seqio.SentencePieceVocabulary(demo_model, extra_ids=100)
  for name in ("vocab_size", "pad_id", "eos_id", "unk_id", "extra_ids"):
    assert getattr(ours, name) == getattr(theirs, name), name
  texts = demo.all_texts()[::23] + ["I like <extra_id_0> and <extra_id_7> sandwiches.",
                                    "\u65e5\u672c", ""]
  for text in texts:
    assert ours.encode(text) == list(theirs.encode(text)), text
  for ids in ([5, 9, 1, 7], [ours.vocab_size - 1, 3, 600, 2, 0], [], [1]):
    assert ours.decode(ids) == theirs.decode(ids), ids
  converted = vocab.as_seqio(ours)
  assert isinstance(converted, seqio.SentencePieceVocabulary) and converted == theirs
  assert vocab.as_seqio(theirs) is theirs
  again = pickle.loads(pickle.dumps(ours))
  assert again == ours and again.encode(texts[0]) == ours.encode(texts[0])


def test_the_default_vocabulary_is_built_in_a_private_folder(tmp_path, monkeypatch):
  """`get_vocabulary(None)` never reads a shared temp folder that another user could have
  filled first (it once reused `<tmp>/jaxmoral_demo_vocab`)."""
  import tempfile  # pylint: disable=g-import-not-at-top
  from jaxmoral import fileio  # pylint: disable=g-import-not-at-top
  fileio.local_folder_for("made before the temp folder moves")  # This process's own folder.
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  planted = tmp_path / "jaxmoral_demo_vocab" / f"demo_spm_{vocab.DEMO_VOCAB_SIZE}.model"
  planted.parent.mkdir()
  planted.write_bytes(b"not the demo vocabulary")
  built = vocab.get_vocabulary(None)
  assert built.vocab_size == vocab.DEMO_VOCAB_SIZE + vocab.T5_EXTRA_IDS
  assert planted.read_bytes() == b"not the demo vocabulary"
