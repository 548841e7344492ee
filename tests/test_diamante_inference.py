"""Diamante inference, bundle save/load, evaluation and chat on a tiny random model."""

import io
import json

import flax.linen as nn
import jax
import numpy as np
import pytest

import toy_dialogues
from jaxmoral import metrics as metrics_lib
from jaxmoral import model_dirs
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.diamante import bundle as bundle_lib
from jaxmoral.diamante import chat, data, evaluate, inference
from jaxmoral.models import t5
from jaxmoral.models.config import t5_config

# What runs is tested here, not how it is sharded (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_device")

RERANK = inference.RerankConfig(num_candidates=4, top_k=10, max_decode_length=8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  root = tmp_path_factory.mktemp("diamante")
  vocab_path = vocab_lib.build_demo_vocabulary(output_dir=root / "vocab")
  config = t5_config(size="tiny", num_encoder_layers=1, num_decoder_layers=1)
  model = t5.T5(config, with_scalar_head=True)
  params = nn.meta.unbox(jax.jit(lambda r: t5.init_params(model, r))(jax.random.PRNGKey(3)))
  params["scalar_head"]["kernel"] = params["scalar_head"]["kernel"] * 5.0
  features = data.FeatureConfig(context_length=24, response_length=10)
  vocabulary = vocab_lib.get_vocabulary(vocab_path)
  # What a Diamante run's settings.json says (DialogueData + the run's feature lengths).
  settings = {"data": {"separator": data.DEFAULT_SEPARATOR},
              "feature_lengths": {"inputs": 24, "targets": 10}}
  export = model_dirs.export(root / "export", params=params, config=config,
                             vocabulary=vocabulary, settings=settings)
  in_memory = bundle_lib.Bundle(model, params, vocabulary=vocabulary, features=features)
  return root, export, in_memory


def test_saved_model_reloads_and_ranks_identically(saved):
  root, export, original = saved
  loaded = bundle_lib.load(root / "export")
  assert loaded.config == original.config and loaded.features == original.features
  turns = toy_dialogues.toy_turns(6, seed=1)
  a = evaluate.evaluate_turns(original, turns, num_random=2, max_candidates=3, batch_size=4)
  b = evaluate.evaluate_turns(loaded, turns, num_random=2, max_candidates=3, batch_size=4)
  assert a == b
  responses = [turns[0].response, *turns[0].candidates]
  s1, l1 = inference.rank_texts(original, turns[0].context, responses)
  s2, l2 = inference.rank_texts(loaded, turns[0].context, responses)
  np.testing.assert_array_equal(s1, s2)
  np.testing.assert_array_equal(l1, l2)
  np.testing.assert_array_equal(np.argsort(-s1), np.argsort(-s2))


def test_load_errors_name_the_missing_file(tmp_path, saved):
  with pytest.raises(FileNotFoundError, match="no model found"):
    bundle_lib.load(tmp_path)
  _, export, _ = saved
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.copytree(export, tmp_path / "copy")
  (tmp_path / "copy" / "settings.json").write_text("{bad")
  # The export's manifest covers settings.json: a changed one is refused as damage ...
  with pytest.raises(ValueError, match="the export is damaged: settings.json is 4 bytes"):
    bundle_lib.load(tmp_path / "copy")
  # ... and without a manifest (an older export) its bad JSON is named by file and line.
  (tmp_path / "copy" / "_INTEGRITY.json").unlink()
  with pytest.raises(ValueError, match="settings.json:1"):
    bundle_lib.load(tmp_path / "copy")


def test_sampled_candidates_are_scored_like_separate_teacher_forced_passes(saved):
  _, _, bundle = saved
  contexts = [["hi! do you like chess?"], ["how was your weekend?", "pretty good."]]
  encoder = np.stack([data.encode_context(bundle.vocabulary, c, bundle.features) for c in contexts])
  out = bundle.run(inference.generate_and_rank, encoder, jax.random.PRNGKey(0),
                   static=(RERANK,))
  assert out.tokens.shape == (2, RERANK.num_candidates, RERANK.max_decode_length)
  np.testing.assert_array_equal(out.best, np.argmax(out.scores, -1))
  apply = jax.jit(lambda p, e, d: bundle.module.apply({"params": p}, e, d, return_hidden=True))
  score = jax.jit(lambda p, h: bundle.module.apply({"params": p}, h, method=t5.T5.score))
  for b in range(2):
    for i in range(RERANK.num_candidates):
      n = int(out.lengths[b, i])
      tokens = out.tokens[b, i, :n]
      # Decoder input: start, the candidate's tokens (EOS last); state n has read them all.
      dec = np.zeros((1, RERANK.max_decode_length + 1), np.int32)
      dec[0, 1:n + 1] = tokens
      logits, hidden = apply(bundle.params, encoder[b:b + 1], dec)
      want_score = float(np.asarray(score(bundle.params, hidden))[0, n])
      logp = jax.nn.log_softmax(np.asarray(logits[0, :n], np.float64), -1)
      want_logprob = float(np.sum(np.asarray(logp)[np.arange(n), tokens]))
      np.testing.assert_allclose(out.scores[b, i], want_score, rtol=1e-4, atol=1e-5)
      np.testing.assert_allclose(out.logprobs[b, i], want_logprob, rtol=1e-4, atol=1e-4)


def test_ranking_items_drop_what_the_scorer_reads_as_the_human_response():
  turns = [data.Turn(context=("hi",), response="I like chess a lot", dialogue=0,
                     candidates=("I like chess too", "i like CHESS a lot", "I like cats",
                                 "I like cats!", "no")),
           data.Turn(context=("yo",), response="I like chess very much", dialogue=1,
                     candidates=("sure",))]
  # Without an encoder only the normalised text counts ...
  items = evaluate.ranking_items(turns, num_random=1, max_candidates=5, seed=0)
  assert items[0][1][1:4] == ["I like chess too", "I like cats", "I like cats!"]
  # ... with one, a response truncated to r_H's tokens (here: its first three words) is r_H,
  # and two candidates with the same tokens are one candidate.
  three_words = lambda text: [hash(w.strip("!")) for w in text.lower().split()[:3]]  # noqa: E731
  items = evaluate.ranking_items(turns, num_random=1, max_candidates=5, seed=0,
                                 encode=three_words)
  (_, responses, kinds), (_, other, _) = items
  assert responses == ["I like chess a lot", "I like cats", "no"]
  assert kinds == [data.HUMAN, data.MODEL, data.MODEL]
  assert other == ["I like chess very much", "sure"]  # the only random one reads as r_H


def test_evaluation_matches_per_context_ranking(saved):
  _, _, bundle = saved
  turns = toy_dialogues.toy_turns(5, seed=2)
  result = evaluate.evaluate_turns(bundle, turns, num_random=2, max_candidates=3, batch_size=3,
                                   seed=4)
  items = evaluate.ranking_items(turns, num_random=2, max_candidates=3, seed=4,
                                 encode=evaluate.model_view(bundle))
  prefs, gens, labels, accs = [], [], [], []
  for i, responses, kinds in items:
    s, lp = inference.rank_texts(bundle, turns[i].context, responses)
    prefs.append(s)
    gens.append(lp)
    labels.append(np.asarray(kinds) == data.HUMAN)
    kinds = np.asarray(kinds)
    pairs = [(a, b) for a in range(len(s)) for b in range(len(s))
             if (kinds[a], kinds[b]) in ((0, 1), (0, 2), (1, 2))]
    accs.append(np.mean([s[a] > s[b] for a, b in pairs]))
  want_pref = metrics_lib.ranking_metrics(prefs, labels)
  want_gen = metrics_lib.ranking_metrics(gens, labels)
  assert result["num_contexts"] == len(items) > 0
  for key in ("map", "mrr", "p@1"):
    assert result[f"preference/{key}"] == pytest.approx(want_pref[key], abs=1e-6)
    assert result[f"generation/{key}"] == pytest.approx(want_gen[key], abs=1e-6)
  # Per context (the demo's and the experiment's paired intervals): each item's own ranking.
  rankings: list = []
  per = evaluate.rank_contexts(bundle, turns, num_random=2, max_candidates=3, batch_size=3,
                               seed=4, rankings=rankings)
  assert per["turn"].tolist() == [i for i, _, _ in items]
  # The contexts as ranked, for a reader without the model: each one's own scores.
  assert [r["turn"] for r in rankings] == [i for i, _, _ in items][:evaluate.NUM_RANKINGS]
  for ranking, (i, responses, kinds), s, lp in zip(rankings, items, prefs, gens):
    assert ranking["responses"] == responses and ranking["context"] == list(turns[i].context)
    assert ranking["kinds"] == [("human", "model", "random")[k] for k in kinds]
    np.testing.assert_allclose(ranking["scores"], s, atol=1e-5)
    np.testing.assert_allclose(ranking["logprobs"], lp, atol=1e-4)
  for key in ("map", "p@1"):
    np.testing.assert_allclose(
        per[f"preference/{key}"],
        [metrics_lib.ranking_metrics([p], [l])[key] for p, l in zip(prefs, labels)], atol=1e-6)
  assert result["pe_accuracy"] == pytest.approx(np.mean(accs), abs=1e-6)
  assert result["random/p@1"] == pytest.approx(np.mean([1 / len(r) for _, r, _ in items]))
  for _, responses, kinds in items:
    assert kinds[0] == data.HUMAN and kinds.count(data.HUMAN) == 1
    assert all(data.normalize(r) != data.normalize(responses[0]) for r in responses[1:])
    # Nothing the scorer reads as r_H (the same tokens after truncation) competes with it.
    human = data.encode_response(bundle.vocabulary, responses[0], bundle.features)
    assert not any(np.array_equal(data.encode_response(bundle.vocabulary, r, bundle.features),
                                  human) for r in responses[1:])


def test_chat_and_self_chat_write_transcripts(saved, tmp_path):
  root, _, _ = saved
  lines = iter(["hi! do you like chess?", "", "why?", "/quit", "never read"])
  printed = io.StringIO()
  records = chat.chat(model_dir=str(root / "export"), transcript_path=str(tmp_path / "chat.jsonl"),
                      rerank=RERANK, input_fn=lambda _: next(lines), output=printed,
                      show_candidates=2)
  assert [r["speaker"] for r in records] == ["user", "bot", "user", "bot"]
  written = [json.loads(l) for l in (tmp_path / "chat.jsonl").read_text().splitlines()]
  assert written == json.loads(json.dumps(records))
  bot = records[1]
  assert bot["score"] == max(c[1] for c in bot["candidates"])
  assert bot["text"] == bot["candidates"][0][0] and len(bot["candidates"]) == 4
  assert printed.getvalue().count("bot>") == 2
  self_records = chat.self_chat(model_dir=str(root / "export"), opening="hello there",
                                num_rounds=3, transcript_path=str(tmp_path / "self.jsonl"),
                                rerank=RERANK, output=None)
  assert [r["speaker"] for r in self_records] == ["bot_b", "bot_a", "bot_b", "bot_a"]
  assert len((tmp_path / "self.jsonl").read_text().splitlines()) == 4
  with pytest.raises(ValueError, match="opening"):
    chat.self_chat(model_dir=str(root / "export"), opening=" ", num_rounds=1,
                   transcript_path=str(tmp_path / "x.jsonl"))


def test_rerank_bindings_given_on_the_command_line_apply(saved, tmp_path):
  import gin  # pylint: disable=g-import-not-at-top
  from jaxmoral import cli  # pylint: disable=g-import-not-at-top
  root, _, _ = saved
  gin.clear_config()
  try:
    assert cli.main(["diamante", "self_chat", f"--model_dir={root / 'export'}",
                     "--opening=hello there", "--num_rounds=1",
                     f"--transcript_path={tmp_path / 's.jsonl'}",
                     "--gin.RerankConfig.num_candidates=3",
                     "--gin.RerankConfig.max_decode_length=6"]) == 0
  finally:
    gin.clear_config()
  (record,) = [json.loads(l) for l in (tmp_path / "s.jsonl").read_text().splitlines()[1:]]
  assert len(record["candidates"]) == 3


def test_candidates_are_sampled_and_stored_in_the_diamante_format(saved, tmp_path):
  from jaxmoral.diamante import candidates
  root, _, _ = saved
  turns = toy_dialogues.toy_turns(3, seed=7)
  out = tmp_path / "with_candidates.jsonl"
  kwargs = dict(model_dir=str(root / "export"), turns=turns, num_candidates=2, top_k=10,
                max_decode_length=8, batch_size=4, seed=1)
  assert candidates.generate_candidates(output_path=str(out), **kwargs) == 3
  again = tmp_path / "again.jsonl"
  candidates.generate_candidates(output_path=str(again), **kwargs)
  assert out.read_text() == again.read_text()  # deterministic in the seed
  read = data.read_dialogues(out)
  assert [(t.context, t.response) for t in read] == [(t.context, t.response) for t in turns]
  assert all(len(t.candidates) <= 2 for t in read)  # empty samples are dropped on reading
  first = [json.loads(l) for l in out.read_text().splitlines()][0]["conversation"]
  assert first[0]["response_candidates"] == []
  assert all(len(u["response_candidates"]) == 2 for u in first[1:])


def test_eval_summary_is_a_ranker_table_with_n():
  result = {f"{r}/{m}": 0.5 for r in evaluate.RANKERS for m in evaluate.RANKING_METRICS}
  result.update({"random/p@1": 0.1, "pe_accuracy": 0.75, "num_contexts": 26.0,
                 "distinct-1": 0.3})
  lines = evaluate.format_summary(result).splitlines()
  assert lines[0].split() == ["ranker", "map", "mrr", "p@1"]
  assert lines[2].split() == ["preference", "0.500", "0.500", "0.500"]
  assert "n = 26 contexts" in evaluate.format_summary(result)
  assert lines[-1] == "generated responses: distinct-1 0.300"
