"""Tests for jaxmoral.checkpoints (Orbax) on 8 fake CPU devices (see conftest.py)."""

import json
import logging
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct
from jax.sharding import PartitionSpec as P

from jaxmoral import checkpoints as ck
from jaxmoral import params_export
from jaxmoral import partitioning as pt
from jaxmoral import run_dirs
from jaxmoral.models import t5
from jaxmoral.models.config import t5_config

CFG = t5_config(size="tiny", num_encoder_layers=1, num_decoder_layers=1)


class TrainState(struct.PyTreeNode):
  """TrainState-like struct: static `tx` is not saved, it comes back from the target."""
  step: jax.Array
  params: Any
  opt_state: Any
  tx: Any = struct.field(pytree_node=False, default=None)


@pytest.fixture(scope="module")
def boxed():
  return jax.jit(lambda rng: t5.init_params(t5.T5(CFG), rng))(jax.random.PRNGKey(0))


def _state(params, seed=0, step=7):
  tx = optax.adam(1e-3)
  opt_state = tx.init(params)
  # Non-trivial moments so the round trip checks real values.
  grads = jax.tree_util.tree_map(
      lambda x: jax.random.normal(jax.random.PRNGKey(seed), x.shape), params)
  _, opt_state = tx.update(grads, opt_state, params)
  return TrainState(step=jnp.asarray(step, jnp.int32), params=params, opt_state=opt_state, tx=tx)


def _abstract(tree, shardings=None):
  if shardings is None:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
  return jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _assert_identical(got, want):
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  want_leaves = jax.tree_util.tree_leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for (path, g), w in zip(got_leaves, want_leaves):
    assert np.asarray(g).dtype == np.asarray(w).dtype, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w),
                                  err_msg=jax.tree_util.keystr(path))


def test_round_trip_async_extra_and_max_to_keep(tmp_path, boxed):
  params = nn.unbox(boxed)
  extra = {"reward_mean": np.float32(0.25), "reward_var": 2.0, "data_position": [3, 4],
           "note": "x", "hist": np.arange(3)}
  with ck.CheckpointManager(tmp_path / "run", save_interval_steps=2, max_to_keep=2,
                            async_save=True) as manager:
    assert manager.latest_step() is None
    states = {}
    for step in range(1, 8):
      states[step] = _state(params, seed=step, step=step)
      saved = manager.save(step, states[step], extra={**extra, "step": step})
      assert saved == (step % 2 == 0), step
    assert manager.save(7, states[7], force=True) is True
    assert manager.save(7, states[7], force=True) is False  # already saved
    manager.wait()
    assert manager.all_steps() == [6, 7] and manager.latest_step() == 7
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == ["6", "7"]

    target = _abstract(states[6])
    restored, got_extra = manager.restore(6, target=target)
    assert isinstance(restored, TrainState) and restored.tx is states[6].tx
    _assert_identical(restored, states[6])
    assert got_extra == {"reward_mean": 0.25, "reward_var": 2.0, "data_position": [3, 4],
                         "note": "x", "hist": [0, 1, 2], "step": 6}
    latest, latest_extra = manager.restore(target=target)  # default: latest
    _assert_identical(latest, states[7])
    assert latest_extra == {}  # forced save without extra
    with pytest.raises(FileNotFoundError, match="no checkpoint for step 2"):
      manager.restore(2, target=target)
    with pytest.raises(TypeError, match=r"extra\['bad'\]: object"):
      manager.save(8, states[7], extra={"bad": object()})


def test_resume_in_new_manager_and_restore_params_only(tmp_path, boxed, caplog):
  params = nn.unbox(boxed)
  state = _state(params, step=3)
  with ck.CheckpointManager(tmp_path, save_interval_steps=1, async_save=False) as manager:
    manager.save(3, state)
  with ck.CheckpointManager(tmp_path, save_interval_steps=1) as manager:  # a resumed run
    assert manager.latest_step() == 3
    restored, _ = manager.restore(target=_abstract(state))
  _assert_identical(restored, state)

  with caplog.at_level(logging.WARNING):
    only = params_export.restore_params_from_run(tmp_path)
  # Opening the run read-only is intended: Orbax's notice about it is not passed on.
  assert not [r for r in caplog.records if "read only" in r.getMessage()], caplog.text
  assert set(only) == set(params)  # params only: no optimizer state, no step
  _assert_identical(only, params)
  assert all(x.sharding.is_fully_addressable for x in jax.tree_util.tree_leaves(only))
  partitioner = pt.PjitPartitioner(num_partitions=2)
  shardings = partitioner.sharding_for(boxed)
  sharded = params_export.restore_params_from_run(tmp_path, step=3, shardings=shardings,
                                                  dtype="bfloat16")
  for got, want, sharding in zip(jax.tree_util.tree_leaves(sharded),
                                 jax.tree_util.tree_leaves(params),
                                 jax.tree_util.tree_leaves(shardings)):
    assert got.dtype == jnp.bfloat16 and got.sharding == sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
  with pytest.raises(FileNotFoundError, match="no checkpoint for step 9"):
    params_export.restore_params_from_run(tmp_path, step=9)
  with pytest.raises(FileNotFoundError, match="no such run directory"):
    params_export.restore_params_from_run(tmp_path / "does_not_exist")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="no checkpoints"):
    params_export.restore_params_from_run(tmp_path / "empty")


