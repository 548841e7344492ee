"""Evaluation metrics and baseline selection on hand-made examples."""

import json

import numpy as np
import pytest

from jaxmoral import metrics
from jaxmoral import partitioning
from jaxmoral.clarify import baselines, evaluate, formats, reward


def _result(scores, jsd, filtered, flips):
  n = len(scores)
  dist = np.full((n, 3), 1 / 3)
  return reward.RewardResult(
      scores=np.asarray(scores, np.float32), jsd=np.asarray(jsd, np.float32),
      filtered=np.asarray(filtered), flips=np.asarray(flips), judgment=["bad"] * n,
      base_distribution=dist, weakener=[""] * n, strengthener=[""] * n,
      weakened_situation=[""] * n, strengthened_situation=[""] * n,
      weakened_distribution=dist, strengthened_distribution=dist,
      weakener_filtered=np.asarray(filtered), strengthener_filtered=np.zeros(n, bool))


def test_question_metrics_by_hand():
  questions = ["Why did you do it?", "why now?", "What happened?", "Did you ask first?"]
  result = _result([0.5, 0.0, 0.25, 0.25], [0.5, 0.9, 0.25, 0.25],
                   [False, True, False, False], [True, False, False, True])
  m = evaluate.question_metrics(questions, result)
  assert m["jsd"] == pytest.approx(0.25)
  assert m["jsd_unfiltered"] == pytest.approx(0.475)
  assert m["flips_pct"] == pytest.approx(50.0)
  assert m["filtered_pct"] == pytest.approx(25.0)
  assert m["first_word_pct"] == {"why": 50.0, "what": 25.0, "did": 25.0}
  assert m["wh_word_pct"]["why"] == 50.0 and m["wh_word_pct"]["other"] == 25.0
  # distinct-1: 13 whitespace tokens, "you" twice ("Why"/"why" differ by case) -> 12 unique.
  assert m["distinct_1"] == pytest.approx(12 / 13)
  assert m["distinct_2"] == pytest.approx(1.0)


def test_select_best_picks_argmax():
  candidates = [["a", "b", "c"], ["d", "e", "f"]]
  scores = np.array([[0.1, 0.9, 0.3], [0.5, 0.5, 0.2]])
  assert baselines.select_best(candidates, scores) == ["b", "d"]  # first one on ties


class _FakeReward:
  """Scores a question by its length; filters questions starting with "is" when NLI is on."""
  nli = object()

  def __init__(self):
    self.use_nli = []

  def score_questions(self, situations, questions, use_nli=None):
    self.use_nli.append(use_nli)
    jsd = np.array([len(q) / 100 for q in questions], np.float32)
    filtered = np.array([bool(use_nli is not False and q.lower().startswith("is"))
                         for q in questions])
    return _result(np.where(filtered, 0, jsd), jsd, filtered, np.zeros(len(questions), bool))


def test_pipeline_ranks_wh_candidates(monkeypatch):
  candidates = [["Why x?", "Is it very very long?", "Who?"], ["What is it?", "How?", "Is it?"]]
  monkeypatch.setattr(baselines, "wh_candidates", lambda model, situations, **kw: candidates)
  fake = _FakeReward()
  with_nli = baselines.pipeline_generators(None, fake, wh_words=("a", "b", "c"))["pipeline"]
  without = baselines.pipeline_generators(None, fake, wh_words=("a", "b", "c"))["pipeline_no_nli"]
  assert with_nli(["s1", "s2"]) == ["Why x?", "What is it?"]
  assert without(["s1", "s2"]) == ["Is it very very long?", "What is it?"]
  # Built together, the two pipelines rank one scoring (the NLI one: its unfiltered JSD is the
  # no-NLI reward); other situations are scored anew.
  fake = _FakeReward()
  both = baselines.pipeline_generators(None, fake, wh_words=("a", "b", "c"))
  assert both["pipeline"](["s1", "s2"]) == ["Why x?", "What is it?"]
  assert both["pipeline_no_nli"](["s1", "s2"]) == ["Is it very very long?", "What is it?"]
  assert fake.use_nli == [True]
  both["pipeline_no_nli"](["s3", "s4"])
  assert fake.use_nli == [True, True]
  assert baselines.why_generator()(["Lying to a friend"]) == ["Why are you lying to a friend?"]


