"""Microbatches are exact for every method's loss: k = 4 microbatches give the one-batch
SGD update and metrics, on batches whose rows carry very different token counts.

Rows alternate long and short responses, and microbatch i takes rows i, i + k, ...: with k = 4
microbatches 0 and 2 hold only long rows and 1 and 3 only short ones (with k = 2 the same split
in two), the case where weighting a per-example term by tokens (or a per-token term by
microbatch) goes most wrong. One k > 2 runs the same scan as any other k, and accumulates over
more than two microbatches; each k compiles its own step.
"""


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoral import optimizers, partitioning, prompt_tuning, runs
from jaxmoral import trainer as tr
from jaxmoral.diamante import diamante_model
from jaxmoral.diamante import model as dmodel
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5, trainable
from jaxmoral.rl import ppo_trainer
from jaxmoral.rl import rollout as rollout_lib

VOCAB = 32
CONFIG = config_lib.t5_config(size="tiny", vocab_size=VOCAB, d_model=32, d_ff=64, num_heads=2,
                              num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0)
ROWS = 8
LEARNING_RATE = 0.5


def _tokens(rs, lengths, width):
  """(rows, width) ids in [2, VOCAB): row r has lengths[r] tokens, the last one EOS (1)."""
  out = np.zeros((len(lengths), width), np.int32)
  for row, n in enumerate(lengths):
    out[row, :n] = rs.randint(2, VOCAB, n)
    out[row, n - 1] = 1
  return out


def _seq2seq_batch(rs, target_lengths, input_lengths):
  targets = _tokens(rs, target_lengths, 10)
  return {"encoder_input_tokens": _tokens(rs, input_lengths, 12),
          "decoder_target_tokens": targets,
          "decoder_input_tokens": np.asarray(t5.shift_right(jnp.asarray(targets))),
          "decoder_loss_weights": (targets > 0).astype(np.int32)}


