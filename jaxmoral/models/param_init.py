"""Declaring parameters: initialisation in one random draw per kind, and no re-tracing.

Flax's `init` draws each parameter with its own `jax.random` call, which XLA compiles
separately: a T5's initialiser took longer to compile than its training step. A parameter
declared with `normal_param` carries its distribution in its box (`NormalParam`), one declared
with `constant_param` its value (`ConstantParam`), and `draw` makes all of a model's parameters
from those boxes alone: one normal draw per distinct (shape, logical axes) - a handful, whatever
the depth - each block constrained to its axes so a sharded initialisation stays sharded. The
model's forward pass is not traced again to initialise it.

`param` declares every parameter; in `apply` it returns the existing value after a shape
check, where flax's `Module.param` re-traces the initializer under `jax.eval_shape` on every
access (a T5's gradient traced 1.16-1.25x slower; `bench/bench_trace.py`).
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


class ConstantParam(nn.LogicallyPartitioned):
  """A parameter that starts at `fill` everywhere (a layer norm's scale, a bias), boxed with its
  T5X logical axis names."""
  fill: float = flax.struct.field(pytree_node=False, default=0.0)


def param(module: nn.Module, name: str, init: Callable[..., Any], shape: tuple[int, ...],
          dtype: Any = jnp.float32) -> Array:
  """`module.param(name, init, shape, dtype)`, unboxed, without re-tracing `init` in `apply`.

  An existing parameter is shape-checked against the declared `shape` instead of `init`'s
  traced output; a missing one is created by flax as usual.

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


def constant_param(module: nn.Module, name: str, fill: float, shape: tuple[int, ...],
                   axes: tuple[Optional[str], ...]) -> Array:
  """A float32 parameter of `module` that starts at `fill`, with logical `axes`."""
  def init(key: Array, shape: tuple[int, ...], dtype: Any) -> ConstantParam:
    del key
    return ConstantParam(jnp.full(shape, fill, dtype), axes, fill=fill)

  return param(module, name, init, shape)


def draw(abstract_params: PyTree, rng: Array) -> Optional[dict[str, Any]]:
  """Every parameter of `abstract_params` (as `jax.eval_shape` of an init gives them), made
  from its box: the nested dict of boxed values `init` would give for the same draws, or None
  when a parameter was declared another way (its initializer is only known to `init`)."""
  flat = _boxes(abstract_params)
  if not all(isinstance(box, (NormalParam, ConstantParam)) for box in flat.values()):
    return None
  made = _drawn_normals(flat, rng)
  for path, box in flat.items():
    if isinstance(box, ConstantParam):
      value = jnp.full(box.value.shape, box.fill, box.value.dtype)
      made[path] = box.replace_boxed(nn.with_logical_constraint(value, tuple(box.names)))
  return traverse_util.unflatten_dict(made)


def draw_normals(abstract_params: PyTree, rng: Array) -> dict[str, Any]:
  """The `NormalParam`s of `abstract_params` (as `jax.eval_shape` of an init gives them),
  drawn: a nested dict holding those parameters only, boxed."""
  return traverse_util.unflatten_dict(_drawn_normals(_boxes(abstract_params), rng))


def _boxes(abstract_params: PyTree) -> dict[tuple[str, ...], Any]:
  return traverse_util.flatten_dict(
      abstract_params, is_leaf=lambda _, value: isinstance(value, nn.meta.AxisMetadata))


def _drawn_normals(flat: dict[tuple[str, ...], Any], rng: Array) -> dict[tuple[str, ...], Any]:
  """{path: drawn box} of the `NormalParam`s of `flat`, one draw per (shape, dtype, axes)."""
  groups: dict[tuple[Any, ...], list[tuple[str, ...]]] = {}
  for path, box in flat.items():
    if isinstance(box, NormalParam):
      groups.setdefault((box.value.shape, box.value.dtype, tuple(box.names)), []).append(path)
  drawn: dict[tuple[str, ...], Any] = {}
  for index, ((shape, dtype, names), paths) in enumerate(groups.items()):
    block = jax.random.normal(jax.random.fold_in(rng, index), (len(paths),) + shape, dtype)
    block = nn.with_logical_constraint(block, (None,) + names)
    for row, path in enumerate(paths):
      drawn[path] = flat[path].replace_boxed(block[row] * jnp.asarray(flat[path].stddev, dtype))
  return drawn
