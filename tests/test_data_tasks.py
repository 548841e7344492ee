"""Tests for jaxmoral.data.tasks: seqio Tasks stream (deterministic, resumable, sharded) the
features encode_pairs makes, without materialising them."""

import json
import os
import shutil

import numpy as np
import pytest
import seqio

from jaxmoral import integrity
from jaxmoral.data import demo, tasks, vocab
from jaxmoral.data import pairs as pairs_lib
from jaxmoral.data.pipeline import encode_pairs

LENGTHS = {"inputs": 24, "targets": 12}


@pytest.fixture(scope="module")
def vocab_path(tmp_path_factory):
  return vocab.build_demo_vocabulary(output_dir=tmp_path_factory.mktemp("vocab"))


@pytest.fixture(scope="module")
def vocabulary(vocab_path):
  return vocab.get_vocabulary(vocab_path)


def one_pass(name, split="train", **kwargs):
  """Every example of a split, in order, through `TaskSource.eval_batches` (padding dropped)."""
  source = tasks.TaskSource(name, split, kwargs.pop("feature_lengths", LENGTHS), 8,
                            shuffle=False, **kwargs)
  batches = list(source.eval_batches())
  out = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
  keep = out["decoder_target_tokens"].any(-1)
  return {k: v[keep] for k, v in out.items()}


def test_in_memory_task_streams_the_features_of_encode_pairs(vocabulary):
  pairs = [(r["situation"], r["question"]) for r in demo.clarify_questions()[:40]]
  pairs.append(("a very long situation " * 10, "and an equally long question " * 5))
  tasks.register_text_pair_task("jm_test_pairs", vocabulary=vocabulary, examples=pairs)
  got = one_pass("jm_test_pairs")
  want = encode_pairs([x for x, _ in pairs], [y for _, y in pairs], vocabulary=vocabulary,
                      feature_lengths=LENGTHS)
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert got["decoder_target_tokens"][-1, -1] == 1  # Truncated, EOS kept.
  assert tasks.TaskSource("jm_test_pairs", "train", LENGTHS, 8).num_examples == 41


def test_file_task_and_packing_match(vocabulary):
  path = demo.path("clarify_fusion.csv")
  tasks.register_text_pair_task("jm_test_fusion", vocabulary=vocabulary, file=str(path),
                                input_field="input", target_field="output")
  rows = demo.clarify_fusion()[:12]
  lengths = {"inputs": 64, "targets": 32}
  tasks.register_text_pair_task("jm_test_fusion12", vocabulary=vocabulary,
                                examples=[(r["input"], r["output"]) for r in rows])
  got = one_pass("jm_test_fusion12", feature_lengths=lengths, pack=True)
  want = encode_pairs([r["input"] for r in rows], [r["output"] for r in rows],
                      vocabulary=vocabulary, feature_lengths=lengths, pack=True)
  # seqio packs greedily in order (next-fit), ours is first-fit: compare per-example content.
  def segments(f):
    out = []
    for r in range(len(f["encoder_input_tokens"])):
      for s in range(1, f["encoder_segment_ids"][r].max() + 1):
        out.append(tuple(f["encoder_input_tokens"][r][f["encoder_segment_ids"][r] == s])
                   + (-1,) + tuple(f["decoder_input_tokens"][r][f["decoder_segment_ids"][r] == s]))
    return sorted(out)
  assert segments(got) == segments(want)
  full = one_pass("jm_test_fusion", feature_lengths=lengths)
  assert len(full["encoder_input_tokens"]) == len(demo.clarify_fusion())


def test_demo_mixture_stream_is_deterministic_resumable_and_sharded(vocabulary, monkeypatch):
  # A quarter of the rows a Mixture's cache holds by default: enough for every batch drawn
  # here, and tf.data then builds a quarter of the rows for each cache (seeds 1 and 2).
  monkeypatch.setattr(tasks, "MIN_MIXTURE_ROWS", 512)
  mixture = tasks.register_demo_tasks(vocabulary=vocabulary)
  assert isinstance(mixture, seqio.Mixture)
  src = tasks.TaskSource(tasks.DEMO_MIXTURE, "train", LENGTHS, 8, seed=1)
  sizes = [seqio.get_mixture_or_task(t).num_input_examples("train") for t in tasks.DEMO_TASKS]
  assert src.num_examples == sum(sizes) == 144 + 90 + 144  # 9 in 10 of each train.
  stream = src.iterate(0)
  first = [next(stream) for _ in range(6)]
  for v in first[5].values():
    assert v.shape[0] == 8 and v.dtype == np.int32
  # The position is the step: a stream resumed at 5 continues exactly, a new one repeats it.
  resumed = next(src.iterate(5))
  for k in resumed:
    np.testing.assert_array_equal(resumed[k], first[5][k])
  again = next(tasks.TaskSource(tasks.DEMO_MIXTURE, "train", LENGTHS, 8, seed=1).iterate(0))
  np.testing.assert_array_equal(again["encoder_input_tokens"], first[0]["encoder_input_tokens"])
  other = next(tasks.TaskSource(tasks.DEMO_MIXTURE, "train", LENGTHS, 8, seed=2).iterate(0))
  assert not np.array_equal(other["encoder_input_tokens"], first[0]["encoder_input_tokens"])
  # Two processes' shards: half the rows each, together every example of the split once.
  val = dict(feature_lengths=LENGTHS)
  halves = [one_pass(tasks.DEMO_TASKS[2], "validation", shard_index=i, shard_count=2, **val)
            for i in range(2)]
  whole = one_pass(tasks.DEMO_TASKS[2], "validation", **val)
  joined = sorted(map(tuple, np.concatenate([h["encoder_input_tokens"] for h in halves])))
  assert joined == sorted(map(tuple, whole["encoder_input_tokens"]))
  assert tasks.TaskSource(tasks.DEMO_MIXTURE, "train", LENGTHS, 8).shard(1, 2).per_shard_batch_size == 4
  judgments = demo.clarify_judgments()[::10]
  want = encode_pairs(["judge: " + r["situation"] for r in judgments],
                      [r["judgment"] for r in judgments], vocabulary=vocabulary,
                      feature_lengths=LENGTHS)
  np.testing.assert_array_equal(whole["decoder_target_tokens"], want["decoder_target_tokens"])


