"""PPO for a T5 policy with any reward of (prompt, response): compiled, sharded, resumable.

An iteration (`PPOTrainer.iteration`) is four stages: rollout (`decoding.sample`, jitted);
reward (a host `reward_fn(prompt_texts, response_texts, key=RewardKey)`, which may run its own
jitted models on the same mesh, or a jittable `reward_fn_tokens`); score (one jitted pass:
old/reference log-probs, values, KL-penalised rewards, GAE); update (one jitted `ppo_update`: a
`lax.scan` of `num_ppo_epochs` x `num_minibatches` clipped updates, each optionally accumulated
over `num_microbatches`, then the KL controller step). The policy and value states are
`jaxmoral.trainer.TrainState`s, so trainable masks and optimizer-state shardings work as in
supervised training.

`PPOTrainer` speaks the core loop's trainer protocol, so `train_ppo` runs `jaxmoral.train.train`
(resume, TensorBoard, NaN stop, preemption) with hooks for the reward normalisation, sample texts
and the learning curves. Iteration i reads batch i of a `PromptSource`, draws from
`fold_in(base_key, i)` and names its reward call (`RewardKey`), so a resumed run continues
exactly like an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import flax
import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmoral import fileio
from jaxmoral import losses
from jaxmoral import metrics as metrics_lib
from jaxmoral import optimizers
from jaxmoral import partitioning
from jaxmoral import pictures
from jaxmoral import run_layout
from jaxmoral import token_rows
from jaxmoral import train as train_lib
from jaxmoral import trainer as trainer_lib
from jaxmoral import validation
from jaxmoral.data import pipeline
from jaxmoral.data import source
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import t5 as t5_lib
from jaxmoral.rl import ppo
from jaxmoral.rl import rollout as rollout_lib

logger = logging.getLogger(__name__)

Array = jax.Array
PyTree = Any


@dataclasses.dataclass(frozen=True)
class RewardKey:
  """Which reward call this is, for a reward that samples to key its randomness by (so a
  resumed run draws what the uninterrupted one drew)."""
  purpose: str  # "normalization" | "rollout"
  index: int


# reward_fn(prompt_texts, response_texts, *, key) -> (scores (B,), {name: (B,) array or scalar}).
RewardFn = Callable[..., tuple[np.ndarray, Mapping[str, Any]]]
# reward_fn_tokens(prompt_tokens (B, L), response_tokens (B, T), response_mask (B, T)) -> (B,).
TokenRewardFn = Callable[[Array, Array, Array], Array]
KL_CONTROLS = ("adaptive", "fixed")


# -- config -------------------------------------------------------------------------------------
@gin.configurable
@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig:
  """Settings of PPO (Ziegler et al. 2019 / PPO2 conventions).

  The defaults are the original ClarifyDelphi recipe (allenai/clarifydelphi `Code/arguments.py`
  and `Code/main.py`, as gin/ppo/clarifydelphi.gin binds it); the original's `--adaptive_kl`
  flag, on by default, selects its FixedKLController.

  Attributes:
    batch_size: Prompts (episodes) per rollout; divisible by `num_minibatches` and by the
      mesh's data axis.
    num_ppo_epochs: Passes over each rollout.
    num_minibatches: Minibatches per pass (a fresh permutation per pass).
    num_microbatches: Gradient accumulation steps per minibatch (less activation memory, the
      same update: see `trainer.microbatch_gradients`). Divides the minibatch size.
    clip_ratio, value_clip: Clip of the policy ratio and of the value change in the losses.
    value_coef: alpha in loss = policy_loss + alpha * value_loss.
    kl_control: "adaptive" (Ziegler's proportional controller) or "fixed".
    init_kl_coef: Initial (or fixed) KL penalty coefficient.
    kl_target: Adaptive controller's target KL (nats per sequence).
    kl_horizon: Adaptive controller's horizon (episodes). The coefficient moves by at most
      0.2 * batch_size / kl_horizon per iteration: with the default 10,000 and 32 episodes per
      iteration that is 0.064 %, i.e. fixed in practice; about 10 iterations' episodes lets
      it follow the target within tens of iterations.
    gamma, lam: GAE discount and lambda.
    whiten_rewards: Scale per-token rewards to unit variance before GAE.
    whiten_advantages: Whiten advantages over the batch.
    temperature: Sampling temperature, also of the teacher-forced policy and reference logits.
    top_p, top_k: Must be 1.0 and 0: rollouts sample the policy's whole distribution (see
      `jaxmoral.rl.rollout`); evaluation decoding has settings of its own.
    max_prompt_length: Prompts are encoded (+EOS) and truncated/padded to this length.
    max_response_length: Tokens sampled at most (EOS included).
    compute_entropy: Compute (and log) the policy entropy in the update step.
    share_value_encoder: The value model reads the policy's encoder output (it has no encoder
      of its own; value-loss gradients reach the policy encoder).
    normalize_reward: Pay (score - mu0) / sigma0, with mu0 / sigma0 measured on the initial
      policy's responses to the training prompts before training.
    reward_norm_num_prompts: Prompts used to measure mu0 / sigma0 (at most all of them).
  """
  batch_size: int = 64
  num_ppo_epochs: int = 4
  num_minibatches: int = 1
  num_microbatches: int = 1
  clip_ratio: float = 0.2
  value_clip: float = 0.2
  value_coef: float = 1.0
  kl_control: str = "fixed"
  init_kl_coef: float = 0.15
  kl_target: float = 6.0
  kl_horizon: float = 10000.0
  gamma: float = 1.0
  lam: float = 0.95
  whiten_rewards: bool = True
  whiten_advantages: bool = True
  temperature: float = 0.7
  top_p: float = 1.0
  top_k: int = 0
  max_prompt_length: int = 128
  max_response_length: int = 16
  compute_entropy: bool = True
  share_value_encoder: bool = False
  normalize_reward: bool = True
  reward_norm_num_prompts: int = 256

  def __post_init__(self):
    for name in ("batch_size", "num_ppo_epochs", "num_minibatches", "num_microbatches",
                 "max_prompt_length", "max_response_length", "reward_norm_num_prompts"):
      validation.positive_int(getattr(self, name), f"PPOConfig.{name}")
    if self.batch_size % self.num_minibatches:
      raise ValueError(f"PPOConfig.batch_size={self.batch_size} must be divisible by "
                       f"num_minibatches={self.num_minibatches}")
    if self.minibatch_size % self.num_microbatches:
      raise ValueError(f"PPOConfig: the minibatch size {self.minibatch_size} (batch_size / "
                       f"num_minibatches) must be divisible by "
                       f"num_microbatches={self.num_microbatches}")
    for names, rule, holds in (
        (("clip_ratio", "value_clip", "temperature", "kl_target", "kl_horizon"), "> 0",
         lambda v: v > 0),
        (("value_coef", "init_kl_coef"), ">= 0", lambda v: v >= 0),
        (("gamma", "lam"), "in [0, 1]", lambda v: 0.0 <= v <= 1.0)):
      for name in names:
        if not holds(getattr(self, name)):
          raise ValueError(f"PPOConfig.{name} must be {rule}, got {getattr(self, name)!r}")
    validation.non_negative_int(self.top_k, "PPOConfig.top_k")
    if self.top_p != 1.0 or self.top_k != 0:
      raise ValueError(f"PPOConfig: top_p={self.top_p!r}, top_k={self.top_k!r}: PPO rollouts "
                       f"must sample the policy's whole distribution softmax(logits / "
                       f"temperature) (its ratio, entropy and KL penalty are that "
                       f"distribution's; a truncated sampler never charges mass moved into "
                       f"the tail); set top_p = 1.0 and top_k = 0 (evaluation decoding has "
                       f"its own settings)")
    if self.kl_control not in KL_CONTROLS:
      raise ValueError(f"PPOConfig.kl_control must be one of {KL_CONTROLS}, got "
                       f"{self.kl_control!r}")

  @property
  def minibatch_size(self) -> int:
    return self.batch_size // self.num_minibatches

  def adaptive_kl_reach(self, num_iterations: int) -> float:
    """How far the adaptive coefficient can move in `num_iterations`: the factor it reaches
    when the KL stays far above target every iteration (1.0 for a fixed coefficient)."""
    if self.kl_control != "adaptive":
      return 1.0
    return float((1.0 + 0.2 * self.batch_size / self.kl_horizon) ** num_iterations)

  def kl_controller(self) -> ppo.AdaptiveKLController | ppo.FixedKLController:
    if self.kl_control == "adaptive":
      return ppo.AdaptiveKLController(init_kl_coef=self.init_kl_coef, target=self.kl_target,
                                      horizon=self.kl_horizon)
    return ppo.FixedKLController(init_kl_coef=self.init_kl_coef)


@gin.configurable
def ppo_update_count(*, num_iterations: int, config: PPOConfig) -> int:
  """Optimizer updates of a run, `num_iterations * num_ppo_epochs * num_minibatches`: the
  `total_steps` of a learning-rate decay over the whole run (an optax schedule counts
  updates; gin/ppo/clarifydelphi.gin binds it)."""
  validation.positive_int(num_iterations, "ppo_update_count: num_iterations")
  return num_iterations * config.num_ppo_epochs * config.num_minibatches


# -- state --------------------------------------------------------------------------------------
@flax.struct.dataclass
class PPOState:
  """Everything a PPO run checkpoints.

  Attributes:
    step: PPO iterations done (int32 scalar); also the data position.
    policy: Policy `TrainState` (its `step` counts optimizer updates).
    value: Value-model `TrainState`.
    ref_params: Frozen reference policy (the initial policy); no optimizer state.
    kl_coef: Current KL penalty coefficient (float32 scalar).
    reward_mean: mu0 of the reward normalisation (0 when off).
    reward_std: sigma0 of the reward normalisation (1 when off).
  """
  step: Array
  policy: trainer_lib.TrainState
  value: trainer_lib.TrainState
  ref_params: PyTree
  kl_coef: Array
  reward_mean: Array
  reward_std: Array


@dataclasses.dataclass(frozen=True, eq=False)
class PromptSource(source.DataSource):
  """PPO's data: batches of prompts (tokens and texts), deterministic in (seed, iteration).

  Batch i is stream positions [i*B, (i+1)*B) of per-epoch seeded permutations of the prompts
  (`pipeline.stream_indices`, as `pipeline.BatchSource`), so a resumed run reads the same ones.

  Attributes (besides `DataSource`'s batch_size and shard):
    tokens: (N, max_prompt_length) int32 encoded prompts.
    texts: The N prompts as text (for the reward).
    seed: Order seed.
  """
  tokens: np.ndarray
  texts: Sequence[str]
  batch_size: int
  seed: int = 0
  shard_index: int = 0
  shard_count: int = 1

  def __post_init__(self):
    if len(self.tokens) != len(self.texts):
      raise ValueError(f"PromptSource: {len(self.tokens)} token rows but {len(self.texts)} texts")
    self.check_shard()

  @property
  def num_examples(self) -> int:
    return len(self.texts)

  def indices(self, iteration: int) -> np.ndarray:
    return pipeline.stream_indices(self.shard_positions(iteration), self.num_examples,
                                   seed=self.seed)

  def batch(self, iteration: int) -> dict[str, Any]:
    """{"prompt_tokens": (B, L) int32, "prompt_texts": [B texts]} of an iteration."""
    rows = self.indices(iteration)
    return {"prompt_tokens": self.tokens[rows], "prompt_texts": [self.texts[i] for i in rows]}


@dataclasses.dataclass(frozen=True)
class PPOInit:
  """Initial parameters of a fresh PPO run (`PPOTrainer.init_state_from_params`): the
  policy's (and the frozen reference's), and the value model's (None: random)."""
  policy: PyTree
  value: PyTree = None


