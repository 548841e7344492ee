"""Heads on decoder states, shared by every method that needs one.

`ScalarHead` maps each decoder state to one float: the PPO value model's per-token values and
Diamante's preference score s(c, r) (read at the response's end token) both use it.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmoral.models import param_init


class ScalarHead(nn.Module):
  """Linear map (d_model -> 1) with float32 output; kernel axes ("embed", None)."""

  @nn.compact
  def __call__(self, hidden: jax.Array) -> jax.Array:
    kernel = param_init.normal_param(self, "kernel", hidden.shape[-1] ** -0.5,
                                     (hidden.shape[-1], 1), ("embed", None))
    bias = param_init.constant_param(self, "bias", 0.0, (1,), (None,))
    return jnp.einsum("bld,dk->blk", hidden.astype(jnp.float32), kernel)[..., 0] + bias[0]


def gather_at(values: jax.Array, index: jax.Array) -> jax.Array:
  """values[b, index[b]] for (batch, length[, ...]) values; e.g. the score at the end token."""
  return jnp.take_along_axis(values, index[:, None].astype(jnp.int32), axis=1)[:, 0]


def last_token_index(mask: jax.Array) -> jax.Array:
  """Index of the last nonzero position of a (batch, length) mask (0 for an empty row)."""
  return jnp.max(jnp.where(mask > 0, jnp.arange(mask.shape[1])[None, :], 0), axis=1)