def test_bad_arguments(vocabulary, tmp_path):
  with pytest.raises(ValueError, match="exactly one of examples, file"):
    tasks.register_text_pair_task("jm_bad", vocabulary=vocabulary)
  bad = tmp_path / "bad.tsv"
  bad.write_text("inputs\ttargets\nok\tfine\nbroken\n")
  with pytest.raises(ValueError, match=r"bad\.tsv:3: expected 2 columns"):
    tasks.register_text_pair_task("jm_bad", vocabulary=vocabulary, file=str(bad))
  tasks.register_text_pair_task("jm_one", vocabulary=vocabulary, examples=[("a", "b")])
  with pytest.raises(ValueError, match="no split 'validation'"):
    tasks.TaskSource("jm_one", "validation", LENGTHS, 8)
  with pytest.raises(ValueError, match="not divisible by shard_count"):
    tasks.TaskSource("jm_one", "train", LENGTHS, 9, shard_count=2)


def test_mixture_rates_decide_the_mix(vocabulary, monkeypatch):
  # Task a: 10 examples, task b: 30; seqio samples the Tasks at their rates. Each Mixture's
  # cache holds 512 rows (a quarter of the default, fewer for tf.data to build): the share of
  # a among them has a standard deviation of at most 0.022.
  monkeypatch.setattr(tasks, "MIN_MIXTURE_ROWS", 512)
  # Letters, not digits: the demo vocabulary has no digits.
  words = [f"{x} {y}" for x in "abc" for y in "defghijklm"]
  tasks.register_text_pair_task("jm_mix_a", vocabulary=vocabulary,
                                examples=[(f"alpha {w}", "a") for w in words[:10]])
  tasks.register_text_pair_task("jm_mix_b", vocabulary=vocabulary,
                                examples=[(f"beta {w}", "b") for w in words])
  target_a = encode_pairs(["x"], ["a"], vocabulary=vocabulary,
                          feature_lengths=LENGTHS)["decoder_target_tokens"][0]

  def share_of_a(rates, seed=0, batches=50):
    seqio.MixtureRegistry.remove("jm_mix")
    seqio.MixtureRegistry.add("jm_mix", list(zip(["jm_mix_a", "jm_mix_b"], rates)))
    stream = tasks.TaskSource("jm_mix", "train", LENGTHS, 8, seed=seed).iterate(0)
    targets = np.concatenate([next(stream)["decoder_target_tokens"] for _ in range(batches)])
    return float((targets == target_a).all(-1).mean())

  # 400 draws: the binomial standard deviation of a share is at most 0.025.
  assert share_of_a([3.0, 1.0]) == pytest.approx(0.75, abs=0.08)
  assert share_of_a([1.0, 1.0]) == pytest.approx(0.5, abs=0.08)
  assert share_of_a([1.0, 0.0], batches=5) == 1.0
  assert share_of_a([10.0, 30.0]) == pytest.approx(0.25, abs=0.08)