def _method(name):
  """(model, batch) of one method, rows alternating long and short (models built alike for
  the same name, so the fixture's trainers can be shared)."""
  rs = np.random.RandomState(0)
  long_short = [9, 2] * (ROWS // 2)
  inputs = [12, 3] * (ROWS // 2)
  if name == "seq2seq":  # Label smoothing and z-loss on: every auxiliary term is exact too.
    model = trainable.Seq2SeqModel(config=CONFIG, label_smoothing=0.1, z_loss=1e-2)
    return model, _seq2seq_batch(rs, long_short, inputs)
  if name == "prompt_tuning":
    model = prompt_tuning.PromptTuningModel(
        config=CONFIG, prompt=prompt_tuning.PromptConfig(length=3, init="uniform",
                                                         vocab_sample_size=VOCAB))
    return model, _seq2seq_batch(rs, long_short, inputs)
  if name == "npov_classifier":  # A prompt over the base; targets: a label word and EOS.
    model = prompt_tuning.PromptTuningModel(
        config=CONFIG, prompt=prompt_tuning.PromptConfig(length=3, init="uniform",
                                                         vocab_sample_size=VOCAB))
    batch = _seq2seq_batch(rs, [2] * ROWS, inputs)
    batch["decoder_target_tokens"][:, 0] = np.tile([5, 6], ROWS // 2)  # "yes" / "no"
    batch["decoder_input_tokens"] = np.asarray(
        t5.shift_right(jnp.asarray(batch["decoder_target_tokens"])))
    return model, batch
  if name == "diamante":  # Human responses of 9 and 2 tokens; the others of any length.
    model = diamante_model.DiamanteModel(config=CONFIG, pe_weight=1.0)
    targets = np.stack([_tokens(rs, long_short, 10),
                        _tokens(rs, rs.randint(1, 10, ROWS), 10),
                        _tokens(rs, rs.randint(1, 10, ROWS), 10)], axis=1)
    flat = targets.reshape(-1, 10)
    return model, {"encoder_input_tokens": _tokens(rs, inputs, 12),
                   "decoder_target_tokens": targets,
                   "decoder_input_tokens": np.asarray(
                       t5.shift_right(jnp.asarray(flat))).reshape(targets.shape),
                   "decoder_loss_weights": (targets > 0).astype(np.int32)}
  raise ValueError(name)


@pytest.fixture(scope="module")
def trainers():
  """`get(model, k)`: the run's Trainer of a model with k microbatches, on one device, with SGD
  (the update is -LEARNING_RATE * gradient); cached, so equal models share compiled steps."""
  partitioner = partitioning.PjitPartitioner(devices=jax.devices()[:1])
  sgd = optimizers.make_optimizer(name="sgd", learning_rate=LEARNING_RATE)
  cache = {}

  def get(model, k):
    key = (repr(model), k)
    if key not in cache:
      cache[key] = runs.make_trainer(model=model, optimizer=sgd, partitioner=partitioner,
                                     num_microbatches=k)
    return cache[key]

  get.partitioner, get.optimizer = partitioner, sgd
  return get


def _host(tree):
  return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


def _copy(state, trainer):
  """A copy of a device state in `trainer`'s shardings, with its dtypes (weak types too: the
  step then compiles to the program `lower_train_step` lowers, found in the compilation cache
  by test_microbatched_step_costs_no_extra_forward_pass)."""
  return jax.device_put(state, trainer.state_shardings, may_alias=False)


def _assert_same_update(start, one, micro, what):
  """Params after the step, compared through their updates (relative to the largest)."""
  delta = jax.tree_util.tree_map(lambda a, b: np.asarray(a, np.float64) - b, one, start)
  delta_micro = jax.tree_util.tree_map(lambda a, b: np.asarray(a, np.float64) - b, micro, start)
  scale = max(float(np.max(np.abs(x))) for x in jax.tree_util.tree_leaves(delta))
  assert scale > 1e-4, what  # the step moved the parameters
  worst = max(float(np.max(np.abs(a - b))) for a, b in zip(
      jax.tree_util.tree_leaves(delta_micro), jax.tree_util.tree_leaves(delta)))
  assert worst <= 2e-5 * scale, f"{what}: updates differ by {worst / scale:.2%} of the largest"


# (T5X's fixed loss-normalizing factor, a "sum" term: tests/test_trainer.py.)
@pytest.mark.parametrize("name", ["seq2seq", "prompt_tuning", "npov_classifier", "diamante"])
def test_update_and_metrics_equal_one_batch(trainers, name):
  model, batch = _method(name)
  rng = jax.random.PRNGKey(1)
  results = {}
  initial = trainers(model, 1).init_state(jax.random.PRNGKey(0))
  start = _host(initial.params)
  for k in (1, 4):
    trainer = trainers(model, k)
    # Both start from copies of one state (the steps donate theirs): the k = 4 trainer has the
    # same model, optimizer and mesh, so it needs no initialisation of its own.
    state = _copy(initial, trainer)
    state, metrics = trainer.train_step(state, batch, rng)
    results[k] = (_host(state.params), {m: float(v) for m, v in metrics.items()})
    if k == 1:  # The reported loss is the loss fn's own on the whole batch.
      loss, _ = jax.jit(model.loss_fn())(nn.meta.unbox(start), batch, rng)
      np.testing.assert_allclose(results[1][1]["loss"], float(loss), rtol=1e-5)
  one_params, one_metrics = results[1]
  for k in (4,):
    params, metrics = results[k]
    _assert_same_update(start, one_params, params, f"{name}, {k} microbatches")
    assert set(metrics) == set(one_metrics)
    for key, want in one_metrics.items():
      np.testing.assert_allclose(metrics[key], want, rtol=2e-5, atol=1e-6,
                                 err_msg=f"{name}, {k} microbatches: {key}")
  # The microbatches differ: their (human) response tokens are 18, 4, 18, 4 with k = 4.
  targets = batch["decoder_target_tokens"]
  human = targets[:, 0] if targets.ndim == 3 else targets
  if name != "npov_classifier":
    assert [int((human[i::4] > 0).sum()) for i in range(4)] == [18, 4, 18, 4]


def test_diamante_pe_loss_is_per_example_not_per_token(trainers):
  """The preference term is a mean over examples (NumPy, from the scores), in a microbatched
  step and in evaluation over batches of very different token counts."""
  model, batch = _method("diamante")
  trainer = trainers(model, 4)  # The step test_update_and_metrics_equal_one_batch compiled.
  # Its initial state too (the one-batch trainer's init, already compiled there).
  initial = trainers(model, 1).init_state(jax.random.PRNGKey(0))
  params = nn.meta.unbox(_host(initial.params))
  scores = np.asarray(jax.jit(lambda p: dmodel.forward_responses(
      model.module(), p, batch["encoder_input_tokens"], batch["decoder_input_tokens"],
      batch["decoder_loss_weights"])[1])(params), np.float64)

  def softplus(x):
    return np.log1p(np.exp(x))

  h, m, r = scores[:, 0], scores[:, 1], scores[:, 2]
  per_example = (softplus(m - h) + softplus(r - h) + softplus(r - m)) / 3
  state = _copy(initial, trainer)
  # Evaluation: the long rows' and the short rows' batches combine as the whole batch.
  whole = _host(trainer.eval_step(state, batch))
  halves = [_host(trainer.eval_step(state, {k: v[i::2] for k, v in batch.items()}))
            for i in range(2)]
  combined = tr.average_metrics(halves)
  assert set(combined) == {k for k in whole if "/" not in k}
  for key, value in combined.items():
    np.testing.assert_allclose(value, whole[key], rtol=1e-5, atol=1e-6, err_msg=key)
  np.testing.assert_allclose(combined["pe_loss"], per_example.mean(), rtol=1e-5)
  _, metrics = trainer.train_step(state, batch, jax.random.PRNGKey(1))
  np.testing.assert_allclose(float(metrics["pe_loss"]), per_example.mean(), rtol=1e-5)


def test_microbatched_step_costs_no_extra_forward_pass(trainers):
  """The whole batch's counts come from a forward pass of which XLA keeps only the counts:
  the microbatched step's FLOPs stay those of the one-batch step."""
  model, batch = _method("diamante")
  flops = {}
  for k in (1, 4):
    cost = trainers(model, k).lower_train_step({n: v.shape for n, v in batch.items()}).compile()
    cost = cost.cost_analysis()
    flops[k] = (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]
  # XLA's cost analysis counts a loop body once: 4 microbatches cost a quarter of the batch.
  # A kept forward pass over the whole batch would add a third of the batch's FLOPs (seen:
  # 19.2M against 8.4M when the counts were made to depend on the loss).
  assert flops[4] <= 1.1 * flops[1] / 4, flops


# -- PPO ----------------------------------------------------------------------------------------
def _rollout(rs, batch):
  """A scored rollout by hand: responses alternately 6 and 1 tokens long."""
  length = 6
  mask = np.zeros((batch, length), np.float32)
  for row in range(batch):
    mask[row, :length if row % 2 == 0 else 1] = 1.0

  def floats(scale=1.0):
    return (rs.randn(batch, length) * scale).astype(np.float32) * mask

  return rollout_lib.Rollout(
      prompt_tokens=_tokens(rs, [8, 3] * (batch // 2), 8),
      response_tokens=(_tokens(rs, [length, 1] * (batch // 2), length)),
      response_mask=mask, sampler_logprobs=floats() - 2.0, old_logprobs=floats(0.3) - 2.5,
      ref_logprobs=floats() - 2.0, old_values=floats(), scores=rs.randn(batch).astype(np.float32),
      rewards=floats(), kl=floats(), advantages=floats(), returns=floats())


class _Vocab:
  def encode(self, s):
    return [int(w[1:]) for w in s.split()]

  def decode(self, ids):
    return " ".join(f"w{i}" for i in ids)


def test_ppo_update_equals_one_minibatch(trainers):
  rollout = _rollout(np.random.RandomState(0), ROWS)
  results = {}
  initial = None
  for k in (1, 4):
    config = ppo_trainer.PPOConfig(batch_size=ROWS, num_minibatches=1, num_microbatches=k,
                                   num_ppo_epochs=1, max_prompt_length=8, max_response_length=6,
                                   value_coef=0.5)
    trainer = ppo_trainer.PPOTrainer(
        policy_model=t5.T5(CONFIG), value_model=t5.T5(CONFIG, with_scalar_head=True),
        vocabulary=_Vocab(), reward_fn=lambda *a, **kw: None, config=config,
        optimizer=trainers.optimizer, partitioner=trainers.partitioner)
    if initial is None:  # One initial state for both (same models and mesh).
      initial = trainer.init_state(jax.random.PRNGKey(0))
      start = _host((initial.policy.params, initial.value.params))
    state = _copy(initial, trainer)  # ppo_update donates its state.
    state, metrics = trainer.ppo_update(state, rollout, jax.random.PRNGKey(2))
    results[k] = (_host((state.policy.params, state.value.params)),
                  {m: float(v) for m, v in metrics.items()})
  for k in (4,):
    _assert_same_update(start, results[1][0], results[k][0], f"PPO, {k} microbatches")
    for key, want in results[1][1].items():
      np.testing.assert_allclose(results[k][1][key], want, rtol=2e-5, atol=1e-6,
                                 err_msg=f"PPO, {k} microbatches: {key}")
  with pytest.raises(ValueError, match="num_microbatches=3"):
    ppo_trainer.PPOConfig(batch_size=8, num_minibatches=2, num_microbatches=3)
