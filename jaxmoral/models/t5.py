"""Flax linen T5 encoder-decoder (T5 1.0 and T5 1.1 / Flan-T5), T5X parameter names and axes.

Parameter tree (T5X names, so T5X checkpoints and rules apply unchanged)::

  token_embedder/embedding                       (vocab, embed)
  encoder/relpos_bias/rel_embedding              (heads, relpos_buckets)
  encoder/layers_{i}/pre_attention_layer_norm/scale
  encoder/layers_{i}/attention/{query,key,value}/kernel   (embed, joined_kv)
  encoder/layers_{i}/attention/out/kernel        (joined_kv, embed)
  encoder/layers_{i}/pre_mlp_layer_norm/scale
  encoder/layers_{i}/mlp/{wi | wi_0, wi_1}/kernel (embed, mlp); mlp/wo/kernel (mlp, embed)
  encoder/encoder_norm/scale
  decoder/relpos_bias/rel_embedding
  decoder/layers_{i}/{pre_self_attention_layer_norm, self_attention,
                      pre_cross_attention_layer_norm, encoder_decoder_attention,
                      pre_mlp_layer_norm, mlp}
  decoder/decoder_norm/scale
  decoder/logits_dense/kernel                    (embed, vocab)   untied variants only
  scalar_head/kernel, scalar_head/bias           only with `with_scalar_head=True`

Callers reach `T5`'s methods through `model.apply(..., method=...)`; products by weights and
fused attention are `ops.py`'s.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import validation
from jaxmoral.models import heads
from jaxmoral.models import ops as ops_lib
from jaxmoral.models import param_init
from jaxmoral.models.config import T5Config
from jaxmoral.models.ops import DecodeStepOps
from jaxmoral.models.ops import FusedMask
from jaxmoral.models.ops import ModelOps

Array = jax.Array


def _dtype(config: T5Config) -> Any:
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[config.dtype]


def _constrain(x: Array, axes: tuple[Optional[str], ...]) -> Array:
  return nn.with_logical_constraint(x, axes)


@functools.lru_cache(maxsize=64)
def relative_position_bucket_table(max_distance_span: int, bidirectional: bool,
                                   num_buckets: int, max_distance: int) -> np.ndarray:
  """Bucket of every relative position in [-span, span] (index `relative_position + span`).

  Mesh TensorFlow's / HF `T5Attention`'s formula, computed once in NumPy: exact buckets for
  small distances, logarithmic ones up to `max_distance`.
  """
  relative_position = np.arange(-max_distance_span, max_distance_span + 1, dtype=np.int64)
  buckets = np.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    buckets += (relative_position > 0).astype(np.int64) * num_buckets
    distance = np.abs(relative_position)
  else:
    distance = -np.minimum(relative_position, 0)
  max_exact = num_buckets // 2
  is_small = distance < max_exact
  with np.errstate(divide="ignore"):
    scaled = (np.log(np.maximum(distance, 1).astype(np.float32) / np.float32(max_exact))
              / np.float32(np.log(max_distance / max_exact)) * (num_buckets - max_exact))
  if_large = np.minimum(max_exact + scaled.astype(np.int64), num_buckets - 1)
  buckets += np.where(is_small, distance, if_large)
  return buckets.astype(np.int32)


class RMSNorm(nn.Module):
  """T5 layer norm: scale only, no mean subtraction, statistics in float32."""
  epsilon: float
  dtype: Any

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = param_init.constant_param(self, "scale", 1.0, (x.shape[-1],), ("embed",))
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return (x32 * scale).astype(self.dtype)


class DenseKernel(nn.Module):
  """A bias-free dense layer `x @ kernel` with logical axes on the kernel."""
  features: int
  axes: tuple[Optional[str], Optional[str]]
  init_scale: float
  dtype: Any
  ops: ModelOps

  @nn.compact
  def kernel(self, in_features: int) -> Array:
    """The (in_features, features) kernel in the compute dtype (created on first use)."""
    return param_init.normal_param(self, "kernel", self.init_scale,
                                   (in_features, self.features), self.axes).astype(self.dtype)

  def __call__(self, x: Array, *, step_ops: Optional[DecodeStepOps] = None,
               preferred_element_type: Any = None) -> Array:
    """`x @ kernel` in the compute dtype (or `preferred_element_type`); in a cached decoding
    step (`step_ops`), the step's product."""
    kernel = self.kernel(x.shape[-1])
    if step_ops is not None:
      out = step_ops.products(self.path, ("kernel",), x, [kernel],
                              preferred_element_type=preferred_element_type)[0]
      return out.astype(preferred_element_type or self.dtype)
    return self.ops.dense(x, kernel, preferred_element_type=preferred_element_type)