def test_training_order_is_a_permutation_of_the_whole_split_every_epoch(vocabulary):
  # Pairs stored in blocks, as a multi-task file written task by task: 1,200 of target "a",
  # then 1,200 of "b". seqio's own 1,000-example shuffle window alone served the first 25
  # batches of 40 with "a" only, which a multi-task model then learns as role blocks.
  letters = "abcdefghijklmnop"
  words = [f"{x} {y} {z}" for x in letters for y in letters for z in letters][:2400]
  pairs = [(w, "a" if i < 1200 else "b") for i, w in enumerate(words)]
  tasks.register_text_pair_task("jm_blocks", vocabulary=vocabulary, examples=pairs)
  target_b = encode_pairs(["x"], ["b"], vocabulary=vocabulary,
                          feature_lengths=LENGTHS)["decoder_target_tokens"][0]
  stream = tasks.TaskSource("jm_blocks", "train", LENGTHS, 40, seed=3).iterate(0)
  batches = [next(stream) for _ in range(150)]  # Two and a half epochs.
  first = np.concatenate([b["decoder_target_tokens"] for b in batches[:5]])
  # 200 draws without replacement: the share's standard deviation is about 0.035.
  assert (first == target_b).all(-1).mean() == pytest.approx(0.5, abs=0.15)
  # A new permutation each epoch: an example's position in the second epoch is unrelated to
  # its position in the first (seqio's window, after the repeat, blurs the epochs' edges).
  inputs = [tuple(row) for b in batches for row in b["encoder_input_tokens"]]
  first_seen, second_seen = {}, {}
  for position, row in enumerate(inputs):
    (second_seen if row in first_seen else first_seen).setdefault(row, position)
  both = [row for row in first_seen if row in second_seen]
  assert len(both) > 2000
  correlation = np.corrcoef([first_seen[r] for r in both], [second_seen[r] for r in both])[0, 1]
  assert abs(correlation) < 0.2, correlation


def test_a_ten_million_example_task_trains_in_bounded_memory(vocabulary, tmp_path):
  """Nothing is materialised: a 10M-example Task starts training at once, in bounded memory."""
  import resource  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jaxmoral import optimizers, partitioning, runs  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import config, trainable  # pylint: disable=g-import-not-at-top
  count = 10_000_000
  words = tf.constant(["good", "bad", "help", "friend", "lie", "okay", "why", "ask"])

  def dataset_fn(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    def example(i):
      pick = lambda k: tf.gather(words, (i * k) % 8)  # noqa: E731
      return {"inputs": tf.strings.join([pick(3), pick(5), pick(7)], " "),
              "targets": pick(11)}
    return tf.data.Dataset.range(count).map(example)

  seqio.TaskRegistry.remove("jm_ten_million")
  features = {k: seqio.Feature(vocabulary=vocab.as_seqio(vocabulary)) for k in ("inputs", "targets")}
  seqio.TaskRegistry.add(
      "jm_ten_million", source=seqio.FunctionDataSource(
          dataset_fn, splits=["train"], num_input_examples={"train": count}),
      output_features=features,
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim])
  before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
  tick = time.perf_counter()
  result = runs.train_run(
      model_dir=str(tmp_path / "run"),
      model=trainable.Seq2SeqModel(config=config.t5_config(
          size="tiny", num_encoder_layers=1, num_decoder_layers=1)),
      data=runs.Seq2SeqData(mixture_or_task_name="jm_ten_million",
                            vocabulary_path=vocabulary.sentencepiece_model_file),
      train_steps=3, batch_size=8, feature_lengths={"inputs": 8, "targets": 4},
      optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-3),
      # One device: what is tested is the data, and one device's step compiles fastest.
      partitioner=partitioning.PjitPartitioner(devices=jax.devices()[:1]), log_every=3,
      checkpoint_every=3)
  seconds = time.perf_counter() - tick
  grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # MiB
  assert result["step"] == 3
  # Materialising 10M examples would take many minutes and gigabytes.
  assert seconds < 60 and grown < 600, (seconds, grown)
  # The stream's position at the checkpoint is kept with the run: a resume restores it.
  assert (tmp_path / "run" / "data_position" / "3" / "process_0-of-1" / "iterator.index"
          ).is_file()


def test_file_task_errors_name_the_file(vocabulary, tmp_path):
  header_only = tmp_path / "empty.tsv"
  header_only.write_text("inputs\ttargets\n")
  with pytest.raises(ValueError, match=r"split 'train' is empty \(file .*empty\.tsv has no rows"):
    tasks.register_text_pair_task("jm_empty", vocabulary=vocabulary, file=str(header_only))
  typed = tmp_path / "typed.jsonl"
  typed.write_text('{"inputs": "ok", "targets": "fine"}\n{"inputs": true, "targets": 3.5}\n')
  with pytest.raises(ValueError, match=r"typed\.jsonl:2: expected a string, got true"):
    pairs_lib.read_pairs(typed, input_field="inputs", target_field="targets")


