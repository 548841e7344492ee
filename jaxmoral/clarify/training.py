"""Gin entry points that train the ClarifyDelphi models.

`train_clarify_model` trains one supervised model (or one multi-task model for every role) as
an ordinary `runs.train_run` directory. `train_clarify_ppo` tunes θQ with PPO
(`jaxmoral.rl.ppo_trainer`) against the defeasibility reward, every model on the run's mesh;
the PPO run directory then loads as the tuned question generator. `build_ppo_program` makes the
functions that `train-ppo` runs and `jaxmoral compile` (target "clarify_ppo") lowers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any, Mapping, Optional, Sequence, Union

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import optax

from jaxmoral import aot
from jaxmoral import fileio
from jaxmoral import gin_utils
from jaxmoral import model_dirs
from jaxmoral import optimizers
from jaxmoral import partitioning
from jaxmoral import run_dirs
from jaxmoral import runs
from jaxmoral.clarify import data as data_lib
from jaxmoral.clarify import formats
from jaxmoral.clarify import judge as judge_lib
from jaxmoral.clarify import models
from jaxmoral.clarify import reward as reward_lib
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5
from jaxmoral.models import trainable
from jaxmoral.rl import ppo_trainer

logger = logging.getLogger(__name__)


@gin.configurable
def train_clarify_model(*, which: str, model_dir: str,
                        model_config: Optional[config_lib.T5Config] = None,
                        model_size: Optional[str] = None,
                        optimizer: Optional[optax.GradientTransformation] = None,
                        learning_rate: Optional[float] = None, train_steps: int = 1000,
                        batch_size: int = 32, feature_lengths: Optional[Mapping[str, int]] = None,
                        source: str = "demo", split: str = "train",
                        vocabulary_path: Optional[str] = None,
                        judge_classes: Optional[Sequence[str]] = None,
                        nli_labels: Sequence[str] = formats.NLI_LABELS,
                        relevance_labels: Sequence[str] = formats.RELEVANCE_LABELS,
                        partitioner: Optional[partitioning.PjitPartitioner] = None,
                        eval_every: int = 0, checkpoint_every: int = 1000,
                        keep_checkpoints: int = 3, log_every: int = 50, seed: int = 0,
                        init_checkpoint: Optional[str] = None,
                        mixing_cap: Optional[int] = None,
                        pack: bool = False) -> dict[str, float]:
  """Trains θQ, θA, fusion, judge, NLI or relevance (`which`: one of `data.WHICH`, or
  "multitask": all in one model) as a `runs.train_run`, whose final metrics it returns.

  Args:
    model_config, model_size: T5Config (None: `config.t5_config(size=model_size or "tiny")`).
    optimizer: Optax optimizer (None: AdamW at `learning_rate`).
    learning_rate: Rate of the default AdamW (default 1e-3); an error with `optimizer`, which
      has its own (the configs' gin macro LEARNING_RATE).
    feature_lengths: {"inputs": N, "targets": M} (None: inputs 128, targets 32).
    source: "demo" or a folder laid out like ../shared/data (every input of `which` must be
      there: `data.INPUTS`).
    split: δ-Clarify split of the questions (any `delta_clarify/<split>.tsv` of the folder).
    vocabulary_path: SentencePiece model (None: the init checkpoint's, else the demo one).
    judge_classes: Judge targets for bad, ok, good (each must be one vocabulary token; None:
      `formats.DEMO_JUDGE_CLASSES` with the demo vocabulary, i.e. without `vocabulary_path`
      and `init_checkpoint`, else `formats.T5_JUDGE_CLASSES`).
    nli_labels: NLI targets for entailment, neutral, contradiction.
    relevance_labels: Discriminator targets for relevant, irrelevant.
    train_steps, batch_size, partitioner, eval_every, checkpoint_every, keep_checkpoints,
      log_every, init_checkpoint: As `runs.train_run`'s (its evaluation is of one pair in 10,
      held out).
    mixing_cap: At most this many pairs of each model ("multitask": T5's examples-proportional
      mixing with a limit; `data.build_pairs`); None: all.
    pack: Pack several pairs per row (`runs.Seq2SeqData.pack`, T5X's fine-tuning default):
      short pairs fill the rows padding would, so a step reads more pairs at the same cost.
  """
  # Defaults settled (and contradictions refused) before any data is read.
  if model_config is not None and model_size is not None:
    raise ValueError(f"train_clarify_model: model_size={model_size!r} is for the default "
                     f"model_config; one is given (gin binds it): drop model_size")
  model_config = model_config or config_lib.t5_config(size=model_size or "tiny")
  rate = _default_rate(optimizer, learning_rate, 1e-3, function="train_clarify_model",
                       macro="LEARNING_RATE")
  optimizer = optimizer or optimizers.make_optimizer(name="adamw", learning_rate=rate)
  feature_lengths = feature_lengths or {"inputs": 128, "targets": 32}
  if judge_classes is None:
    judge_classes = (formats.T5_JUDGE_CLASSES if vocabulary_path or init_checkpoint
                     else formats.DEMO_JUDGE_CLASSES)
  # Every input of every requested model is checked (and read) before MODEL_DIR is made.
  pairs = data_lib.build_pairs(which, source, split=split, judge_classes=judge_classes,
                               nli_labels=nli_labels, relevance_labels=relevance_labels,
                               mixing_cap=mixing_cap, seed=seed)
  new_run = not fileio.exists(model_dir)
  run_dirs.make_run_dir(model_dir)
  try:
    seq_data = runs.Seq2SeqData(
        train_file=data_lib.write_pairs(pairs, fileio.join(model_dir, "data",
                                                            f"{which}_{split}.jsonl")),
        vocabulary_path=vocabulary_path, pack=pack)
    if which in ("judge", "multitask"):
      init_vocabulary = (model_dirs.inspect(init_checkpoint).vocabulary if init_checkpoint
                         else None)
      judge_lib.class_token_ids(seq_data.vocabulary(run_dirs.vocabulary_build_dir(model_dir),
                                                    fallback=init_vocabulary), judge_classes)
  except BaseException:
    # A run refused before training leaves nothing behind (a rerun with other flags starts
    # clean); a folder that was there before is the user's and stays.
    if new_run:
      with contextlib.suppress(OSError):
        fileio.rmtree(model_dir)
    raise
  logger.info("clarify: training %s on %d pairs from %s -> %s", which, len(pairs), source,
              model_dir)
  return runs.train_run(model_dir=model_dir, model=trainable.Seq2SeqModel(config=model_config),
                        data=seq_data, train_steps=train_steps, batch_size=batch_size,
                        feature_lengths=feature_lengths, optimizer=optimizer,
                        partitioner=partitioner, eval_every=eval_every,
                        checkpoint_every=checkpoint_every,
                        keep_checkpoints=keep_checkpoints, log_every=log_every, seed=seed,
                        init_checkpoint=init_checkpoint)


def _default_rate(optimizer: Optional[optax.GradientTransformation],
                  learning_rate: Optional[float], default: float, *, function: str,
                  macro: str) -> float:
  """The default optimizer's rate: `learning_rate`, else `default`. A rate given with an
  optimizer would be ignored, so it is an error saying where the optimizer's own rate is set."""
  if optimizer is not None and learning_rate is not None:
    raise ValueError(f"{function}: learning_rate={learning_rate!r} is the rate of the default "
                     f"AdamW, but an optimizer is given (gin binds {function}.optimizer): set "
                     f"its rate instead, e.g. --gin.{macro}={learning_rate!r} with "
                     f"configs/clarify/*.gin")
  return default if learning_rate is None else learning_rate


def value_params_from_policy(trainer: ppo_trainer.PPOTrainer, policy_params: Any,
                             rng: jax.Array) -> Any:
  """Value-model params: the policy's T5 weights where shapes agree, and a fresh scalar head
  (created in the value model's shardings)."""
  fresh = dict(trainer.value_init.init_params(rng))
  for key, subtree in nn.meta.unbox(policy_params).items():
    if key in fresh and (jax.tree_util.tree_map(jnp.shape, fresh[key])
                         == jax.tree_util.tree_map(jnp.shape, subtree)):
      fresh[key] = subtree
  return fresh


@gin.configurable(module="training")
@dataclasses.dataclass(frozen=True)
class ModelShape:
  """What a model directory tells a compile, without the directory: its `T5Config` and
  SentencePiece model file. `jaxmoral compile` passes these for the directories a compile host
  lacks; no weights are read either way."""
  config: config_lib.T5Config
  vocabulary_path: str

  def __post_init__(self):
    if not isinstance(self.config, config_lib.T5Config):
      raise ValueError(f"ModelShape.config: a T5Config, got {type(self.config).__name__}")
    if not isinstance(self.vocabulary_path, str) or not self.vocabulary_path:
      raise ValueError(f"ModelShape.vocabulary_path: a SentencePiece model file, got "
                       f"{self.vocabulary_path!r}")


ModelSource = Union[str, ModelShape]


def _config_and_vocabulary(source: ModelSource, role: str) -> tuple[config_lib.T5Config, Any]:
  """A model's config and vocabulary, from its directory (no weights read) or a stand-in."""
  if isinstance(source, ModelShape):
    return source.config, vocab_lib.get_vocabulary(source.vocabulary_path)
  info = model_dirs.inspect(source)
  if info.vocabulary is None:
    raise ValueError(f"{source}: the {role} has no vocabulary")
  return info.config, info.vocabulary


@dataclasses.dataclass(frozen=True)
class PPOProgram:
  """What a ClarifyDelphi PPO run executes: the `PPOTrainer` and the `DefeasibilityReward`
  whose models run on the same mesh."""
  trainer: ppo_trainer.PPOTrainer
  reward: reward_lib.DefeasibilityReward

  def reward_functions(self) -> dict[str, tuple[Any, models.ClarifyModel]]:
    """{name: (the jitted function the reward calls, the model it runs)} of one iteration."""
    r, cfg = self.reward, self.reward.config
    out = {
        "answer": (r.answer_model.sampler(max_decode_length=cfg.max_answer_length,
                                          greedy=cfg.answer_greedy, top_p=cfg.answer_top_p,
                                          temperature=cfg.answer_temperature), r.answer_model),
        "fusion": (r.fusion_model.sampler(max_decode_length=cfg.max_fusion_length),
                   r.fusion_model),
        "judge": (r.judge_model.class_scorer(), r.judge_model),
    }
    if r.nli is not None:
      out["nli"] = (r.nli.model.label_scorer(r.nli.labels), r.nli.model)
    return out


def build_ppo_program(*, policy_config: config_lib.T5Config, vocabulary: Any,
                      ppo_config: ppo_trainer.PPOConfig, optimizer: optax.GradientTransformation,
                      partitioner: partitioning.PjitPartitioner,
                      reward: reward_lib.DefeasibilityReward,
                      value_model_config: Optional[config_lib.T5Config] = None) -> PPOProgram:
  """The trainer of θQ against `reward` on `partitioner`'s mesh (the run's and compile's)."""
  return PPOProgram(reward=reward, trainer=ppo_trainer.PPOTrainer(
      policy_model=t5.T5(policy_config),
      value_model=t5.T5(value_model_config or policy_config, with_scalar_head=True),
      vocabulary=vocabulary, config=ppo_config, optimizer=optimizer, partitioner=partitioner,
      reward_fn=reward))


@gin.configurable(denylist=["compile_only"])  # Set by `jaxmoral compile` only.
def train_clarify_ppo(*, model_dir: str, question_model_dir: ModelSource,
                      answer_model_dir: ModelSource, fusion_model_dir: ModelSource,
                      judge_model_dir: ModelSource, nli_model_dir: Optional[ModelSource] = None,
                      ppo_config: Optional[ppo_trainer.PPOConfig] = None,
                      optimizer: Optional[optax.GradientTransformation] = None,
                      learning_rate: Optional[float] = None, num_iterations: int = 100,
                      reward_config: Optional[reward_lib.RewardConfig] = None,
                      source: str = "demo", split: str = "train",
                      max_prompts: Optional[int] = None,
                      partitioner: Optional[partitioning.PjitPartitioner] = None,
                      value_model_config: Optional[config_lib.T5Config] = None,
                      checkpoint_every: int = 100, log_every: int = 10,
                      sample_every: int = 100, seed: int = 0,
                      async_checkpoint: bool = True,
                      compile_only: bool = False) -> Any:
  """PPO of θQ against the defeasibility reward (resumes MODEL_DIR/checkpoints).

  Args:
    question_model_dir: The supervised θQ (initial policy and reference).
    answer_model_dir: The answer generator θA of the reward (a run or export directory).
    fusion_model_dir, judge_model_dir: The fusion model and the judge of the reward.
    nli_model_dir: The NLI filter of the reward's answers (None: no filter).
    ppo_config, reward_config: PPO settings (the original ClarifyDelphi recipe by default)
      and reward-pipeline settings; None: `PPOConfig()` / `RewardConfig()`, made at call time
      so that their gin bindings apply.
    optimizer: Policy (and value) optimizer (None: the recipe's Adam, as
      gin/ppo/clarifydelphi.gin binds it: eps 1e-5, `learning_rate` decaying linearly to 0
      over the run's updates).
    learning_rate: Initial rate of the default Adam (default 1e-5); an error with
      `optimizer`, which has its own (the configs' gin macro PPO_LEARNING_RATE).
    source, split, max_prompts: The situations: "demo" or a δ-Clarify folder, its split, and
      at most this many of them.
    partitioner: Mesh and rules (default data parallel).
    value_model_config: Value-model T5Config (default θQ's; then it starts from θQ's weights).
    checkpoint_every, log_every, async_checkpoint, seed: As for `ppo_trainer.train_ppo`.
    sample_every: Log sample questions to TensorBoard every N iterations (0: never).
    compile_only: Set by `jaxmoral compile` (not a flag): build the iteration's programs from
      the models' configs (a directory or a `ModelShape` each) and return them as an
      `aot.CompileProgram`, reading no data or weights and writing nothing.

  Returns:
    `train_ppo`'s metrics plus "policy_dir" (the run itself: it loads as the tuned policy) and
    "reward_curve_values" (the mean raw reward of every iteration).
  """
  ppo_config = ppo_config or ppo_trainer.PPOConfig()
  rate = _default_rate(optimizer, learning_rate, 1e-5, function="train_clarify_ppo",
                       macro="PPO_LEARNING_RATE")
  optimizer = optimizer or optimizers.make_optimizer(
      name="adamw", eps=1e-5, weight_decay=0.0, learning_rate=optimizers.make_schedule(
          name="linear_decay", base_learning_rate=rate,
          total_steps=ppo_trainer.ppo_update_count(num_iterations=num_iterations,
                                                   config=ppo_config)))
  reward_config = reward_config or reward_lib.RewardConfig()
  if not compile_only:
    # The data first: a missing split or a bad file fails before any model loads.
    situations = data_lib.situations(source, split=split)[:max_prompts]
  partitioner = partitioner or partitioning.PjitPartitioner()
  config, vocabulary = _config_and_vocabulary(question_model_dir, "question generator")
  reward_dirs = dict(answer_model_dir=answer_model_dir, fusion_model_dir=fusion_model_dir,
                     judge_model_dir=judge_model_dir, nli_model_dir=nli_model_dir)
  if compile_only:
    reward = _abstract_reward(reward_dirs, reward_config, partitioner)
  else:
    stand_ins = [name for name, d in dict(reward_dirs, question_model_dir=question_model_dir
                                          ).items() if isinstance(d, ModelShape)]
    if stand_ins:
      raise ValueError(f"train_clarify_ppo: {', '.join(sorted(stand_ins))}: a ModelShape "
                       f"stands in for a model only in `jaxmoral compile`; a run needs the "
                       f"model directory")
    reward = reward_lib.DefeasibilityReward.from_dirs(
        **reward_dirs, config=reward_config, partitioner=partitioner)  # type: ignore[arg-type]
  program = build_ppo_program(
      policy_config=config, vocabulary=vocabulary, ppo_config=ppo_config,
      optimizer=optimizer, partitioner=partitioner, value_model_config=value_model_config,
      reward=reward)
  if compile_only:
    return _compile_program(program)
  assert isinstance(question_model_dir, str)
  prompts = [formats.question_input(s) for s in situations]
  run_dirs.make_run_dir(model_dir)
  if jax.process_index() == 0:
    run_dirs.save_run_files(model_dir, config=config, vocabulary=vocabulary,
                            settings={"model": {"kind": "clarify_ppo_policy"}})
    if gin.config_str():
      gin_utils.write_operative_config(model_dir)

  def init() -> ppo_trainer.PPOInit:
    policy = model_dirs.load(question_model_dir, partitioner=partitioner).lm_params
    value = value_params_from_policy(program.trainer, policy, jax.random.PRNGKey(seed + 1))
    return ppo_trainer.PPOInit(policy=policy, value=value)

  result = ppo_trainer.train_ppo(
      model_dir=model_dir, trainer=program.trainer, prompt_source=prompts,
      num_iterations=num_iterations, checkpoint_every=checkpoint_every, log_every=log_every,
      sample_every=sample_every, seed=seed, async_checkpoint=async_checkpoint, init=init)
  curve = ppo_trainer.read_reward_curve(ppo_trainer.reward_curve_path(model_dir))
  return {**result, "policy_dir": os.fspath(model_dir),
          "reward_curve_values": [curve[i] for i in sorted(curve)]}


# -- jaxmoral compile ---------------------------------------------------------------------------
def _abstract_model(source: ModelSource, role: str, reward_config: reward_lib.RewardConfig,
                    partitioner: partitioning.PjitPartitioner) -> models.ClarifyModel:
  """A reward model with abstract parameters in the partitioner's shardings."""
  config, vocabulary = _config_and_vocabulary(source, role)
  shardings = model_dirs.param_shardings(config, partitioner)
  shapes = nn.meta.unbox(t5.abstract_params(t5.T5(config)))
  params = jax.tree_util.tree_map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings)
  return models.ClarifyModel(t5.T5(config), params, vocabulary=vocabulary,
                             input_length=reward_config.input_length,
                             batch_size=reward_config.batch_size, partitioner=partitioner)


def _abstract_reward(dirs: Mapping[str, Optional[ModelSource]],
                     reward_config: reward_lib.RewardConfig,
                     partitioner: partitioning.PjitPartitioner
                     ) -> reward_lib.DefeasibilityReward:
  """The reward `from_dirs` would load, with abstract parameters (a compile's). Without
  `use_nli` a run never calls the NLI model, so the compile leaves it out."""
  roles = {name: _abstract_model(source, name.removesuffix("_model_dir"), reward_config,
                                 partitioner)
           for name, source in dirs.items()
           if source is not None and (name != "nli_model_dir" or reward_config.use_nli)}
  return reward_lib.DefeasibilityReward(
      answer_model=roles["answer_model_dir"], fusion_model=roles["fusion_model_dir"],
      judge_model=roles["judge_model_dir"], nli_model=roles.get("nli_model_dir"),
      config=reward_config)


def _reward_stage_args(name: str, cm: models.ClarifyModel, reward: reward_lib.DefeasibilityReward
                       ) -> tuple[Any, ...]:
  """Abstract arguments of a reward function as `predict` / `label_distribution` call it."""
  rows = jax.ShapeDtypeStruct((cm.batch_size, cm.input_length), jnp.int32,
                              sharding=cm.partitioner.data_sharding(2))
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=cm.partitioner.replicated)
  if name in ("answer", "fusion"):
    return (cm.params, rows, None, None, key, None)
  if name == "judge":
    labels = reward.config.judge_classes
  else:
    assert reward.nli is not None  # The NLI role exists only with an NLI scorer.
    labels = reward.nli.labels
  ids = cm.label_ids(labels)
  if all(len(i) == 1 for i in ids):
    return (cm.params, rows, jax.ShapeDtypeStruct((len(ids),), jnp.int32,
                                                  sharding=cm.partitioner.replicated))
  targets = jax.ShapeDtypeStruct((cm.batch_size, len(ids), max(map(len, ids)) + 1), jnp.int32,
                                 sharding=cm.partitioner.data_sharding(3))
  return (cm.params, rows, None, None, targets, None)