class Embed(nn.Module):
  """Token embedding; `attend` is the tied logits projection of T5 1.0."""
  num_embeddings: int
  features: int
  dtype: Any
  ops: ModelOps

  def setup(self):
    self.embedding = param_init.normal_param(
        self, "embedding", 1.0, (self.num_embeddings, self.features), ("vocab", "embed"))

  def __call__(self, tokens: Array) -> Array:
    out = jnp.take(self.embedding.astype(self.dtype), tokens, axis=0)
    return _constrain(out, ("batch", "length", "embed"))

  def attend(self, x: Array, *, step_ops: Optional[DecodeStepOps] = None) -> Array:
    if step_ops is not None:
      return step_ops.products(self.path, ("attend",), x, [self.embedding.astype(x.dtype).T],
                               preferred_element_type=jnp.float32)[0]
    return self.ops.dense(x, self.embedding.astype(x.dtype).T, split_one_row=False,
                          preferred_element_type=jnp.float32)


class RelativePositionBias(nn.Module):
  """Learned per-head bias of the bucketed distance between query and key positions."""
  config: T5Config
  bidirectional: bool

  @nn.compact
  def __call__(self, query_positions: Array, key_positions: Array, span: int) -> Array:
    """Returns a (1, heads, q, k) float32 bias; `span` bounds |q - k| (static)."""
    num_buckets = self.config.relative_attention_num_buckets
    table = jnp.asarray(relative_position_bucket_table(
        span, self.bidirectional, num_buckets, self.config.relative_attention_max_distance))
    buckets = table[key_positions[None, :] - query_positions[:, None] + span]
    embedding = param_init.normal_param(self, "rel_embedding", 1.0,
                                        (self.config.num_heads, num_buckets),
                                        ("heads", "relpos_buckets"))
    return jnp.take(embedding, buckets, axis=1)[None]


