"""Adafactor applied to groups of same-shaped parameters at once (same updates as optax's).

`optax.adafactor` maps its update over the leaves: on a GPU each of a T5's ~580 leaves becomes
its own kernels, a visible share of a train step. A T5 has few distinct shapes, so this stacks
each (shape, dtype) group and reduces over the stack with per-leaf axes kept apart. The state
holds one stacked array per group and statistic, not shaped like parameters (the trainer
replicates it; it is small).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

Schedule = Callable[[jax.Array], jax.Array]


class GroupedAdafactorState(NamedTuple):
  """The updates applied so far (`count`, int32) and each group's stacked statistics.

  Attributes:
    stats: One dict per (shape, dtype) group in tree order: `v_row` / `v_col` (factored) or `v`
      (unfactored), each with the group size as leading axis; plus `momentum` when it is on.
  """
  count: jax.Array  # type: ignore[assignment]  # Shadows tuple.count, as optax's states do.
  stats: tuple[dict[str, jax.Array], ...]


def group_by_shape(leaves: list[Any]) -> list[list[int]]:
  """Leaf indices grouped by (shape, dtype), groups in order of first appearance."""
  by_key: dict[tuple, list[int]] = {}
  for index, leaf in enumerate(leaves):
    by_key.setdefault((tuple(leaf.shape), jnp.dtype(leaf.dtype)), []).append(index)
  return list(by_key.values())


def _block_mean(x: jax.Array) -> jax.Array:
  """Mean over every axis but the leading (group) one, kept as broadcastable dims."""
  return jnp.mean(x, axis=tuple(range(1, x.ndim)), keepdims=True)


def grouped_adafactor(learning_rate: Union[float, Schedule], *,
                      min_dim_size_to_factor: int = 128, decay_rate: float = 0.8,
                      clipping_threshold: Optional[float] = 1.0,
                      multiply_by_parameter_scale: bool = True,
                      momentum: Optional[float] = None, factored: bool = True,
                      weight_decay_rate: Optional[float] = None, epsilon: float = 1e-30,
                      min_parameter_scale: float = 1e-3) -> optax.GradientTransformation:
  """Adafactor as `optax.adafactor` computes it, one group of same-shaped leaves at a time (its
  `update` needs `params`).

  Args:
    min_dim_size_to_factor: Factor a leaf's second moments only if its two largest axes are
      both at least this long.
    clipping_threshold: Clip each leaf's update to this RMS (None: no clipping).
    multiply_by_parameter_scale: Scale each leaf's update by max(RMS(param),
      `min_parameter_scale`).
    momentum: EMA coefficient of the updates (None: no momentum, as in T5X).
    weight_decay_rate: Decoupled weight decay added before the sign flip (None: none).
    decay_rate, factored, epsilon: As `optax.adafactor` takes them.
  """

  def group_dims(shape: tuple[int, ...]) -> Optional[tuple[int, int]]:
    """(second-largest, largest) axis of a leaf whose statistics are factored, else None."""
    order = np.argsort(shape)
    if not factored or len(shape) < 2 or shape[order[-2]] < min_dim_size_to_factor:
      return None
    return int(order[-2]), int(order[-1])

  def init_fn(params: Any) -> GroupedAdafactorState:
    leaves = jax.tree_util.tree_leaves(params)
    stats = []
    for group in group_by_shape(leaves):
      shape, dtype, size = tuple(leaves[group[0]].shape), leaves[group[0]].dtype, len(group)
      dims = group_dims(shape)
      if dims is None:
        entry = {"v": jnp.zeros((size, *shape), dtype)}
      else:
        d1, d0 = dims
        entry = {"v_row": jnp.zeros((size, *np.delete(shape, d0)), dtype),
                 "v_col": jnp.zeros((size, *np.delete(shape, d1)), dtype)}
      if momentum is not None:
        entry["momentum"] = jnp.zeros((size, *shape), dtype)
      stats.append(entry)
    return GroupedAdafactorState(count=jnp.zeros([], jnp.int32), stats=tuple(stats))

  def update_fn(grads: Any, state: GroupedAdafactorState,
                params: Optional[Any] = None) -> tuple[Any, GroupedAdafactorState]:
    if params is None:
      raise ValueError("grouped_adafactor: update needs params (parameter scale, decay)")
    grad_leaves, treedef = jax.tree_util.tree_flatten(grads)
    param_leaves = jax.tree_util.tree_leaves(params)
    groups = group_by_shape(grad_leaves)
    if len(groups) != len(state.stats):
      raise ValueError(f"grouped_adafactor: {len(groups)} shape groups in the gradients, "
                       f"{len(state.stats)} in the state (built for another tree?)")
    step = state.count
    decay = 1.0 - jnp.asarray(step + 1, jnp.float32) ** (-decay_rate)
    lr = learning_rate(step) if callable(learning_rate) else learning_rate
    out: list[Any] = [None] * len(grad_leaves)
    new_stats = []
    for group, stats in zip(groups, state.stats, strict=True):
      shape, dtype = tuple(grad_leaves[group[0]].shape), grad_leaves[group[0]].dtype
      g = jnp.stack([grad_leaves[i] for i in group])
      p = jnp.stack([param_leaves[i] for i in group])
      grad_sqr = jnp.square(g) + epsilon
      dims = group_dims(shape)
      if dims is None:
        entry = {"v": (decay * stats["v"] + (1.0 - decay) * grad_sqr).astype(dtype)}
        update = g * entry["v"] ** -0.5
      else:
        d1, d0 = dims[0] + 1, dims[1] + 1  # +1: axis 0 is the group.
        v_row = (decay * stats["v_row"] + (1.0 - decay) * jnp.mean(grad_sqr, axis=d0)
                 ).astype(dtype)
        v_col = (decay * stats["v_col"] + (1.0 - decay) * jnp.mean(grad_sqr, axis=d1)
                 ).astype(dtype)
        entry = {"v_row": v_row, "v_col": v_col}
        reduced_d1 = d1 - 1 if d1 > d0 else d1
        row_factor = (v_row / jnp.mean(v_row, axis=reduced_d1, keepdims=True)) ** -0.5
        col_factor = v_col ** -0.5
        update = (g * jnp.expand_dims(row_factor, axis=d0)
                  * jnp.expand_dims(col_factor, axis=d1))
      if clipping_threshold is not None:
        update = update / jnp.maximum(
            1.0, jnp.sqrt(_block_mean(jnp.square(update))) / clipping_threshold)
      update = update * lr
      if multiply_by_parameter_scale:
        update = update * jnp.maximum(jnp.sqrt(_block_mean(jnp.square(p))),
                                      min_parameter_scale)
      if momentum is not None:
        update = (1.0 - momentum) * update + momentum * stats["momentum"]
        entry["momentum"] = update.astype(dtype)
      if weight_decay_rate is not None:
        update = update + weight_decay_rate * p
      update = (-update).astype(dtype)
      for position, index in enumerate(group):
        out[index] = update[position]
      new_stats.append(entry)
    return (jax.tree_util.tree_unflatten(treedef, out),
            GroupedAdafactorState(count=optax.safe_increment(state.count),
                                  stats=tuple(new_stats)))

  return optax.GradientTransformation(init_fn, update_fn)
