"""The defeasibility reward on tiny random models: JSD vs SciPy, NLI filtering, end to end."""

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest
from scipy.spatial import distance

from jaxmoral.clarify import formats, models, reward
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5

import random_model_dirs

SITUATIONS = ["skipping your friend's birthday party", "lying to a friend", "feeding a stray cat"]
QUESTIONS = ["Why are you skipping it?", "Did they find out?", "Whose cat is it?"]
CONFIG = reward.RewardConfig(judge_classes=formats.DEMO_JUDGE_CLASSES, batch_size=4,
                             input_length=32, max_answer_length=6, max_fusion_length=8)


@pytest.fixture(scope="module")
def vocab_path(tmp_path_factory):
  return vocab_lib.build_demo_vocabulary(output_dir=tmp_path_factory.mktemp("vocab"))


@pytest.fixture(scope="module")
def pipeline(vocab_path):
  vocabulary = vocab_lib.get_vocabulary(vocab_path)
  model = t5.T5(config_lib.t5_config(size="tiny", num_encoder_layers=1, num_decoder_layers=1))

  def make(seed):
    params = nn.meta.unbox(t5.init_params(model, jax.random.PRNGKey(seed)))
    return models.ClarifyModel(model, params, vocabulary=vocabulary)

  return reward.DefeasibilityReward(answer_model=make(0), fusion_model=make(1),
                                    judge_model=make(2), nli_model=None,
                                    config=dataclasses.replace(CONFIG, use_nli=False))