class MultiHeadAttention(nn.Module):
  """T5 attention: no 1/sqrt(d) scaling (folded into the query init), optional KV cache.

  In decode mode self-attention keeps `cached_key`/`cached_value` (batch, heads,
  max_decode_length, d_kv), one position written per step; cross-attention projects the
  encoder outputs once, in `init_cache`, one row per input, which G query rows per input
  (samples or beams, `T5.init_cache(rows_per_input=G)`) read in groups. Heads come before
  positions because the per-step batched dots read that layout (a heads-last cache made
  XLA:CPU transpose every cache on every step).
  """
  config: T5Config
  deterministic: bool = True

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Optional[Array], bias: Array | FusedMask, *,
               decode: bool = False, init_cache: bool = False, is_cross: bool = False,
               decode_position: Optional[Array] = None,
               max_decode_length: Optional[int] = None,
               step_ops: Optional[DecodeStepOps] = None) -> Array:
    """Attention of `inputs_q` to `inputs_kv` (or to the cache); `step_ops`: given exactly in
    cached decoding steps (`Decoder` sees to it)."""
    cfg = self.config
    ops = ModelOps.for_config(cfg)
    dtype = _dtype(cfg)
    heads, d_kv, d_model = cfg.num_heads, cfg.d_kv, cfg.d_model
    joined = heads * d_kv
    dense = functools.partial(DenseKernel, features=joined, axes=("embed", "joined_kv"),
                              dtype=dtype, ops=ops)
    query_proj = dense(init_scale=(d_model * d_kv) ** -0.5, name="query")
    key_proj = dense(init_scale=d_model ** -0.5, name="key")
    value_proj = dense(init_scale=d_model ** -0.5, name="value")
    out_proj = DenseKernel(features=d_model, axes=("joined_kv", "embed"),
                           init_scale=joined ** -0.5, dtype=dtype, ops=ops, name="out")
    batch = inputs_q.shape[0]

    def split(x: Array) -> Array:  # (b, l, h * d) -> (b, l, h, d)
      return _constrain(x.reshape(x.shape[:-1] + (heads, d_kv)),
                        ("batch", "length", "heads", "kv"))

    def heads_first(x: Array) -> Array:  # (b, l, h * d) -> (b, h, l, d)
      return _constrain(jnp.swapaxes(split(x), 1, 2), ("batch", "heads", "length", "kv"))

    if isinstance(bias, FusedMask):
      # Teacher forcing only (Decoder builds no FusedMask to decode); the caller gives `encoded`.
      assert not decode and inputs_kv is not None
      out = ops.fused_attention(split(query_proj(inputs_q)), split(key_proj(inputs_kv)),
                                split(value_proj(inputs_kv)), bias)
      out = out.reshape(out.shape[0], out.shape[1], joined)
      return _constrain(out_proj(out), ("batch", "length", "embed"))
    # A decoding step projects query, key and value with one product (ops.stacked_matmul);
    # training keeps three (the split product's backward pass was slower).
    if step_ops is not None and not is_cross:
      query, own_key, own_value = [p.astype(dtype) for p in step_ops.products(
          self.path, ("query", "key", "value"), inputs_q,
          [proj.kernel(d_model) for proj in (query_proj, key_proj, value_proj)])]
    else:
      query = query_proj(inputs_q, step_ops=step_ops)
    query = heads_first(query)
    if decode and is_cross:
      if init_cache:
        assert inputs_kv is not None  # T5.init_cache passes the encoder outputs.
        self.put_variable("cache", "cached_key", heads_first(key_proj(inputs_kv)))
        self.put_variable("cache", "cached_value", heads_first(value_proj(inputs_kv)))
      key: Array = self.get_variable("cache", "cached_key")
      value: Array = self.get_variable("cache", "cached_value")
    elif decode:
      shape = (batch, heads, max_decode_length, d_kv)
      cached_key = self.variable("cache", "cached_key", jnp.zeros, shape, dtype)
      cached_value = self.variable("cache", "cached_value", jnp.zeros, shape, dtype)
      if init_cache:
        return jnp.zeros(inputs_q.shape[:-1] + (d_model,), dtype)
      assert decode_position is not None  # Decoder passes it in decode mode.
      # A self-attention step: own_key and own_value were projected above.
      for cached, step in ((cached_key, own_key), (cached_value, own_value)):
        cached.value = jax.lax.dynamic_update_slice(cached.value, heads_first(step),
                                                    (0, 0, decode_position, 0))
      key, value = cached_key.value, cached_value.value
    else:
      assert inputs_kv is not None
      key = heads_first(key_proj(inputs_kv))
      value = heads_first(value_proj(inputs_kv))

    group = batch // key.shape[0]  # Query rows per key row: > 1 for samples of one input.
    if group * key.shape[0] != batch:
      raise ValueError(f"MultiHeadAttention: {batch} query rows do not come in groups over "
                       f"{key.shape[0]} key/value rows")
    step_out = (step_ops.attention(self.path, query[:, :, 0], key, value, bias[:, :, 0])
                if step_ops is not None else None)
    if step_out is not None:  # The backend's attention of the step's one query per row/head.
      out = step_out[:, :, None].astype(dtype)
    elif group > 1:
      # Each group of query rows attends to its input's keys once, rather than to G copies.
      grouped = query.reshape((key.shape[0], group) + query.shape[1:])
      scores = jnp.einsum("bghqd,bhkd->bghqk", grouped, key,
                          preferred_element_type=jnp.float32) + bias[:, None]
      weights = jax.nn.softmax(scores, axis=-1)
      out = jnp.einsum("bghqk,bhkd->bghqd", weights.astype(dtype), value)
      out = out.reshape(query.shape)
    else:
      scores = jnp.einsum("bhqd,bhkd->bhqk", query, key,
                          preferred_element_type=jnp.float32) + bias
      weights = jax.nn.softmax(scores, axis=-1)
      if cfg.dropout_rate > 0 and not self.deterministic:
        keep = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - cfg.dropout_rate,
                                    weights.shape)
        weights = weights * keep / (1.0 - cfg.dropout_rate)
      out = jnp.einsum("bhqk,bhkd->bhqd", weights.astype(dtype), value)
    out = jnp.swapaxes(out, 1, 2).reshape(out.shape[0], out.shape[2], joined)
    return _constrain(out_proj(out, step_ops=step_ops), ("batch", "length", "embed"))