# -- trainer ------------------------------------------------------------------------------------
class PPOTrainer:
  """Compiled, sharded PPO steps for a T5 policy and a T5 value model.

  Attributes:
    policy_init: `jaxmoral.trainer.TrainStateInitializer` of the policy (state creation,
      trainable mask, shardings); `value_init` that of the value model.
    state_shardings: `PPOState` of `NamedSharding`s.
    last_samples: (prompt, response, raw score) rows of the last iteration, for logs.
  """
  # Shown on the core loop's progress line besides the loss.
  progress_metrics = ("reward_mean", "raw_score_mean", "kl", "entropy")

  def __init__(self, *, policy_model: t5_lib.T5, value_model: t5_lib.T5,
               vocabulary: vocab_lib.Vocabulary, config: PPOConfig,
               optimizer: optax.GradientTransformation,
               partitioner: partitioning.PjitPartitioner, reward_fn: Optional[RewardFn] = None,
               reward_fn_tokens: Optional[TokenRewardFn] = None,
               value_optimizer: Optional[optax.GradientTransformation] = None,
               policy_trainable_mask: trainer_lib.MaskSpec = None,
               value_trainable_mask: trainer_lib.MaskSpec = None):
    """Builds shardings and the compiled functions (compiled on first use).

    Args:
      policy_model: The policy T5 (the reference is a frozen copy of its initial params).
      value_model: A T5 built with `with_scalar_head=True`.
      vocabulary: Encodes prompts and decodes the texts the reward reads.
      optimizer, value_optimizer: Optax optimizers of the policy and of the value model
        (default: `optimizer`).
      reward_fn: Host reward (`RewardFn`); `key` is the call's `RewardKey`, `extra` maps names
        to (B,) arrays or scalars (logged as means). Response texts exclude EOS.
      reward_fn_tokens: Alternatively a jittable `TokenRewardFn`, run compiled on the mesh.
      policy_trainable_mask, value_trainable_mask: Parameters to train (`jaxmoral.trainer`).
    """
    if (reward_fn is None) == (reward_fn_tokens is None):
      raise ValueError("PPOTrainer: give exactly one of reward_fn, reward_fn_tokens")
    if not isinstance(config, PPOConfig):
      raise TypeError(f"PPOTrainer: config must be a PPOConfig, got {type(config).__name__}")
    if not value_model.with_scalar_head:
      raise ValueError("PPOTrainer: value_model must be built with with_scalar_head=True")
    if config.share_value_encoder and value_model.config.d_model != policy_model.config.d_model:
      raise ValueError(f"PPOTrainer: share_value_encoder needs equal d_model (policy "
                       f"{policy_model.config.d_model}, value {value_model.config.d_model})")
    data = partitioner.data_parallel_size
    if config.batch_size % data:
      raise ValueError(f"PPOConfig.batch_size={config.batch_size} must be divisible by the "
                       f"mesh's data axis ({data})")
    self.config = config
    self.partitioner = partitioner
    self.policy_model = policy_model
    self.value_model = value_model
    self.vocabulary = vocabulary
    self.reward_fn = reward_fn
    self.optimizer = optimizer  # The policy's.
    self._value_optimizer = value_optimizer if value_optimizer is not None else optimizer
    self._kl_controller = config.kl_controller()

    self.last_samples: list[dict[str, Any]] = []
    self.policy_init = trainer_lib.TrainStateInitializer(
        init_params_fn=functools.partial(t5_lib.init_params, policy_model),
        optimizer=optimizer, partitioner=partitioner, trainable_mask=policy_trainable_mask)
    self.value_init = trainer_lib.TrainStateInitializer(
        init_params_fn=lambda rng: self._value_params(t5_lib.init_params(value_model, rng)),
        optimizer=self._value_optimizer, partitioner=partitioner,
        trainable_mask=value_trainable_mask)

    rep = partitioner.replicated
    d1, d2 = partitioner.data_sharding(1), partitioner.data_sharding(2)
    self.state_shardings = PPOState(
        step=rep, kl_coef=rep, reward_mean=rep, reward_std=rep,  # type: ignore[arg-type]
        policy=self.policy_init.state_shardings, value=self.value_init.state_shardings,
        ref_params=self.policy_init.params_shardings)
    self.rollout_shardings = jax.tree_util.tree_map(partitioner.data_sharding,
                                                    rollout_lib.ROLLOUT_NDIMS)
    params_sh = self.policy_init.params_shardings
    self._copy_jit = partitioner.partition(
        lambda p: jax.tree_util.tree_map(jnp.copy, p), in_shardings=(params_sh,),
        out_shardings=params_sh)
    self._generate_jit = partitioner.partition(
        self._generate_fn, in_shardings=(params_sh, d2, rep), out_shardings=(d2, d2, d2))
    self._score_jit = partitioner.partition(
        self._score_fn, in_shardings=(self.state_shardings, d2, d2, d2, d2, d1),
        out_shardings=(self.rollout_shardings, rep))
    self._update_jit = partitioner.partition(
        self._update_fn, in_shardings=(self.state_shardings, self.rollout_shardings, rep),
        out_shardings=(self.state_shardings, rep), donate_argnums=(0,))
    self._token_reward_jit = None if reward_fn_tokens is None else partitioner.partition(
        lambda p, r, m: jnp.asarray(reward_fn_tokens(p, r, m), jnp.float32),
        in_shardings=(d2, d2, d2), out_shardings=d1)

  @property
  def functions(self) -> dict[str, Any]:
    """The jitted, sharded functions of an iteration besides the reward, by stage name:
    rollout (sampling), score (old/reference log-probs, values, GAE), update."""
    return {"rollout": self._generate_jit, "score": self._score_jit, "update": self._update_jit}

  def stage_args(self) -> dict[str, tuple[Any, ...]]:
    """Abstract arguments (shapes, dtypes, shardings) of each of `functions` (AOT compile)."""
    cfg = self.config
    state = self.abstract_state()
    rep, d1, d2 = (self.partitioner.replicated, self.partitioner.data_sharding(1),
                   self.partitioner.data_sharding(2))
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)
    prompts = jax.ShapeDtypeStruct((cfg.batch_size, cfg.max_prompt_length), jnp.int32,
                                   sharding=d2)

    def abstract(x, sharding):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    with self.partitioner.context():
      sampled = jax.eval_shape(self._generate_fn, state.policy.params, prompts, key)
      tokens, logprobs, mask = (abstract(x, d2) for x in sampled)
      score_args = (state, prompts, tokens, mask, logprobs,
                    jax.ShapeDtypeStruct((cfg.batch_size,), jnp.float32, sharding=d1))
      rollout, _ = jax.eval_shape(self._score_fn, *score_args)
    rollout = jax.tree_util.tree_map(abstract, rollout, self.rollout_shardings)
    return {"rollout": (state.policy.params, prompts, key), "score": score_args,
            "update": (state, rollout, key)}

  # -- state ------------------------------------------------------------------------------------
  def init_state(self, rng: Array, *, policy_params: PyTree = None,
                 value_params: PyTree = None) -> PPOState:
    """A fresh state: the reference is a copy of the initial policy.

    `rng` initialises whatever parameters are not given (None: random); `value_params` have
    the scalar head, and their `encoder` subtree is dropped when the encoder is shared.
    """
    policy_rng, value_rng = jax.random.split(rng)
    policy = (self.policy_init.init_state(policy_rng) if policy_params is None
              else self.policy_init.init_state_from_params(policy_params))
    value = (self.value_init.init_state(value_rng) if value_params is None else
             self.value_init.init_state_from_params(
                 self._value_params(nn.meta.unbox(value_params))))
    scalar = self._replicated
    return PPOState(step=scalar(0, jnp.int32), policy=policy, value=value,
                    ref_params=self._copy_jit(policy.params),
                    kl_coef=scalar(self.config.init_kl_coef), reward_mean=scalar(0.0),
                    reward_std=scalar(1.0))

  def _replicated(self, x: Any, dtype: Any = jnp.float32) -> Array:
    return jax.device_put(jnp.asarray(x, dtype), self.partitioner.replicated)

  def _value_params(self, params: PyTree) -> PyTree:
    """Value-model params without `encoder` when it reads the policy's encoder."""
    params = dict(params)
    if self.config.share_value_encoder:
      params.pop("encoder", None)
    return params

  def init_state_from_params(self, params: PPOInit) -> PPOState:
    """A fresh state from given policy (and value) parameters (the core loop's fine-tuning
    start); `rng` of any missing part is fixed (PRNGKey(0))."""
    if not isinstance(params, PPOInit):
      raise TypeError(f"PPOTrainer.init_state_from_params takes a PPOInit, got "
                      f"{type(params).__name__}")
    return self.init_state(jax.random.PRNGKey(0), policy_params=params.policy,
                           value_params=params.value)

  def abstract_state(self) -> PPOState:
    """`PPOState` of `ShapeDtypeStruct`s with shardings (checkpoint restore target)."""
    rep = self.partitioner.replicated
    policy = self.policy_init.abstract_state()
    step: Any = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    scalar: Any = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
    return PPOState(step=step, policy=policy,
                    value=self.value_init.abstract_state(), ref_params=policy.params,
                    kl_coef=scalar, reward_mean=scalar, reward_std=scalar)

  def with_reward_stats(self, state: PPOState, mean: float, std: float) -> PPOState:
    """`state` with the reward normalisation set to (mean, std)."""
    if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
      raise ValueError(f"PPOTrainer: reward normalisation needs finite mean and std > 0, got "
                       f"mean={mean}, std={std}")
    return dataclasses.replace(state, reward_mean=self._replicated(mean),
                               reward_std=self._replicated(std))

  # -- host-side text -----------------------------------------------------------------------------
  def encode_prompts(self, prompts: Sequence[str] | np.ndarray) -> tuple[np.ndarray, list[str]]:
    """(tokens (N, max_prompt_length) int32, texts) from texts or from token rows.

    Texts are encoded with the vocabulary, EOS appended, truncated (keeping EOS) and
    0-padded; token rows are padded/truncated as given and decoded for the reward.
    """
    length, eos = self.config.max_prompt_length, self.policy_model.config.eos_token_id
    if len(prompts) == 0:
      raise ValueError("PPOTrainer.encode_prompts: prompt_source is empty")
    if isinstance(prompts, np.ndarray) or not isinstance(prompts[0], str):
      rows = [list(np.asarray(p).reshape(-1)) for p in prompts]
      texts = [self.vocabulary.decode([int(t) for t in r if t not in (0, eos)]) for r in rows]
    else:
      rows, texts = [], list(prompts)
      for i, text in enumerate(prompts):
        if not isinstance(text, str) or not text.strip():
          raise ValueError(f"PPOTrainer.encode_prompts: prompt {i} is empty or not a str: "
                           f"{text!r}")
        rows.append(list(self.vocabulary.encode(text))[:length - 1] + [eos])
    rows = [row[:length] for row in rows]
    for i, row in enumerate(rows):
      if not any(int(t) != 0 for t in row):
        raise ValueError(f"PPOTrainer.encode_prompts: prompt {i} has no tokens")
    return token_rows.padded(rows, length), texts

  def response_texts(self, response_tokens: Any, response_mask: Any) -> list[str]:
    """Decoded responses (EOS and padding removed)."""
    return [self.vocabulary.decode(ids) for ids in _response_ids(
        response_tokens, response_mask, self.policy_model.config.eos_token_id)]

  # -- compiled pieces ----------------------------------------------------------------------------
  def _generate_fn(self, policy_params, prompt_tokens, rng):
    cfg = self.config
    return rollout_lib.generate_rollout(
        self.policy_model, policy_params, prompt_tokens, rng,
        max_response_length=cfg.max_response_length, temperature=cfg.temperature)

  def generate(self, state: PPOState, prompt_tokens: Any,
               rng: Array) -> tuple[Array, Array, Array]:
    """(response_tokens, sampler_logprobs, response_mask), each (B, T), data-sharded."""
    return self._generate_jit(state.policy.params, self._shard(prompt_tokens), rng)

  def _score_fn(self, state: PPOState, prompt_tokens, response_tokens, response_mask,
                sampler_logprobs, raw_scores):
    cfg = self.config
    raw_scores = raw_scores.astype(jnp.float32)
    scores = ((raw_scores - state.reward_mean) / state.reward_std if cfg.normalize_reward
              else raw_scores)
    rollout, metrics = rollout_lib.score_rollout(
        policy_model=self.policy_model, value_model=self.value_model,
        policy_params=state.policy.params, ref_params=state.ref_params,
        value_params=state.value.params, prompt_tokens=prompt_tokens,
        response_tokens=response_tokens, response_mask=response_mask,
        sampler_logprobs=sampler_logprobs, scores=scores, kl_coef=state.kl_coef,
        temperature=cfg.temperature, share_value_encoder=cfg.share_value_encoder,
        gamma=cfg.gamma, lam=cfg.lam, whiten_rewards=cfg.whiten_rewards,
        whiten_advantages=cfg.whiten_advantages)
    metrics.update(raw_score_mean=jnp.mean(raw_scores), raw_score_std=jnp.std(raw_scores),
                   kl_coef=state.kl_coef)
    return rollout, metrics

  def score(self, state: PPOState, prompt_tokens: Any, response_tokens: Array,
            response_mask: Array, sampler_logprobs: Array,
            raw_scores: Any) -> tuple[rollout_lib.Rollout, dict[str, Array]]:
    """The scored rollout (old/ref log-probs, values, rewards, GAE) and its metrics."""
    return self._score_jit(state, self._shard(prompt_tokens), response_tokens, response_mask,
                           sampler_logprobs, self._shard(raw_scores, ndim=1))

  def _update_fn(self, state: PPOState, rollout: rollout_lib.Rollout, rng: Array):
    cfg = self.config
    batch, num_mb, epochs = cfg.batch_size, cfg.num_minibatches, cfg.num_ppo_epochs
    perms = jax.vmap(lambda k: jax.random.permutation(k, batch))(jax.random.split(rng, epochs))
    perms = perms.reshape(epochs * num_mb, cfg.minibatch_size)
    policy_mask = self.policy_init.trainable_mask
    value_mask = self.value_init.trainable_mask
    p_train, p_frozen = trainer_lib.split_params(state.policy.params, policy_mask)
    v_train, v_frozen = trainer_lib.split_params(state.value.params, value_mask)
    mesh = self.partitioner.mesh

    def terms_fn(trainables, mb: rollout_lib.Rollout, rng) -> dict[str, losses.Term]:
      del rng  # The update runs without dropout.
      policy_params = trainer_lib.merge_params(trainables[0], p_frozen)
      value_params = trainer_lib.merge_params(trainables[1], v_frozen)
      logprobs, entropy, values = rollout_lib.policy_and_values(
          self.policy_model, self.value_model, policy_params, value_params, mb.prompt_tokens,
          mb.response_tokens, temperature=cfg.temperature,
          share_value_encoder=cfg.share_value_encoder, with_entropy=cfg.compute_entropy)
      mask = mb.response_mask
      terms = {**ppo.ppo_policy_terms(logprobs, mb.old_logprobs, mb.advantages, mask,
                                      clip_ratio=cfg.clip_ratio),
               **ppo.ppo_value_terms(values, mb.old_values, mb.returns, mask,
                                     clip_value=cfg.value_clip)}
      if entropy is not None:
        terms["entropy"] = losses.Term.tokens(
            jax.lax.stop_gradient(jnp.sum(entropy * mask)), jnp.sum(mask))
      return terms

    update_loss = losses.TermsLoss(terms_fn, weights={"policy_loss": 1.0,
                                                      "value_loss": cfg.value_coef},
                                   name="ppo_update")

    # The scan carry and the gradients keep the state's shardings: left to propagation
    # inside the loop, XLA may drop the parameters' data-axis (FSDP) sharding and hold whole
    # model-parallel shards of every parameter, gradient and optimizer slot per chip.
    p_sh, _ = trainer_lib.split_params(self.policy_init.params_shardings, policy_mask)
    v_sh, _ = trainer_lib.split_params(self.value_init.params_shardings, value_mask)
    carry_sh = (p_sh, v_sh, self.policy_init.state_shardings.opt_state,
                self.value_init.state_shardings.opt_state)
    constrain = jax.lax.with_sharding_constraint

    def body(carry, index):
      p_t, v_t, p_opt, v_opt = constrain(carry, carry_sh)
      mb = jax.tree_util.tree_map(lambda x: constrain(
          jnp.take(x, index, axis=0), self.partitioner.data_sharding(x.ndim)), rollout)
      (p_grads, v_grads), terms = trainer_lib.microbatch_gradients(
          update_loss.terms, update_loss.weights, (p_t, v_t), mb, None,
          num_microbatches=cfg.num_microbatches, mesh=mesh, grad_shardings=(p_sh, v_sh))
      _, metrics = update_loss.loss_and_metrics(terms)
      updates, p_opt = self.optimizer.update(p_grads, p_opt, p_t)
      p_t = optax.apply_updates(p_t, updates)
      updates, v_opt = self._value_optimizer.update(v_grads, v_opt, v_t)
      v_t = optax.apply_updates(v_t, updates)
      metrics["policy_grad_norm"] = optimizers.global_norm(p_grads)
      metrics["value_grad_norm"] = optimizers.global_norm(v_grads)
      return constrain((p_t, v_t, p_opt, v_opt), carry_sh), metrics

    init = (p_train, v_train, state.policy.opt_state, state.value.opt_state)
    (p_train, v_train, p_opt, v_opt), stacked = jax.lax.scan(body, init, perms)
    policy, value = (
        dataclasses.replace(old, step=old.step + epochs * num_mb,
                            params=trainer_lib.merge_params(trained, frozen), opt_state=opt)
        for old, trained, frozen, opt in ((state.policy, p_train, p_frozen, p_opt),
                                          (state.value, v_train, v_frozen, v_opt)))
    # The controller sees the KL of the rollout policy (Ziegler et al.), per sequence.
    rollout_kl = jnp.mean(jnp.sum(rollout.kl, axis=1))
    kl_coef = self._kl_controller.update(state.kl_coef, rollout_kl, batch)
    metrics = {k: jnp.mean(v) for k, v in stacked.items()}
    if isinstance(self.optimizer, optimizers.Optimizer):
      # The policy's rate at this iteration's first update (a schedule counts updates).
      metrics["learning_rate"] = self.optimizer.learning_rate(state.policy.step)
    metrics.update({f"first_minibatch/{name}": stacked[name][0]
                    for name in ("ratio_mean", "approx_kl", "clipfrac", "policy_loss")})
    new_state = dataclasses.replace(state, step=state.step + 1, policy=policy, value=value,
                                    kl_coef=kl_coef.astype(jnp.float32))
    return new_state, metrics

  def ppo_update(self, state: PPOState, rollout: rollout_lib.Rollout,
                 rng: Array) -> tuple[PPOState, dict[str, Array]]:
    """`num_ppo_epochs` x `num_minibatches` clipped updates in one compiled call.

    `state` is donated. Metrics: means over all minibatches of the loss terms and grad norms,
    plus `first_minibatch/<term>` (ratio 1 and approx_kl 0 there: nothing has moved yet).
    """
    return self._update_jit(state, rollout, rng)

  # -- rewards ------------------------------------------------------------------------------------
  def rewards(self, prompt_tokens: Any, prompt_texts: Sequence[str], response_tokens: Array,
              response_mask: Array, response_texts: Optional[list[str]] = None, *,
              key: RewardKey) -> tuple[Any, dict[str, float]]:
    """Raw scores (B,) of the responses (host array or device array) and reward metrics."""
    if self._token_reward_jit is not None:
      return self._token_reward_jit(self._shard(prompt_tokens), response_tokens,
                                    response_mask), {}
    if response_texts is None:
      response_texts = self.response_texts(response_tokens, response_mask)
    assert self.reward_fn is not None  # A reward function or a token reward model is given.
    out = self.reward_fn(list(prompt_texts), response_texts, key=key)
    scores, extra = out if isinstance(out, tuple) else (out, {})
    scores = np.asarray(scores, np.float32)
    batch = len(response_texts)
    if scores.shape != (batch,):
      raise ValueError(f"reward_fn returned scores of shape {scores.shape}; expected ({batch},)")
    if not np.all(np.isfinite(scores)):
      raise ValueError(f"reward_fn returned non-finite scores at rows "
                       f"{np.flatnonzero(~np.isfinite(scores))[:10].tolist()}")
    extra = {name: np.asarray(value) for name, value in (extra or {}).items()}
    return scores, {f"reward/{name}": float(np.mean(value)) for name, value in extra.items()
                    if value.dtype.kind in "biuf" and value.size}

  def measure_reward_stats(self, state: PPOState, prompts: PromptSource,
                           rng: Array) -> tuple[float, float]:
    """(mu0, sigma0) of the current policy's raw scores on up to `reward_norm_num_prompts`
    prompts (one sample each, in rollout-sized batches)."""
    cfg = self.config
    count = min(cfg.reward_norm_num_prompts, prompts.num_examples)
    scores = []
    for chunk, start in enumerate(range(0, count, cfg.batch_size)):
      # Full-size batches (wrapping around) so the compiled rollout is reused.
      rows = np.arange(start, start + cfg.batch_size) % prompts.num_examples
      responses, _, mask = self.generate(state, prompts.tokens[rows],
                                         jax.random.fold_in(rng, chunk))
      raw, _ = self.rewards(prompts.tokens[rows], [prompts.texts[int(i)] for i in rows], responses,
                            mask, key=RewardKey("normalization", chunk))
      scores.append(np.asarray(jax.device_get(raw))[:min(cfg.batch_size, count - start)])
    scores = np.concatenate(scores).astype(np.float64)
    mean, std = float(scores.mean()), float(scores.std())
    if std < 1e-6:
      logger.warning("ppo: initial rewards have std %.3g over %d prompts; using sigma0 = 1",
                     std, count)
      std = 1.0
    return mean, std

  # -- one iteration ------------------------------------------------------------------------------
  def iteration(self, state: PPOState, prompt_tokens: np.ndarray, prompt_texts: Sequence[str],
                rng: Array, *, iteration: Optional[int] = None, num_samples: int = 0
                ) -> tuple[PPOState, dict[str, float], list[dict[str, Any]]]:
    """Rollout, reward, score and update on one batch of prompts.

    Args:
      state: Current state (donated).
      prompt_tokens: (batch_size, max_prompt_length) int32.
      rng: This iteration's key (split into sampling and minibatch-permutation keys).
      iteration: The iteration's index, for the reward's key (default: `state.step`).
      num_samples: Also return this many (prompt, response, score) samples.

    Returns:
      (new state, metrics as floats incl. `time/<stage>`, `episodes_per_sec`, `distinct_1` /
      `distinct_2` of the response tokens, samples).
    """
    if len(prompt_tokens) != self.config.batch_size:
      raise ValueError(f"PPOTrainer.iteration: got {len(prompt_tokens)} prompts, "
                       f"batch_size is {self.config.batch_size}")
    if iteration is None:
      iteration = int(jax.device_get(state.step))
    gen_rng, update_rng = jax.random.split(rng)
    times: dict[str, float] = {}
    tick = time.perf_counter()

    def done(stage: str, output: Any) -> None:  # Times a stage, from the end of the last one.
      nonlocal tick
      jax.block_until_ready(output)
      now = time.perf_counter()
      times[stage], tick = now - tick, now

    responses, sampler_logprobs, mask = self.generate(state, prompt_tokens, gen_rng)
    done("rollout", responses)
    texts = (self.response_texts(responses, mask) if self.reward_fn is not None or num_samples
             else None)
    raw_scores, reward_metrics = self.rewards(prompt_tokens, prompt_texts, responses, mask,
                                              texts, key=RewardKey("rollout", iteration))
    done("reward", raw_scores)
    rollout, score_metrics = self.score(state, prompt_tokens, responses, mask, sampler_logprobs,
                                        raw_scores)
    done("score", rollout)
    state, update_metrics = self.ppo_update(state, rollout, update_rng)
    done("update", state)

    renamed = {"score_mean": "reward_mean", "score_std": "reward_std",
               "entropy": "rollout_entropy"}
    metrics = {renamed.get(k, k): float(v) for k, v in jax.device_get(score_metrics).items()}
    metrics.update({k: float(v) for k, v in jax.device_get(update_metrics).items()})
    metrics.update(reward_metrics)
    ids = [" ".join(map(str, row)) for row in _response_ids(
        responses, mask, self.policy_model.config.eos_token_id)]
    metrics.update({f"distinct_{n}": metrics_lib.distinct_n(ids, n) for n in (1, 2)})
    total = sum(times.values())
    metrics.update({f"time/{k}": v for k, v in times.items()})
    metrics["episodes_per_sec"] = self.config.batch_size / total if total > 0 else float("nan")
    samples = []
    if num_samples and texts is not None:
      raw = np.asarray(jax.device_get(raw_scores))[:num_samples]
      samples = [{"prompt": p, "response": r, "score": float(s)}
                 for p, r, s in zip(prompt_texts, texts, raw, strict=False)]
    return state, metrics, samples

  def train_step(self, state: PPOState, batch: Mapping[str, Any],
                 rng: Array) -> tuple[PPOState, dict[str, float]]:
    """One iteration in the core loop's contract: `batch` is a `PromptSource` batch, `rng`
    the run's base key (the iteration draws from `fold_in(rng, iteration)`). Keeps a few
    samples of the iteration in `last_samples`."""
    iteration = int(jax.device_get(state.step))
    state, metrics, self.last_samples = self.iteration(
        state, batch["prompt_tokens"], batch["prompt_texts"], jax.random.fold_in(rng, iteration),
        iteration=iteration, num_samples=self.config.batch_size)
    return state, metrics

  def _shard(self, x: Any, ndim: int = 2) -> Array:
    if isinstance(x, jax.Array):
      return x
    return jax.device_put(np.asarray(x), self.partitioner.data_sharding(ndim))


