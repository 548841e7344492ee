"""jaxmoral.adafactor against optax.adafactor: the same updates and statistics, step by step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmoral import adafactor


def _tree(seed: int) -> dict:
  """Leaves of every kind: factored both ways round, 3-D, vectors, a small unfactored matrix,
  and repeated shapes (groups of several leaves)."""
  rs = np.random.RandomState(seed)
  shapes = {"a": (256, 128), "b": (256, 128), "c": (128, 300), "d": (16, 32),
            "e": (130,), "f": (130,), "g": (4, 128, 160), "h": (), "i": (128, 256)}
  return {"layer_0": {k: jnp.asarray(np.asarray(rs.randn(*s), np.float32) * (1 + 0.1 * j))
                      for j, (k, s) in enumerate(shapes.items())},
          "layer_1": {"a": jnp.asarray(rs.randn(256, 128).astype(np.float32)),
                      "e": jnp.asarray(rs.randn(130).astype(np.float32))}}


@pytest.mark.parametrize("options", [
    dict(),
    dict(momentum=0.9, weight_decay_rate=1e-3),
    dict(clipping_threshold=None, multiply_by_parameter_scale=False, factored=False),
    dict(min_dim_size_to_factor=200, decay_rate=0.5),
])
def test_updates_match_optax_adafactor(options):
  schedule = lambda step: 0.01 / jnp.sqrt(1.0 + step)  # noqa: E731
  ours = adafactor.grouped_adafactor(schedule, **options)
  reference = optax.adafactor(learning_rate=schedule, **options)
  params = _tree(0)
  our_state, ref_state = ours.init(params), reference.init(params)
  our_params = ref_params = params
  our_update = jax.jit(ours.update)
  ref_update = jax.jit(reference.update)
  for step in range(4):
    grads = jax.tree_util.tree_map(lambda x, s=step: x * 0.3 + 0.05 * s, _tree(step + 1))
    got, our_state = our_update(grads, our_state, our_params)
    want, ref_state = ref_update(grads, ref_state, ref_params)
    for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-9,
                                 err_msg=f"step {step} {jax.tree_util.keystr(path[0])}")
    our_params = optax.apply_updates(our_params, got)
    ref_params = optax.apply_updates(ref_params, want)
  assert int(our_state.count) == 4
  # The factored statistics are optax's, stacked per shape group.
  ref_factored = ref_state[0]
  group_of_a = our_state.stats[0]  # Shape (256, 128): layer_0/a, layer_0/b, layer_1/a.
  if "v_row" in group_of_a:
    np.testing.assert_allclose(np.asarray(group_of_a["v_row"][2]),
                               np.asarray(ref_factored.v_row["layer_1"]["a"]), rtol=2e-5)


def test_one_group_per_shape_and_clear_errors():
  params = _tree(0)
  state = adafactor.grouped_adafactor(0.1).init(params)
  # 7 distinct (shape, dtype) pairs among the 11 leaves.
  assert len(state.stats) == 7
  # (256, 128), three leaves: v_row averages over the largest axis, v_col over the other.
  assert state.stats[0]["v_row"].shape == (3, 128)
  assert state.stats[0]["v_col"].shape == (3, 256)
  with pytest.raises(ValueError, match="needs params"):
    adafactor.grouped_adafactor(0.1).update(params, state)
  with pytest.raises(ValueError, match="shape groups"):
    adafactor.grouped_adafactor(0.1).update({"x": jnp.ones((3, 3))}, state, {"x": jnp.ones((3, 3))})


def test_trainer_with_grouped_adafactor_on_a_2x2_mesh_matches_optax_on_one_device():
  """Grouped state (replicated) through the sharded trainer gives optax's parameters. A 2 x 2
  mesh shards data and model as a 4 x 2 one does, and one layer each side still gives shape
  groups of several leaves (query/key/value/out): half the compile time."""
  import functools  # pylint: disable=g-import-not-at-top
  from jaxmoral import losses, optimizers, partitioning, trainer as trainer_lib
  from jaxmoral.models import config, t5
  model = t5.T5(config.t5_config(size="tiny", vocab_size=128, num_encoder_layers=1,
                                 num_decoder_layers=1))
  rs = np.random.RandomState(3)
  dec = rs.randint(2, 128, (8, 6)).astype(np.int32)
  batch = {"encoder_input_tokens": rs.randint(2, 128, (8, 10)).astype(np.int32),
           "decoder_target_tokens": dec,
           "decoder_input_tokens": np.asarray(t5.shift_right(jnp.asarray(dec)))}

  def make(group, devices, num_partitions):
    opt = optimizers.make_optimizer(name="adafactor", learning_rate=1e-2,
                                    min_dim_size_to_factor=32, group_same_shapes=group)
    return trainer_lib.Trainer(
        init_params_fn=functools.partial(t5.init_params, model),
        loss_fn=losses.seq2seq_loss_fn(model), optimizer=opt,
        partitioner=partitioning.PjitPartitioner(num_partitions=num_partitions,
                                                 devices=devices))

  reference = make(False, jax.devices()[:1], 1)
  grouped = make(True, jax.devices()[:4], 2)
  s_ref = reference.init_state(jax.random.PRNGKey(0))
  s_grp = grouped.init_state(jax.random.PRNGKey(0))
  assert any(len(group.get("v_row", ())) > 1 for group in s_grp.opt_state.stats)
  rng = jax.random.PRNGKey(1)
  for _ in range(3):
    s_ref, m_ref = reference.train_step(s_ref, batch, rng)
    s_grp, m_grp = grouped.train_step(s_grp, batch, rng)
    np.testing.assert_allclose(float(m_grp["loss"]), float(m_ref["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m_grp["grad_norm"]), float(m_ref["grad_norm"]), rtol=1e-5)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5),
      jax.device_get(s_grp.params), jax.device_get(s_ref.params))


def test_group_same_shapes_is_for_adafactor_only():
  from jaxmoral import optimizers  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="group_same_shapes"):
    optimizers.make_optimizer(name="adamw", learning_rate=1e-3, group_same_shapes=True)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_global_norm_matches_numpy_on_both_paths(backend, monkeypatch):
  """The CPU path (dot products) and the accelerator path (per-shape stacked reductions)."""
  from jaxmoral import optimizers  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  tree = _tree(4)
  want = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2)
                     for x in jax.tree_util.tree_leaves(tree)))
  np.testing.assert_allclose(float(optimizers.global_norm(tree)), want, rtol=1e-6)