def test_a_resumed_run_keeps_its_heldout_rule(vocab_path, vocabulary, tmp_path, monkeypatch):
  """A run without the setting (saved before "hash") resumes holding out by position; a
  new run holds out by hash; the setting is saved; an eval file makes it moot."""
  from jaxmoral import model_dirs, optimizers, run_dirs, runs  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import trainable  # pylint: disable=g-import-not-at-top
  pairs = tmp_path / "pairs.tsv"
  pairs.write_text("inputs\ttargets\n" + "".join(f"in {i}\tout {i}\n" for i in range(30)))
  data = runs.Seq2SeqData(train_file=str(pairs), vocabulary_path=vocab_path)
  assert data.heldout == "hash" and data.settings() == {"kind": "seq2seq", "heldout": "hash"}
  assert data.resumed({"kind": "seq2seq"}).heldout == "position"
  assert data.resumed({}) is data  # no record of its data (a Hub checkpoint): the setting
  assert data.resumed({"kind": "seq2seq", "heldout": "hash"}) is data
  with_eval = runs.Seq2SeqData(train_file=str(pairs), eval_file=str(pairs))
  assert with_eval.resumed({}) is with_eval and "heldout" not in with_eval.settings()
  with pytest.raises(ValueError, match="Seq2SeqData.heldout must be one of"):
    runs.Seq2SeqData(train_file=str(pairs), heldout="every_10th")

  class Seen(Exception):
    pass

  def seen(self, *args, **kwargs):  # Where a run or eval first reads the pairs.
    del args, kwargs
    raise Seen(self.heldout)

  monkeypatch.setattr(runs.Seq2SeqData, "sources", seen)
  config = config_lib.t5_config(size="tiny", vocab_size=vocabulary.vocab_size, d_model=16,
                                d_kv=4, d_ff=32, num_encoder_layers=1, num_decoder_layers=1)
  run = dict(model=trainable.Seq2SeqModel(config=config), data=data, train_steps=2,
             batch_size=2, feature_lengths={"inputs": 8, "targets": 8},
             optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-3))
  old = tmp_path / "old"
  (old / "checkpoints" / "1").mkdir(parents=True)  # a run to resume (read after `sources`)
  (old / "settings.json").write_text('{"data": {"kind": "seq2seq"}}')
  for run_dir, want in ((old, "position"), (tmp_path / "new", "hash")):
    with pytest.raises(Seen, match=want):
      runs.train_run(model_dir=str(run_dir), **run)
  # A run refused before its first step changes nothing (its settings are rewritten only once
  # the resume is accepted; a new run that failed leaves no folder).
  assert run_dirs.read_settings(old)["data"] == {"kind": "seq2seq"}
  # `eval_run` evaluates a run on the pairs it held out.
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import t5  # pylint: disable=g-import-not-at-top
  params = nn.meta.unbox(jax.eval_shape(lambda: t5.init_params(t5.T5(config),
                                                               jax.random.PRNGKey(0))))
  params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), params)
  monkeypatch.setattr(runs.Seq2SeqData, "task_name", seen)
  for saved, want in (({"kind": "seq2seq"}, "position"), ({}, "hash")):
    export = tmp_path / f"export_{want}"
    model_dirs.export(export, params=params, config=config, vocabulary=vocabulary,
                      settings={"data": saved} if saved else None)
    with pytest.raises(Seen, match=want):
      runs.eval_run(model_dir=str(export), data=data, feature_lengths=run["feature_lengths"])


@pytest.fixture(scope="module")
def indexed(vocabulary, tmp_path_factory):
  """A 41-pair Task (5 batches of 8 an epoch) and its index cache folder."""
  pairs = [(f"question {a} {b}", f"answer {b}") for a in "abcdefg" for b in "hijklm"][:41]
  tasks.register_text_pair_task("jm_indexed", vocabulary=vocabulary, examples=pairs)
  return tmp_path_factory.mktemp("data_cache")


def test_resume_at_any_step_costs_the_same_and_continues_exactly(indexed):
  import time  # pylint: disable=g-import-not-at-top
  source = tasks.TaskSource("jm_indexed", "train", LENGTHS, 8, seed=4, cache_dir=str(indexed))
  stream = source.iterate(0)
  uninterrupted = [next(stream) for _ in range(13)]  # two and a half epochs
  # A resumed run (a new source: another process) reads batch k directly, equal to the
  # uninterrupted run's batch k, across epoch boundaries.
  resumed = tasks.TaskSource("jm_indexed", "train", LENGTHS, 8, seed=4,
                             cache_dir=str(indexed)).iterate(7)
  for want in uninterrupted[7:]:
    got = next(resumed)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])

  def seconds_to_first_batch(step):
    best = float("inf")
    for _ in range(3):
      tick = time.perf_counter()
      next(source.iterate(step))
      best = min(best, time.perf_counter() - tick)
    return best

  near, far = seconds_to_first_batch(10), seconds_to_first_batch(10_000)
  # Skipping 10,000 batches of a stream would take seconds; by index it is a gather.
  assert far <= 2 * near + 1e-3, (near, far)
  # Two processes' shards: the halves of every global batch.
  halves = [source.shard(i, 2).batch(10_000) for i in range(2)]
  whole = source.batch(10_000)
  for k in whole:
    np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), whole[k])


