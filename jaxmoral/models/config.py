"""T5 model configuration: a frozen dataclass that gin binds, plus the named sizes.

The fields follow Hugging Face's `T5Config` names where one exists, so that an imported
`config.json` maps onto it one to one (see `hf_import.py`).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Literal

import gin

from jaxmoral import validation

FeedForward = Literal["relu", "gated-gelu", "gated-relu", "gated-silu"]
DType = Literal["float32", "bfloat16", "float16"]
AttentionImpl = Literal["auto", "einsum", "cudnn", "pallas", "pallas_gpu"]
FusedAttentionBackend = Literal["cudnn", "xla"]
CpuWeightGradients = Literal["plain", "autodiff"]
# The fields whose value must be one of their Literal type's.
_CHOICES = {"feed_forward_proj": typing.get_args(FeedForward), "dtype": typing.get_args(DType),
            "attention_impl": typing.get_args(AttentionImpl),
            "fused_attention_backend": typing.get_args(FusedAttentionBackend),
            "cpu_weight_gradients": typing.get_args(CpuWeightGradients)}


def cudnn_supports_head_width(d_kv: int) -> bool:
  """cuDNN's fused attention takes heads whose width is a multiple of 8, at most 128."""
  return d_kv % 8 == 0 and d_kv <= 128


@gin.configurable
@dataclasses.dataclass(frozen=True, kw_only=True)
class T5Config:
  """Sizes and variant switches of a T5 encoder-decoder.

  Attributes:
    vocab_size: Rows of the token embedding (and of the logits).
    d_model: Width of the residual stream.
    d_kv: Width of one attention head.
    d_ff: Width of the feed-forward hidden layer.
    num_encoder_layers, num_decoder_layers: Blocks of each stack.
    relative_attention_max_distance: Distance beyond which positions share a bucket.
    dropout_rate: Dropout on residual branches and attention weights (train only).
    layer_norm_epsilon: RMS norm epsilon.
    feed_forward_proj: "relu" (T5 1.0) or "gated-gelu" (T5 1.1 / Flan-T5), ...
    tie_word_embeddings: T5 1.0 ties the logits head to the embedding (and rescales).
    dtype: Activation dtype; parameters are always float32.
    remat: Rematerialise each block in the backward pass (saves activation memory).
    pad_token_id: Padding id (also the decoder start id, as in T5).
    attention_impl: How teacher-forced attention is computed (docs/core_api.md): "einsum"
      (any device), "cudnn" (NVIDIA GPUs, 16-bit), "pallas" (`backends.tpu_attention`),
      "pallas_gpu" (`backends.gpu_attention`), or "auto" (cuDNN where it applies, else einsum);
      none but einsum applies attention dropout. Off their platform the Pallas kernels run
      only with `backends.attention.INTERPRET`, checked when traced (a config built on a CPU
      host may be compiled for a TPU).
    right_padded_inputs: Promise that every unpacked encoder row is its valid tokens followed
      by padding: cuDNN attention then masks keys by per-row lengths instead of a dense bias
      (much faster; a row with padding before a valid token would attend wrongly).
    fused_attention_backend: The `jax.nn.dot_product_attention` implementation of fused
      attention: "cudnn", or "xla" (JAX's reference, any device: checks the same masks on a CPU).
    gpu_bias_as_diagonals: attention_impl="pallas_gpu" hands the Triton kernels T5's position
      bias as its diagonals (`backends.gpu_attention.bias_diagonals`) rather than whole.
    cpu_weight_gradients: How float32 dense layers traced for CPUs compute weight gradients:
      "plain" (`backends.cpu_products.cpu_rows_matmul`, faster on XLA:CPU; reverse mode only)
      or "autodiff" (JAX's own transpose; `jax.jvp` needs it).
  """

  vocab_size: int = 32128
  d_model: int = 512
  d_kv: int = 64
  d_ff: int = 1024
  num_heads: int = 6
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  dropout_rate: float = 0.0
  layer_norm_epsilon: float = 1e-6
  feed_forward_proj: FeedForward = "gated-gelu"
  tie_word_embeddings: bool = False
  dtype: DType = "float32"
  remat: bool = False
  pad_token_id: int = 0
  eos_token_id: int = 1
  attention_impl: AttentionImpl = "auto"
  right_padded_inputs: bool = False
  fused_attention_backend: FusedAttentionBackend = "cudnn"
  gpu_bias_as_diagonals: bool = False
  cpu_weight_gradients: CpuWeightGradients = "plain"

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_heads",
                 "num_encoder_layers", "num_decoder_layers",
                 "relative_attention_num_buckets", "relative_attention_max_distance"):
      validation.positive_int(getattr(self, name), f"T5Config.{name}")
    if (not isinstance(self.dropout_rate, (int, float)) or isinstance(self.dropout_rate, bool)
        or not 0.0 <= self.dropout_rate < 1.0):
      raise ValueError(f"T5Config.dropout_rate must be a number in [0, 1), got "
                       f"{self.dropout_rate!r}")
    for name, choices in _CHOICES.items():
      if getattr(self, name) not in choices:
        raise ValueError(f"T5Config.{name} must be one of {choices}, got "
                         f"{getattr(self, name)!r}")
    if self.attention_impl == "cudnn" and self.dtype == "float32":
      raise ValueError("T5Config.attention_impl='cudnn' needs dtype bfloat16 or float16 "
                       "(cuDNN's fused attention has no float32 kernel); use 'auto' or 'einsum'")
    if self.attention_impl in ("cudnn", "pallas", "pallas_gpu") and self.dropout_rate > 0:
      raise ValueError(f"T5Config.attention_impl={self.attention_impl!r} cannot apply "
                       "dropout_rate > 0 to the attention weights; use 'auto' (einsum while "
                       "dropout is on) or 'einsum'")
    if self.attention_impl == "cudnn" and not cudnn_supports_head_width(self.d_kv):
      raise ValueError(f"T5Config.attention_impl='cudnn' needs d_kv a multiple of 8 and at "
                       f"most 128, got {self.d_kv}")
    if self.pad_token_id >= self.vocab_size or self.eos_token_id >= self.vocab_size:
      raise ValueError("T5Config: pad/eos ids must be < vocab_size")

  @property
  def is_gated(self) -> bool:
    return self.feed_forward_proj.startswith("gated")

  @property
  def decoder_start_token_id(self) -> int:
    return self.pad_token_id

  def replace(self, **changes: Any) -> T5Config:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def architecture(self) -> dict[str, Any]:
    """The fields that shape the weights (all but `COMPUTE_FIELDS`): a checkpoint written
    under one config loads under any config with the same architecture."""
    return {k: v for k, v in self.to_dict().items() if k not in COMPUTE_FIELDS}

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, values: dict[str, Any]) -> T5Config:
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
      raise ValueError(f"T5Config: unknown fields {unknown}")
    return cls(**values)

  def num_params(self) -> int:
    """Parameter count (no heads), for FLOP and memory estimates."""
    d, h, kv, f = self.d_model, self.num_heads, self.d_kv, self.d_ff
    attn = 4 * d * h * kv
    mlp = (3 if self.is_gated else 2) * d * f
    enc = self.num_encoder_layers * (attn + mlp + 2 * d)
    dec = self.num_decoder_layers * (2 * attn + mlp + 3 * d)
    emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
    relpos = 2 * self.relative_attention_num_buckets * h
    return enc + dec + emb + relpos + 2 * d