def test_jsd_equals_scipy_on_judge_outputs(pipeline):
  result = pipeline.score_questions(SITUATIONS, QUESTIONS)
  for i in range(len(SITUATIONS)):
    expected = distance.jensenshannon(result.weakened_distribution[i],
                                      result.strengthened_distribution[i], base=2) ** 2
    np.testing.assert_allclose(result.jsd[i], expected, rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(result.scores, result.jsd)  # nothing filtered
  assert ((result.scores >= 0) & (result.scores <= 1)).all()
  # The distributions are the judge's on the fused situations the pipeline reports.
  np.testing.assert_allclose(result.weakened_distribution, pipeline.judge(
      result.weakened_situation), rtol=1e-5)
  flips = result.weakened_distribution.argmax(1) != result.strengthened_distribution.argmax(1)
  np.testing.assert_array_equal(result.flips, flips)
  assert result.judgment == [formats.JUDGMENTS[i] for i in result.base_distribution.argmax(1)]


def test_questions_only_zeroes_the_ppo_reward_of_non_questions(pipeline, monkeypatch):
  prompts = [formats.question_input(s) for s in SITUATIONS]
  responses = ["Why are you skipping it?", "Did they find out", "what are you ?  "]
  gated = reward.DefeasibilityReward(
      answer_model=pipeline.answer_model, fusion_model=pipeline.fusion_model,
      judge_model=pipeline.judge_model, nli_model=None,
      config=dataclasses.replace(pipeline.config, questions_only=True))
  # The random tiny models fuse both answers alike (JSD 0): known scores stand in for theirs.
  scored = gated.score_questions(SITUATIONS, responses)
  known = dataclasses.replace(scored, scores=np.float32([0.1, 0.2, 0.3]))
  monkeypatch.setattr(gated, "score_questions", lambda *a, **k: known)
  scores, extras = gated(prompts, responses, key=("test", 0))
  np.testing.assert_allclose(scores, [0.1, 0.0, 0.3])  # The fragment earns nothing.
  np.testing.assert_array_equal(extras["jsd"], scored.jsd)  # Diagnostics as the pipeline's.
  monkeypatch.setattr(pipeline, "score_questions", lambda *a, **k: known)
  np.testing.assert_allclose(pipeline(prompts, responses, key=("test", 0))[0], [0.1, 0.2, 0.3])
  assert [formats.is_question(r) for r in responses] == [True, False, True]


class _StubNLI:
  """Entailment for the weakener answer of situation 0 and the strengthener of situation 2."""

  def __init__(self):
    self.calls = []

  def probabilities(self, premises, hypotheses):
    self.calls.append((list(premises), list(hypotheses)))
    probs = np.tile([0.1, 0.8, 0.1], (len(premises), 1))
    n = len(premises) // 2
    probs[0] = [0.9, 0.05, 0.05]          # weakener of row 0: entailed
    probs[n + 2] = [0.05, 0.05, 0.9]      # strengthener of row 2: contradicted
    return probs


def test_nli_filter_zeroes_filtered_rewards(pipeline):
  unfiltered = pipeline.score_questions(SITUATIONS, QUESTIONS)
  stub = _StubNLI()
  filtering = reward.DefeasibilityReward(
      answer_model=pipeline.answer_model, fusion_model=pipeline.fusion_model,
      judge_model=pipeline.judge_model, config=CONFIG)
  filtering.nli = stub
  result = filtering.score_questions(SITUATIONS, QUESTIONS)
  # The filter saw (situation, answer) for both answer types.
  premises, hypotheses = stub.calls[0]
  assert premises == SITUATIONS + SITUATIONS
  assert hypotheses == result.weakener + result.strengthener
  np.testing.assert_array_equal(result.filtered, [True, False, True])
  np.testing.assert_array_equal(result.weakener_filtered, [True, False, False])
  np.testing.assert_array_equal(result.strengthener_filtered, [False, False, True])
  np.testing.assert_allclose(result.scores, [0.0, unfiltered.jsd[1], 0.0], rtol=1e-6)
  np.testing.assert_allclose(result.jsd, unfiltered.jsd, rtol=1e-6)
  assert not result.flips[0] and not result.flips[2]
  # use_nli=False switches the filter off for one call (the pipeline baseline without NLI).
  np.testing.assert_allclose(filtering.score_questions(SITUATIONS, QUESTIONS,
                                                       use_nli=False).scores,
                             unfiltered.scores, rtol=1e-6)


def test_end_to_end_from_directories(tmp_path, vocab_path):
  # One exported random model serves every role (a multi-task model is loaded once).
  directory = random_model_dirs.random_model_dir(tmp_path / "model", seed=5, vocabulary_path=vocab_path)
  fn = reward.DefeasibilityReward.from_dirs(
      answer_model_dir=directory, fusion_model_dir=directory, judge_model_dir=directory,
      nli_model_dir=directory, config=CONFIG)
  assert fn.judge_model.params is fn.answer_model.params
  prompts = [formats.question_input(s) for s in SITUATIONS] + ["question: lying wh: why"]
  scores, extras = fn(prompts, QUESTIONS + ["Why?"])
  assert scores.shape == (4,) and scores.dtype == np.float32
  assert ((scores >= 0) & (scores <= 1)).all()
  assert extras["jsd"].shape == (4,) and len(extras["weakener"]) == 4
  assert extras["weakened_distribution"].shape == (4, 3)
  np.testing.assert_allclose(extras["weakened_distribution"].sum(1), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(scores[extras["filtered"] > 0], 0.0)
  assert reward.situation_of("question: lying wh: why") == "lying"
  with pytest.raises(ValueError, match="ONE token"):
    reward.DefeasibilityReward.from_dirs(
        answer_model_dir=directory, fusion_model_dir=directory, judge_model_dir=directory,
        config=dataclasses.replace(CONFIG, judge_classes=("bad", "ok", "good")))
  with pytest.raises(FileNotFoundError, match="no model found"):
    models.load_model(tmp_path)


def test_reward_config_validation():
  with pytest.raises(ValueError, match="RewardConfig.batch_size"):
    reward.RewardConfig(batch_size=0)
  with pytest.raises(ValueError, match="RewardConfig.judge_classes"):
    reward.RewardConfig(judge_classes=("bad", "good"))