def _response_ids(tokens: Any, mask: Any, eos_id: int) -> list[list[int]]:
  """Each row's generated ids without the final EOS (the response's text; any arrays)."""
  lengths = np.asarray(mask).sum(axis=1).astype(int)
  rows = [[int(t) for t in row[:n]] for row, n in zip(np.asarray(tokens), lengths, strict=True)]
  return [ids[:-1] if ids and ids[-1] == eos_id else ids for ids in rows]


# -- the loop's hooks ---------------------------------------------------------------------------
class RewardNormalizationHook(train_lib.TrainHook):
  """On a fresh run, measures mu0/sigma0 of the initial policy's rewards (an explicit call of
  the reward with `RewardKey("normalization", ...)`) and stores them in the state."""

  def __init__(self, trainer: PPOTrainer, prompts: PromptSource, rng: Array):
    self.trainer, self.prompts, self.rng = trainer, prompts, rng
    self.mean, self.std = 0.0, 1.0

  def on_start(self, loop: train_lib.LoopInfo, state: PPOState) -> PPOState:
    if loop.fresh and self.trainer.config.normalize_reward:
      mean, std = self.trainer.measure_reward_stats(state, self.prompts, self.rng)
      logger.info("train_ppo: reward normalisation mu0 %.4g sigma0 %.4g", mean, std)
      state = self.trainer.with_reward_stats(state, mean, std)
    self.mean, self.std = map(float, jax.device_get((state.reward_mean, state.reward_std)))
    return state


