"""Span corruption (T5's objective), its streaming Task, and the pretraining corpus."""

import json
import os
import pathlib
import time

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf

from jaxmoral.data import demo
from jaxmoral.data import pretraining_corpus
from jaxmoral.data import span_corruption as sc
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.npov import knowledge_base  # noqa: F401  (registers the perspectrum source)

EXTRA_IDS = 100


@pytest.fixture(scope="module")
def vocab_path(tmp_path_factory):
  return vocab_lib.build_demo_vocabulary(output_dir=tmp_path_factory.mktemp("vocab"))


@pytest.fixture(scope="module")
def vocabulary(vocab_path):
  return vocab_lib.get_vocabulary(vocab_path)


@pytest.fixture(scope="module")
def texts():
  return demo.all_texts()


def _ref_counts(length, density=0.15, mean=3.0):
  """The spec's counts, written independently of the module."""
  noise = int(np.clip(np.round(length * density), 1, length - 1))
  return noise, max(1, int(np.round(noise / mean)))


def _runs(mask):
  """Lengths of the maximal runs of True in a bool array."""
  padded = np.r_[False, mask, False].astype(np.int8)
  starts, ends = np.flatnonzero(np.diff(padded) == 1), np.flatnonzero(np.diff(padded) == -1)
  return ends - starts


def _reconstruct(inputs, targets, first_sentinel):
  """Puts each target span back in place of its sentinel (plain Python)."""
  spans, current = {}, None
  for t in targets:
    if t >= first_sentinel:
      current = t
      spans[t] = []
    else:
      spans[current].append(t)
  out = []
  for t in inputs:
    out.extend(spans.pop(t) if t >= first_sentinel else [t])
  assert not spans, "a target span has no sentinel in the inputs"
  return out


@tf.function
def _mask(length, seed):
  return sc.noise_span_mask(length, 0.15, 3.0, seed=seed)


def test_pre_corruption_length_is_t5s_and_maximal():
  assert sc.pre_corruption_length(512) == 568
  assert sc.corrupted_lengths(568) == (512, 114)
  # Brute force with the reference counts: the largest n whose inputs + EOS fit.
  candidates = np.arange(2, 1400)
  ref_inputs = np.array([n - _ref_counts(n)[0] + _ref_counts(n)[1] + 1 for n in candidates])
  for inputs_length in range(4, 700):
    n = sc.pre_corruption_length(inputs_length)
    assert n == candidates[ref_inputs <= inputs_length].max(), inputs_length
    assert sc.corrupted_lengths(n)[0] == inputs_length  # A full chunk fills the inputs exactly.


def test_noise_density_span_counts_and_mean_span_length():
  rng = np.random.default_rng(0)
  total, noise_total, all_runs = 0, 0, []
  for i in range(300):
    length = int(rng.integers(2, 400))
    mask = _mask(tf.constant(length), tf.constant([i, 7])).numpy()
    ref_noise, ref_spans = _ref_counts(length)
    assert mask.shape == (length,)
    assert mask.sum() == ref_noise, length
    runs = _runs(mask)
    assert len(runs) == min(ref_spans, length - ref_noise), length
    assert not mask[0] and mask[-1]  # Interleaved from non-noise, ending with noise.
    total += length
    noise_total += mask.sum()
    all_runs.extend(runs)
  assert abs(noise_total / total - 0.15) < 0.003
  assert abs(np.mean(all_runs) - 3.0) < 0.1
  assert np.std(all_runs) > 1.0  # Random span lengths, not all 3.


def test_span_lengths_are_a_uniform_random_segmentation():
  # length 100: 15 noise tokens in 5 spans. Uniform compositions of 15 into 5 parts give
  # P(first span = 1) = C(13, 3) / C(14, 4) = 2/7; the first noise span starts after the
  # first non-noise span, whose length has the same law for the 85 tokens: C(83,3)/C(84,4).
  first_noise, first_clean = [], []
  for i in range(800):
    mask = _mask(tf.constant(100), tf.constant([3, i])).numpy()
    first_noise.append(_runs(mask)[0])
    first_clean.append(int(np.argmax(mask)))
  assert abs(np.mean(np.array(first_noise) == 1) - 2 / 7) < 0.05
  assert abs(np.mean(np.array(first_clean) == 1) - 4 / 84) < 0.025
  assert abs(np.mean(first_noise) - 3.0) < 0.2
  assert abs(np.mean(first_clean) - 17.0) < 1.5