def test_changed_data_files_change_the_fingerprint(vocabulary, tmp_path):
  path = tmp_path / "pairs.tsv"
  path.write_text("inputs\ttargets\nhelp a friend\tgood\ntell a lie\tbad\n")
  tasks.register_text_pair_task("jm_changing", vocabulary=vocabulary, file=str(path))
  before = tasks.TaskSource("jm_changing", "train", LENGTHS, 2, cache_dir=str(tmp_path))
  same = tasks.TaskSource("jm_changing", "train", LENGTHS, 2, cache_dir=str(tmp_path))
  assert before.data_fingerprint == same.data_fingerprint
  path.write_text("inputs\ttargets\nhelp a friend\tbad\ntell a lie\tgood\n")
  tasks.register_text_pair_task("jm_changing", vocabulary=vocabulary, file=str(path))
  after = tasks.TaskSource("jm_changing", "train", LENGTHS, 2, cache_dir=str(tmp_path))
  assert after.data_fingerprint != before.data_fingerprint


def test_a_task_without_a_data_fingerprint_is_cached_per_process(vocabulary):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  words = tf.constant(["good", "bad", "help", "friend", "lie"])

  def dataset_fn(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.range(20).map(
        lambda i: {"inputs": tf.gather(words, i % 5), "targets": tf.gather(words, i // 5)})

  seqio.TaskRegistry.remove("jm_foreign")
  seqio.TaskRegistry.add(
      "jm_foreign", source=seqio.FunctionDataSource(dataset_fn, splits=["train"]),
      output_features={k: seqio.Feature(vocabulary=vocab.as_seqio(vocabulary)) for k in ("inputs", "targets")},
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim])
  source = tasks.TaskSource("jm_foreign", "train", LENGTHS, 4, seed=2)
  stream = source.iterate(0)
  uninterrupted = [next(stream) for _ in range(8)]  # 5 batches an epoch
  again = tasks.TaskSource("jm_foreign", "train", LENGTHS, 4, seed=2)
  np.testing.assert_array_equal(again.batch(6)["encoder_input_tokens"],
                                uninterrupted[6]["encoder_input_tokens"])
  assert again.data_fingerprint == source.data_fingerprint is not None
  assert again._cached_rows()[0]["encoder_input_tokens"].filename == (
      source._cached_rows()[0]["encoder_input_tokens"].filename)


def test_a_vocabulary_is_known_by_its_pieces_not_its_path(demo_vocab_path, tmp_path):
  """Two builds of the demo vocabulary (each records where it was trained) share data caches;
  a vocabulary with other pieces does not."""
  again = vocab.build_demo_vocabulary(output_dir=tmp_path / "again")
  other = vocab.build_demo_vocabulary(output_dir=tmp_path / "other", vocab_size=300)
  assert open(again, "rb").read() != open(demo_vocab_path, "rb").read()
  digest = [vocab.model_digest(vocab.get_vocabulary(p))
            for p in (demo_vocab_path, again, other)]
  assert digest[0] == digest[1] != digest[2]


def test_a_data_cache_serves_the_seqio_batches_without_tensorflow(vocab_path, vocabulary,
                                                                  tmp_path):
  """`cache_run` writes a config's rows to DATA_CACHE; read from there the batches, the
  evaluation pass and the fingerprint are the seqio path's, in a process that cannot import
  TensorFlow or seqio (where data without a cache says what is missing); another SEED or
  TASK_FEATURE_LENGTHS is refused in one line."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from jaxmoral import runs  # pylint: disable=g-import-not-at-top
  pairs = tmp_path / "pairs.tsv"
  pairs.write_text("inputs\ttargets\n" + "".join(f"help friend {i}\tanswer {i % 7}\n"
                                                 for i in range(90)))
  data = runs.Seq2SeqData(train_file=str(pairs), vocabulary_path=vocab_path, pack=True)
  cached = dataclasses.replace(data, cache_dir=str(tmp_path / "cache"))
  spec = runs.cache_run(data=cached, feature_lengths=LENGTHS, seed=3)
  assert spec["rows"]["eval"] == len(pairs_lib.split_pairs(
      pairs_lib.read_pairs(pairs, input_field="inputs", target_field="targets"))["validation"])
  kwargs = dict(vocabulary=vocabulary, batch_size=8, feature_lengths=LENGTHS, seed=3)
  (train, evaluation), (from_cache, eval_from_cache) = data.sources(**kwargs), cached.sources(
      **kwargs)
  assert from_cache.data_fingerprint == train.data_fingerprint is not None
  for step in (0, 9):
    for k, v in train.batch(step).items():
      np.testing.assert_array_equal(from_cache.batch(step)[k], v)
  for want, got in zip(evaluation.eval_batches(), eval_from_cache.eval_batches(), strict=True):
    for k, v in want.items():
      np.testing.assert_array_equal(got[k], v)
  child = f"""
import importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ("tensorflow", "seqio", "tensorflow_datasets"):
      raise ModuleNotFoundError(name, name=name)
sys.meta_path.insert(0, Blocked())
import os

import numpy as np
from jaxmoral import runs
data = runs.Seq2SeqData(train_file="elsewhere/pairs.tsv", pack=True, cache_dir={str(cached.cache_dir)!r})
vocabulary = data.vocabulary("unused")
train, _ = data.sources(vocabulary=vocabulary, batch_size=8, feature_lengths={LENGTHS!r}, seed=3)
np.save({str(tmp_path / "child.npy")!r}, train.batch(9)["encoder_input_tokens"])
try:  # Data without a cache needs seqio: one line saying so.
  runs.Seq2SeqData(mixture_or_task_name="t").sources(vocabulary=vocabulary, batch_size=8,
                                                     feature_lengths={LENGTHS!r}, seed=3)
except ValueError as error:
  assert "is not installed here" in str(error) and "DATA_CACHE" in str(error), error
else:
  raise AssertionError("no error without seqio")
"""
  done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                        check=False, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-3000:]
  np.testing.assert_array_equal(np.load(tmp_path / "child.npy"),
                                train.batch(9)["encoder_input_tokens"])
  with pytest.raises(ValueError, match=r"cache_dir: .* holds rows for seed=3, this run has 4"):
    cached.sources(**{**kwargs, "seed": 4})
  with pytest.raises(ValueError, match=r"holds rows for feature_lengths="):
    cached.sources(**{**kwargs, "feature_lengths": {"inputs": 32, "targets": 12}})
  _check_a_written_cache_is_verified(cached, kwargs, tmp_path)


def _check_a_written_cache_is_verified(cached, kwargs, tmp_path):
  """A DATA_CACHE is verified before training on it, whatever happened to it after it was
  written: a changed, truncated or foreign `.npy` is refused naming the file, and the data
  fingerprint is the verified files' (never copied from meta.json)."""
  from jaxmoral.data import index_cache  # pylint: disable=g-import-not-at-top
  train = os.path.join(cached.cache_dir, "train")
  good = tmp_path / "good"
  shutil.copytree(train, good)
  victim = os.path.join(train, "encoder_input_tokens.npy")
  rows = np.load(victim)
  flipped = rows ^ 1  # One bit in every row; same size, a valid .npy.
  np.save(victim, flipped)
  with pytest.raises(index_cache.CacheDamagedError, match=rf"{victim} is damaged: its bytes"):
    cached.sources(**kwargs)
  # The same flip with meta.json's digest of the file edited to match: the fingerprint is
  # computed from the files, so it no longer is the checkpointed one.
  meta = json.loads(open(os.path.join(train, index_cache.META)).read())
  meta["files"]["encoder_input_tokens.npy"]["sha256"] = integrity.file_sha256(victim)
  open(os.path.join(train, index_cache.META), "w").write(json.dumps(meta))
  with pytest.raises(index_cache.CacheDamagedError, match="fingerprint does not match"):
    cached.sources(**kwargs)
  # Cut short: named, not "mmap length is greater than file size".
  shutil.rmtree(train)
  shutil.copytree(good, train)
  with open(victim, "r+b") as f:
    f.truncate(os.path.getsize(victim) - 7)
  with pytest.raises(index_cache.CacheDamagedError, match=rf"{victim} is damaged: .*truncated"):
    cached.sources(**kwargs)
  # A train/ folder of a cache with other lengths (consistent in itself) under this spec.
  shutil.rmtree(train)
  wider = {k: np.pad(np.load(good / k), ((0, 0), (0, 8))) for k in os.listdir(good)
           if k.endswith(".npy")}
  index_cache.write(train, [{k[:-4]: v for k, v in wider.items()}], {"other": True})
  with pytest.raises(ValueError, match=rf"{train}/\w+\.npy holds rows of length (32|20), this "
                     r"run's (inputs|targets) length is (24|12) \(TASK_FEATURE_LENGTHS\)"):
    cached.sources(**kwargs)
  shutil.rmtree(train)
  shutil.copytree(good, train)
  assert cached.sources(**kwargs)[0].data_fingerprint  # Restored: accepted again.


def test_tfds_data_dir_points_a_tfds_task_at_a_bucket_read_by_tensorflows_client(
    tensorflow_gcs, demo_vocab_path, tmp_path):
  """`--tfds_data_dir=gs://...` (T5X's flag): a TFDS-backed Task's prepared data is read from
  the bucket by TFDS and TensorFlow's own GCS client, and `jaxmoral cache` writes the same
  rows as from a local copy of the same data."""
  import gin  # pylint: disable=g-import-not-at-top

  from conftest import tfds_pairs_task  # pylint: disable=g-import-not-at-top
  from conftest import upload_folder  # pylint: disable=g-import-not-at-top
  from jaxmoral import cli, runs  # pylint: disable=g-import-not-at-top
  pairs = {"inputs": [f"help friend {i}" for i in range(24)],
           "targets": [f"answer {i % 5}" for i in range(24)]}
  vocabulary = vocab.get_vocabulary(demo_vocab_path)
  lengths = {"inputs": 48, "targets": 24}  # configs/core/tiny_cpu.gin's.
  try:
    with tfds_pairs_task("tfds_test_pairs", "jaxmoral_test_pairs", tmp_path / "tfds", pairs,
                         vocabulary_path=demo_vocab_path, validation_rows=4):
      bucket = upload_folder(tmp_path / "tfds", "gs://bucket/tfds")
      for name, data_dir in (("bucket", bucket), ("local", str(tmp_path / "tfds"))):
        gin.clear_config()
        assert cli.main(["cache", f"--tfds_data_dir={data_dir}",
                         "--gin_file=configs/core/tiny_cpu.gin",
                         "--gin.MIXTURE_OR_TASK_NAME='tfds_test_pairs'",
                         f"--gin.DATA_CACHE='{tmp_path / name}'", "--gin.BATCH_SIZE=4",
                         f"--gin.VOCABULARY_PATH='{demo_vocab_path}'",
                         f"--gin.MODEL_DIR='{tmp_path / 'unused'}'"]) == 0
  finally:
    gin.clear_config()
    seqio.set_tfds_data_dir_override(None)
  # The bucket's records were read by TensorFlow's client (through the proxy), not gcsfs.
  import urllib.parse  # pylint: disable=g-import-not-at-top
  read = [urllib.parse.unquote(r) for r in tensorflow_gcs]
  assert ("storage.googleapis.com /bucket/tfds/jaxmoral_test_pairs/1.0.0/"
          "jaxmoral_test_pairs-train.tfrecord-00000-of-00001") in read, read[:5]
  kwargs = dict(vocabulary=vocabulary, batch_size=4, feature_lengths=lengths, seed=0)
  got, _ = runs.Seq2SeqData(mixture_or_task_name="tfds_test_pairs",
                            cache_dir=str(tmp_path / "bucket")).sources(**kwargs)
  want, _ = runs.Seq2SeqData(mixture_or_task_name="tfds_test_pairs",
                             cache_dir=str(tmp_path / "local")).sources(**kwargs)
  assert got.num_examples == want.num_examples == 24
  for step in (0, 5):
    for key, value in want.batch(step).items():
      np.testing.assert_array_equal(got.batch(step)[key], value)


def _register_two_task_mixture(name, vocabulary):
  """Registers `name`: Tasks `name_a` (10 "alpha ..." rows) and `name_b` (30 "beta ..."
  rows), mixed 1:2, so a batch's first token tells which Task a row came from."""
  words = [f"{x} {y}" for x in "abc" for y in "defghijklm"]
  tasks.register_text_pair_task(f"{name}_a", vocabulary=vocabulary,
                                examples=[(f"alpha {w}", "a") for w in words[:10]])
  tasks.register_text_pair_task(f"{name}_b", vocabulary=vocabulary,
                                examples=[(f"beta {w}", "b") for w in words])
  seqio.MixtureRegistry.remove(name)
  seqio.MixtureRegistry.add(name, [(f"{name}_a", 1.0), (f"{name}_b", 2.0)])


def test_a_streamed_mixture_resumes_from_its_saved_position_without_replay(vocabulary,
                                                                           tmp_path):
  """A two-Task Mixture forced to stream (max_cached_examples=1): each shard's tf.data
  position is saved every `position_every` batches; a resume (a new source, as a restarted
  process builds) restores it and continues with exactly the uninterrupted run's batches,
  and one at step 10,000 starts as fast as one at step 10."""
  import time  # pylint: disable=g-import-not-at-top
  _register_two_task_mixture("jm_pos", vocabulary)
  lengths = {"inputs": 8, "targets": 4}

  def source(every, shard=(0, 1), batch_size=2):
    return tasks.TaskSource("jm_pos", "train", lengths, batch_size, seed=3,
                            max_cached_examples=1, position_dir=str(tmp_path / "pos"),
                            position_every=every, shard_index=shard[0], shard_count=shard[1])

  assert not source(5)._cacheable()  # Streamed.

  def first_batches_after(start, shard, count):
    began = time.perf_counter()
    stream = source(5, shard).iterate(start)
    first = next(stream)
    return time.perf_counter() - began, [first] + [next(stream) for _ in range(count - 1)]
  # Each process its own shard's positions: shard 0 resumes at a saved position (10), shard 1
  # between two (12: restored at 10, then 2 batches read).
  for shard, start in (((0, 2), 10), ((1, 2), 12)):
    stream = source(5, shard).iterate(0)
    uninterrupted = [next(stream) for _ in range(start + 2)]
    assert (tmp_path / "pos" / "10" / f"process_{shard[0]}-of-2").is_dir()
    seconds, resumed = first_batches_after(start, shard, 2)
    if shard[0] == 0:
      near = seconds
    for got, want in zip(resumed, uninterrupted[start:], strict=True):
      for k in want:
        np.testing.assert_array_equal(got[k], want[k])
  # A far position costs what a near one does: the first batch after a resume at 10,000 (the
  # stream advanced to it inside TensorFlow and its position saved as `iterate` saves it).
  far_source = source(5, (0, 2))
  iterator = iter(far_source._dataset(repeat=True))
  tasks._advance(iterator, 10_000)
  far_source._save_position(iterator, 10_000)
  want = {k: np.asarray(v, np.int32) for k, v in next(iterator).items()}
  far, (got,) = first_batches_after(10_000, (0, 2), 1)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k])
  # Each the best of three resumes (the first ones above included), as a benchmark times: one
  # resume on a loaded machine can stall for a second whatever its position.
  near = min(near, *(first_batches_after(10, (0, 2), 1)[0] for _ in range(2)))
  far = min(far, *(first_batches_after(10_000, (0, 2), 1)[0] for _ in range(2)))
  assert far < 2 * near, (far, near)


def test_a_streamed_mixture_run_resumed_trains_exactly_as_the_uninterrupted_run(
    vocab_path, vocabulary, tmp_path, monkeypatch):
  """`runs.train_run` on a two-Task Mixture forced to stream (TaskSource.max_cached_examples
  bound to 1 in gin, as a config would bind it): stopped at step 2 and resumed to step 4, it
  restores the stream's saved position (no batch read again) and trains on exactly the
  uninterrupted run's batches, to the same parameters."""
  import gin  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jaxmoral import model_dirs, optimizers, partitioning, runs  # pylint: disable=g-import-not-at-top
  from jaxmoral import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import trainable  # pylint: disable=g-import-not-at-top
  _register_two_task_mixture("jm_run", vocabulary)
  read = {"into": []}
  step = trainer_lib.Trainer.train_step

  def recording_step(self, state, batch, rng):
    read["into"].append({k: np.asarray(v) for k, v in batch.items()})
    return step(self, state, batch, rng)

  monkeypatch.setattr(trainer_lib.Trainer, "train_step", recording_step)
  replayed = []
  advance = tasks._advance
  monkeypatch.setattr(tasks, "_advance", lambda it, n: (replayed.append(n), advance(it, n)))
  config = config_lib.t5_config(size="tiny", vocab_size=vocabulary.vocab_size, d_model=16,
                                d_kv=4, d_ff=32, num_encoder_layers=1, num_decoder_layers=1)

  def train(name, steps):
    read["into"] = read.get(name, [])
    read[name] = read["into"]
    return runs.train_run(
        model_dir=str(tmp_path / name), model=trainable.Seq2SeqModel(config=config),
        data=runs.Seq2SeqData(mixture_or_task_name="jm_run", vocabulary_path=vocab_path),
        train_steps=steps, batch_size=4, feature_lengths={"inputs": 8, "targets": 4},
        optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-3),
        partitioner=partitioning.PjitPartitioner(devices=jax.devices()[:1]),
        checkpoint_every=2, log_every=1, eval_steps=0)

  gin.bind_parameter("jaxmoral.data.tasks.TaskSource.max_cached_examples", 1)
  try:
    train("whole", 4)
    train("part", 2)
    replayed.clear()
    assert train("part", 4)["step"] == 4
  finally:
    gin.clear_config()
  assert (tmp_path / "part" / "data_position" / "2" / "process_0-of-1").is_dir()
  assert replayed == [0]  # Restored at its saved position: nothing read again.
  assert len(read["whole"]) == len(read["part"]) == 4
  for got, want in zip(read["part"], read["whole"], strict=True):
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  # Both Tasks are in the stream (its rows are the Mixture's, not one Task's).
  inputs = np.concatenate([b["encoder_input_tokens"] for b in read["whole"]])
  assert len({tuple(r[:1]) for r in inputs}) == 2
  whole, part = (model_dirs.load(tmp_path / name).params for name in ("whole", "part"))
  jax.tree_util.tree_map(np.testing.assert_array_equal, part, whole)