def _samples_markdown(samples: Sequence[Mapping[str, Any]]) -> str:
  def cell(text: Any) -> str:
    return str(text).replace("|", "\\|")
  rows = [f"| {cell(s['prompt'])} | {cell(s['response'])} | {s['score']:.4g} |" for s in samples]
  return "\n".join(["| prompt | response | score |", "|---|---|---|", *rows])


class SampleLogHook(train_lib.TrainHook):
  """Every `every` iterations, writes `count` of the iteration's samples to TensorBoard."""

  def __init__(self, trainer: PPOTrainer, *, every: int, count: int):
    self.trainer, self.every, self.count = trainer, every, count

  def after_step(self, loop: train_lib.LoopInfo, step: int, state: Any,
                 metrics: Mapping[str, float]) -> None:
    if self.every and step % self.every == 0 and self.trainer.last_samples:
      loop.writers.text("train", step, "samples",
                        _samples_markdown(self.trainer.last_samples[:self.count]))


# The per-iteration metrics of the learning curves (JSON, TensorBoard `iteration/<name>`).
CURVE_METRICS = (
    "raw_score_mean", "raw_score_std",  # The reward as the reward function returns it.
    "reward_mean", "reward_std",  # The score PPO pays, normalised by (mu0, sigma0).
    "kl", "kl_full_vocab", "kl_coef", "non_score_reward",  # KL to the reference, its price.
    "rollout_entropy", "entropy", "policy_loss", "value_loss", "clipfrac", "approx_kl",
    "value_explained_variance", "response_length", "distinct_1", "distinct_2",
    "learning_rate")


