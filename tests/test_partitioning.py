"""Tests for jaxmoral.partitioning on 8 fake CPU devices (see conftest.py)."""

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmoral import partitioning as pt
from jaxmoral.models import t5
from jaxmoral.models.config import t5_config

# One layer each side: every kind of parameter the rules resolve, at half the compile time.
CFG = t5_config(size="tiny", num_encoder_layers=1, num_decoder_layers=1)
MODEL = t5.T5(CFG)


@pytest.fixture(scope="module")
def boxed():
  return jax.jit(lambda rng: t5.init_params(MODEL, rng))(jax.random.PRNGKey(0))


def _batch(seed=0, batch=8, length=6):
  rng = np.random.default_rng(seed)
  enc = rng.integers(2, CFG.vocab_size, (batch, length)).astype(np.int32)
  enc[:, -2:] = 0  # some padding
  dec = rng.integers(2, CFG.vocab_size, (batch, length)).astype(np.int32)
  return enc, dec


def _spec(specs, *path):
  node = specs
  for key in path:
    node = node[key]
  return node


def test_rules_resolve_tiny_t5_params_1d_and_2d(boxed):
  one_d = pt.PjitPartitioner(num_partitions=2)
  two_d = pt.PjitPartitioner(num_partitions=2, logical_axis_rules=pt.standard_logical_axis_rules(
      parameter_partitioning_dims=2))
  assert dict(one_d.mesh.shape) == {"data": 4, "model": 2}
  s1, s2 = one_d.logical_to_mesh(boxed), two_d.logical_to_mesh(boxed)
  attn = ("encoder", "layers_0", "attention")
  expected = {  # path: (1-D spec, 2-D spec)
      attn + ("query", "kernel"): (P(None, "model"), P("data", "model")),
      attn + ("out", "kernel"): (P("model", None), P("model", "data")),
      ("encoder", "layers_0", "mlp", "wi_0", "kernel"): (P(None, "model"), P("data", "model")),
      ("decoder", "layers_0", "mlp", "wo", "kernel"): (P("model", None), P("model", "data")),
      ("token_embedder", "embedding"): (P("model", None), P("model", "data")),
      ("decoder", "logits_dense", "kernel"): (P(None, "model"), P("data", "model")),
      ("encoder", "relpos_bias", "rel_embedding"): (P("model", None), P("model", None)),
      ("decoder", "decoder_norm", "scale"): (P(None), P("data")),
  }
  for path, (want1, want2) in expected.items():
    assert _spec(s1, *path) == want1, path
    assert _spec(s2, *path) == want2, path
  # Every leaf resolved; the sharding tree mirrors the unboxed params.
  shardings = one_d.sharding_for(boxed)
  assert (jax.tree_util.tree_structure(shardings)
          == jax.tree_util.tree_structure(nn.unbox(boxed)))
  assert _spec(shardings, *attn, "query", "kernel") == NamedSharding(one_d.mesh, P(None, "model"))


def test_activation_rules_keep_batch_only_with_fsdp():
  fsdp = pt.standard_logical_axis_rules(parameter_partitioning_dims=2)
  assert nn.logical_to_mesh_axes(("batch", "length", "embed"), fsdp) == P("data", None, None)
  assert nn.logical_to_mesh_axes(("batch", "length", "heads", "kv"), fsdp) == P(
      "data", None, "model", None)
  act2 = pt.standard_logical_axis_rules(activation_partitioning_dims=2,
                                        parameter_partitioning_dims=2)
  assert nn.logical_to_mesh_axes(("batch", "length", "embed"), act2) == P("data", None, "model")
  assert nn.logical_to_mesh_axes(("embed", "mlp"), act2) == P("data", "model")
  # Additional rules take precedence over the standard ones.
  extra = pt.standard_logical_axis_rules(additional_rules=[("vocab", None), ("prompt", None)])
  assert nn.logical_to_mesh_axes(("vocab", "embed"), extra) == P(None, None)
  with pytest.raises(ValueError, match="parameter_partitioning_dims"):
    pt.standard_logical_axis_rules(parameter_partitioning_dims=3)
  with pytest.raises(ValueError, match=r"additional_rules\[0\]"):
    pt.standard_logical_axis_rules(additional_rules=["vocab"])


