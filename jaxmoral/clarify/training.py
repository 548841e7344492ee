"""Gin entry points that train the ClarifyDelphi models.

`train_clarify_model` trains one supervised model (or one multi-task model for every role)
through the core's `jaxmoral.runs.train_run`, so each is an ordinary self-describing run
directory. `train_clarify_ppo` tunes θQ with PPO (`jaxmoral.rl.ppo_trainer`) against the
defeasibility reward, then exports the final policy to `MODEL_DIR/policy` (a directory that
`models.load_model`, the evaluation and the chat read).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
from typing import Any, Mapping, Optional, Sequence

import flax.linen as nn
import gin
import jax
import optax

from jaxmoral import checkpoints, gin_utils, partitioning, runs
from jaxmoral.clarify import data as data_lib
from jaxmoral.clarify import formats
from jaxmoral.clarify import judge as judge_lib
from jaxmoral.clarify import models
from jaxmoral.clarify import reward as reward_lib
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5
from jaxmoral.rl import ppo_trainer

logger = logging.getLogger(__name__)
POLICY_DIR = models.POLICY_DIR
REWARD_CURVE = "reward_curve"


@gin.configurable
def train_clarify_model(*, which: str, model_dir: str, model_config: config_lib.T5Config,
                        optimizer: optax.GradientTransformation, train_steps: int,
                        batch_size: int, feature_lengths: Mapping[str, int],
                        source: str = "demo", split: str = "train",
                        vocabulary_path: Optional[str] = None,
                        judge_classes: Sequence[str] = formats.T5_JUDGE_CLASSES,
                        nli_labels: Sequence[str] = formats.NLI_LABELS,
                        relevance_labels: Sequence[str] = formats.RELEVANCE_LABELS,
                        partitioner: Optional[partitioning.PjitPartitioner] = None,
                        eval_every: int = 0, checkpoint_every: int = 1000,
                        log_every: int = 50, seed: int = 0,
                        init_checkpoint: Optional[str] = None) -> dict[str, float]:
  """Trains θQ, θA, fusion, judge, NLI or relevance (or "multitask": all in one model).

  Args:
    which: One of `data.WHICH` or "multitask".
    model_dir: Run directory.
    model_config: T5Config.
    optimizer: Optax optimizer.
    train_steps: Steps.
    batch_size: Global batch size.
    feature_lengths: {"inputs": N, "targets": M}.
    source: "demo" or a folder laid out like ../shared/data.
    split: δ-Clarify split of the questions.
    vocabulary_path: SentencePiece model (None: the demo vocabulary).
    judge_classes: Judge targets for bad, ok, good (each must be one vocabulary token).
    nli_labels: NLI targets for entailment, neutral, contradiction.
    relevance_labels: Discriminator targets for relevant, irrelevant.
    partitioner: Mesh and rules (default data parallel).
    eval_every: Evaluate every N steps (0: at the end; every 10th pair is held out).
    checkpoint_every: Save every N steps.
    log_every: Log every N steps.
    seed: Seed.
    init_checkpoint: Fine-tune from these params (export, run dir or HF T5 folder).

  Returns:
    Final training metrics of `runs.train_run`.
  """
  pairs = data_lib.build_pairs(which, source, split=split, judge_classes=judge_classes,
                               nli_labels=nli_labels, relevance_labels=relevance_labels)
  checkpoints.make_run_dir(model_dir)
  seq_data = runs.Seq2SeqData(
      train_file=data_lib.write_pairs(pairs, os.path.join(model_dir, "data",
                                                          f"{which}_{split}.jsonl")),
      vocabulary_path=vocabulary_path)
  if which in ("judge", "multitask"):
    judge_lib.class_token_ids(seq_data.vocabulary(os.path.join(model_dir, runs.VOCAB_DIR)),
                              judge_classes)
  logger.info("clarify: training %s on %d pairs from %s -> %s", which, len(pairs), source,
              model_dir)
  return runs.train_run(model_dir=model_dir, model_config=model_config, data=seq_data,
                        train_steps=train_steps, batch_size=batch_size,
                        feature_lengths=feature_lengths, optimizer=optimizer,
                        partitioner=partitioner, eval_every=eval_every,
                        checkpoint_every=checkpoint_every, log_every=log_every, seed=seed,
                        init_checkpoint=init_checkpoint)


def value_params_from_policy(value_model: t5.T5, policy_params: Any, rng: jax.Array) -> Any:
  """Value-model params: the policy's T5 weights where shapes agree, and a fresh scalar head."""
  fresh = dict(nn.meta.unbox(t5.init_params(value_model, rng)))
  policy_params = nn.meta.unbox(policy_params)
  for key, subtree in policy_params.items():
    if key not in fresh:
      continue
    same = jax.tree_util.tree_structure(fresh[key]) == jax.tree_util.tree_structure(subtree)
    if same and all(a.shape == b.shape for a, b in zip(jax.tree_util.tree_leaves(fresh[key]),
                                                       jax.tree_util.tree_leaves(subtree))):
      fresh[key] = subtree
  return fresh