def _compile_program(program: PPOProgram) -> aot.CompileProgram:
  """Every program of a PPO iteration, the very functions a run calls, as compile stages.

  The memory report counts every model's parameters and state once (they stay on the chips)
  plus the largest program's working memory.
  """
  trainer, reward = program.trainer, program.reward
  args, functions = trainer.stage_args(), program.reward_functions()

  def own(name: str) -> aot.Stage:  # The first argument: the state (or the policy's params).
    return aot.Stage(name, trainer.functions[name], args[name], persistent=args[name][0])

  stages = [own("rollout")]
  for name in ("answer", "nli", "fusion", "judge"):
    if name in functions:
      fn, cm = functions[name]
      stages.append(aot.Stage(name, fn, _reward_stage_args(name, cm, reward),
                              persistent=cm.params))
  stages += [own("score"), own("update")]
  state = args["update"][0]
  resident = (state, [cm.params for _, cm in functions.values()])
  cfg, reward_config = trainer.config, reward.config
  num_params = aot._num_params  # pylint: disable=protected-access
  policy_n, value_n = num_params(state.policy.params), num_params(state.value.params)
  reward_n = sum(num_params(cm.params) for _, cm in functions.values())
  trainable = trainer.policy_init.num_params()[1] + trainer.value_init.num_params()[1]
  return aot.CompileProgram(
      stages=tuple(stages), partitioner=trainer.partitioner, resident=resident,
      description=(f"ClarifyDelphi PPO iteration: policy {policy_n / 1e6:.1f}M + frozen "
                   f"reference + value {value_n / 1e6:.1f}M + {len(functions)} reward models "
                   f"{reward_n / 1e6:.1f}M; batch {cfg.batch_size} x (prompt "
                   f"{cfg.max_prompt_length}, response {cfg.max_response_length}), reward batch "
                   f"{reward_config.batch_size} x {reward_config.input_length}; "
                   f"{cfg.num_ppo_epochs} epochs x {cfg.num_minibatches} minibatches"),
      num_params=2 * policy_n + value_n + reward_n, num_trainable_params=int(trainable),
      tokens_per_step=cfg.batch_size * (cfg.max_prompt_length + cfg.max_response_length),
      program=program)


