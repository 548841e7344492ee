"""Declaring parameters: initialisation in one random draw per kind, and no re-tracing.

Flax's `init` draws each parameter with its own `jax.random` call; XLA compiles every such
call separately, so a T5's initialiser took longer to compile than its training step (and a
GPU runs one kernel per parameter). A parameter declared with `normal_param` carries its
distribution in its box (`NormalParam`); `init_params` draws all of a model's normal
parameters in one call per distinct (shape, logical axes) - a T5 has a handful, whatever its
depth - each block constrained to its axes so a sharded initialisation stays sharded, and
lets the module create the others (ones, zeros) itself.

Every parameter is declared through `param`, which in `apply` returns the existing value after
checking its shape. Flax's `Module.param` re-traces the initializer under `jax.eval_shape`
for that check on every access: a T5's gradient traced 1.16-1.25x slower with it
(`bench/bench_trace.py`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, cast

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import errors as flax_errors
from flax import traverse_util

Array = jax.Array
PyTree = Any


class NormalParam(nn.LogicallyPartitioned):
  """A parameter drawn from N(0, stddev^2), boxed with its T5X logical axis names."""
  stddev: float = flax.struct.field(pytree_node=False, default=1.0)


def param(module: nn.Module, name: str, init: Callable[..., Any], shape: tuple[int, ...],
          dtype: Any = jnp.float32) -> Array:
  """`module.param(name, init, shape, dtype)`, unboxed, without re-tracing `init` in `apply`.

  An existing parameter (`apply`, or an init that is given some parameters) is returned
  after the shape check flax makes, on the declared `shape` instead of on `init`'s traced
  output; a missing one is created by flax as usual (name checks included).

  Raises:
    flax.errors.ScopeParamShapeError: The existing value's shape is not `shape`.
  """
  if module.has_variable("params", name):
    value = nn.meta.unbox(module.get_variable("params", name))
    if tuple(np.shape(value)) != tuple(shape):
      assert module.scope is not None  # A bound module (it has variables).
      raise flax_errors.ScopeParamShapeError(name, module.scope.path_text, np.shape(value),
                                             tuple(shape))
    return cast(Array, value)
  # `param` returns the unboxed value; flax's annotation gives the box's type.
  return cast(Array, module.param(name, init, shape, dtype))


def normal_param(module: nn.Module, name: str, stddev: float, shape: tuple[int, ...],
                 axes: tuple[Optional[str], ...]) -> Array:
  """A float32 parameter of `module` drawn from N(0, stddev^2), with logical `axes`."""
  def init(key: Array, shape: tuple[int, ...], dtype: Any) -> NormalParam:
    return NormalParam(nn.initializers.normal(stddev=stddev)(key, shape, dtype), axes,
                       stddev=stddev)

  return param(module, name, init, shape)


def _is_box(_: Any, value: Any) -> bool:
  return isinstance(value, nn.meta.AxisMetadata)


def draw_normals(abstract_params: PyTree, rng: Array) -> dict[str, Any]:
  """The `NormalParam`s of `abstract_params` (as `jax.eval_shape` of an init gives them),
  drawn: a nested dict holding those parameters only, boxed."""
  flat = traverse_util.flatten_dict(abstract_params, is_leaf=_is_box)
  groups: dict[tuple[Any, ...], list[tuple[str, ...]]] = {}
  for path, box in flat.items():
    if isinstance(box, NormalParam):
      groups.setdefault((box.value.shape, box.value.dtype, tuple(box.names)), []).append(path)
  drawn: dict[tuple[str, ...], Any] = {}
  for index, ((shape, dtype, names), paths) in enumerate(groups.items()):
    block = jax.random.normal(jax.random.fold_in(rng, index), (len(paths),) + shape, dtype)
    block = nn.with_logical_constraint(block, (None,) + names)
    for row, path in enumerate(paths):
      box = flat[path]
      drawn[path] = box.replace_boxed(block[row] * jnp.asarray(box.stddev, dtype))
  return traverse_util.unflatten_dict(drawn)


def init_params(abstract_params: PyTree, init_missing: Callable[[PyTree, Array], PyTree],
                rng: Array) -> PyTree:
  """Boxed parameters: the `NormalParam`s drawn together (`draw_normals`), the rest made by
  the module.

  Args:
    abstract_params: The module's boxed params as `jax.eval_shape` of its init gives them.
    init_missing: (params holding the drawn ones, rng) -> all params: the module applied with
      a mutable "params" collection, so it creates only those it is not given.
    rng: The key every draw derives from.
  """
  return init_missing(draw_normals(abstract_params, rng), rng)
