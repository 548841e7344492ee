"""Tests for jaxmoral.data.tasks: seqio Tasks materialise to the same features as encode_pairs."""

import numpy as np
import pytest
import seqio

from jaxmoral.data import demo, tasks, vocab
from jaxmoral.data.pipeline import encode_pairs

LENGTHS = {"inputs": 24, "targets": 12}


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory):
  return vocab.get_vocabulary(
      vocab.build_demo_vocabulary(output_dir=tmp_path_factory.mktemp("vocab")))


def test_in_memory_task_matches_encode_pairs(vocabulary):
  pairs = [(r["situation"], r["question"]) for r in demo.clarify_questions()[:40]]
  pairs.append(("a very long situation " * 10, "and an equally long question " * 5))
  tasks.register_text_pair_task("jm_test_pairs", vocabulary=vocabulary, examples=pairs)
  got = tasks.task_examples("jm_test_pairs", "train", feature_lengths=LENGTHS)
  want = encode_pairs([x for x, _ in pairs], [y for _, y in pairs], vocabulary=vocabulary,
                      feature_lengths=LENGTHS)
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert got["decoder_target_tokens"][-1, -1] == 1  # Truncated, EOS kept.


def test_file_task_and_packing_match(vocabulary):
  path = demo.path("clarify_fusion.csv")
  tasks.register_text_pair_task("jm_test_fusion", vocabulary=vocabulary, file=str(path),
                                input_field="input", target_field="output")
  rows = demo.clarify_fusion()[:12]
  lengths = {"inputs": 64, "targets": 32}
  tasks.register_text_pair_task("jm_test_fusion12", vocabulary=vocabulary,
                                examples=[(r["input"], r["output"]) for r in rows])
  got = tasks.task_examples("jm_test_fusion12", "train", feature_lengths=lengths, pack=True)
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
  full = tasks.task_examples("jm_test_fusion", "train", feature_lengths=lengths)
  assert len(full["encoder_input_tokens"]) == len(demo.clarify_fusion())


def test_task_to_source_and_demo_mixture(vocabulary):
  mixture = tasks.register_demo_tasks(vocabulary=vocabulary)
  assert isinstance(mixture, seqio.Mixture)
  src = tasks.task_to_source(tasks.DEMO_MIXTURE, "train", feature_lengths=LENGTHS,
                             batch_size=8, seed=1)
  sizes = [seqio.get_mixture_or_task(t).num_input_examples("train") for t in tasks.DEMO_TASKS]
  assert src.num_examples == sum(sizes) == 144 + 90 + 144  # 9 in 10 of each train.
  for v in src.batch(5).values():
    assert v.shape[0] == 8 and v.dtype == np.int32
  val = tasks.task_to_source(tasks.DEMO_TASKS[2], "validation", feature_lengths=LENGTHS,
                             batch_size=4, shuffle=False)
  judgments = demo.clarify_judgments()[::10]
  want = encode_pairs([r["situation"] for r in judgments], [r["judgment"] for r in judgments],
                      vocabulary=vocabulary, feature_lengths=LENGTHS)
  np.testing.assert_array_equal(val.features["decoder_target_tokens"],
                                want["decoder_target_tokens"])


def test_bad_arguments(vocabulary, tmp_path):
  with pytest.raises(ValueError, match="exactly one of examples, file"):
    tasks.register_text_pair_task("jm_bad", vocabulary=vocabulary)
  bad = tmp_path / "bad.tsv"
  bad.write_text("inputs\ttargets\nok\tfine\nbroken\n")
  with pytest.raises(ValueError, match=r"bad\.tsv:3: expected 2 columns"):
    tasks.register_text_pair_task("jm_bad", vocabulary=vocabulary, file=str(bad))
  tasks.register_text_pair_task("jm_one", vocabulary=vocabulary, examples=[("a", "b")])
  with pytest.raises(ValueError, match="no split 'validation'"):
    tasks.task_examples("jm_one", "validation", feature_lengths=LENGTHS)


def test_mixture_rates_decide_the_mix(vocabulary):
  # Task a: 10 examples, task b: 30. Rates 3:1 of 40 examples give 30 of a (its 10 three
  # times) and 10 of b (a seeded sample of its 30); rate 0 leaves a Task out.
  # Letters, not digits: the demo vocabulary has no digits, so "beta 1" and "beta 2" would
  # encode alike.
  words = [f"{x} {y}" for x in "abc" for y in "defghijklm"]
  a = [(f"alpha {w}", "a") for w in words[:10]]
  b = [(f"beta {w}", "b") for w in words]
  tasks.register_text_pair_task("jm_mix_a", vocabulary=vocabulary, examples=a)
  tasks.register_text_pair_task("jm_mix_b", vocabulary=vocabulary, examples=b)
  target_a = encode_pairs(["x"], ["a"], vocabulary=vocabulary,
                          feature_lengths=LENGTHS)["decoder_target_tokens"][0]

  def share_of_a(rates, seed=0):
    seqio.MixtureRegistry.remove("jm_mix")
    seqio.MixtureRegistry.add("jm_mix", list(zip(["jm_mix_a", "jm_mix_b"], rates)))
    got = tasks.task_examples("jm_mix", "train", feature_lengths=LENGTHS, seed=seed)
    is_a = (got["decoder_target_tokens"] == target_a).all(-1)
    return int(is_a.sum()), len(is_a), got["encoder_input_tokens"]

  assert share_of_a([3.0, 1.0])[:2] == (30, 40)
  assert share_of_a([1.0, 1.0])[:2] == (20, 40)
  assert share_of_a([1.0, 0.0])[:2] == (40, 40)
  assert share_of_a([10.0, 30.0])[:2] == (10, 40)  # By size: every example once.
  # The sample of b depends on the seed, deterministically.
  np.testing.assert_array_equal(share_of_a([3.0, 1.0], seed=1)[2], share_of_a([3.0, 1.0], 1)[2])
  assert not np.array_equal(share_of_a([3.0, 1.0], seed=1)[2], share_of_a([3.0, 1.0], 2)[2])
  with pytest.raises(ValueError, match="positive sum"):
    share_of_a([0.0, 0.0])


def test_file_task_errors_name_the_file(vocabulary, tmp_path):
  header_only = tmp_path / "empty.tsv"
  header_only.write_text("inputs\ttargets\n")
  with pytest.raises(ValueError, match=r"split 'train' is empty \(file .*empty\.tsv has no rows"):
    tasks.register_text_pair_task("jm_empty", vocabulary=vocabulary, file=str(header_only))
  typed = tmp_path / "typed.jsonl"
  typed.write_text('{"inputs": "ok", "targets": "fine"}\n{"inputs": true, "targets": 3.5}\n')
  with pytest.raises(ValueError, match=r"typed\.jsonl:2: expected a string, got true"):
    tasks.read_pairs(typed, input_field="inputs", target_field="targets")
