"""jaxmoral.rl.ppo_trainer: first-epoch ratio, learning a toy reward, kill-and-resume, sharding."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoral import checkpoints, optimizers, partitioning
from jaxmoral.models.config import t5_config
from jaxmoral.models.t5 import T5, shift_right
from jaxmoral.rl import ppo_trainer

CFG = t5_config(size="tiny", vocab_size=32, d_model=32, d_ff=64, num_heads=2,
                num_encoder_layers=1, num_decoder_layers=1)
TARGET = {2, 3, 4, 5}  # Rewarded first words ("w2" .. "w5"): 1/8 of the vocabulary.
# The original ClarifyDelphi recipe (PPOConfig's defaults: one minibatch, 4 epochs, value
# coefficient 1, whitened rewards, fixed KL coefficient 0.15, untruncated sampling) on a tiny
# policy, at temperature 1 (at 0.7 the random policy never starts with a rewarded word).
PPO_CONFIG = ppo_trainer.PPOConfig(batch_size=16, max_prompt_length=8, max_response_length=5,
                                   temperature=1.0, reward_norm_num_prompts=32)
LEARN_ITERATIONS = 30


class WordVocab:
  """Id i <-> word "w<i>"."""

  def encode(self, s):
    return [int(w[1:]) for w in s.split()]

  def decode(self, ids):
    return " ".join(f"w{i}" for i in ids)


class FirstWordReward:
  """+1 when the response starts with a TARGET word; records the keys of its calls."""

  def __init__(self):
    self.keys = []

  def __call__(self, prompts, responses, *, key=None):
    self.keys.append(key)
    words = [r.split() for r in responses]
    scores = np.array([1.0 if w and int(w[0][1:]) in TARGET else 0.0 for w in words])
    return scores, {"num_words": np.array([len(w) for w in words])}


def make_trainer(partitioner, reward_fn=None, reward_fn_tokens=None, config=PPO_CONFIG):
  return ppo_trainer.PPOTrainer(
      policy_model=T5(CFG), value_model=T5(CFG, with_scalar_head=True), vocabulary=WordVocab(),
      reward_fn=reward_fn, reward_fn_tokens=reward_fn_tokens, config=config,
      optimizer=optimizers.make_optimizer(name="adamw", eps=1e-5, learning_rate=(
          optimizers.make_schedule(name="linear_decay", base_learning_rate=3e-3,
                                   total_steps=ppo_trainer.ppo_update_count(
                                       num_iterations=LEARN_ITERATIONS, config=config)))),
      partitioner=partitioner)


PROMPTS = [" ".join(f"w{i}" for i in np.random.default_rng(k).integers(2, 32, size=2 + k % 4))
           for k in range(48)]


@pytest.fixture(scope="module")
def setup():
  reward = FirstWordReward()
  partitioner = partitioning.PjitPartitioner(devices=jax.devices()[:1])
  return make_trainer(partitioner, reward_fn=reward), reward


def test_config_validation():
  with pytest.raises(ValueError, match="num_minibatches"):
    ppo_trainer.PPOConfig(batch_size=10, num_minibatches=4)
  with pytest.raises(ValueError, match="PPOConfig.top_k"):
    ppo_trainer.PPOConfig(top_k=-1)
  with pytest.raises(ValueError, match="PPOConfig.kl_control"):
    ppo_trainer.PPOConfig(kl_control="pid")
  with pytest.raises(ValueError, match="PPOConfig.lam"):
    ppo_trainer.PPOConfig(lam=1.5)


def test_adaptive_kl_reach_is_where_the_controller_can_get():
  for horizon, iterations in ((10000.0, 120), (320.0, 120), (320.0, 7)):
    config = ppo_trainer.PPOConfig(batch_size=32, num_minibatches=4, init_kl_coef=0.05,
                                   kl_control="adaptive",
                                   kl_target=2.0, kl_horizon=horizon)
    controller, coef = config.kl_controller(), 0.05
    for _ in range(iterations):  # KL far above target every iteration: the fastest growth
      coef = float(controller.update(coef, 100.0, config.batch_size))
    assert config.adaptive_kl_reach(iterations) == pytest.approx(coef / 0.05, rel=1e-4)
  # The adaptive controller's default horizon at 32 episodes per iteration: under 8 % in 120
  # iterations, too little to hold a drifting policy.
  assert ppo_trainer.PPOConfig(batch_size=32,
                               kl_control="adaptive").adaptive_kl_reach(120) < 1.08
  assert ppo_trainer.PPOConfig(kl_control="fixed").adaptive_kl_reach(120) == 1.0


def test_prompt_batches_are_epoch_permutations():
  texts = [f"w{i + 2}" for i in range(6)]
  source = ppo_trainer.PromptSource(tokens=np.arange(6)[:, None], texts=texts, batch_size=4,
                                    seed=3)
  rows = np.concatenate([source.indices(i) for i in range(3)])
  assert sorted(rows[:6]) == list(range(6)) and sorted(rows[6:12]) == list(range(6))
  batch = next(source.iterate(2))
  np.testing.assert_array_equal(batch["prompt_tokens"][:, 0], rows[8:12])
  assert batch["prompt_texts"] == [texts[i] for i in rows[8:12]]


def test_encode_prompts_and_errors(setup):
  trainer, _ = setup
  tokens, texts = trainer.encode_prompts(["w3 w4", "w9 w8 w7 w6 w5 w4 w3 w2 w2 w2"])
  np.testing.assert_array_equal(tokens[0], [3, 4, 1, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(tokens[1], [9, 8, 7, 6, 5, 4, 3, 1])  # truncated, EOS kept
  assert texts[0] == "w3 w4"
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    trainer.encode_prompts(["w3", " "])
  with pytest.raises(ValueError, match="exactly one of reward_fn"):
    make_trainer(trainer.partitioner)


def test_first_epoch_ratio_is_one_and_update_changes_policy(setup):
  trainer, _ = setup
  state = trainer.init_state(jax.random.PRNGKey(0))
  tokens, texts = trainer.encode_prompts(PROMPTS[:16])
  before = jax.tree_util.tree_map(np.asarray, state.policy.params)
  ref_before = jax.tree_util.tree_map(np.asarray, state.ref_params)
  state, metrics, samples = trainer.iteration(state, tokens, texts, jax.random.PRNGKey(1),
                                              num_samples=2)
  # An iteration runs `trainer.functions` (what `jaxmoral compile` lowers): each has been
  # traced and compiled by it.
  assert sorted(trainer.functions) == ["rollout", "score", "update"]
  assert all(f._jitted._cache_size() >= 1  # pylint: disable=protected-access
             for f in trainer.functions.values())
  # Nothing has moved before the first minibatch: pi / pi_old == 1, approx KL == 0.
  assert abs(metrics["first_minibatch/ratio_mean"] - 1.0) < 1e-5
  assert metrics["first_minibatch/approx_kl"] < 1e-10
  assert metrics["first_minibatch/clipfrac"] == 0.0
  # Policy == reference at the first rollout, so the KL penalty is 0 too.
  assert abs(metrics["kl"]) < 1e-5
  assert metrics["sampler_logprob_gap"] < 1e-4  # top_p = 1: sampler == teacher forcing
  # Later minibatches moved the policy; the reference stayed frozen.
  assert metrics["approx_kl"] > 0
  moved = jax.tree_util.tree_map(lambda a, b: np.max(np.abs(np.asarray(a) - b)),
                                 state.policy.params, before)
  assert max(jax.tree_util.tree_leaves(moved)) > 1e-4
  jax.tree_util.tree_map(np.testing.assert_array_equal, state.ref_params, ref_before)
  assert int(state.step) == 1 and int(state.policy.step) == 4  # 4 epochs x 1 minibatch
  assert metrics["learning_rate"] == pytest.approx(3e-3)  # The decay's start.
  for name in (*ppo_trainer.CURVE_METRICS, "episodes_per_sec", "time/update",
               "reward/num_words"):
    assert np.isfinite(metrics[name]), name
  assert len(samples) == 2 and set(samples[0]) == {"prompt", "response", "score"}


def test_ppo_learns_a_reward_for_a_chosen_first_token(setup, tmp_path):
  """Learnability of the whole update under the recipe: +1 for a response that starts with
  one of 4 of the 32 tokens (the initial policy: about 1/8). Within LEARN_ITERATIONS (30)
  iterations of 16 episodes the mean reward of the last 5 reaches 80 % of the maximum (it was
  0.96 when written, first above 0.8 at iteration 14), while the KL to the reference stays
  under 10 nats per 5-token response (at most 8.1 when written; log 32 per token is 17)."""
  trainer, _ = setup
  result = ppo_trainer.train_ppo(model_dir=tmp_path, trainer=trainer, prompt_source=PROMPTS,
                                 num_iterations=LEARN_ITERATIONS, log_every=5,
                                 checkpoint_every=LEARN_ITERATIONS, sample_every=10, seed=1)
  assert result["reward_norm_mean"] < 0.35
  curves = ppo_trainer.read_learning_curves(tmp_path / "reward_curve.json")["rows"]
  last = [curves[i] for i in range(LEARN_ITERATIONS - 4, LEARN_ITERATIONS + 1)]
  assert np.mean([row["raw_score_mean"] for row in last]) >= 0.8, last
  assert max(row["kl"] for row in curves.values()) < 10.0
  assert max(row["kl_full_vocab"] for row in curves.values()) < 10.0
  assert curves[LEARN_ITERATIONS]["learning_rate"] < 1e-4  # Decayed linearly to ~0.
  assert (tmp_path / "train").is_dir() and (tmp_path / "reward_curve.png").is_file()


def _final(trainer, directory):
  with checkpoints.CheckpointManager(directory / "checkpoints") as mgr:
    return mgr.restore(target=trainer.abstract_state())


def test_kill_and_resume_continues_the_same_run(setup, tmp_path):
  trainer, reward = setup
  kwargs = dict(trainer=trainer, prompt_source=PROMPTS, checkpoint_every=2, log_every=1,
                sample_every=0, seed=7, async_checkpoint=False)
  reward.keys.clear()
  ppo_trainer.train_ppo(model_dir=tmp_path / "a", num_iterations=4, **kwargs)
  # A fresh run: mu0/sigma0 measured by explicitly named calls (32 prompts, 2 batches), then
  # one call per iteration, each named by its iteration.
  Key = ppo_trainer.RewardKey  # noqa: N806
  assert reward.keys == [Key("normalization", 0), Key("normalization", 1),
                         *(Key("rollout", i) for i in range(4))]
  ppo_trainer.train_ppo(model_dir=tmp_path / "b", num_iterations=2, **kwargs)
  reward.keys.clear()
  result = ppo_trainer.train_ppo(model_dir=tmp_path / "b", num_iterations=4, **kwargs)
  # Resumed: no new normalisation; the two missing iterations, named as uninterrupted.
  assert reward.keys == [Key("rollout", 2), Key("rollout", 3)]
  state_a, extra_a = _final(trainer, tmp_path / "a")
  state_b, extra_b = _final(trainer, tmp_path / "b")
  assert int(state_a.step) == int(state_b.step) == 4
  assert extra_a == extra_b and extra_a["num_examples"] == len(PROMPTS)
  assert result["reward_norm_std"] == pytest.approx(float(state_b.reward_std))
  assert result["reward_norm_std"] > 0
  jax.tree_util.tree_map(np.testing.assert_array_equal, state_a, state_b)
  # One reward curve over the whole run, resumes included, as JSON and as a picture.
  curve = ppo_trainer.read_reward_curve(tmp_path / "b" / "reward_curve.json")
  assert sorted(curve) == [1, 2, 3, 4]
  assert curve == ppo_trainer.read_reward_curve(tmp_path / "a" / "reward_curve.json")
  assert (tmp_path / "b" / "reward_curve.png").is_file()
  # The same data position is required to resume.
  with pytest.raises(ValueError, match="would not continue the same run"):
    ppo_trainer.train_ppo(model_dir=tmp_path / "b", num_iterations=5,
                          **{**kwargs, "prompt_source": PROMPTS[:40]})


def test_token_reward_fn_runs_compiled(setup):
  trainer, _ = setup

  def first_token_reward(prompt_tokens, response_tokens, response_mask):
    del prompt_tokens
    first = response_tokens[:, 0]
    return ((first >= 2) & (first <= 5)).astype(jnp.float32) * response_mask[:, 0]

  tok_trainer = make_trainer(trainer.partitioner, reward_fn_tokens=first_token_reward)
  responses = np.array([[3, 7, 1, 0, 0], [9, 1, 0, 0, 0]] * 8, np.int32)
  mask = (responses > 0).astype(np.float32)
  prompts, texts = tok_trainer.encode_prompts(PROMPTS[:16])
  scores, _ = tok_trainer.rewards(prompts, texts, jnp.asarray(responses), jnp.asarray(mask),
                                  key=ppo_trainer.RewardKey("rollout", 0))
  host, _ = FirstWordReward()(texts, trainer.response_texts(responses, mask))
  np.testing.assert_array_equal(np.asarray(scores), host)


def test_sharded_update_matches_unsharded(setup):
  trainer, _ = setup
  state = trainer.init_state(jax.random.PRNGKey(5))
  host_state = jax.tree_util.tree_map(np.asarray, state)
  tokens, texts = trainer.encode_prompts(PROMPTS[16:32])
  responses, sampler_lp, mask = trainer.generate(state, tokens, jax.random.PRNGKey(6))
  raw, _ = trainer.rewards(tokens, texts, responses, mask,
                           key=ppo_trainer.RewardKey("rollout", 0))
  rollout, _ = trainer.score(state, tokens, responses, mask, sampler_lp, raw)
  host_rollout = jax.tree_util.tree_map(np.asarray, rollout)
  want, want_metrics = trainer.ppo_update(state, rollout, jax.random.PRNGKey(7))

  # A 2 x 2 mesh splits the batch and the model as a 4 x 2 one does, in less compile time.
  sharded = make_trainer(partitioning.PjitPartitioner(num_partitions=2,
                                                      devices=jax.devices()[:4]),
                         reward_fn=FirstWordReward())
  assert dict(sharded.partitioner.mesh.shape) == {"data": 2, "model": 2}
  state2 = jax.device_put(host_state, sharded.state_shardings)
  rollout2 = jax.device_put(host_rollout, sharded.rollout_shardings)
  got, got_metrics = sharded.ppo_update(state2, rollout2, jax.random.PRNGKey(7))
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                         jax.device_get(got), jax.device_get(want))
  np.testing.assert_allclose(got_metrics["policy_loss"], want_metrics["policy_loss"], atol=1e-5)
  kernel = got.policy.params["decoder"]["logits_dense"]["kernel"]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")


def test_the_reward_curve_of_a_run_in_a_bucket_is_written_and_resumed_there(gcs):
  """A PPO run's MODEL_DIR may be gs://: its reward curve (JSON and picture) goes there, and a
  resumed run keeps the iterations up to the one it restored."""
  import types  # pylint: disable=g-import-not-at-top

  from jaxmoral import fileio  # pylint: disable=g-import-not-at-top
  del gcs
  model_dir = "gs://bucket/ppo_run"
  hook = ppo_trainer.RewardCurveHook(model_dir, batch_size=4)
  hook.on_start(types.SimpleNamespace(start_step=0), None)
  written = []
  loop = types.SimpleNamespace(writers=types.SimpleNamespace(
      scalars=lambda name, step, values: written.append((name, step, dict(values)))))
  for step, reward in ((1, 0.5), (2, 0.25), (3, 0.75)):
    hook.after_step(loop, step, None, {"raw_score_mean": reward, "kl": 2.0 * step,
                                       "kl_full_vocab": step, "loss": 9.0})
  hook.on_end(None, None)
  assert hook.picture == f"{model_dir}/reward_curve.png" and fileio.getsize(hook.picture) > 1000
  # Every iteration in TensorBoard, whatever the loop's log_every: the curve metrics only.
  assert written[1] == ("train", 2, {"iteration/raw_score_mean": 0.25, "iteration/kl": 4.0,
                                     "iteration/kl_full_vocab": 2.0})
  path = ppo_trainer.reward_curve_path(model_dir)
  assert ppo_trainer.read_reward_curve(path) == {1: 0.5, 2: 0.25, 3: 0.75}
  curves = ppo_trainer.read_learning_curves(path)
  assert curves["episodes"] == {1: 4, 2: 8, 3: 12}
  assert curves["rows"][3] == {"raw_score_mean": 0.75, "kl": 6.0, "kl_full_vocab": 3.0}
  resumed = ppo_trainer.RewardCurveHook(model_dir, batch_size=4)
  resumed.on_start(types.SimpleNamespace(start_step=2), None)  # Restored at iteration 2.
  assert {i: row["raw_score_mean"] for i, row in resumed.rows.items()} == {1: 0.5, 2: 0.25}
  assert not os.path.exists("gs:")


# -- the KL the trainer logs is the policy's ------------------------------------------------------
KL_CONFIG = ppo_trainer.PPOConfig(batch_size=128, max_prompt_length=8, max_response_length=5,
                                  temperature=0.7, normalize_reward=False)


@pytest.fixture(scope="module")
def kl_setup():
  partitioner = partitioning.PjitPartitioner(devices=jax.devices()[:1])
  trainer = make_trainer(partitioner, reward_fn=FirstWordReward(), config=KL_CONFIG)
  tokens, _ = trainer.encode_prompts(PROMPTS)
  prompts = np.resize(tokens, (KL_CONFIG.batch_size, tokens.shape[1]))
  model = trainer.policy_model
  logits_fn = jax.jit(lambda params, responses: model.apply(
      {"params": params}, prompts, shift_right(responses), return_hidden=True)[0])
  return trainer, prompts, logits_fn


def _with_logits_scale(params, scale):
  """`params` with the output projection scaled: logits * scale (sharper for scale > 1)."""
  params = jax.tree_util.tree_map(jnp.asarray, params)
  params["decoder"]["logits_dense"]["kernel"] = params["decoder"]["logits_dense"]["kernel"] * scale
  return params


def _np_log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _rollouts(trainer, state, prompts, logits_fn, calls):
  """The trainer's own rollouts and logged KL, and NumPy's exact KL along the same samples."""
  tau = trainer.config.temperature
  logged, per_sequence, exact, full_vocab, first_tokens = [], [], [], [], []
  for i in range(calls):
    responses, sampler_lp, mask = trainer.generate(state, prompts, jax.random.PRNGKey(100 + i))
    rollout, metrics = trainer.score(state, prompts, responses, mask, sampler_lp,
                                     np.zeros(len(prompts), np.float32))
    responses, mask = np.asarray(responses), np.asarray(mask)
    logp = _np_log_softmax(np.asarray(logits_fn(state.policy.params, responses)) / tau)
    logq = _np_log_softmax(np.asarray(logits_fn(state.ref_params, responses)) / tau)
    # KL(pi(.|s_t) || pi_ref(.|s_t)) enumerated over the vocabulary at every position.
    exact.append(((np.exp(logp) * (logp - logq)).sum(-1) * mask).sum(1))
    per_sequence.append(np.asarray(rollout.kl).sum(1))
    logged.append(metrics["kl"])
    full_vocab.append(metrics["kl_full_vocab"])
    first_tokens.append(responses[:, 0])
  return (np.array(logged), np.concatenate(per_sequence), np.concatenate(exact),
          np.array(full_vocab), np.concatenate(first_tokens))


def _assert_logged_kl_is_exact(logged, per_sequence, exact, full_vocab, calls):
  batch = len(per_sequence) // calls
  np.testing.assert_allclose(logged, per_sequence.reshape(calls, batch).mean(1), atol=1e-4)
  # The full-vocabulary KL the trainer logs is the enumeration's (float rounding).
  np.testing.assert_allclose(full_vocab, exact.reshape(calls, batch).mean(1), rtol=1e-4,
                             atol=1e-4)
  # The sampled-token estimate the reward pays is unbiased for it: the paired difference is
  # within 4 standard errors of 0.
  diff = per_sequence - exact
  assert abs(diff.mean()) < 4 * diff.std() / np.sqrt(len(diff)), (diff.mean(), diff.std())


def test_logged_kl_is_the_exact_kl_of_the_sampled_distribution(kl_setup):
  """A policy and a reference of another seed: the KL the trainer logs (and pays) is the exact
  KL(pi || pi_ref) of the temperature-scaled distributions, enumerated over the vocabulary."""
  trainer, prompts, logits_fn = kl_setup
  state = trainer.init_state(jax.random.PRNGKey(0))
  other = trainer.init_state(jax.random.PRNGKey(1))
  state = dataclasses.replace(state, ref_params=other.policy.params)
  calls = 8
  logged, per_sequence, exact, full_vocab, _ = _rollouts(trainer, state, prompts, logits_fn,
                                                        calls)
  assert exact.mean() > 0.5  # The two policies differ.
  _assert_logged_kl_is_exact(logged, per_sequence, exact, full_vocab, calls)


def test_mass_moved_into_tokens_the_old_sampler_never_drew_is_charged(kl_setup):
  """The reference (and first sampler) is nearly greedy; the policy spreads its mass over
  tokens that sampler never drew. Rollouts sample the policy itself, so those tokens are
  drawn and the KL the reward pays is the full KL (a nucleus sampler of the policy would draw
  mostly the reference's top tokens and miss it)."""
  trainer, prompts, logits_fn = kl_setup
  state = trainer.init_state(jax.random.PRNGKey(0))
  policy = state.policy.params
  sharp = _with_logits_scale(policy, 50.0)
  old = dataclasses.replace(state, policy=dataclasses.replace(state.policy, params=sharp),
                            ref_params=sharp)
  calls = 8
  *_, old_first = _rollouts(trainer, old, prompts, logits_fn, calls)
  state = dataclasses.replace(state, ref_params=sharp)
  logged, per_sequence, exact, full_vocab, new_first = _rollouts(trainer, state, prompts,
                                                                 logits_fn, calls)
  # First tokens: the old sampler drew one per prompt; the policy mostly draws others.
  old_drawn = old_first.reshape(calls, -1)
  drawn_sets = [set(old_drawn[:, b]) for b in range(old_drawn.shape[1])]
  assert np.mean([len(d) for d in drawn_sets]) < 1.5
  new = new_first.reshape(calls, -1)
  unseen = np.mean([new[c, b] not in drawn_sets[b] for c in range(calls)
                    for b in range(new.shape[1])])
  assert unseen > 0.5, unseen
  # Charged: the logged KL is the exact KL, and it is large.
  assert exact.mean() > 5.0, exact.mean()
  _assert_logged_kl_is_exact(logged, per_sequence, exact, full_vocab, calls)


def test_truncated_rollout_sampling_is_refused():
  for kwargs in ({"top_p": 0.6}, {"top_k": 5}):
    with pytest.raises(ValueError, match="must sample the policy's whole distribution"):
      ppo_trainer.PPOConfig(**kwargs)