@gin.configurable(module="training")
def ppo_compile_target(*, policy_config: Optional[config_lib.T5Config] = None,
                       reward_model_config: Optional[config_lib.T5Config] = None,
                       vocabulary_path: Optional[str] = None) -> aot.CompileProgram:
  """`jaxmoral compile` target "clarify_ppo": `train_clarify_ppo` in its compile-only mode.

  Every other setting (PPO, optimizer, reward, partitioner, value model) is the run's own,
  as gin binds `train_clarify_ppo`. A pod compile has no model directories; the configs given
  here stand in for them (no stand-ins: the directories the run binds are read, without
  their weights).

  Args:
    policy_config: T5Config of θQ (and of the value model unless `train_clarify_ppo.
      value_model_config` is bound).
    reward_model_config: T5Config of the answer, NLI, fusion and judge models (default: the
      policy's).
    vocabulary_path: The models' SentencePiece model (the judge's classes must be one token).
  """
  if policy_config is None:
    try:
      return train_clarify_ppo(model_dir="", compile_only=True)  # type: ignore[call-arg]
    except TypeError as error:
      if "missing" not in str(error) or "train_clarify_ppo()" not in str(error):
        raise
      missing = str(error).splitlines()[0]  # gin appends the configurable's repr.
      raise ValueError(f"compile: {missing}: bind the model directories (e.g. training."
                       f"train_clarify_ppo.question_model_dir = 'DIR'), or stand-ins for them: "
                       f"training.ppo_compile_target.policy_config and vocabulary_path (see "
                       f"configs/clarify/tpu_pod.gin)") from None
  if vocabulary_path is None:
    raise ValueError("compile: training.ppo_compile_target.policy_config is bound but not its "
                     "vocabulary_path; see configs/clarify/tpu_pod.gin")
  policy = ModelShape(config=policy_config, vocabulary_path=vocabulary_path)
  reward = ModelShape(config=reward_model_config or policy_config,
                      vocabulary_path=vocabulary_path)
  # model_dir is never written in compile-only mode.
  return train_clarify_ppo(model_dir="", question_model_dir=policy, answer_model_dir=reward,
                           fusion_model_dir=reward, judge_model_dir=reward, nli_model_dir=reward,
                           compile_only=True)


aot.register_compile_target("clarify_ppo", ppo_compile_target)