def test_mask_is_deterministic_by_seed_and_short_sequences_have_no_noise():
  a = sc.noise_span_mask(200, seed=(1, 2)).numpy()
  assert (a == sc.noise_span_mask(200, seed=(1, 2)).numpy()).all()
  assert (a != sc.noise_span_mask(200, seed=(1, 3)).numpy()).any()
  assert sc.noise_span_mask(1, seed=(0, 0)).numpy().tolist() == [False]
  assert sc.noise_span_mask(0, seed=(0, 0)).numpy().shape == (0,)
  assert sc.noise_span_mask(2, seed=(0, 0)).numpy().tolist() == [False, True]


def test_corrupt_spans_sentinel_order_and_reconstruction():
  vocab_size = 500
  rng = np.random.default_rng(1)
  for i in range(50):
    tokens = rng.integers(3, 400, size=int(rng.integers(2, 300))).astype(np.int32)
    mask = _mask(tf.constant(tokens.size), tf.constant([i, 0])).numpy()
    inputs, targets = (t.numpy().tolist() for t in sc.corrupt_spans(tokens, mask, vocab_size))
    num_spans = len(_runs(mask))
    expected = list(range(vocab_size - 1, vocab_size - 1 - num_spans, -1))
    assert [t for t in inputs if t >= 400] == expected
    assert [t for t in targets if t >= 400] == expected
    assert targets[0] == vocab_size - 1  # Targets start with the first sentinel.
    assert len(inputs) == tokens.size - mask.sum() + num_spans
    assert _reconstruct(inputs, targets, 400) == tokens.tolist()
  # A mask starting with noise works too: inputs start with the sentinel.
  inputs, targets = sc.corrupt_spans([5, 6, 7, 8], [True, False, True, True], 10)
  assert inputs.numpy().tolist() == [9, 6, 8]
  assert targets.numpy().tolist() == [9, 5, 8, 7, 8]
  with pytest.raises(tf.errors.InvalidArgumentError, match="more noise spans"):
    sc.corrupt_spans([5, 6, 7, 8], [True, False, True, False], 10, num_sentinels=1)


def _examples(task, inputs_length, split="train", seed=0, targets_length=None):
  lengths = {"inputs": inputs_length, "targets": targets_length or inputs_length}
  ds = task.get_dataset(lengths, split=split, shuffle=False, seed=seed)
  return [{k: v.tolist() for k, v in ex.items()} for ex in ds.as_numpy_iterator()]