def test_get_mesh_shapes_slices_and_errors():
  mesh = pt.get_mesh(num_partitions=4)
  assert mesh.axis_names == ("data", "model") and dict(mesh.shape) == {"data": 2, "model": 4}
  assert dict(pt.get_mesh(model_parallel_submesh=(2, 1, 1, 1)).shape) == {"data": 4, "model": 2}
  # Two slices (fake CPU devices have no slice_index: contiguous halves): the model axis stays
  # inside a slice, the data axis spans both.
  sliced = pt.get_mesh(num_partitions=2, num_slices=2)
  ids = np.vectorize(lambda d: d.id)(sliced.devices)
  assert ids.shape == (4, 2)
  assert set(ids[:2].ravel()) == {0, 1, 2, 3} and set(ids[2:].ravel()) == {4, 5, 6, 7}
  with pytest.raises(ValueError, match="num_partitions=3"):
    pt.get_mesh(num_partitions=3)
  with pytest.raises(ValueError, match="model_parallel_submesh"):
    pt.get_mesh(num_partitions=4, model_parallel_submesh=(2, 1))
  assert dict(pt.get_mesh(num_partitions=2, devices=jax.devices()[:4]).shape) == {
      "data": 2, "model": 2}


def test_indivisible_dims_are_replicated():
  partitioner = pt.PjitPartitioner(num_partitions=2)
  odd = nn.LogicallyPartitioned(jnp.zeros((3, 4)), names=("vocab", "embed"))
  assert partitioner.logical_to_mesh({"w": odd})["w"] == P(None, None)
  even = nn.LogicallyPartitioned(jnp.zeros((6, 4)), names=("vocab", "embed"))
  assert partitioner.logical_to_mesh({"w": even})["w"] == P("model", None)


def _loss_and_logits(params, enc, dec):
  logits = MODEL.apply({"params": params}, enc, dec)
  targets = jnp.roll(dec, -1, axis=1)
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)), logits


_grad_fn = jax.value_and_grad(_loss_and_logits, has_aux=True)


@pytest.fixture(scope="module")
def unsharded_reference(boxed):
  """Loss, logits and gradients on one device (no mesh, no rules)."""
  enc, dec = _batch()
  (loss, logits), grads = jax.jit(_grad_fn)(nn.unbox(boxed), enc, dec)
  return loss, logits, grads