class RewardCurveHook(train_lib.TrainHook):
  """The learning curves of a run: every iteration's `CURVE_METRICS` in
  `MODEL_DIR/reward_curve.json` (written as the run goes, kept across resumes up to the
  restored iteration) and in TensorBoard (train/, tags `iteration/<name>`, whatever the
  loop's `log_every`), drawn against episodes in `reward_curve.png` at the end."""

  def __init__(self, model_dir: str, *, batch_size: int):
    self.path = reward_curve_path(model_dir)
    self.batch_size = batch_size
    self.rows: dict[int, dict[str, float]] = {}
    self.picture: Optional[str] = None

  def on_start(self, loop: train_lib.LoopInfo, state: Any) -> Any:
    self.rows = {i: row for i, row in read_learning_curves(self.path)["rows"].items()
                 if i <= loop.start_step}
    return state

  def after_step(self, loop: train_lib.LoopInfo, step: int, state: Any,
                 metrics: Mapping[str, float]) -> None:
    row = {name: float(metrics[name]) for name in CURVE_METRICS if name in metrics}
    self.rows[step] = row
    loop.writers.scalars("train", step, {f"iteration/{k}": v for k, v in row.items()})
    if jax.process_index() == 0:
      steps = sorted(self.rows)
      names = [n for n in CURVE_METRICS if all(n in self.rows[i] for i in steps)]
      fileio.write_text(self.path, json.dumps({
          "iterations": steps, "episodes": [i * self.batch_size for i in steps],
          "raw_reward_mean": [self.rows[i]["raw_score_mean"] for i in steps],
          "metrics": {n: [self.rows[i][n] for i in steps] for n in names}}))

  def on_end(self, loop: train_lib.LoopInfo, state: Any) -> None:
    if jax.process_index() == 0 and self.rows:
      self.picture = plot_reward_curve(self.path)


