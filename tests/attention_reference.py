"""The contract of the flash-attention kernels (`jaxmoral.backends.attention`) in plain jnp."""

from typing import Optional

import jax
import jax.numpy as jnp

from jaxmoral.backends import attention

Array = jax.Array


def reference_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                        query_segment_ids: Optional[Array] = None,
                        key_segment_ids: Optional[Array] = None, *,
                        causal: bool = False) -> Array:
  """Either kernel set's `flash_attention` in plain jnp (materialises the scores)."""
  attention.check_shapes("reference_attention", query, key, value, bias, query_segment_ids,
                         key_segment_ids)
  batch, q_len, _, _ = query.shape
  k_len = key.shape[1]
  scores = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
  if bias is not None:
    scores = scores + bias.astype(jnp.float32)
  q_ids = attention.kernel_ids(query_segment_ids, batch, q_len, q_len, -1)
  k_ids = attention.kernel_ids(key_segment_ids, batch, k_len, k_len, -2)
  mask = (q_ids[:, None, :, None] == k_ids[:, None, None, :])
  if causal:
    mask = mask & (jnp.arange(k_len)[None, :] <= jnp.arange(q_len)[:, None])
  scores = jnp.where(mask, scores, attention.MASK_VALUE)
  p = jnp.where(mask, jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True)), 0.0)
  total = jnp.sum(p, axis=-1, keepdims=True)
  weights = p / jnp.where(total > 0.0, total, 1.0)
  return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(value.dtype), value).astype(query.dtype)