@pytest.mark.parametrize("param_dims", [1, 2])
def test_sharded_forward_and_grad_match_unsharded(boxed, unsharded_reference, param_dims):
  partitioner = pt.PjitPartitioner(
      num_partitions=2,
      logical_axis_rules=pt.standard_logical_axis_rules(parameter_partitioning_dims=param_dims))
  shardings = partitioner.sharding_for(boxed)
  sharded_params = jax.device_put(nn.unbox(boxed), shardings)
  data = partitioner.data_sharding(2)
  step = partitioner.partition(_grad_fn, in_shardings=(shardings, data, data),
                               out_shardings=None)
  (loss, logits), grads = step(sharded_params, *_batch())
  want_loss, want_logits, want_grads = unsharded_reference
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)
  # The model's logical constraint on logits ('batch', 'length', 'vocab') took effect.
  assert logits.sharding.spec == P("data", None, "model")
  query = grads["encoder"]["layers_0"]["attention"]["query"]["kernel"]
  assert query.sharding.mesh.devices.shape == (4, 2)
  for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(want_grads),
                               jax.tree_util.tree_leaves(grads)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-4,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("make_tx", [
    lambda: optax.adamw(1e-2),
    lambda: optax.adafactor(1e-2, min_dim_size_to_factor=32),
    lambda: optax.masked(optax.adam(1e-2),
                         lambda p: jax.tree_util.tree_map_with_path(
                             lambda k, _: "encoder" in jax.tree_util.keystr(k), p)),
], ids=["adamw", "adafactor", "masked_adam"])
def test_optimizer_state_shardings(boxed, make_tx):
  tx = make_tx()
  partitioner = pt.PjitPartitioner(
      num_partitions=2,
      logical_axis_rules=pt.standard_logical_axis_rules(parameter_partitioning_dims=2))
  params = nn.unbox(boxed)
  param_shardings = partitioner.sharding_for(boxed)
  abstract_state = jax.eval_shape(tx.init, params)
  state_shardings = partitioner.sharding_for(pt.logical_specs_like(abstract_state, boxed))
  assert (jax.tree_util.tree_structure(state_shardings)
          == jax.tree_util.tree_structure(abstract_state))

  param_by_path = {jax.tree_util.keystr(k): (v.shape, s) for (k, v), s in zip(
      jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(param_shardings))}
  n_mirrored = 0
  for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(abstract_state),
                                    jax.tree_util.tree_leaves(state_shardings)):
    key = jax.tree_util.keystr(path)
    match = [v for k, v in param_by_path.items() if key.endswith(k)]
    if match and match[0][0] == leaf.shape:
      assert sharding == match[0][1], key
      n_mirrored += 1
    else:  # counters, factored statistics, placeholders
      assert sharding.spec == P(), key
  assert n_mirrored > 0

  # A sharded optimizer update equals the unsharded one.
  # Gradients and initial state in one compiled program each: op by op, every op (one per
  # leaf shape) would compile on its own; the values are the same.
  grads = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: jnp.cos(x) * 0.1, p))(params)
  init_state = jax.jit(tx.init)(params)

  def update(g, s, p):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  want_params, want_state = jax.jit(update)(grads, init_state, params)
  sharded_update = partitioner.partition(
      update, in_shardings=(param_shardings, state_shardings, param_shardings),
      out_shardings=(param_shardings, state_shardings))
  got_params, got_state = sharded_update(
      jax.device_put(grads, param_shardings),
      jax.device_put(init_state, state_shardings),
      jax.device_put(params, param_shardings))
  for got, want in zip(jax.tree_util.tree_leaves((got_params, got_state)),
                       jax.tree_util.tree_leaves((want_params, want_state))):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_data_sharding_and_host_local_to_global():
  partitioner = pt.PjitPartitioner(num_partitions=2)
  assert partitioner.data_sharding(3).spec == P("data", None, None)
  assert partitioner.replicated.spec == P()
  batch = {"encoder_input_tokens": np.arange(32, dtype=np.int32).reshape(8, 4),
           "weights": np.ones((8,), np.float32)}
  out = partitioner.host_local_to_global(batch)
  np.testing.assert_array_equal(np.asarray(out["encoder_input_tokens"]),
                                batch["encoder_input_tokens"])
  assert out["encoder_input_tokens"].sharding.spec == P("data", None)
  assert out["weights"].sharding.spec == P("data")
  # Each data shard holds its 2 rows, replicated over the model axis.
  shard_rows = {tuple(np.asarray(s.data)[:, 0]) for s in out["encoder_input_tokens"]
                .addressable_shards}
  assert shard_rows == {(0, 4), (8, 12), (16, 20), (24, 28)}
  with pytest.raises(ValueError, match="scalar leaf"):
    partitioner.host_local_to_global({"x": np.float32(1.0)})


def test_initialize_distributed(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID",
               "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES"):
    monkeypatch.delenv(name, raising=False)
  assert pt.initialize_distributed() is False
  assert pt.initialize_distributed(num_processes=1) is False
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  with pytest.raises(ValueError, match="process_id"):
    pt.initialize_distributed()
  monkeypatch.setenv("JAX_PROCESS_ID", "2")
  assert pt.initialize_distributed() is True
  assert calls[-1] == dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=2)
  with pytest.raises(ValueError, match="process_id=5"):
    pt.initialize_distributed(process_id=5)
  monkeypatch.setenv("JAX_NUM_PROCESSES", "four")
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='four'"):
    pt.initialize_distributed()
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name)
  monkeypatch.setenv("SLURM_JOB_ID", "77")
  monkeypatch.setenv("SLURM_NTASKS", "1")
  assert pt.initialize_distributed() is False
  monkeypatch.setenv("SLURM_NTASKS", "2")
  assert pt.initialize_distributed() is True and calls[-1] == {}