class MlpBlock(nn.Module):
  """ReLU MLP (T5 1.0) or gated MLP (T5 1.1: gelu(x wi_0) * (x wi_1)); a cached decoding
  step multiplies by the two gated inputs in one `step_ops` product."""
  config: T5Config
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: Array, *, step_ops: Optional[DecodeStepOps] = None) -> Array:
    cfg = self.config
    ops = ModelOps.for_config(cfg)
    dtype = _dtype(cfg)
    activations: dict[str, Callable[[Array], Array]] = {
        "relu": jax.nn.relu, "gelu": functools.partial(jax.nn.gelu, approximate=True),
        "silu": jax.nn.silu}
    act = activations[cfg.feed_forward_proj.split("-")[-1]]
    dense = functools.partial(DenseKernel, features=cfg.d_ff, axes=("embed", "mlp"),
                              init_scale=cfg.d_model ** -0.5, dtype=dtype, ops=ops)
    if cfg.is_gated and step_ops is not None:
      gate, linear = [p.astype(dtype) for p in step_ops.products(
          self.path, ("wi_0", "wi_1"), x,
          [dense(name=name).kernel(x.shape[-1]) for name in ("wi_0", "wi_1")])]
      hidden = act(gate) * linear
    elif cfg.is_gated:
      hidden = act(dense(name="wi_0")(x)) * dense(name="wi_1")(x)
    else:
      hidden = act(dense(name="wi")(x, step_ops=step_ops))
    hidden = _constrain(hidden, ("batch", "length", "mlp"))
    hidden = _dropout(hidden, cfg.dropout_rate, self.deterministic)
    out = DenseKernel(features=cfg.d_model, axes=("mlp", "embed"), init_scale=cfg.d_ff ** -0.5,
                      dtype=dtype, ops=ops, name="wo")(hidden, step_ops=step_ops)
    return _constrain(out, ("batch", "length", "embed"))


def _dropout(x: Array, rate: float, deterministic: bool) -> Array:
  """Dropout in the calling module's compact method; none when inactive."""
  if rate == 0.0 or deterministic:
    return x
  return nn.Dropout(rate=rate, deterministic=False)(x)


class EncoderLayer(nn.Module):
  config: T5Config
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: Array, bias: Array | FusedMask) -> Array:
    cfg = self.config
    norm = functools.partial(RMSNorm, epsilon=cfg.layer_norm_epsilon, dtype=_dtype(cfg))
    h = norm(name="pre_attention_layer_norm")(x)
    h = MultiHeadAttention(cfg, self.deterministic, name="attention")(h, h, bias)
    x = x + _dropout(h, cfg.dropout_rate, self.deterministic)
    h = norm(name="pre_mlp_layer_norm")(x)
    h = MlpBlock(cfg, self.deterministic, name="mlp")(h)
    x = x + _dropout(h, cfg.dropout_rate, self.deterministic)
    return _constrain(x, ("batch", "length", "embed"))


