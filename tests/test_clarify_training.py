"""Training entry points: a supervised run and the value model's start (PPO itself: test_one_path)."""

import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxmoral import model_dirs, optimizers, partitioning
from jaxmoral.clarify import formats, models, training
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5
from jaxmoral.rl import ppo_trainer


TINY = config_lib.t5_config(size="tiny", num_encoder_layers=1, num_decoder_layers=1)
# What is tested is what a run writes and how the value model starts, not sharding (the
# sharded PPO run: test_one_path): every mesh here is one device, which compiles faster.
pytestmark = pytest.mark.usefixtures("one_device")


@pytest.fixture(scope="module")
def vocab_path(tmp_path_factory):
  return vocab_lib.build_demo_vocabulary(output_dir=tmp_path_factory.mktemp("vocab"))


def test_train_clarify_model_writes_a_run_dir_and_packs_rows(tmp_path, vocab_path):
  model_dir = str(tmp_path / "judge")
  metrics = training.train_clarify_model(
      which="judge", model_dir=model_dir, model_config=TINY,
      optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-3), train_steps=2,
      batch_size=8, feature_lengths={"inputs": 96, "targets": 8}, vocabulary_path=vocab_path,
      judge_classes=formats.DEMO_JUDGE_CLASSES, log_every=1, pack=True)
  # A judge target is its class and EOS: 8 rows of one pair each would weigh 16 tokens (a demo
  # judge input is about 30 tokens, so packed rows of 96 + 8 hold about three).
  assert metrics["train/num_tokens"] > 8 * 2 * 1.5
  info = model_dirs.inspect(model_dir)
  assert info.config == TINY and info.vocabulary is not None
  rows = [json.loads(line) for line in open(os.path.join(model_dir, "data",
                                                          "judge_train.jsonl"))]
  assert {r["targets"] for r in rows} == set(formats.DEMO_JUDGE_CLASSES)
  judge = models.load_model(model_dir)
  probs = judge.label_distribution(["judge: lying"], formats.DEMO_JUDGE_CLASSES,
                                   require_single_token=True)
  np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-5)
  with pytest.raises(ValueError, match="ONE token"):
    training.train_clarify_model(
        which="judge", model_dir=str(tmp_path / "bad"),
        model_config=TINY,
        optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-3), train_steps=1,
        batch_size=8, feature_lengths={"inputs": 32, "targets": 4}, vocabulary_path=vocab_path,
        judge_classes=("bad", "ok", "good"))


def test_value_params_start_from_policy():
  config = TINY
  policy = nn.meta.unbox(t5.init_params(t5.T5(config), jax.random.PRNGKey(0)))
  trainer = ppo_trainer.PPOTrainer(
      policy_model=t5.T5(config), value_model=t5.T5(config, with_scalar_head=True),
      vocabulary=None, config=ppo_trainer.PPOConfig(batch_size=8),
      optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-4),
      partitioner=partitioning.PjitPartitioner(),
      reward_fn_tokens=lambda p, r, m: m.sum(-1))
  value = training.value_params_from_policy(trainer, policy, jax.random.PRNGKey(1))
  assert "scalar_head" in value
  for key in policy:
    for a, b in zip(jax.tree_util.tree_leaves(policy[key]),
                    jax.tree_util.tree_leaves(value[key])):
      np.testing.assert_array_equal(a, b)