def test_task_reconstructs_the_token_stream_with_exact_lengths(vocabulary, texts):
  task = sc.register_span_corruption_task("test_sc_texts", vocabulary=vocabulary,
                                          texts={"train": texts[:400]}, concat_batch_size=1000)
  examples = _examples(task, 64, seed=3)
  first_sentinel = vocabulary.vocab_size - EXTRA_IDS
  stream = [t for text in texts[:400] for t in vocabulary.encode(text)]
  rebuilt = []
  for ex in examples:
    assert ex["inputs"][-1] == 1 and ex["targets"][-1] == 1  # EOS after corruption.
    rebuilt += _reconstruct(ex["inputs"][:-1], ex["targets"][:-1], first_sentinel)
  assert rebuilt == stream
  chunk = sc.pre_corruption_length(64)
  assert len(examples) == -(-len(stream) // chunk)
  full = examples[:-1]  # One concatenated group: only the last chunk is short.
  assert {len(ex["inputs"]) for ex in full} == {64}
  assert {len(ex["targets"]) for ex in full} == {sc.corrupted_lengths(chunk)[1]}


def test_task_at_t5_lengths_and_packing(vocabulary, texts):
  task = sc.register_span_corruption_task("test_sc_t5", vocabulary=vocabulary,
                                          texts={"train": texts[:150]}, concat_batch_size=1000)
  ds = task.get_dataset({"inputs": 512, "targets": 114}, split="train", shuffle=False, seed=0)
  examples = [{k: v.tolist() for k, v in ex.items()} for ex in ds.as_numpy_iterator()]
  assert len(examples) >= 3
  assert {(len(ex["inputs"]), len(ex["targets"])) for ex in examples[:-1]} == {(512, 114)}
  packed = list(seqio.EncDecFeatureConverter(pack=True)(
      ds, {"inputs": 512, "targets": 114}).as_numpy_iterator())
  # The short last chunk shares a row with nothing else here (full rows cannot take it).
  assert len(packed) == len(examples)
  assert packed[0]["encoder_input_tokens"].tolist() == examples[0]["inputs"]


def test_task_is_deterministic_by_seed(vocabulary, texts):
  task = sc.register_span_corruption_task("test_sc_seed", vocabulary=vocabulary,
                                          texts={"train": texts[:200]}, concat_batch_size=50)
  a = _examples(task, 40, seed=5)
  assert a == _examples(task, 40, seed=5)
  assert a != _examples(task, 40, seed=6)
  assert {len(ex["inputs"]) for ex in a} <= set(range(41))


def test_in_memory_texts_are_shuffled_as_a_whole(vocabulary):
  # 2,000 texts of one kind, then 2,000 of another: seqio's 1,000-example window alone would
  # serve the first kind only for the first 1,000 examples.
  words = ("good friend help", "bad lie okay")
  texts = [words[i >= 2000] for i in range(4000)]
  task = sc.register_span_corruption_task("test_sc_order", vocabulary=vocabulary,
                                          texts={"train": texts}, concat_batch_size=1)
  ds = task.get_dataset({"inputs": 16, "targets": 16}, split="train", shuffle=True, seed=1,
                        num_epochs=1)
  second_kind = set(vocabulary.encode(words[1])) - set(vocabulary.encode(words[0]))
  first_200 = [bool(second_kind & {*ex["inputs"], *ex["targets"]})
               for ex, _ in zip(ds.as_numpy_iterator(), range(200))]
  assert np.mean(first_200) == pytest.approx(0.5, abs=0.15)


def test_iterate_texts_formats(tmp_path):
  (tmp_path / "a.jsonl").write_text('{"t": "one"}\n\n{"t": ["two", "three"]}\n{"t": " "}\n')
  assert list(sc.iterate_texts(tmp_path / "a.jsonl", text_field="t")) == ["one", "two", "three"]
  (tmp_path / "b.tsv").write_text('id\ttext\n1\t"a ""quoted"" text"\n2\tplain\n')
  assert list(sc.iterate_texts(tmp_path / "b.tsv", text_field="text")) == [
      'a "quoted" text', "plain"]
  (tmp_path / "c.csv").write_text('x,y\n1,"multi\nline"\n2,z\n')
  assert list(sc.iterate_texts(tmp_path / "c.csv", text_fn=lambda r: r["x"] + r["y"])) == [
      "1multi\nline", "2z"]
  (tmp_path / "d.jsonl").write_text('{"t": "ok"}\n{"t": \n')
  with pytest.raises(ValueError, match=r"d\.jsonl:2: invalid JSON"):
    list(sc.iterate_texts(tmp_path / "d.jsonl", text_field="t"))
  with pytest.raises(ValueError, match="give text_field or text_fn"):
    sc.register_span_corruption_task("test_sc_bad", vocabulary=None,
                                     text_files=[tmp_path / "a.jsonl"])


def test_file_sources_are_streamed(vocabulary, tmp_path):
  lines = 1_000_000
  txt = tmp_path / "big.txt"
  with open(txt, "w") as f:
    f.writelines(f"why would you skip the party number {i} ?\n" for i in range(lines))
  task = sc.register_span_corruption_task("test_sc_txt", vocabulary=vocabulary,
                                          text_files=[str(txt)])
  start = time.perf_counter()
  it = task.get_dataset({"inputs": 64, "targets": 64}, split="train", shuffle=False,
                        seed=0).as_numpy_iterator()
  first = [next(it) for _ in range(3)]
  # Tokenising the whole file takes minutes on 2 cores; the first examples need ~200 lines.
  assert time.perf_counter() - start < 8.0
  assert all(len(ex["inputs"]) == 64 for ex in first)
  # A generator source: count the rows read when the first example arrives.
  jsonl = tmp_path / "big.jsonl"
  with open(jsonl, "w") as f:
    f.writelines(json.dumps({"text": f"row {i} of the file"}) + "\n" for i in range(100_000))
  rows_read = []

  def text_fn(row):
    rows_read.append(1)
    return row["text"]

  task = sc.register_span_corruption_task("test_sc_jsonl", vocabulary=vocabulary,
                                          text_files={"train": [str(jsonl)]}, text_fn=text_fn)
  it = task.get_dataset({"inputs": 64, "targets": 64}, split="train", shuffle=False,
                        seed=0).as_numpy_iterator()
  next(it)
  assert 0 < len(rows_read) < 5_000


def test_pretraining_mixture_demo_corpus(vocab_path, tmp_path):
  out = tmp_path / "corpus"
  task = pretraining_corpus.register_pretraining_mixture(
      data_dir=None, sources=("demo",), vocabulary_path=vocab_path, output_dir=str(out),
      task_name="test_pretrain_demo", validation_every=10)
  paths = pretraining_corpus.corpus_paths(out)
  train = pathlib.Path(paths["train"]).read_text().splitlines()
  valid = pathlib.Path(paths["validation"]).read_text().splitlines()
  texts = list(dict.fromkeys(" ".join(t.split()) for t in demo.all_texts()))
  # The files hold every text once, in a seeded random order (not the sources' order).
  expected = [texts[i] for i in np.random.default_rng(
      pretraining_corpus.CORPUS_ORDER_SEED).permutation(len(texts))]
  assert expected != texts
  assert valid == expected[::10]
  assert train == [t for i, t in enumerate(expected) if i % 10]
  assert set(task.splits) == {"train", "validation"}
  example = next(task.get_dataset({"inputs": 32, "targets": 16}, split="validation",
                                  shuffle=False, seed=0).as_numpy_iterator())
  assert len(example["inputs"]) == 32 and example["targets"][0] == 499
  # Same arguments: nothing rebuilt or re-registered.
  mtime = os.path.getmtime(paths["train"])
  again = pretraining_corpus.register_pretraining_mixture(
      data_dir=None, sources=("demo",), vocabulary_path=vocab_path, output_dir=str(out),
      task_name="test_pretrain_demo", validation_every=10)
  assert again is task and os.path.getmtime(paths["train"]) == mtime
  with pytest.raises(ValueError, match="need data_dir"):
    pretraining_corpus.corpus_texts(None, sources=("clarify",))


def test_corpus_from_shared_data_excludes_held_out_splits(shared_dir):
  import csv
  data = shared_dir / "data"

  def column_texts(path, *names):
    with open(path, newline="", encoding="utf-8") as f:
      rows = list(csv.DictReader(f, delimiter="\t"))
    return [" ".join(r[n].split()) for r in rows for n in names]

  clarify = pretraining_corpus.corpus_texts(data, sources=("clarify",))
  train = column_texts(data / "delta_clarify" / "train.tsv", "situation", "question")
  assert clarify == list(dict.fromkeys(t for t in train if t))
  dev_only = set(column_texts(data / "delta_clarify" / "dev.tsv", "question")) - set(train)
  assert dev_only and not dev_only & set(clarify)
  claims = json.loads((data / "perspectrum" / "perspectrum_with_answers_v1.0.json").read_text())
  split = json.loads((data / "perspectrum" / "dataset_split_v1.0.json").read_text())
  perspectrum = set(pretraining_corpus.corpus_texts(data, sources=("perspectrum",)))
  for claim in claims[:100]:
    assert (" ".join(claim["text"].split()) in perspectrum) == (split[str(claim["cId"])]
                                                                 == "train")
  silver = pretraining_corpus.corpus_texts(data, sources=("silver",))
  assert "You are not financially stable to help out" in silver
  fusion = pretraining_corpus.corpus_texts(data, sources=("fusion",))
  assert "getting your family member's support by asking them" in fusion


def test_gin_config_registers_the_task(shared_dir, tmp_path):
  from jaxmoral import gin_utils
  from jaxmoral import runs
  del shared_dir
  gin.clear_config()
  try:
    # The chitchat source needs the dialogue extra, which tests do not install.
    gin_utils.parse_gin(gin_utils.GinArgs(
        files=("configs/core/pretrain_span_corruption.gin",),
        bindings=(f"MODEL_DIR = '{tmp_path}'",
                  "pretraining_corpus.register_pretraining_mixture.sources = "
                  f"{list(pretraining_corpus.DEFAULT_SOURCES)}")))
    assert gin.query_parameter("%TASK_FEATURE_LENGTHS") == {"inputs": 256, "targets": 58}
    data = gin.get_configurable(runs.Seq2SeqData)()
    assert data.mixture_or_task_name == pretraining_corpus.PRETRAIN_TASK
    task = seqio.get_mixture_or_task(data.mixture_or_task_name)
    assert set(task.splits) == {"train", "validation"}
    assert task.output_features["targets"].vocabulary.vocab_size == 32100
    assert os.path.isfile(pretraining_corpus.corpus_paths(tmp_path)["train"])
  finally:
    gin.clear_config()


def test_the_chitchat_source_is_skipped_with_a_notice_without_the_dialogue_extra(
    monkeypatch, caplog):
  import importlib.util  # pylint: disable=g-import-not-at-top
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "chitchat_dataset" else real(name, *a))
  with caplog.at_level("WARNING"):
    assert pretraining_corpus.installed_sources(["demo", "chitchat"]) == ["demo"]
  notices = [r.getMessage() for r in caplog.records if "chitchat" in r.getMessage()]
  assert len(notices) == 1 and "dialogue extra" in notices[0]
  assert pretraining_corpus.installed_sources(["demo"]) == ["demo"]
  monkeypatch.setattr(importlib.util, "find_spec", real)
  if real("chitchat_dataset") is not None:
    assert pretraining_corpus.installed_sources(["chitchat"]) == ["chitchat"]