def test_compare_table_and_json(tmp_path):
  fake = _FakeReward()
  systems = {"why": baselines.why_generator(),
             "fixed": lambda situations: ["Is it okay?" for _ in situations]}
  results = evaluate.compare(systems, ["lying", "cheating"], fake,
                             output_json=tmp_path / "t.json", print_table=False)
  assert results["fixed"]["jsd"] == 0.0 and results["fixed"]["filtered_pct"] == 100.0
  assert results["why"]["jsd"] == pytest.approx(np.mean([len("Why are you lying?"),
                                                         len("Why are you cheating?")]) / 100)
  table = evaluate.format_table(results)
  assert "why" in table.splitlines()[2] and "fixed" in table.splitlines()[3]
  jsd = np.asarray(results["why"]["per_situation"]["jsd"])
  ci = metrics.bootstrap_ci(np.mean, jsd)  # The unvectorised reference draws the same rows.
  assert results["why"]["ci95"]["jsd"] == pytest.approx([ci.low, ci.high])
  row = table.splitlines()[2].split()
  assert row[1] == "2" and f"[{ci.low:.4f}," in table.splitlines()[2]
  written = json.loads((tmp_path / "t.json").read_text())
  assert written["why"]["questions"] == ["Why are you lying?", "Why are you cheating?"]
  assert formats.PIPELINE_WH_WORDS[:3] == ("what", "how", "who")
  assert len(formats.PIPELINE_WH_WORDS) == 14


def test_systems_from_dirs_builds_what_the_directories_allow(monkeypatch):
  """Every system needs its model: no NLI model, no "pipeline_no_nli"; no relevance model, no
  "discriminator"; no PPO run, no "ppo". Question models load with the shapes asked for."""
  loaded, built = [], []

  class Reward:
    def __init__(self, nli):
      self.nli = nli

  def from_dirs(**kw):
    built.append(kw)
    return Reward(kw["nli_model_dir"])

  monkeypatch.setattr(reward.DefeasibilityReward, "from_dirs", staticmethod(from_dirs))
  monkeypatch.setattr(evaluate.models, "load_model",
                      lambda d, **kw: loaded.append((d, kw)) or f"model:{d}")
  config = reward.RewardConfig(batch_size=4)
  dirs = dict(question_model_dir="q", answer_model_dir="a", fusion_model_dir="f",
              judge_model_dir="j")
  systems, got = evaluate.systems_from_dirs(**dirs, reward_config=config)
  assert sorted(systems) == ["finetuned", "pipeline", "why"] and got.nli is None
  # Every model on one mesh: the default one (one device) when none is given.
  one_device = partitioning.inference_partitioner()
  assert built[-1] == dict(answer_model_dir="a", fusion_model_dir="f", judge_model_dir="j",
                           nli_model_dir=None, config=config, partitioner=one_device)
  assert loaded == [("q", {"input_length": 128, "batch_size": 32, "partitioner": one_device})]
  loaded.clear()
  systems, _ = evaluate.systems_from_dirs(
      **dirs, nli_model_dir="n", relevance_model_dir="r", ppo_model_dir="p",
      reward_config=config, input_length=64, batch_size=8)
  assert sorted(systems) == ["discriminator", "finetuned", "pipeline", "pipeline_no_nli",
                             "ppo", "why"]
  assert sorted(d for d, _ in loaded) == ["p", "q", "r"]
  assert all(kw == {"input_length": 64, "batch_size": 8, "partitioner": one_device}
             for _, kw in loaded)