def test_gin_binds_partitioner():
  gin.clear_config()
  try:
    gin.parse_config("""
      partitioning.PjitPartitioner.num_partitions = 4
      partitioning.PjitPartitioner.logical_axis_rules = @partitioning.standard_logical_axis_rules()
      partitioning.standard_logical_axis_rules.parameter_partitioning_dims = 2
    """)
    partitioner = pt.PjitPartitioner()
  finally:
    gin.clear_config()
  assert dict(partitioner.mesh.shape) == {"data": 2, "model": 4}
  assert ("embed", "data") in partitioner.rules


def test_sharding_like_replicates_indivisible_dims_in_optimizer_state():
  # 6 heads on a 4-way model axis: rel_embedding (heads, buckets) cannot be split by heads.
  model = t5.T5(t5_config(size="tiny", num_heads=6))
  boxed6 = jax.eval_shape(lambda r: t5.init_params(model, r), jax.random.PRNGKey(0))
  partitioner = pt.PjitPartitioner(num_partitions=4)
  tx = optax.adam(1e-3)
  abstract_state = jax.eval_shape(tx.init, nn.unbox(boxed6))
  shardings = partitioner.sharding_like(abstract_state, boxed6)
  param_shardings = partitioner.sharding_for(boxed6)
  rel = ("encoder", "relpos_bias", "rel_embedding")
  query = ("encoder", "layers_0", "attention", "query", "kernel")
  assert _spec(param_shardings, *rel).spec == P(None, None)
  assert _spec(shardings[0].mu, *rel) == _spec(param_shardings, *rel)
  assert _spec(shardings[0].nu, *query).spec == P(None, "model")
  assert shardings[0].count.spec == P()
  # Every sharding is valid for its leaf: materialising the state with them works.
  state = jax.jit(tx.init, out_shardings=shardings)(
      jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), nn.unbox(boxed6)))
  assert _spec(state[0].mu, *rel).sharding == _spec(param_shardings, *rel)


def test_partition_static_args_and_lower():
  partitioner = pt.PjitPartitioner(num_partitions=2)

  def scaled_sum(x, factor):
    y = nn.with_logical_constraint(x * factor, ("batch", "mlp"))
    return y, y.sum()

  fn = partitioner.partition(scaled_sum, in_shardings=(partitioner.data_sharding(2),),
                             out_shardings=None, static_argnums=(1,))
  x = np.arange(16, dtype=np.float32).reshape(8, 2)
  y, total = fn(x, 3)
  np.testing.assert_array_equal(np.asarray(y), x * 3)
  assert float(total) == float((x * 3).sum())
  assert y.sharding.spec == P("data", "model")  # the logical constraint applied
  assert "sharding" in fn.lower(x, 2).as_text()
  # The plain context manager makes constraints apply in an ordinary jit too.
  with partitioner.context():
    y2, _ = jax.jit(scaled_sum, static_argnums=1)(x, 2)
  assert y2.sharding.spec == P("data", "model")
  y3, _ = jax.jit(scaled_sum, static_argnums=1)(x, 2)  # outside: no mesh, no constraint
  assert len(y3.sharding.device_set) == 1


def test_default_devices_place_meshes_made_without_devices():
  devices = jax.devices()[2:6]
  with pt.default_devices(devices):
    inside = pt.PjitPartitioner(num_partitions=2)  # As a gin config makes the run's.
    explicit = pt.PjitPartitioner(devices=jax.devices()[:2])
  assert list(inside.mesh.devices.flat) == devices and dict(inside.mesh.shape) == {
      "data": 2, "model": 2}
  assert list(explicit.mesh.devices.flat) == jax.devices()[:2]  # Explicit devices win.
  assert pt.PjitPartitioner().mesh.devices.size == len(jax.devices())  # Restored after.
