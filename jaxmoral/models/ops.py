"""The hardware-specific operations of the T5 network (`models/t5.py`), behind one interface.

Every product by a weight and every fused-attention call goes through the `ModelOps` the
`T5Config` selects: dense products, and teacher-forced attention through cuDNN or the Pallas
kernels of `backends.tpu_attention` and `backends.gpu_attention` (`T5Config.attention_impl`).
A cached decoding step's are a decoding backend's `DecodeStepOps` (`T5.decode(step_ops=...)`).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Literal, Optional, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmoral.backends import cpu_products
from jaxmoral.backends import gpu_attention
from jaxmoral.backends import tpu_attention
from jaxmoral.models.config import T5Config
from jaxmoral.models.config import cudnn_supports_head_width

Array = jax.Array
NEG_INF = -1e10  # Large negative bias for masked attention (T5X uses the same order).


def matmul_last_axis(x: Array, kernel: Array, *, split_one_row: bool = True,
                     cpu_plain_weight_gradients: bool = True, **dot_kwargs: Any) -> Array:
  """(..., d) @ (d, *f) -> (..., *f), as one product over the flattened leading axes.

  As a 3-D einsum, the weight gradient contracts over batch and length, and XLA:CPU transposes
  the activation gradient before every such product (a T5 1.1 MLP's forward + backward ran at
  half this form's speed). A single row goes through `vector_matmul` unless `split_one_row` is
  False (a transposed `kernel`, whose split would be a copy); float32 rows traced for CPUs
  through `backends.cpu_products.cpu_rows_matmul` when `cpu_plain_weight_gradients`.
  """
  rows = x.reshape(-1, x.shape[-1])
  if rows.shape[0] == 1 and split_one_row:
    out = vector_matmul(rows, kernel, **dot_kwargs)
  elif (cpu_plain_weight_gradients and rows.dtype == kernel.dtype == jnp.float32
        and cpu_products.tracing_for_cpu()):
    out = cpu_products.cpu_rows_matmul(rows, kernel, dot_kwargs.get("preferred_element_type"))
  else:
    out = jnp.tensordot(rows, kernel, axes=1, **dot_kwargs)
  return out.reshape(*x.shape[:-1], *kernel.shape[1:])


def vector_matmul(row: Array, kernel: Array, **dot_kwargs: Any) -> Array:
  """(1, d) @ (d, ...) -> (1, ...) as two half-length products, summed in float32.

  A one-row product (a decoding step at batch 1) is bound by memory latency on XLA:CPU; one
  batched product over the two halves of the contracted axis keeps two streams in flight,
  which reads the kernel faster (the reshape of a row-major kernel is free).
  """
  d = row.shape[-1]
  if d % 2:
    return jnp.tensordot(row, kernel, axes=1, **dot_kwargs)
  out_dtype = dot_kwargs.pop("preferred_element_type", None) or jnp.result_type(row, kernel)
  halves = jnp.einsum("sd,sd...->s...", row.reshape(2, d // 2),
                      kernel.reshape(2, d // 2, *kernel.shape[1:]),
                      preferred_element_type=jnp.float32, **dot_kwargs)
  return (halves[0] + halves[1]).astype(out_dtype)[None]


def stacked_matmul(x: Array, stacked: Array) -> list[Array]:
  """[x @ stacked[:, i] for each i] as one product: (..., d) @ (d, n, f) -> n x (..., f).

  One wide product reads the kernels in a single pass, which made decoding's bandwidth-bound
  query/key/value (and gated MLP input) products markedly faster on CPU. Stacked on a new
  middle axis, not concatenated, a kernel sharded along `f` stays sharded the same way.
  """
  out = matmul_last_axis(x, stacked)
  return [out[..., i, :] for i in range(stacked.shape[1])]


def mask_to_bias(mask: Array) -> Array:
  """An additive float32 bias: 0 where `mask` holds, T5's large negative number elsewhere."""
  return jnp.where(mask, 0.0, NEG_INF).astype(jnp.float32)


def attention_mask(query_valid: Array, key_valid: Array,
                   query_segments: Optional[Array] = None,
                   key_segments: Optional[Array] = None) -> Array:
  """(batch, 1, q, k) bool mask: both positions valid and (if packed) in the same segment."""
  mask = query_valid[:, None, :, None].astype(bool) & key_valid[:, None, None, :].astype(bool)
  if query_segments is not None and key_segments is not None:
    mask &= query_segments[:, None, :, None] == key_segments[:, None, None, :]
  return mask


@functools.cache
def cudnn_attention_available() -> bool:
  """Whether the default backend is a CUDA GPU (where cuDNN's fused attention runs)."""
  try:
    return (jax.default_backend() == "gpu"
            and "cuda" in jax.devices()[0].client.platform_version.lower())
  except Exception:  # pylint: disable=broad-except
    return False


@flax.struct.dataclass
class FusedMask:
  """The bias and mask of fused attention, kept apart (einsum attention gets them summed).

  Attributes:
    position_bias: (1, heads, q, k) float32 relative-position bias, or None.
    mask: (batch, 1, q, k) bool, True where a query may attend to a key; None: all may.
    key_lengths: (batch,) int32: keys at positions >= length are masked (right padding).
    query_ids: (batch, q) int32 segment id of each query, 0 for padding; set (with `key_ids`,
      instead of `mask` and `key_lengths`) only for the Pallas kernels, which take masks
      factored: a query attends to the keys with its id.
    key_ids: (batch, k) int32 segment id of each key, 0 for padding.
    causal: Queries attend to keys at their own position or before.
    gpu_kernel: With segment ids, run the Triton kernels, not the TPU ones ("pallas_gpu").
  """
  position_bias: Optional[Array] = None
  mask: Optional[Array] = None
  key_lengths: Optional[Array] = None
  query_ids: Optional[Array] = None
  key_ids: Optional[Array] = None
  causal: bool = flax.struct.field(pytree_node=False, default=False)
  gpu_kernel: bool = flax.struct.field(pytree_node=False, default=False)


def fused_attention(query: Array, key: Array, value: Array, masking: FusedMask, *,
                    implementation: str = "cudnn", bias_as_diagonals: bool = False) -> Array:
  """T5 attention (no 1/sqrt(d) scale) of (batch, length, heads, d_kv) inputs in one kernel.

  With segment ids a Pallas kernel runs (float32 bias; padded queries output zeros), given the
  position bias as its diagonals when `bias_as_diagonals` (Triton only). Otherwise
  `jax.nn.dot_product_attention`'s `implementation`, with a boolean mask folded into the bias
  in float32 before the cast, so padded positions get T5's -1e10 as in the einsum path.
  """
  if masking.query_ids is not None:
    batch_axes, head_axes = typing.cast(tuple[Any, Any],
                                        nn.logical_to_mesh_axes(("batch", "heads")))
    if masking.gpu_kernel:
      bias: Optional[Array] = masking.position_bias
      diagonals: Optional[Array] = None
      if bias_as_diagonals and bias is not None:  # T5's bias depends on k - q alone.
        diagonals = gpu_attention.bias_diagonals(bias)
        bias = None
      return gpu_attention.sharded_flash_attention(
          query, key, value, bias, masking.query_ids, masking.key_ids,
          bias_diagonals=diagonals, causal=masking.causal, batch_axes=batch_axes,
          head_axes=head_axes)
    return tpu_attention.sharded_flash_attention(
        query, key, value, masking.position_bias, masking.query_ids, masking.key_ids,
        causal=masking.causal, batch_axes=batch_axes, head_axes=head_axes)
  bias = masking.position_bias
  if masking.mask is not None:
    additive = mask_to_bias(masking.mask)
    bias = additive if bias is None else bias + additive
  if bias is not None:
    bias = bias.astype(query.dtype)
  return jax.nn.dot_product_attention(
      query, key, value, bias=bias, scale=1.0, is_causal=masking.causal,
      key_value_seq_lengths=masking.key_lengths,
      implementation=typing.cast(Literal["xla", "cudnn"], implementation))


@dataclasses.dataclass(frozen=True)
class ModelOps:
  """The dense products and teacher-forced attention of one `T5Config` (its compute fields)."""
  config: T5Config

  @classmethod
  def for_config(cls, config: T5Config) -> ModelOps:
    return cls(config)

  def dense(self, x: Array, kernel: Array, *, split_one_row: bool = True,
            **dot_kwargs: Any) -> Array:
    """(..., d) @ (d, *f) -> (..., *f) (`matmul_last_axis`)."""
    return matmul_last_axis(
        x, kernel, split_one_row=split_one_row,
        cpu_plain_weight_gradients=self.config.cpu_weight_gradients == "plain", **dot_kwargs)

  def use_fused_attention(self, *, deterministic: bool, query_length: int,
                          key_length: int) -> bool:
    """Whether teacher-forced attention of this call goes through a fused kernel: always but
    for "einsum" and "auto"; "auto" on a CUDA GPU with 16-bit activations, no attention dropout,
    heads cuDNN takes and even lengths (cuDNN's bias gradient needs them)."""
    config = self.config
    if config.attention_impl in ("cudnn", "pallas", "pallas_gpu"):
      return True
    if config.attention_impl == "einsum":
      return False
    return (config.dtype != "float32" and (deterministic or config.dropout_rate == 0.0)
            and cudnn_supports_head_width(config.d_kv)
            and query_length % 2 == 0 and key_length % 2 == 0
            and cudnn_attention_available())

  def attention_masking(self, query_valid: Array, key_valid: Array,
                        query_segments: Optional[Array], key_segments: Optional[Array], *,
                        position_bias: Optional[Array] = None,
                        causal: bool = False) -> FusedMask:
    """Padding (and packing) masks for fused attention: segment ids for the Pallas kernels;
    for cuDNN per-row key lengths when the config promises right padding and the batch is
    unpacked (padded queries then attend to the valid keys, which no valid output reads),
    else the dense boolean mask."""
    config = self.config
    if config.attention_impl in ("pallas", "pallas_gpu"):
      def ids(valid: Array, segments: Optional[Array]) -> Array:
        return jnp.where(valid.astype(bool), 1 if segments is None else segments, 0).astype(
            jnp.int32)
      return FusedMask(position_bias=position_bias, causal=causal,
                       query_ids=ids(query_valid, query_segments),
                       key_ids=ids(key_valid, key_segments),
                       gpu_kernel=config.attention_impl == "pallas_gpu")
    if config.right_padded_inputs and query_segments is None and key_segments is None:
      return FusedMask(position_bias=position_bias,
                       key_lengths=jnp.sum(key_valid, axis=-1, dtype=jnp.int32))
    return FusedMask(position_bias=position_bias, mask=attention_mask(
        query_valid, key_valid, query_segments, key_segments))

  def fused_attention(self, query: Array, key: Array, value: Array,
                      masking: FusedMask) -> Array:
    """`fused_attention` with this config's kernel choices."""
    return fused_attention(query, key, value, masking,
                           implementation=self.config.fused_attention_backend,
                           bias_as_diagonals=self.config.gpu_bias_as_diagonals)


class DecodeStepOps:
  """How a cached decoding step multiplies by its weights and attends (XLA by default).

  `jaxmoral.decoding` passes its backend's ops to every decoder step it traces; training and
  teacher forcing never see them. Keys are the calling module's path and the names of the
  kernels it multiplies by, e.g. (("decoder", "layers_0", "self_attention"), ("query", "key",
  "value")).
  """

  def products(self, path: tuple[str, ...], names: tuple[str, ...], x: Array,
               kernels: Sequence[Array], *, preferred_element_type: Any = None
               ) -> list[Array]:
    """[x @ k for k in kernels] (..., d) -> (..., f_i), as one product when there are several
    (one pass over the weights, which bounds a decoding step)."""
    del path, names
    if len(kernels) == 1:
      return [matmul_last_axis(x, kernels[0], preferred_element_type=preferred_element_type)]
    return stacked_matmul(x, jnp.stack(list(kernels), axis=1))

  def attention(self, path: tuple[str, ...], query: Array, key: Array, value: Array,
                bias: Array) -> Optional[Array]:
    """A step's attention, (G*R, H, D) queries against (R, H, L, D) keys/values and a bias
    broadcastable to (R, H, L); None: the model's own einsum attention."""
    del path, query, key, value, bias
    return None