class _RecordingReward:
  """Wraps the reward_fn: keys its sampled answers by PPO iteration and keeps the curve.

  The calls before iteration 1 (measuring mu0/sigma0 on a fresh run) get call indices past
  any iteration. After each iteration the mean raw reward goes into MODEL_DIR/
  reward_curve.json, with the earlier iterations a resumed run finds there (up to its
  checkpoint; later ones it computes again): so a killed, resumed or extended run has one
  curve, and samples the same answers as an uninterrupted one.
  """

  def __init__(self, reward: reward_lib.DefeasibilityReward, *, model_dir: str,
               start_iteration: int, calls_before_first_iteration: int):
    self.reward = reward
    self.path = pathlib.Path(model_dir) / f"{REWARD_CURVE}.json"
    self.curve = {i: v for i, v in _read_reward_curve(self.path).items() if i <= start_iteration}
    self._iteration = start_iteration
    self._calls_left_before = calls_before_first_iteration

  def __call__(self, prompts: list[str], responses: list[str]):
    if self._calls_left_before:
      self._calls_left_before -= 1
      return self.reward(prompts, responses, call_index=_NORM_CALL_INDEX +
                         self._calls_left_before)
    self._iteration += 1
    scores, extras = self.reward(prompts, responses, call_index=self._iteration)
    self.curve[self._iteration] = float(scores.mean()) if len(scores) else 0.0
    self.path.write_text(json.dumps({"iterations": self.iterations(),
                                     "raw_reward_mean": self.means()}))
    return scores, extras

  def iterations(self) -> list[int]:
    return sorted(self.curve)

  def means(self) -> list[float]:
    """The mean raw reward of each iteration, in iteration order."""
    return [self.curve[i] for i in self.iterations()]


# Call indices of the mu0/sigma0 calls: past any iteration a run will reach.
_NORM_CALL_INDEX = 2 ** 30


def _read_reward_curve(path: pathlib.Path) -> dict[int, float]:
  """{iteration: mean raw reward} of a curve file; {} when there is none."""
  if not path.is_file():
    return {}
  data = json.loads(path.read_text())
  return dict(zip(data["iterations"], data["raw_reward_mean"]))


def _plot_reward_curve(recorder: _RecordingReward) -> str:
  """Draws the recorder's curve beside its JSON file; returns the picture (or the JSON)."""
  path = recorder.path
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(recorder.iterations(), recorder.means(), marker="o")
    ax.set_xlabel("PPO iteration")
    ax.set_ylabel("mean raw reward (JSD)")
    ax.set_title("ClarifyDelphi PPO")
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return str(png)
  except ImportError:  # matplotlib is optional
    return str(path)