def _pretraining_data_folder(root: pathlib.Path) -> pathlib.Path:
  """A small folder laid out like ../shared/data for the corpus sources that read files."""
  files = {
      "delta_clarify/train.tsv": "id\tsource\tsituation\tquestion\n"
                                 "0\tMTurk\tskipping the party\tWhy are you skipping it?\n"
                                 "1\tMTurk\tfeeding the cat\tWhat do you feed it?\n",
      "delta_clarify_silver/silver.tsv":
          "DataSource\tHypothesis\tUpdate\tUpdateType\tquestion_davinci\tsituation\n"
          "SC\tIt's rude to skip parties.\tI was sick.\tweakener\tWhy skip?\tskipping it\n",
      "fusion/fusion.csv": "input,output\nSITUATION: a QUESTION: b ANSWER: c,a because c\n",
      "perspectrum/perspectrum_with_answers_v1.0.json": json.dumps([
          {"cId": 1, "text": "Zoos should be banned.", "perspectives": [
              {"pids": [10], "stance_label_3": "SUPPORT"},
              {"pids": [11], "stance_label_3": "UNDERMINE"}]}]),
      "perspectrum/perspective_pool_v1.0.json": json.dumps([
          {"pId": 10, "text": "Animals suffer in cages."},
          {"pId": 11, "text": "Zoos protect endangered species."}]),
      "perspectrum/dataset_split_v1.0.json": json.dumps({"1": "train"}),
  }
  for name, text in files.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text, encoding="utf-8")
  return root


