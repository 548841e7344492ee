"""Trainer, optimizers and schedules: against NumPy formulas and against unsharded/unsplit runs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmoral import losses, optimizers, partitioning
from jaxmoral import trainer as tr
from jaxmoral.models import config, t5

VOCAB = 128


def small_model(dropout_rate: float = 0.0) -> t5.T5:
  # One layer each keeps compilation short on the shared CPU.
  return t5.T5(config.t5_config(size="tiny", vocab_size=VOCAB, num_encoder_layers=1,
                                num_decoder_layers=1, dropout_rate=dropout_rate))


def make_batch(seed: int = 0, batch: int = 8, enc_len: int = 10, dec_len: int = 6) -> dict:
  """Random tokens with row-dependent padding (so rows carry different token counts)."""
  rs = np.random.RandomState(seed)
  enc = rs.randint(2, VOCAB, (batch, enc_len)).astype(np.int32)
  dec = rs.randint(2, VOCAB, (batch, dec_len)).astype(np.int32)
  for i in range(batch):
    enc[i, enc_len - (i % 4):] = 0
    dec[i, dec_len - (i % 5):] = 0
  return {"encoder_input_tokens": enc, "decoder_target_tokens": dec,
          "decoder_input_tokens": np.asarray(t5.shift_right(jnp.asarray(dec)))}


def make_trainer(model, *, optimizer, devices=None, num_partitions=1,
                 loss_normalizing_factor=None, **kwargs) -> tr.Trainer:
  partitioner = partitioning.PjitPartitioner(num_partitions=num_partitions, devices=devices)
  loss_fn = losses.seq2seq_loss_fn(model, loss_normalizing_factor=loss_normalizing_factor)
  return tr.Trainer(init_params_fn=functools.partial(t5.init_params, model),
                    loss_fn=loss_fn, optimizer=optimizer,
                    partitioner=partitioner, **kwargs)


def host(tree):
  return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


# -- schedules / optimizers -------------------------------------------------------------------
def test_schedules_match_numpy_formulas():
  steps = np.arange(0, 60)
  base, warm, total, end = 0.1, 10, 50, 0.01
  s = steps.astype(np.float64)
  expected = {
      "constant": np.full_like(s, base),
      "linear_warmup": base * np.minimum(1.0, s / warm),
      "rsqrt": base / np.sqrt(np.maximum(s, warm)),
      "linear_decay": base + (end - base) * np.clip(s / total, 0, 1),
      "warmup_linear_decay": np.where(
          s < warm, base * s / warm, base + (end - base) * np.clip((s - warm) / (total - warm),
                                                                   0, 1)),
      "warmup_rsqrt": np.where(s < warm, base * s / warm, base * np.sqrt(warm / np.maximum(s, 1))),
  }
  for name, want in expected.items():
    fn = optimizers.make_schedule(name=name, base_learning_rate=base, warmup_steps=warm,
                                  total_steps=total, end_learning_rate=end)
    got = np.asarray(jax.jit(jax.vmap(fn))(jnp.asarray(steps)))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=name)
  # Prompt tuning's schedule: 0.1 peak at step 500, 0 at the end.
  pt = optimizers.make_schedule(name="warmup_linear_decay", base_learning_rate=0.1,
                                warmup_steps=500, total_steps=2000)
  np.testing.assert_allclose([float(pt(250)), float(pt(500)), float(pt(1250)), float(pt(2000))],
                             [0.05, 0.1, 0.05, 0.0], atol=1e-7)


def test_schedule_and_optimizer_errors_name_the_field():
  with pytest.raises(ValueError, match="unknown name 'cosine'"):
    optimizers.make_schedule(name="cosine", base_learning_rate=1.0)
  with pytest.raises(ValueError, match="total_steps"):
    optimizers.make_schedule(name="warmup_linear_decay", base_learning_rate=1.0, warmup_steps=5)
  with pytest.raises(ValueError, match="warmup_steps"):
    optimizers.make_schedule(name="linear_warmup", base_learning_rate=1.0)
  with pytest.raises(ValueError, match="unknown name 'lamb'"):
    optimizers.make_optimizer(name="lamb", learning_rate=1.0)
  with pytest.raises(ValueError, match="grad_clip_norm"):
    optimizers.make_optimizer(name="adamw", learning_rate=1.0, grad_clip_norm=0.0)


def test_adafactor_is_factored_and_clipping_applies():
  params = {"w": jnp.ones((256, 128)), "b": jnp.ones((128,))}
  opt = optimizers.make_optimizer(name="adafactor", learning_rate=1e-2,
                                  group_same_shapes=False)
  state = opt.init(params)
  factored = [s for s in jax.tree_util.tree_leaves(state, is_leaf=lambda x: hasattr(x, "v_row"))
              if hasattr(s, "v_row")][0]
  assert {factored.v_row["w"].shape, factored.v_col["w"].shape} == {(256,), (128,)}
  assert factored.v["b"].shape == (128,)  # vectors keep a full second moment
  # The default (no momentum) is the grouped layout: one stacked entry per shape.
  grouped = optimizers.make_optimizer(name="adafactor", learning_rate=1e-2).init(params)
  assert [sorted((k, v.shape) for k, v in g.items()) for g in grouped.stats] == [
      [("v", (1, 128))], [("v_col", (1, 256)), ("v_row", (1, 128))]]
  with_momentum = optimizers.make_optimizer(name="adafactor", learning_rate=1e-2,
                                            momentum=0.9).init(params)
  assert not hasattr(with_momentum, "stats")  # optax's layout: momentum stays sharded
  # Global-norm clipping: a huge gradient gives the same SGD step as the clipped one.
  sgd = optimizers.make_optimizer(name="sgd", learning_rate=1.0, grad_clip_norm=1.0)
  g = {"w": jnp.full((256, 128), 100.0), "b": jnp.zeros((128,))}
  upd, _ = sgd.update(g, sgd.init(params), params)
  np.testing.assert_allclose(float(optax.tree.norm(upd)), 1.0, rtol=1e-5)


# -- trainable mask ---------------------------------------------------------------------------
def test_global_norm_matches_numpy():
  rs = np.random.RandomState(3)
  tree = {"a": rs.randn(37, 5).astype(np.float32), "b": [rs.randn(1000).astype(np.float32),
                                                        rs.randn(2, 3, 4).astype(np.float32)]}
  ref = np.sqrt(sum(np.sum(np.square(x.astype(np.float64))) for x in
                    jax.tree_util.tree_leaves(tree)))
  np.testing.assert_allclose(float(jax.jit(optimizers.global_norm)(tree)), ref, rtol=1e-6)
  assert float(optimizers.global_norm({})) == 0.0


def test_trainable_mask_patterns_split_merge():
  params = {"encoder": {"a": {"kernel": np.ones(2)}}, "decoder": {"b": {"kernel": np.zeros(3)},
                                                                  "c": {"scale": np.ones(1)}}}
  mask = tr.trainable_mask_from_patterns(params, ["^decoder/b/"])
  assert mask == {"encoder": {"a": {"kernel": False}},
                  "decoder": {"b": {"kernel": True}, "c": {"scale": False}}}
  trainable, frozen = tr.split_params(params, mask)
  assert tr.param_paths(trainable) == ["decoder/b/kernel"]
  assert tr.param_paths(frozen) == ["decoder/c/scale", "encoder/a/kernel"]
  merged = tr.merge_params(trainable, frozen)
  assert jax.tree_util.tree_structure(merged) == jax.tree_util.tree_structure(params)
  callable_mask = tr.resolve_trainable_mask(params, lambda path, leaf: path.endswith("scale"))
  assert tr.param_paths(tr.split_params(params, callable_mask)[0]) == ["decoder/c/scale"]
  with pytest.raises(ValueError, match=r"'\^decoder/typo' matches no parameter"):
    tr.trainable_mask_from_patterns(params, ["^decoder/typo"])
  with pytest.raises(ValueError, match="bad regex"):
    tr.trainable_mask_from_patterns(params, ["("])
  with pytest.raises(ValueError, match="no parameter is trainable"):
    tr.resolve_trainable_mask(params, lambda path, leaf: False)


# -- trainer ----------------------------------------------------------------------------------
def test_loss_decreases_frozen_params_bit_identical_and_stateless():
  model = small_model()
  trainer = make_trainer(model, optimizer=optimizers.make_optimizer(name="adamw",
                                                                    learning_rate=3e-3),
                         num_partitions=2, trainable_mask=["^decoder/layers_0/"])
  state = trainer.init_state(jax.random.PRNGKey(0))
  initial = host(state.params)
  # Params and opt state are born sharded (4 x 2 mesh): the MLP kernel is split over "model".
  wi = state.params["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
  assert wi.sharding.spec == jax.sharding.PartitionSpec(None, "model")
  assert len(wi.addressable_shards) == 8 and wi.addressable_shards[0].data.shape == (64, 64)
  # Optimizer state exists only for the trainable subtree.
  opt_paths = tr.param_paths(state.opt_state)
  moments = [p for p in opt_paths if "/mu/" in p or "/nu/" in p]
  assert set(opt_paths) - set(moments) == {"0/count"}
  assert all("/decoder/layers_0/" in p for p in moments), moments
  n_trainable = len(tr.param_paths(tr.split_params(initial, trainer.trainable_mask)[0]))
  assert len(moments) == 2 * n_trainable and n_trainable == 14  # 8 attention + 3 mlp + 3 norms

  batch = make_batch(0)
  rng = jax.random.PRNGKey(1)
  losses_seen = []
  for _ in range(20):
    state, metrics = trainer.train_step(state, batch, rng)
    losses_seen.append(float(metrics["loss"]))
  assert int(state.step) == 20
  assert losses_seen[-1] < 0.5 * losses_seen[0], losses_seen
  final = host(state.params)
  mask = trainer.trainable_mask
  for path, m, before, after in zip(tr.param_paths(initial), jax.tree_util.tree_leaves(mask),
                                    jax.tree_util.tree_leaves(initial),
                                    jax.tree_util.tree_leaves(final)):
    if m:
      assert not np.array_equal(before, after), f"{path} did not train"
    else:
      assert np.array_equal(before, after), f"frozen {path} changed"
  # eval_step = the loss fn evaluated directly, unsharded (compiled in one program: op by op,
  # every op of the model would compile on its own).
  ev = trainer.eval_step(state, batch)
  ref_loss, ref_metrics = jax.jit(lambda p: losses.seq2seq_loss_fn(model)(p, batch, None))(final)
  np.testing.assert_allclose(float(ev["loss"]), float(ref_loss), rtol=1e-5)
  np.testing.assert_allclose(float(ev["num_tokens"]), float(ref_metrics["num_tokens"]))

  # AOT: lower from abstract shapes only; compiled executable reports FLOPs.
  lowered = trainer.lower_train_step({k: v.shape for k, v in batch.items()})
  compiled = lowered.compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert cost["flops"] > 0
  abstract = trainer.abstract_state()
  assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(state)
  assert (abstract.params["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"].sharding.spec
          == wi.sharding.spec)

  # Fine-tuning entry: from host params; shape errors name the parameter.
  restarted = trainer.init_state_from_params(final)
  assert int(restarted.step) == 0
  np.testing.assert_array_equal(host(restarted.params)["encoder"]["encoder_norm"]["scale"],
                                final["encoder"]["encoder_norm"]["scale"])
  bad = jax.tree_util.tree_map(lambda x: x, final)
  bad["decoder"]["decoder_norm"]["scale"] = np.ones(3, np.float32)
  with pytest.raises(ValueError, match="decoder/decoder_norm/scale has shape"):
    trainer.init_state_from_params(bad)
  with pytest.raises(ValueError, match="not divisible by the 'data' mesh axis"):
    trainer.train_step(restarted, make_batch(0, batch=6), rng)


# SGD with the per-token mean loss: tests/test_microbatching.py (every method's loss).
@pytest.mark.parametrize("name,steps,factor", [("adamw", 2, None), ("sgd", 1, 100.0)])
def test_microbatching_equals_one_big_batch(name, steps, factor):
  """4 microbatches with different token counts give the full batch's update, for a per-token
  mean loss (with Adam's state over 2 steps) and for T5X's fixed loss-normalizing factor
  (whose microbatches are summed)."""
  model = small_model()
  one = jax.devices()[:1]
  opt = optimizers.make_optimizer(name=name, learning_rate=0.5 if name == "sgd" else 1e-2)
  big = make_trainer(model, optimizer=opt, devices=one, loss_normalizing_factor=factor)
  micro = make_trainer(model, optimizer=opt, devices=one, num_microbatches=4,
                       loss_normalizing_factor=factor)
  batch, rng = make_batch(3), jax.random.PRNGKey(0)
  s_big = big.init_state(jax.random.PRNGKey(0))
  s_micro = micro.init_state(jax.random.PRNGKey(0))
  start = host(s_big.params)
  for _ in range(steps):
    s_big, m_big = big.train_step(s_big, batch, rng)
    s_micro, m_micro = micro.train_step(s_micro, batch, rng)
  for key in ("loss", "accuracy", "num_tokens", "grad_norm"):
    np.testing.assert_allclose(float(m_micro[key]), float(m_big[key]), rtol=1e-5, err_msg=key)
  delta_big = jax.tree_util.tree_map(lambda a, b: a - b, host(s_big.params), start)
  delta_micro = jax.tree_util.tree_map(lambda a, b: a - b, host(s_micro.params), start)
  scale = max(float(np.max(np.abs(x))) for x in jax.tree_util.tree_leaves(delta_big))
  assert scale > 1e-4  # the step did move the parameters
  # The optimizer's state is linear (Adam's mu) or quadratic (nu) in the accumulated
  # gradients: a tight check, per leaf relative to its largest entry (summation order moved
  # a few entries of Adam's mu by 1.5e-5 of the peak after 2 steps; a wrong microbatch
  # weighting moves them by percents).
  for a, b in zip(jax.tree_util.tree_leaves(host(s_micro.opt_state)),
                  jax.tree_util.tree_leaves(host(s_big.opt_state))):
    peak = float(np.max(np.abs(b))) if np.size(b) else 0.0
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-5 * peak)
  # SGD's update is the gradient itself: tight. Adam's mu / sqrt(nu) is a ratio of near-zero
  # numbers where a gradient entry changed sign between the steps, which magnifies float32
  # summation-order noise on single entries (seen: 1.5e-3 relative on 1 of 8192 entries with
  # an Intel AVX-512 CPU; 2.2e-2 relative, 1.7e-2 of the largest update, on 1 of 8192 with
  # other initial weights), so Adam's update must hold to 1e-3 on all but 1 in 1,000 entries
  # and to 5e-2 of the largest update on every one.
  if name == "sgd":
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-5 * scale),
        delta_micro, delta_big)
  else:
    got = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(delta_micro)])
    want = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(delta_big)])
    off = np.abs(got - want)
    assert np.mean(off > 1e-3 * scale + 1e-3 * np.abs(want)) <= 1e-3
    assert np.max(off) <= 5e-2 * scale
  # Plain mean over microbatches would differ: token counts per microbatch are unequal.
  counts = [int((batch["decoder_target_tokens"][i::4] > 0).sum()) for i in range(4)]
  assert len(set(counts)) > 1


def test_sharded_4x2_matches_single_device_with_dropout():
  model = small_model(dropout_rate=0.1)
  opt = optimizers.make_optimizer(name="adafactor", learning_rate=1e-2)
  single = make_trainer(model, optimizer=opt, devices=jax.devices()[:1])
  sharded = make_trainer(model, optimizer=opt, num_partitions=2)
  assert dict(sharded.partitioner.mesh.shape) == {"data": 4, "model": 2}
  batch, rng = make_batch(5), jax.random.PRNGKey(7)
  s1 = single.init_state(jax.random.PRNGKey(0))
  s8 = sharded.init_state(jax.random.PRNGKey(0))
  jax.tree_util.tree_map(np.testing.assert_array_equal, host(s1.params), host(s8.params))
  first_losses = []
  for _ in range(2):
    s1, m1 = single.train_step(s1, batch, rng)
    s8, m8 = sharded.train_step(s8, batch, rng)
    np.testing.assert_allclose(float(m8["loss"]), float(m1["loss"]), rtol=1e-5)
    first_losses.append(float(m1["loss"]))
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
                         host(s8.params), host(s1.params))
  # Dropout is on and the rng is per step: a different base rng changes the update.
  s1b = single.init_state(jax.random.PRNGKey(0))
  s1b, m1b = single.train_step(s1b, batch, jax.random.PRNGKey(8))
  assert float(m1b["loss"]) != pytest.approx(first_losses[0], rel=1e-6)


def test_average_metrics_weights_by_tokens_and_sums_counts():
  """Plain per-batch metric dicts (no loss terms): token-weighted means, `num_*` summed."""
  out = tr.average_metrics([
      {"nll": np.float32(2.0), "accuracy": 0.5, "num_tokens": 10, "num_examples": 2},
      {"nll": jnp.float32(1.0), "accuracy": 1.0, "num_tokens": 30, "num_examples": 3}])
  assert out["nll"] == pytest.approx((2 * 10 + 1 * 30) / 40)
  assert out["accuracy"] == pytest.approx((0.5 * 10 + 30) / 40)
  assert out["num_tokens"] == 40 and out["num_examples"] == 5
  assert tr.average_metrics([{"x": 1.0}, {"x": 3.0}]) == {"x": 2.0}
  assert tr.average_metrics([]) == {}