def reward_curve_path(model_dir: str | os.PathLike[str]) -> str:
  """`MODEL_DIR/reward_curve.json` (a local path or a bucket URL)."""
  return fileio.join(model_dir, run_layout.REWARD_CURVE_FILE)


def read_reward_curve(path: str | os.PathLike[str]) -> dict[int, float]:
  """{iteration: mean raw reward} of a curve file; {} when there is none."""
  return {i: row["raw_score_mean"] for i, row in read_learning_curves(path)["rows"].items()}


def read_learning_curves(path: str | os.PathLike[str]) -> dict[str, Any]:
  """A curve file as {"rows": {iteration: {metric: value}}, "episodes": {iteration:
  episodes}}; empty when there is none (a file of before the metrics: raw reward only)."""
  if not fileio.isfile(path):
    return {"rows": {}, "episodes": {}}
  data = json.loads(fileio.read_text(path))
  steps = list(data["iterations"])
  metrics = dict(data.get("metrics") or {})
  metrics.setdefault("raw_score_mean", data["raw_reward_mean"])
  rows = {i: {n: float(v[k]) for n, v in metrics.items()} for k, i in enumerate(steps)}
  episodes = data.get("episodes")
  return {"rows": rows, "episodes": dict(zip(steps, episodes, strict=True)) if episodes else {}}