@gin.configurable
def train_clarify_ppo(*, model_dir: str, question_model_dir: str, answer_model_dir: str,
                      fusion_model_dir: str, judge_model_dir: str,
                      nli_model_dir: Optional[str] = None,
                      ppo_config: ppo_trainer.PPOConfig,
                      optimizer: optax.GradientTransformation, num_iterations: int,
                      reward_config: Optional[reward_lib.RewardConfig] = None,
                      source: str = "demo", split: str = "train",
                      max_prompts: Optional[int] = None,
                      partitioner: Optional[partitioning.PjitPartitioner] = None,
                      value_model_config: Optional[config_lib.T5Config] = None,
                      checkpoint_every: int = 100, log_every: int = 10,
                      sample_every: int = 100, seed: int = 0,
                      async_checkpoint: bool = True) -> dict[str, Any]:
  """PPO of θQ against the defeasibility reward (resumes MODEL_DIR/checkpoints).

  Args:
    model_dir: PPO run directory.
    question_model_dir: The supervised θQ (initial policy and reference).
    answer_model_dir, fusion_model_dir, judge_model_dir, nli_model_dir: Reward models (run or
      export directories; None for NLI: no filter).
    ppo_config: PPO settings (batch, epochs, KL, sampling: top-p 0.6, temperature 0.7, ...).
    optimizer: Policy (and value) optimizer.
    num_iterations: Total PPO iterations.
    reward_config: Reward-pipeline settings (None: `RewardConfig()`, made at call time so
      that gin bindings of RewardConfig apply).
    source: Situations: "demo" or a δ-Clarify folder.
    split: δ-Clarify split of the training situations.
    max_prompts: Use at most this many situations.
    partitioner: Mesh and rules (default data parallel).
    value_model_config: Value-model T5Config (default θQ's; then it starts from θQ's weights).
    checkpoint_every, log_every, sample_every, seed, async_checkpoint: See `train_ppo`.

  Returns:
    `train_ppo`'s metrics plus "policy_dir" (the exported final policy) and "reward_curve".
  """
  partitioner = partitioner or partitioning.PjitPartitioner()
  q_model = models.load_model(question_model_dir)
  config, vocabulary = q_model.model.config, q_model.vocabulary
  reward = reward_lib.DefeasibilityReward.from_dirs(
      answer_model_dir=answer_model_dir, fusion_model_dir=fusion_model_dir,
      judge_model_dir=judge_model_dir, nli_model_dir=nli_model_dir,
      config=reward_config or reward_lib.RewardConfig())
  situations = data_lib.situations(source, split=split)[:max_prompts]
  prompts = [formats.question_input(s) for s in situations]
  value_model = t5.T5(value_model_config or config, with_scalar_head=True)
  checkpoints.make_run_dir(model_dir)
  runs.save_run_files(model_dir, model_config=config, vocabulary=vocabulary)
  if jax.process_index() == 0 and gin.config_str():
    gin_utils.write_operative_config(model_dir)
  ckpt_dir = checkpoints.run_checkpoints_dir(model_dir)
  with checkpoints.CheckpointManager(ckpt_dir, async_save=False) as manager:
    start = manager.latest_step() or 0
  # A fresh run first measures mu0/sigma0 with these reward calls.
  norm_calls = 0
  if start == 0 and ppo_config.normalize_reward:
    norm_calls = math.ceil(min(ppo_config.reward_norm_num_prompts, len(prompts))
                           / ppo_config.batch_size)
  recorder = _RecordingReward(reward, model_dir=model_dir, start_iteration=start,
                              calls_before_first_iteration=norm_calls)
  trainer = ppo_trainer.PPOTrainer(
      policy_model=t5.T5(config), value_model=value_model, vocabulary=vocabulary,
      config=ppo_config, optimizer=optimizer, partitioner=partitioner, reward_fn=recorder)
  value_params = value_params_from_policy(value_model, q_model.params,
                                          jax.random.PRNGKey(seed + 1))
  result = ppo_trainer.train_ppo(
      model_dir=model_dir, trainer=trainer, prompt_source=prompts,
      num_iterations=num_iterations, checkpoint_every=checkpoint_every, log_every=log_every,
      sample_every=sample_every, seed=seed, async_checkpoint=async_checkpoint,
      init_policy_params=q_model.params, init_value_params=value_params)
  curve = _plot_reward_curve(recorder)
  with checkpoints.CheckpointManager(ckpt_dir, async_save=False) as manager:
    state, _ = manager.restore(target=trainer.abstract_state())
  policy_dir = models.export_policy(jax.device_get(state.policy.params),
                                    output_dir=os.path.join(model_dir, POLICY_DIR),
                                    config=config, vocabulary=vocabulary)
  result = dict(result)
  result.update({"policy_dir": policy_dir, "reward_curve": curve,
                 "reward_curve_values": recorder.means()})
  return result
