"""Training entry points: a supervised run and PPO wiring (value init, export, reward curve)."""

import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxmoral import model_dirs, optimizers, partitioning
from jaxmoral.clarify import formats, models, reward, testing, training
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5
from jaxmoral.rl import ppo_trainer


@pytest.fixture(scope="module")
def vocab_path(tmp_path_factory):
  return vocab_lib.build_demo_vocabulary(output_dir=tmp_path_factory.mktemp("vocab"))


def test_train_clarify_model_writes_a_run_dir(tmp_path, vocab_path):
  model_dir = str(tmp_path / "judge")
  training.train_clarify_model(
      which="judge", model_dir=model_dir, model_config=config_lib.t5_config(size="tiny"),
      optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-3), train_steps=2,
      batch_size=8, feature_lengths={"inputs": 32, "targets": 4}, vocabulary_path=vocab_path,
      judge_classes=formats.DEMO_JUDGE_CLASSES, log_every=1)
  info = model_dirs.inspect(model_dir)
  assert info.config == config_lib.t5_config(size="tiny") and info.vocabulary is not None
  rows = [json.loads(line) for line in open(os.path.join(model_dir, "data",
                                                          "judge_train.jsonl"))]
  assert {r["targets"] for r in rows} == set(formats.DEMO_JUDGE_CLASSES)
  judge = models.load_model(model_dir)
  probs = models.label_distribution(judge, ["judge: lying"], formats.DEMO_JUDGE_CLASSES,
                                    require_single_token=True)
  np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-5)
  with pytest.raises(ValueError, match="ONE token"):
    training.train_clarify_model(
        which="judge", model_dir=str(tmp_path / "bad"),
        model_config=config_lib.t5_config(size="tiny"),
        optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-3), train_steps=1,
        batch_size=8, feature_lengths={"inputs": 32, "targets": 4}, vocabulary_path=vocab_path,
        judge_classes=("bad", "ok", "good"))


def test_value_params_start_from_policy():
  config = config_lib.t5_config(size="tiny")
  policy = nn.meta.unbox(t5.init_params(t5.T5(config), jax.random.PRNGKey(0)))
  trainer = ppo_trainer.PPOTrainer(
      policy_model=t5.T5(config), value_model=t5.T5(config, with_scalar_head=True),
      vocabulary=None, config=ppo_trainer.PPOConfig(batch_size=8),
      optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-4),
      partitioner=partitioning.PjitPartitioner(num_partitions=2),
      reward_fn_tokens=lambda p, r, m: m.sum(-1))
  value = training.value_params_from_policy(trainer, policy, jax.random.PRNGKey(1))
  assert "scalar_head" in value
  for key in policy:
    for a, b in zip(jax.tree_util.tree_leaves(policy[key]),
                    jax.tree_util.tree_leaves(value[key])):
      np.testing.assert_array_equal(a, b)


def _ppo(model_dir, directory, num_iterations):
  return training.train_clarify_ppo(
      model_dir=model_dir, question_model_dir=directory, answer_model_dir=directory,
      fusion_model_dir=directory, judge_model_dir=directory, nli_model_dir=None,
      ppo_config=ppo_trainer.PPOConfig(batch_size=8, num_ppo_epochs=1, num_minibatches=1,
                                       max_prompt_length=24, max_response_length=6,
                                       reward_norm_num_prompts=8),
      optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-4),
      num_iterations=num_iterations,
      # Sampled answers: a resumed run must draw the same ones as an uninterrupted run.
      reward_config=reward.RewardConfig(judge_classes=formats.DEMO_JUDGE_CLASSES,
                                        input_length=32, batch_size=8, max_answer_length=4,
                                        max_fusion_length=4, use_nli=False,
                                        answer_greedy=False),
      max_prompts=12, log_every=1, sample_every=0, checkpoint_every=2, async_checkpoint=False)


@pytest.mark.slow
def test_train_clarify_ppo_exports_policy_and_resumes_as_one_run(tmp_path, vocab_path):
  directory = testing.random_model_dir(tmp_path / "random", seed=1, vocabulary_path=vocab_path)
  model_dir = str(tmp_path / "ppo")
  result = _ppo(model_dir, directory, 2)
  assert result["iteration"] == 2
  assert len(result["reward_curve_values"]) == 2  # the mu0/sigma0 calls are not in the curve
  assert os.path.isfile(result["reward_curve"]) and result["reward_curve"].endswith(".png")
  policy = models.load_model(result["policy_dir"])
  assert policy.model.config == config_lib.t5_config(size="tiny")
  start = models.load_model(directory)
  moved = [not np.allclose(a, b) for a, b in zip(jax.tree_util.tree_leaves(policy.params),
                                                 jax.tree_util.tree_leaves(start.params))]
  assert any(moved)  # two PPO updates changed the policy
  # The PPO run directory itself loads as its tuned policy.
  for a, b in zip(jax.tree_util.tree_leaves(models.load_model(model_dir).params),
                  jax.tree_util.tree_leaves(policy.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Extended to 3 iterations, the run's curve is one curve, equal to an uninterrupted run's.
  extended = _ppo(model_dir, directory, 3)
  straight = _ppo(str(tmp_path / "straight"), directory, 3)
  curve = json.loads((tmp_path / "ppo" / "reward_curve.json").read_text())
  assert curve["iterations"] == [1, 2, 3]
  assert curve["raw_reward_mean"][:2] == result["reward_curve_values"]
  np.testing.assert_allclose(extended["reward_curve_values"], straight["reward_curve_values"],
                             rtol=1e-5)
  assert model_dirs.inspect(model_dir).format == "run"  # the PPO run dir is self-describing