# Fields that say how to compute, not what the weights are.
COMPUTE_FIELDS = ("dtype", "dropout_rate", "remat", "attention_impl", "right_padded_inputs",
                  "fused_attention_backend", "gpu_bias_as_diagonals", "cpu_weight_gradients")


# T5 1.1 dimensions (Raffel et al.; google/t5-v1_1-*), vocab padded to 32128 as released.
_T5_1_1 = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, vocab_size=32128)
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(_T5_1_1, vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_heads=4,
                 num_encoder_layers=2, num_decoder_layers=2),
    # A CPU-scale T5 1.1 (t5-efficient-tiny's width and depth): pretrains on two cores.
    "mini": dict(_T5_1_1, d_model=256, d_kv=64, d_ff=1024, num_heads=4,
                 num_encoder_layers=4, num_decoder_layers=4),
    "small": dict(_T5_1_1, d_model=512, d_kv=64, d_ff=1024, num_heads=6,
                  num_encoder_layers=8, num_decoder_layers=8),
    "base": dict(_T5_1_1, d_model=768, d_kv=64, d_ff=2048, num_heads=12,
                 num_encoder_layers=12, num_decoder_layers=12),
    "large": dict(_T5_1_1, d_model=1024, d_kv=64, d_ff=2816, num_heads=16,
                  num_encoder_layers=24, num_decoder_layers=24),
    "xl": dict(_T5_1_1, d_model=2048, d_kv=64, d_ff=5120, num_heads=32,
               num_encoder_layers=24, num_decoder_layers=24),
    "xxl": dict(_T5_1_1, d_model=4096, d_kv=64, d_ff=10240, num_heads=64,
                num_encoder_layers=24, num_decoder_layers=24),
    # T5 1.0 small, for checkpoints such as t5-small (ReLU MLP, tied embeddings).
    "t5_1_0_small": dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_heads=8,
                         num_encoder_layers=6, num_decoder_layers=6,
                         feed_forward_proj="relu", tie_word_embeddings=True),
}


@gin.configurable
def t5_config(*, size: str = "tiny", **overrides: Any) -> T5Config:
  """Returns the named size with overrides (e.g. `dtype="bfloat16"`, `vocab_size=...`)."""
  if size not in SIZES:
    raise ValueError(f"unknown T5 size {size!r}; known: {sorted(SIZES)}")
  return T5Config(**{**SIZES[size], **overrides})
