"""Diamante data: format parsing with located errors, truncation, per-epoch quadruples."""

import collections
import json

import numpy as np
import pytest

import toy_dialogues
from jaxmoral.data.readers import DataError
from jaxmoral.diamante import data


class CharVocab:
  """One id per character (ids >= 3), enough to check truncation independently."""

  def encode(self, s):
    return [3 + ord(c) for c in s]

  def decode(self, ids):
    return "".join(chr(i - 3) for i in ids)


def _write(tmp_path, lines):
  path = tmp_path / "d.jsonl"
  path.write_text("\n".join(lines) + "\n")
  return path


def test_reads_turns_and_candidates(tmp_path):
  obj = {"conversation": [{"utterance": "a", "response_candidates": []},
                          {"utterance": "b", "response_candidates": ["x", " ", "y"]},
                          {"utterance": "c"}]}
  path = _write(tmp_path, [json.dumps(obj), "", json.dumps(obj)])
  turns = data.read_dialogues(path)
  assert len(turns) == 4
  assert turns[0] == data.Turn(("a",), "b", ("x", "y"), 0)
  assert turns[1] == data.Turn(("a", "b"), "c", (), 0)
  assert turns[3].dialogue == 1


@pytest.mark.parametrize("record, line_field", [
    ({"conversation": []}, "conversation"),
    ({"conversation": [{"utterance": "a"}, {"text": "b"}]}, "conversation[1].utterance"),
    ({"conversation": [{"utterance": "a"}, {"utterance": 3}]}, "conversation[1].utterance"),
    ({"conversation": [{"utterance": "a"}, {"utterance": "b", "response_candidates": "x"}]},
     "conversation[1].response_candidates"),
    ({"conversation": [{"utterance": "a"}, {"utterance": "b", "response_candidates": [1]}]},
     "conversation[1].response_candidates[0]"),
])
def test_bad_records_name_file_line_and_field(tmp_path, record, line_field):
  good = json.dumps({"conversation": [{"utterance": "a"}, {"utterance": "b"}]})
  path = _write(tmp_path, [good, "", json.dumps(record)])
  with pytest.raises(DataError) as err:
    data.read_dialogues(path)
  assert f"{path}:3:" in str(err.value)
  assert err.value.field == line_field


def test_context_truncated_from_the_left_and_response_keeps_a_spare_slot():
  vocab = CharVocab()
  config = data.FeatureConfig(context_length=6, response_length=5, separator="|")
  ids = data.encode_context(vocab, ["abc", "defg"], config)
  # "abc|defg" -> keep the last 5 characters + EOS.
  assert ids.tolist() == vocab.encode("|defg") + [1]
  short = data.encode_context(vocab, ["ab"], config)
  assert short.tolist() == vocab.encode("ab") + [1, 0, 0, 0]
  resp = data.encode_response(vocab, "hello", config)
  assert resp.tolist() == vocab.encode("hel") + [1, 0]  # T - 2 tokens, EOS, spare 0


def test_char_f1_against_hand_counts():
  assert data.char_f1("abc", "abc") == 1.0
  assert data.char_f1("ab", "cd") == 0.0
  # overlap {a, b} = 2; precision 2/3, recall 2/4 -> F1 = 2*(2/3)(1/2)/(2/3+1/2) = 4/7.
  assert data.char_f1("a bc", "abdd") == pytest.approx(4 / 7)


def _turns_with_duplicates():
  turns = toy_dialogues.toy_turns(12, seed=3)
  # Put the human response itself (case/space variants) among the candidates.
  out = []
  for t in turns:
    dupes = (t.response.upper(), "  " + t.response + " ")
    out.append(data.Turn(t.context, t.response, dupes + t.candidates, t.dialogue))
  only_dupes = data.Turn(("x",), "same", ("SAME", "same "), 99)
  return out + [only_dupes]


@pytest.mark.parametrize("prefer_dissimilar", [False, True])
def test_resampling_never_pairs_model_with_human(prefer_dissimilar):
  turns = _turns_with_duplicates()
  source = data.QuadrupleSource(turns=turns, vocab=CharVocab(), batch_size=7, seed=1,
                                prefer_dissimilar=prefer_dissimilar, pool_size=3)
  assert source.num_examples == len(turns) - 1  # the all-duplicates turn is not trainable
  seen_models = collections.defaultdict(set)
  seen_randoms = collections.defaultdict(set)
  for epoch in range(6):
    quads = source.epoch(epoch)
    assert sorted(q.turn for q in quads) == sorted(data.trainable_turns(turns))
    for q in quads:
      turn = turns[q.turn]
      assert data.normalize(q.model) != data.normalize(q.human)
      assert q.model in turn.candidates
      assert data.normalize(q.random) not in (data.normalize(q.human),
                                              data.normalize(q.model))
      assert q.random in {t.response for t in turns if t.dialogue != turn.dialogue}
      seen_models[q.turn].add(q.model)
      seen_randoms[q.turn].add(q.random)
  # Re-drawn every epoch: most turns see several r_R (and, drawn uniformly, r_M) in 6 epochs.
  assert np.mean([len(v) > 1 for v in seen_randoms.values()]) > 0.8
  if not prefer_dissimilar:
    assert np.mean([len(v) > 1 for v in seen_models.values()]) > 0.5


def test_prefer_dissimilar_takes_least_similar_when_pool_covers_all():
  turns = toy_dialogues.toy_turns(10, seed=5)
  rng = np.random.default_rng(0)
  idx = data.trainable_turns(turns)
  quads = data.draw_quadruples(turns, idx, rng, prefer_dissimilar=True, pool_size=100)
  for q in quads:
    usable = [c for c in turns[q.turn].candidates
              if data.normalize(c) != data.normalize(q.human)]
    best = min(data.char_f1(c, q.human) for c in usable)
    assert data.char_f1(q.model, q.human) == best


def test_batches_deterministic_sharded_and_shaped():
  turns = toy_dialogues.toy_turns(10)
  config = data.FeatureConfig(context_length=40, response_length=12)
  make = lambda **kw: data.QuadrupleSource(turns=turns, vocab=CharVocab(), batch_size=4,
                                           features=config, seed=2, **kw)
  a, b = make(), make()
  for step in (0, 5, 17):
    x, y = a.batch(step), b.batch(step)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  batch = a.batch(3)
  assert batch["encoder_input_tokens"].shape == (4, 40)
  assert batch["decoder_target_tokens"].shape == (4, 3, 12)
  np.testing.assert_array_equal(batch["decoder_input_tokens"][..., 1:],
                                batch["decoder_target_tokens"][..., :-1])
  shards = [a.shard(i, 2).batch(3) for i in range(2)]
  np.testing.assert_array_equal(np.concatenate([s["decoder_target_tokens"] for s in shards]),
                                batch["decoder_target_tokens"])
  with pytest.raises(ValueError, match="batch_size"):
    make().shard(0, 3)


def test_no_trainable_turn_is_a_clear_error():
  turns = [data.Turn(("a",), "b", (), 0), data.Turn(("c",), "d", ("D",), 1)]
  with pytest.raises(ValueError, match="QuadrupleSource.turns"):
    data.QuadrupleSource(turns=turns, vocab=CharVocab(), batch_size=2)