class DecoderLayer(nn.Module):
  config: T5Config
  deterministic: bool = True
  decode: bool = False
  init_cache: bool = False
  max_decode_length: Optional[int] = None

  @nn.compact
  def __call__(self, x: Array, encoded: Optional[Array], self_bias: Array | FusedMask,
               cross_bias: Array | FusedMask, decode_position: Optional[Array], *,
               step_ops: Optional[DecodeStepOps] = None) -> Array:
    cfg = self.config
    norm = functools.partial(RMSNorm, epsilon=cfg.layer_norm_epsilon, dtype=_dtype(cfg))
    cache_args: dict[str, Any] = dict(
        decode=self.decode, init_cache=self.init_cache, decode_position=decode_position,
        max_decode_length=self.max_decode_length, step_ops=step_ops)
    h = norm(name="pre_self_attention_layer_norm")(x)
    h = MultiHeadAttention(cfg, self.deterministic, name="self_attention")(
        h, h, self_bias, **cache_args)
    x = x + _dropout(h, cfg.dropout_rate, self.deterministic)
    h = norm(name="pre_cross_attention_layer_norm")(x)
    h = MultiHeadAttention(cfg, self.deterministic, name="encoder_decoder_attention")(
        h, encoded, cross_bias, is_cross=True, **cache_args)
    x = x + _dropout(h, cfg.dropout_rate, self.deterministic)
    h = norm(name="pre_mlp_layer_norm")(x)
    h = MlpBlock(cfg, self.deterministic, name="mlp")(h, step_ops=step_ops)
    x = x + _dropout(h, cfg.dropout_rate, self.deterministic)
    return _constrain(x, ("batch", "length", "embed"))


class Encoder(nn.Module):
  config: T5Config

  @nn.compact
  def __call__(self, embeds: Array, mask: Array, segment_ids: Optional[Array] = None, *,
               deterministic: bool = True) -> Array:
    cfg = self.config
    ops = ModelOps.for_config(cfg)
    length = embeds.shape[1]
    positions = jnp.arange(length)
    relpos = RelativePositionBias(cfg, bidirectional=True, name="relpos_bias")
    position_bias = relpos(positions, positions, span=length)
    if ops.use_fused_attention(deterministic=deterministic, query_length=length,
                               key_length=length):
      bias = ops.attention_masking(mask, mask, segment_ids, segment_ids,
                                   position_bias=position_bias)
    else:
      bias = position_bias + ops_lib.mask_to_bias(
          ops_lib.attention_mask(mask, mask, segment_ids, segment_ids))
    x = _dropout(embeds, cfg.dropout_rate, deterministic)
    x = _constrain(x, ("batch", "length", "embed"))
    layer_cls = nn.remat(EncoderLayer) if cfg.remat else EncoderLayer
    for i in range(cfg.num_encoder_layers):
      x = layer_cls(cfg, deterministic, name=f"layers_{i}")(x, bias)
    x = RMSNorm(cfg.layer_norm_epsilon, _dtype(cfg), name="encoder_norm")(x)
    return _dropout(x, cfg.dropout_rate, deterministic)