def test_a_damaged_stream_position_is_refused_naming_its_file(vocabulary, tmp_path):
  """A stream position carries the sizes and checksums of its files: one damaged after it
  was saved is refused in one line naming the file, not restored into a wrong position."""
  tasks.register_text_pair_task("jm_damaged", vocabulary=vocabulary,
                                examples=[(f"in {i}", f"out {i}") for i in range(12)])
  source = tasks.TaskSource("jm_damaged", "train", {"inputs": 8, "targets": 4}, 2,
                            max_cached_examples=1, position_dir=str(tmp_path / "pos"),
                            position_every=2)
  stream = source.iterate(0)
  want = [next(stream) for _ in range(4)]
  folder = tmp_path / "pos" / "2" / "process_0-of-1"
  assert (folder / integrity.INTEGRITY_FILE).is_file()
  for got, expected in zip(source.iterate(2), want[2:]):  # intact: restored
    np.testing.assert_array_equal(got["encoder_input_tokens"], expected["encoder_input_tokens"])
    break
  data = next(p for p in folder.iterdir() if p.name.startswith("iterator.data"))
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0xFF
  data.write_bytes(bytes(raw))
  with pytest.raises(integrity.CheckpointIntegrityError) as error:
    next(source.iterate(3))
  message = str(error.value)
  assert "\n" not in message and f"{data.name} differs from its checksum" in message
  assert str(folder) in message