def plot_reward_curve(path: str | os.PathLike[str]) -> str:
  """Draws a curve file beside it (`.png`): the raw reward and the KL to the reference
  against episodes (iterations for a file without episodes); returns the picture's path."""
  curves = read_learning_curves(path)
  rows, episodes = curves["rows"], curves["episodes"]
  steps = sorted(rows)
  x = [episodes.get(i, i) for i in steps] if episodes else steps
  fig, (ax_r, ax_kl) = pictures.pyplot().subplots(1, 2, figsize=(10, 3.2))
  ax_r.plot(x, [rows[i]["raw_score_mean"] for i in steps], marker=".")
  ax_r.set(ylabel="mean raw reward", title="PPO reward")
  for name, label in (("kl", "sampled-token estimate"), ("kl_full_vocab", "full vocabulary")):
    if all(name in rows[i] for i in steps):
      ax_kl.plot(x, [rows[i][name] for i in steps], marker=".", label=label)
  ax_kl.set(ylabel="KL(policy || reference), nats / response", title="KL to the reference")
  if ax_kl.lines:
    ax_kl.legend(fontsize=8)
  for ax in (ax_r, ax_kl):
    ax.set_xlabel("episodes" if episodes else "PPO iteration")
    ax.grid(alpha=0.3)
  return pictures.save_figure(fig, os.path.splitext(os.fspath(path))[0] + ".png")