class Decoder(nn.Module):
  """Decoder stack; returns float32 logits and the final (normed) hidden states."""
  config: T5Config
  shared_embedder: Embed

  @nn.compact
  def __call__(self, embeds: Array, encoded: Optional[Array], encoder_mask: Array,
               segment_ids: Optional[Array] = None,
               encoder_segment_ids: Optional[Array] = None, *, deterministic: bool = True,
               decode: bool = False, init_cache: bool = False,
               max_decode_length: Optional[int] = None,
               step_ops: Optional[DecodeStepOps] = None) -> tuple[Array, Array]:
    cfg = self.config
    ops = ModelOps.for_config(cfg)
    batch, length = embeds.shape[:2]
    relpos = RelativePositionBias(cfg, bidirectional=False, name="relpos_bias")
    decode_position = None
    if decode:
      if length != 1:
        raise ValueError(f"decode mode takes one token per step, got length {length}")
      position_var = self.variable("cache", "decode_position", lambda: jnp.zeros((), jnp.int32))
      decode_position = position_var.value
      assert max_decode_length is not None  # T5.decode's callers give it with decode=True.
      key_positions = jnp.arange(max_decode_length)
      causal = key_positions[None, None, None, :] <= decode_position
      self_bias = relpos(decode_position[None], key_positions, span=max_decode_length)
      self_bias = self_bias + ops_lib.mask_to_bias(causal)
      if not init_cache:
        position_var.value = decode_position + 1
    else:
      positions = jnp.arange(length)
      position_bias = relpos(positions, positions, span=length)
      query_valid = jnp.ones((batch, length), bool) if segment_ids is None else segment_ids > 0
      packing = None if segment_ids is None else ops_lib.attention_mask(
          query_valid, query_valid, segment_ids, segment_ids)
      if cfg.attention_impl in ("pallas", "pallas_gpu"):
        self_bias = ops.attention_masking(query_valid, query_valid, segment_ids, segment_ids,
                                          position_bias=position_bias, causal=True)
      elif ops.use_fused_attention(deterministic=deterministic, query_length=length,
                                   key_length=length):
        self_bias = FusedMask(position_bias=position_bias, causal=True, mask=packing)
      else:
        mask = positions[None, None, :, None] >= positions[None, None, None, :]
        self_bias = position_bias + ops_lib.mask_to_bias(
            mask if packing is None else mask & packing)
    inputs = encoder_mask.shape[0]
    if not decode and inputs != batch:
      # G = batch / inputs rows per input share its encoding (`T5.decode`), e.g. candidates.
      if batch % inputs or segment_ids is not None or encoder_segment_ids is not None:
        raise ValueError(f"Decoder: {batch} unpacked rows cannot share {inputs} inputs' "
                         "encodings (rows must come in equal groups per input, unpacked)")
      if not deterministic and cfg.dropout_rate > 0:
        raise ValueError("Decoder: rows sharing an encoding are for deterministic calls "
                         "(grouped cross-attention applies no attention dropout)")
    if decode or inputs != batch:
      # One row per input, as the cross-attention cache or the shared projection has.
      cross_bias = ops_lib.mask_to_bias(encoder_mask[:, None, None, :].astype(bool))
    elif ops.use_fused_attention(deterministic=deterministic, query_length=length,
                                 key_length=encoder_mask.shape[1]):
      cross_bias = ops.attention_masking(query_valid, encoder_mask, segment_ids,
                                         encoder_segment_ids)
    else:
      cross_bias = ops_lib.mask_to_bias(ops_lib.attention_mask(
          query_valid, encoder_mask, segment_ids, encoder_segment_ids))
    x = _dropout(embeds, cfg.dropout_rate, deterministic)
    x = _constrain(x, ("batch", "length", "embed"))
    if decode and not init_cache:
      step_ops = step_ops if step_ops is not None else DecodeStepOps()
    elif step_ops is not None:
      raise ValueError("Decoder: step_ops are for cached decoding steps (decode=True)")
    layer_cls = nn.remat(DecoderLayer) if cfg.remat and not decode else DecoderLayer
    for i in range(cfg.num_decoder_layers):
      x = layer_cls(cfg, deterministic, decode, init_cache, max_decode_length,
                    name=f"layers_{i}")(x, encoded, self_bias, cross_bias, decode_position,
                                        step_ops=step_ops)
    x = RMSNorm(cfg.layer_norm_epsilon, _dtype(cfg), name="decoder_norm")(x)
    hidden = _dropout(x, cfg.dropout_rate, deterministic)
    if cfg.tie_word_embeddings:
      # T5 1.0 rescales before the tied projection (Mesh TensorFlow convention).
      logits = self.shared_embedder.attend(hidden * (cfg.d_model ** -0.5), step_ops=step_ops)
    else:
      logits = DenseKernel(features=cfg.vocab_size, axes=("embed", "vocab"),
                           init_scale=cfg.d_model ** -0.5, dtype=_dtype(cfg), ops=ops,
                           name="logits_dense")(hidden, step_ops=step_ops,
                                                preferred_element_type=jnp.float32)
    return _constrain(logits, ("batch", "length", "vocab")), hidden


