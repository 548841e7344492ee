"""models.param_init: grouped normal draws give a model's parameters their declared
distributions, the structure `model.init` gives, and a few random draws in all."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoral.models import config as config_lib
from jaxmoral.models import param_init
from jaxmoral.models import t5


def _model() -> t5.T5:
  return t5.T5(config_lib.t5_config(size="tiny"), with_scalar_head=True)


def test_parameters_have_their_declared_distribution_and_model_inits_structure():
  model = _model()
  params = jax.jit(lambda r: t5.init_params(model, r))(jax.random.PRNGKey(0))
  reference = jax.eval_shape(lambda r: t5.init_params(model, r), jax.random.PRNGKey(0))
  direct = jax.eval_shape(
      lambda r: model.init({"params": r, "dropout": r}, np.ones((1, 8), np.int32),
                           np.ones((1, 8), np.int32))["params"], jax.random.PRNGKey(0))
  assert jax.tree.structure(params) == jax.tree.structure(direct) == jax.tree.structure(reference)
  flat = jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))[0]
  normals = 0
  seen = []
  for path, box in flat:
    value = np.asarray(box.value)
    name = jax.tree_util.keystr(path)
    if isinstance(box, param_init.NormalParam):
      normals += 1
      # Standard error of a sample std over n >= 64 values is under 10 %; 35 % bounds it.
      assert abs(value.std() / box.stddev - 1) < 0.35, name
      assert abs(value.mean()) < 0.5 * box.stddev, name
      assert not any(value.shape == other.shape and np.allclose(value, other) for other in seen), (
          f"{name} repeats another parameter's draw")
      seen.append(value)
    elif name.endswith("['scale']"):
      np.testing.assert_array_equal(value, 1.0)
    else:
      np.testing.assert_array_equal(value, 0.0)  # the scalar head's bias
  assert normals > 20


def test_one_random_draw_per_shape_and_axes():
  model = _model()
  jaxpr = jax.make_jaxpr(lambda r: t5.init_params(model, r))(jax.random.PRNGKey(0))
  text = str(jaxpr)
  draws = text.count("random_bits") + text.count("threefry2x32")
  abstract = jax.eval_shape(lambda r: t5.init_params(model, r), jax.random.PRNGKey(0))
  groups = {(box.value.shape, tuple(box.names)) for box in jax.tree.leaves(
      abstract, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
            if isinstance(box, param_init.NormalParam)}
  normals = sum(isinstance(box, param_init.NormalParam) for box in jax.tree.leaves(
      abstract, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)))
  assert 0 < draws <= len(groups) < normals


_INIT_CALLS: list = []


class _Declares(nn.Module):
  """One parameter of a given shape, declared through `param_init.param` with an initializer
  that counts its calls (traced or not)."""
  width: int

  @nn.compact
  def __call__(self, x):
    def init(key, shape, dtype):
      _INIT_CALLS.append(shape)
      return jax.random.normal(key, shape, dtype)
    return x @ param_init.param(self, "kernel", init, (x.shape[-1], self.width))


def test_apply_reads_parameters_without_calling_their_initializer_and_checks_shapes():
  _INIT_CALLS.clear()
  x = jnp.ones((2, 3))
  params = _Declares(width=4).init(jax.random.PRNGKey(0), x)
  assert _INIT_CALLS == [(3, 4)]  # Created once, by init.
  out = jax.jit(lambda p: _Declares(width=4).apply(p, x))(params)
  np.testing.assert_allclose(out, x @ params["params"]["kernel"], rtol=1e-6)
  assert _INIT_CALLS == [(3, 4)]  # flax's own `param` would trace the initializer again here.
  with pytest.raises(flax.errors.ScopeParamShapeError,
                     match=r"kernel.*shape \(3, 5\).*shape \(3, 4\)"):
    _Declares(width=5).apply(params, x)


@pytest.mark.parametrize("prompted", [False, True])
def test_init_builds_every_parameter_from_its_box_without_the_forward_pass(prompted):
  """The initialiser holds no matrix product (the model is not applied again to make the
  layer norms' ones, the head's bias, the prompt's zeros), and its values are those the
  forward pass would have filled in around the same normal draws."""
  from jaxmoral import prompt_tuning  # pylint: disable=import-outside-toplevel
  config = config_lib.t5_config(size="tiny")
  model = (prompt_tuning.PromptedT5(config, prompt_length=3) if prompted
           else t5.T5(config, with_scalar_head=True))
  rng = jax.random.PRNGKey(1)
  assert "dot_general" not in str(jax.make_jaxpr(lambda r: t5.init_params(model, r))(rng))
  params = jax.jit(lambda r: t5.init_params(model, r))(rng)
  abstract = jax.eval_shape(
      lambda r: model.init({"params": r, "dropout": r}, np.ones((1, 8), np.int32),
                           np.ones((1, 8), np.int32))["params"], rng)
  tokens = jnp.ones((1, 8), jnp.int32)
  _, applied = model.apply({"params": param_init.draw_normals(abstract, rng)}, tokens, tokens,
                           mutable=["params"], rngs={"params": rng, "dropout": rng})
  unboxed = nn.meta.unbox(params)
  assert jax.tree.structure(unboxed) == jax.tree.structure(nn.meta.unbox(applied["params"]))
  jax.tree.map(np.testing.assert_array_equal, unboxed, nn.meta.unbox(applied["params"]))


def test_a_parameter_declared_another_way_is_made_by_its_own_initializer():
  """`draw` cannot make what only flax's `init` knows; `init_params` then applies the module."""
  x = jnp.ones((2, 3))
  abstract = jax.eval_shape(lambda r: _Declares(width=4).init(r, x)["params"],
                            jax.random.PRNGKey(0))
  assert param_init.draw(abstract, jax.random.PRNGKey(0)) is None