# -- the run ------------------------------------------------------------------------------------
@gin.configurable
def train_ppo(*, model_dir: str | os.PathLike[str], trainer: PPOTrainer,
              prompt_source: Sequence[str] | np.ndarray, num_iterations: int,
              checkpoint_every: int = 100, keep_checkpoints: int = 3, log_every: int = 10,
              sample_every: int = 100, num_logged_samples: int = 4, seed: int = 0,
              async_checkpoint: bool = True,
              init: Optional[PPOInit | Callable[[], PPOInit]] = None,
              hooks: Sequence[train_lib.TrainHook] = ()) -> dict[str, float]:
  """Runs PPO to `num_iterations` through the core loop (`jaxmoral.train.train`).

  Args:
    model_dir: Run directory (checkpoints/, train/ TensorBoard events, reward_curve.*).
    prompt_source: Training prompts: texts, or token rows (N, L).
    num_iterations: Total PPO iterations of the run (not of this call).
    checkpoint_every, keep_checkpoints, log_every, async_checkpoint: As for `train.train`
      (in iterations).
    sample_every: Log sample responses to TensorBoard every this many iterations (0: never).
    seed: Base seed: initialisation, prompt order, sampling and minibatch keys.
    init: Initial policy (and reference) and value parameters of a fresh run, or a function
      returning them (called only when there is no checkpoint to resume); None: random.

  Returns:
    `{"iteration": final iteration, <metric>: last window mean, ..., "reward_norm_mean",
    "reward_norm_std"}`.

  Raises:
    train.NonFiniteLossError: a NaN/inf loss (nothing of that iteration is saved).
  """
  validation.non_negative_int(sample_every, "train_ppo: sample_every")
  reach = trainer.config.adaptive_kl_reach(num_iterations)
  if 1.0 < reach < 1.5:
    # An "adaptive" penalty that cannot move is a fixed one: say so instead of letting it pass.
    logger.warning("train_ppo: the adaptive KL coefficient can change at most %.3fx in %d "
                   "iterations (PPOConfig.kl_horizon %g for %d episodes per iteration): in "
                   "effect a fixed coefficient; lower kl_horizon to let it follow kl_target",
                   reach, num_iterations, trainer.config.kl_horizon, trainer.config.batch_size)
  optimizer = trainer.optimizer
  if isinstance(optimizer, optimizers.Optimizer):
    # A decay sized for another run length shows here (and as iteration/learning_rate).
    last = ppo_update_count(num_iterations=num_iterations, config=trainer.config) - 1
    logger.info("train_ppo: policy learning rate %.3g at the first update, %.3g at the last "
                "(update %d)", float(optimizer.learning_rate(jnp.int32(0))),
                float(optimizer.learning_rate(jnp.int32(last))), last)
  tokens, texts = trainer.encode_prompts(prompt_source)
  prompts = PromptSource(tokens=tokens, texts=texts, batch_size=trainer.config.batch_size,
                         seed=seed)
  # The keys of the core loop (init, steps) and of the normalisation are apart.
  norm_rng = jax.random.fold_in(jax.random.PRNGKey(seed), 2 ** 20)
  curve = RewardCurveHook(os.fspath(model_dir), batch_size=trainer.config.batch_size)
  normalization = RewardNormalizationHook(trainer, prompts, norm_rng)
  result = train_lib.train(
      model_dir=model_dir, trainer=trainer, train_source=prompts, train_steps=num_iterations,
      checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
      log_every=log_every, seed=seed, async_checkpoint=async_checkpoint, init_params=init,
      hooks=[normalization, curve,
             SampleLogHook(trainer, every=sample_every, count=num_logged_samples), *hooks])
  out = {k.removeprefix("train/"): v for k, v in result.items()}
  out["iteration"] = out.pop("step")
  out["reward_norm_mean"], out["reward_norm_std"] = normalization.mean, normalization.std
  out["reward_curve"] = curve.picture or str(curve.path)
  return out