class T5(nn.Module):
  """The T5 encoder-decoder every jaxmoral model is built from; `with_scalar_head` adds
  `scalar_head` (`heads.ScalarHead`)."""
  config: T5Config
  with_scalar_head: bool = False

  def setup(self):
    cfg = self.config
    self.token_embedder = Embed(cfg.vocab_size, cfg.d_model, _dtype(cfg),
                                ModelOps.for_config(cfg), name="token_embedder")
    self.encoder = Encoder(cfg, name="encoder")
    self.decoder = Decoder(cfg, self.token_embedder, name="decoder")
    if self.with_scalar_head:
      self.scalar_head = heads.ScalarHead(name="scalar_head")

  def embed(self, tokens: Array) -> Array:
    """Token ids (batch, length) -> input embeddings (batch, length, d_model), activation dtype."""
    return self.token_embedder(tokens)

  def encode(self, encoder_input_tokens: Optional[Array] = None, *,
             encoder_embeds: Optional[Array] = None, encoder_mask: Optional[Array] = None,
             encoder_segment_ids: Optional[Array] = None, deterministic: bool = True) -> Array:
    """Encodes token ids or, for salience and soft prompts, given input embeddings."""
    if (encoder_input_tokens is None) == (encoder_embeds is None):
      raise ValueError("encode: give exactly one of encoder_input_tokens, encoder_embeds")
    if encoder_embeds is None:
      assert encoder_input_tokens is not None  # Exactly one is given (checked above).
      encoder_embeds = self.embed(encoder_input_tokens)
    if encoder_mask is None:
      if encoder_input_tokens is None:
        raise ValueError("encode: encoder_mask is required with encoder_embeds")
      encoder_mask = encoder_input_tokens != self.config.pad_token_id
    return self.encoder(encoder_embeds.astype(_dtype(self.config)), encoder_mask,
                        encoder_segment_ids, deterministic=deterministic)

  def decode(self, encoded: Optional[Array], encoder_mask: Array, decoder_input_tokens: Array, *,
             decoder_segment_ids: Optional[Array] = None,
             encoder_segment_ids: Optional[Array] = None, deterministic: bool = True,
             decode: bool = False, max_decode_length: Optional[int] = None,
             init_cache: bool = False,
             step_ops: Optional[DecodeStepOps] = None) -> tuple[Array, Array]:
    """Decoder logits (float32) and final hidden states.

    Teacher forcing when `decode=False`, where G rows per input (rows `b * G + i`,
    deterministic and unpacked) may share one row of `encoded`. With `decode=True` the call
    takes one token per row and reads/writes the `cache` collection (`init_cache`); its
    products and attention are `step_ops`' (a decoding backend's; XLA's when None).
    """
    return self.decoder(self.embed(decoder_input_tokens), encoded, encoder_mask,
                        decoder_segment_ids, encoder_segment_ids, deterministic=deterministic,
                        decode=decode, init_cache=init_cache,
                        max_decode_length=max_decode_length, step_ops=step_ops)

  def init_cache(self, encoded: Array, encoder_mask: Array, max_decode_length: int, *,
                 rows_per_input: int = 1) -> Array:
    """Creates the `cache` collection: empty self-attention caches, projected encoder K/V.

    Call with `mutable=["cache"]`; the returned logits are meaningless. With
    `rows_per_input=G` every later step takes G * batch tokens (rows `b * G + i`, samples or
    beams) with the same (batch, length) `encoder_mask`.
    """
    validation.positive_int(rows_per_input, "init_cache: rows_per_input")
    dummy = jnp.zeros((encoded.shape[0] * rows_per_input, 1), jnp.int32)
    return self.decode(encoded, encoder_mask, dummy, decode=True, init_cache=True,
                       max_decode_length=max_decode_length)[0]

  def score(self, hidden: Array) -> Array:
    """Scalar head on decoder states: (batch, length, d_model) -> (batch, length) float32."""
    if not self.with_scalar_head:
      raise ValueError("score: this T5 was built without with_scalar_head=True")
    return self.scalar_head(hidden)

  def __call__(self, encoder_input_tokens: Optional[Array], decoder_input_tokens: Array, *,
               encoder_embeds: Optional[Array] = None, encoder_mask: Optional[Array] = None,
               encoder_segment_ids: Optional[Array] = None,
               decoder_segment_ids: Optional[Array] = None, deterministic: bool = True,
               return_hidden: bool = False) -> Array | tuple[Array, Array]:
    """Teacher-forced logits (batch, target_length, vocab), float32."""
    if encoder_mask is None and encoder_input_tokens is not None:
      encoder_mask = encoder_input_tokens != self.config.pad_token_id
    encoded = self.encode(encoder_input_tokens, encoder_embeds=encoder_embeds,
                          encoder_mask=encoder_mask, encoder_segment_ids=encoder_segment_ids,
                          deterministic=deterministic)
    assert encoder_mask is not None  # `encode` requires it with encoder_embeds.
    logits, hidden = self.decode(encoded, encoder_mask, decoder_input_tokens,
                                 decoder_segment_ids=decoder_segment_ids,
                                 encoder_segment_ids=encoder_segment_ids,
                                 deterministic=deterministic)
    if self.with_scalar_head:
      # Touch the head so `init` creates its parameters with the rest.
      _ = self.score(hidden[:, :1])
    return (logits, hidden) if return_hidden else logits