def test_pretraining_corpus_reads_its_data_from_and_writes_its_files_to_a_bucket(gcs, tmp_path):
  """data_dir and output_dir (CORPUS_DIR, = MODEL_DIR) may be gs://: the same texts, corpus
  files and examples as from and to local folders, nothing under a local "gs:" folder."""
  from conftest import upload_folder  # pylint: disable=g-import-not-at-top
  from jaxmoral import fileio  # pylint: disable=g-import-not-at-top
  del gcs
  local = _pretraining_data_folder(tmp_path / "data")
  bucket = upload_folder(local, "gs://bucket/pretraining_data")
  sources = ("clarify", "silver", "fusion", "perspectrum")
  texts = pretraining_corpus.corpus_texts(bucket, sources=sources)
  assert texts == pretraining_corpus.corpus_texts(local, sources=sources)
  assert {"Why skip?", "Zoos protect endangered species."} <= set(texts)

  corpus = "gs://bucket/pretraining_corpus"
  kwargs = dict(sources=sources, validation_every=2)
  task = pretraining_corpus.register_pretraining_mixture(
      data_dir=bucket, vocabulary_path=None, output_dir=corpus, task_name="bucket_pretrain",
      **kwargs)
  vocabulary = f"{corpus}/demo_spm_{vocab_lib.DEMO_VOCAB_SIZE}.model"  # Built, then uploaded.
  assert {"pretraining_corpus_train.txt", "pretraining_corpus_validation.txt",
          pretraining_corpus.MANIFEST, os.path.basename(vocabulary)} <= set(
              fileio.listdir(corpus))
  local_task = pretraining_corpus.register_pretraining_mixture(
      data_dir=local, vocabulary_path=fileio.local_copy(vocabulary),
      output_dir=str(tmp_path / "corpus"), task_name="local_pretrain", **kwargs)
  def examples(t, split):
    return list(t.get_dataset({"inputs": 16, "targets": 8}, split=split, shuffle=False,
                              seed=0).as_numpy_iterator())

  for split, path in pretraining_corpus.corpus_paths(corpus).items():
    assert fileio.read_text(path) == (tmp_path / "corpus" / os.path.basename(path)).read_text()
    got, want = examples(task, split), examples(local_task, split)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
      np.testing.assert_array_equal(a["inputs"], b["inputs"])
      np.testing.assert_array_equal(a["targets"], b["targets"])
  # A second registration with the same settings reads the manifest from the bucket and
  # writes nothing.
  before = fileio.version(pretraining_corpus.corpus_paths(corpus)["train"])
  pretraining_corpus.build_corpus(data_dir=bucket, output_dir=corpus, **kwargs)
  assert fileio.version(pretraining_corpus.corpus_paths(corpus)["train"]) == before
  assert not os.path.exists("gs:")
  with pytest.raises(FileNotFoundError, match="gs://bucket/missing is not a folder"):
    pretraining_corpus.corpus_texts("gs://bucket/missing", sources=sources)