@pytest.mark.parametrize("restore_mesh", [(8, 1), (2, 4)])
def test_restore_onto_another_mesh(tmp_path, boxed, restore_mesh):
  params = nn.unbox(boxed)
  tx = optax.adafactor(1e-3, min_dim_size_to_factor=32)
  save_partitioner = pt.PjitPartitioner(num_partitions=2)  # 4 x 2
  save_shardings = save_partitioner.sharding_for(boxed)
  sharded = jax.device_put(params, save_shardings)
  assert jax.tree_util.tree_leaves(sharded)[0].sharding.mesh.devices.shape == (4, 2)
  state = {"params": sharded, "opt_state": tx.init(sharded), "step": jnp.int32(5)}
  with ck.CheckpointManager(tmp_path, async_save=True) as manager:
    manager.save(5, state, force=True)
    manager.wait()

  data, model = restore_mesh
  partitioner = pt.PjitPartitioner(
      num_partitions=model,
      logical_axis_rules=pt.standard_logical_axis_rules(parameter_partitioning_dims=2))
  abstract_opt = jax.eval_shape(tx.init, params)
  target_shardings = {
      "params": partitioner.sharding_for(boxed),
      "opt_state": partitioner.sharding_for(pt.logical_specs_like(abstract_opt, boxed)),
      "step": partitioner.replicated,
  }
  target = _abstract({"params": params, "opt_state": abstract_opt, "step": state["step"]},
                     target_shardings)
  with ck.CheckpointManager(tmp_path) as manager:
    restored, _ = manager.restore(target=target)
  _assert_identical(restored, jax.device_get(state))
  for got, want in zip(jax.tree_util.tree_leaves(restored),
                       jax.tree_util.tree_leaves(target_shardings)):
    assert got.sharding == want
    assert got.sharding.mesh.devices.shape == (data, model)
  # A sharded-kernel spot check: the FSDP restore really split the query kernel two ways.
  query = restored["params"]["encoder"]["layers_0"]["attention"]["query"]["kernel"]
  assert query.sharding.spec == P("data", "model")
  assert query.addressable_shards[0].data.shape == (CFG.d_model // data,
                                                    CFG.num_heads * CFG.d_kv // model)


def test_export_bf16_and_load(tmp_path, boxed):
  params = nn.unbox(boxed)
  config = CFG.to_dict()
  out = params_export.export_params(boxed, tmp_path / "export", dtype="bfloat16", config=config)
  assert json.loads((tmp_path / "export" / "config.json").read_text()) == config
  loaded, got_config = params_export.load_exported(out)
  assert got_config == config
  assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(params)
  for got, want in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(params)):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))

  # Sharded load with an upcast back to float32 (values are the bf16-rounded ones).
  partitioner = pt.PjitPartitioner(num_partitions=4)
  shardings = partitioner.sharding_for(boxed)
  loaded32 = params_export.load_params(out, shardings=shardings, dtype=jnp.float32)
  embedding = loaded32["token_embedder"]["embedding"]
  assert embedding.dtype == jnp.float32 and embedding.sharding.spec == P("model", None)
  np.testing.assert_array_equal(
      np.asarray(embedding),
      np.asarray(params["token_embedder"]["embedding"].astype(jnp.bfloat16).astype(jnp.float32)))

  with pytest.raises(FileExistsError, match="overwrite=True"):
    params_export.export_params(params, out)
  params_export.export_params(params, out, overwrite=True)  # float32, no config change
  _assert_identical(params_export.load_params(out), params)
  with pytest.raises(FileNotFoundError, match="no exported params"):
    params_export.load_params(tmp_path / "nowhere")
  with pytest.raises(ValueError, match="no sharding given for saved parameter"):
    params_export.load_params(out,
                              shardings={"token_embedder": {"embedding": partitioner.replicated}})


def test_bad_options_and_target(tmp_path):
  with pytest.raises(ValueError, match="save_interval_steps"):
    ck.CheckpointManager(tmp_path, save_interval_steps=0)
  with pytest.raises(ValueError, match="max_to_keep"):
    ck.CheckpointManager(tmp_path, max_to_keep=0)
  state = {"w": jnp.ones((4, 2)), "step": jnp.int32(1)}
  with ck.CheckpointManager(tmp_path, save_interval_steps=1, async_save=False) as manager:
    manager.save(1, state)
    with pytest.raises(ValueError, match="cannot restore into the given target"):
      manager.restore(target={"w": jax.ShapeDtypeStruct((4, 2), jnp.float32),
                              "other": jax.ShapeDtypeStruct((1,), jnp.float32)})
    with pytest.raises(ValueError, match="no 'params' entry"):
      params_export.restore_params_from_run(tmp_path)


def test_make_run_dir_creates_a_local_folder(tmp_path):
  # gs:// run directories: tests/test_object_storage.py (against a GCS-API server).
  made = run_dirs.make_run_dir(tmp_path / "a" / "run")
  assert made == str(tmp_path / "a" / "run") and os.path.isdir(made)


def test_saved_steps_lists_step_folders_in_order(tmp_path):
  assert run_dirs.saved_steps(tmp_path / "none") == []
  ckpt = run_dirs.checkpoints_dir(tmp_path)
  for name in ("10", "2", "3.orbax-checkpoint-tmp-1"):  # an unfinished save is not a step
    os.makedirs(os.path.join(ckpt, name))
  assert run_dirs.saved_steps(tmp_path) == [2, 10]