def target_logit_rows(params: Any, config: T5Config, tokens: Array) -> Array:
  """Rows of the output projection for `tokens`, (len(tokens), d_model) float32.

  `hidden[t] . rows[t]` is `logits[t, tokens[t]]` without the whole vocabulary's projection, so
  gradients of chosen logits (salience) skip the (length, vocab) product and its transpose.
  """
  if config.tie_word_embeddings:  # T5 1.0: the embedding, behind the d_model ** -0.5 rescale.
    rows = jnp.take(params["token_embedder"]["embedding"], tokens, axis=0)
    return rows.astype(jnp.float32) * (config.d_model ** -0.5)
  kernel = params["decoder"]["logits_dense"]["kernel"]
  return jnp.take(kernel, tokens, axis=1).T.astype(jnp.float32)


def shift_right(targets: Array, start_id: int = 0) -> Array:
  """Decoder inputs for teacher forcing: targets shifted right behind the start id."""
  shifted = jnp.zeros_like(targets).at[:, 1:].set(targets[:, :-1])
  shifted = shifted.at[:, 0].set(start_id)
  return jnp.where(shifted == -100, 0, shifted)


def init_params(model: T5, rng: Array) -> Any:
  """Randomly initialised (boxed, logically partitioned) parameters.

  The normal parameters are drawn a few at a time (`param_init`), so the values differ from
  `model.init`'s for the same key. Called outside a trace, it runs as one compiled program
  (op by op, the model's forward pass would compile each operation alone).
  """
  if not isinstance(rng, jax.core.Tracer) and _hashable(model):
    return _compiled_init_params(model, rng)
  key = jax.ShapeDtypeStruct(jnp.shape(rng), rng.dtype)
  # A module with unhashable fields cannot be a cache key: traced for its shapes each time.
  abstract = (_abstract_params if _hashable(model) else _abstract_params.__wrapped__)(model, key)
  drawn = param_init.draw(abstract, rng)
  if drawn is not None:
    return drawn
  # A parameter declared without `param_init`: applied with a mutable "params" collection, the
  # module creates only those it is not given.
  tokens = jnp.ones((1, 8), jnp.int32)  # Encoder and decoder inputs: any lengths fit.
  _, variables = model.apply({"params": param_init.draw_normals(abstract, rng)}, tokens, tokens,
                             mutable=["params"], rngs={"params": rng, "dropout": rng})
  return variables["params"]


def _hashable(model: T5) -> bool:
  try:
    hash(model)
  except TypeError:  # A module with unhashable fields cannot be a static argument.
    return False
  return True


_compiled_init_params = jax.jit(init_params, static_argnums=0)


def abstract_params(model: T5) -> Any:
  """The boxed parameters `init_params(model, rng)` makes, as `jax.ShapeDtypeStruct` leaves with
  their logical axes. Traced once per model and kept: a large model's init takes seconds."""
  # `init_params`'s key, so a default init and this share one trace.
  return _abstract_params(model, jax.ShapeDtypeStruct((2,), jnp.uint32))


@functools.lru_cache(maxsize=64)
def _abstract_params(model: T5, key: Any) -> Any:
  """`model.init`'s boxed params as `jax.eval_shape` gives them (shapes, axes, distributions)."""
  tokens = jnp.ones((1, 8), jnp.int32)  # As `init_params`'s.
  return jax.eval_shape(lambda r: model.init({"params": r, "dropout": r}, tokens, tokens)["params"],
                        key)
