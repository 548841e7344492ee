"""Hugging Face T5 checkpoints <-> jaxmoral parameters: the format, read one slice at a time.

Reads `model.safetensors` and PyTorch `pytorch_model.bin` (each single or sharded through its
index; `.bin` memory-mapped, weights only, when torch is installed), for T5 1.0
(`DenseReluDense.wi`, logits through the tied, rescaled `shared.weight`) and T5 1.1 / Flan-T5 /
mT5 (`wi_0`/`wi_1`, separate `lm_head.weight`). Every parameter is a `TensorSource` that reads
any slice of it in jaxmoral's layout, so a loader can hand each device only its own shard.

Transformers 5 ties `lm_head` to `shared` unless the checkpoint holds a different
`lm_head.weight`, and says whether the decoder output is rescaled in `scale_decoder_outputs`
(older configs in `tie_word_embeddings`). jaxmoral's `tie_word_embeddings` means "tied and
rescaled" (T5 1.0); every other combination becomes an untied `decoder/logits_dense/kernel` with
the same numbers. jaxmoral's T5 has one token embedding, so a checkpoint whose
`encoder.embed_tokens` or `decoder.embed_tokens` differs from `shared` is refused.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import os
import pathlib
from typing import Any, Callable, Mapping, Optional, Sequence

import flax
import flax.linen as nn
import jax
import numpy as np

from jaxmoral import fileio
from jaxmoral.models.config import T5Config
from jaxmoral.models.t5x_import import expected_shapes
from jaxmoral.models.t5x_import import validate_params

Params = dict[str, Any]
Index = tuple[slice, ...]
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
CHECKPOINT_FILES = (SINGLE_FILE, INDEX_FILE, BIN_FILE, BIN_INDEX_FILE)
# Tensors HF never uses (cross-attention has no relative bias of its own).
_IGNORED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)
# Copies of `shared` that HF checkpoints may hold; a different table is refused.
_EMBEDDING_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
_SUPPORTED_MODEL_TYPES = ("t5", "mt5")
# config.json fields that `config_to_hf` writes under T5Config's names.
_SHARED_FIELDS = ("vocab_size", "d_model", "d_kv", "d_ff", "num_heads", "num_decoder_layers",
                  "relative_attention_num_buckets", "relative_attention_max_distance",
                  "dropout_rate", "layer_norm_epsilon", "feed_forward_proj",
                  "tie_word_embeddings", "pad_token_id", "eos_token_id")


def is_hf_checkpoint(directory: str | os.PathLike) -> bool:
  """Whether `directory` holds a Hugging Face checkpoint file (safetensors or PyTorch)."""
  return any((pathlib.Path(directory) / name).is_file() for name in CHECKPOINT_FILES)


# -- config -------------------------------------------------------------------------------------
def _as_int(value: Any, field: str) -> int:
  if isinstance(value, (list, tuple)):  # eos_token_id may be a list in newer configs.
    value = value[0] if value else None
  if not isinstance(value, int):
    raise ValueError(f"config.json: {field} must be an int, got {value!r}")
  return value


def config_from_hf(hf_config: Mapping[str, Any], **overrides: Any) -> T5Config:
  """Maps a parsed Hugging Face T5 `config.json` to a `T5Config`, with `overrides` (T5Config
  fields, e.g. `dtype="bfloat16"`) on top.

  Raises:
    ValueError: unsupported `model_type` or a bad field (the message names it).
  """
  model_type = hf_config.get("model_type", "t5")
  if model_type not in _SUPPORTED_MODEL_TYPES:
    raise ValueError(f"config.json: model_type {model_type!r} is not supported "
                     f"(supported: {list(_SUPPORTED_MODEL_TYPES)})")
  required = ("vocab_size", "d_model", "d_kv", "d_ff", "num_heads", "num_layers")
  missing = [k for k in required if k not in hf_config]
  if missing:
    raise ValueError(f"config.json: missing fields {missing}")
  num_layers = hf_config["num_layers"]
  num_decoder_layers = hf_config.get("num_decoder_layers")
  pad = hf_config.get("pad_token_id")
  # Whether HF rescales the decoder output by d_model**-0.5 (T5 1.0); before transformers 5,
  # tie_word_embeddings said so (True by default).
  scaled = hf_config.get("scale_decoder_outputs", hf_config.get("tie_word_embeddings", True))
  values = dict(
      {name: hf_config[name] for name in required[:-1]}, num_encoder_layers=num_layers,
      num_decoder_layers=num_layers if num_decoder_layers is None else num_decoder_layers,
      relative_attention_num_buckets=hf_config.get("relative_attention_num_buckets", 32),
      relative_attention_max_distance=hf_config.get("relative_attention_max_distance", 128),
      dropout_rate=float(hf_config.get("dropout_rate", 0.1)),
      layer_norm_epsilon=float(hf_config.get("layer_norm_epsilon", 1e-6)),
      feed_forward_proj=hf_config.get("feed_forward_proj", "relu"),
      tie_word_embeddings=bool(scaled),
      pad_token_id=0 if pad is None else _as_int(pad, "pad_token_id"),
      eos_token_id=_as_int(hf_config.get("eos_token_id", 1), "eos_token_id"))
  return T5Config(**{**values, **overrides})


def config_to_hf(config: T5Config) -> dict[str, Any]:
  """The config.json dict Hugging Face `T5ForConditionalGeneration` reads for `config`."""
  return {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
          **{name: getattr(config, name) for name in _SHARED_FIELDS},
          "num_layers": config.num_encoder_layers,
          "scale_decoder_outputs": config.tie_word_embeddings, "is_encoder_decoder": True,
          "decoder_start_token_id": config.pad_token_id}


def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
  """A Hugging Face folder's `config.json`, checked to describe a T5 (errors name the file)."""
  config_path = pathlib.Path(directory) / "config.json"
  if not config_path.is_file():
    raise FileNotFoundError(f"{config_path} not found")
  try:
    hf_config = json.loads(config_path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{config_path}: invalid JSON ({e})") from e
  try:
    config_from_hf(hf_config)
  except ValueError as e:
    raise ValueError(f"{config_path}: {e}") from e
  return hf_config


# -- name table ---------------------------------------------------------------------------------
# (hf name, jaxmoral path, kind); kind "linear": HF (out, in) = kernel.T, "relpos": (buckets,
# heads) = rel_embedding.T, "copy": same layout. One table serves import and export.
_Entry = tuple[str, tuple[str, ...], str]
# Each stack's sublayers, HF `layer.{j}` in order: (HF block, jaxmoral layer norm, block).
_SUBLAYERS = {
    "encoder": (("SelfAttention", "pre_attention_layer_norm", "attention"),
                ("DenseReluDense", "pre_mlp_layer_norm", "mlp")),
    "decoder": (("SelfAttention", "pre_self_attention_layer_norm", "self_attention"),
                ("EncDecAttention", "pre_cross_attention_layer_norm",
                 "encoder_decoder_attention"),
                ("DenseReluDense", "pre_mlp_layer_norm", "mlp")),
}
_ATTENTION_KERNELS = (("q", "query"), ("k", "key"), ("v", "value"), ("o", "out"))


def name_table(config: T5Config, *, lm_head: bool) -> list[_Entry]:
  """Every HF tensor name with its jaxmoral path, for `config` (`lm_head`: untied head)."""
  mlp_kernels = [(name, name) for name in
                 (("wi_0", "wi_1") if config.is_gated else ("wi",)) + ("wo",)]
  table: list[_Entry] = [("shared.weight", ("token_embedder", "embedding"), "copy")]
  for stack, num_layers in (("encoder", config.num_encoder_layers),
                            ("decoder", config.num_decoder_layers)):
    table.append((f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                  (stack, "relpos_bias", "rel_embedding"), "relpos"))
    for i in range(num_layers):
      for j, (hf_block, norm, block) in enumerate(_SUBLAYERS[stack]):
        hf, ours = f"{stack}.block.{i}.layer.{j}", (stack, f"layers_{i}")
        table.append((f"{hf}.layer_norm.weight", ours + (norm, "scale"), "copy"))
        kernels = mlp_kernels if block == "mlp" else _ATTENTION_KERNELS
        table += [(f"{hf}.{hf_block}.{hf_name}.weight", ours + (block, name, "kernel"), "linear")
                  for hf_name, name in kernels]
    norm = "encoder_norm" if stack == "encoder" else "decoder_norm"
    table.append((f"{stack}.final_layer_norm.weight", (stack, norm, "scale"), "copy"))
  if lm_head:
    table.append(("lm_head.weight", ("decoder", "logits_dense", "kernel"), "linear"))
  return table


# -- checkpoint files ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorSource:
  """One parameter in jaxmoral's layout, read slice by slice from a checkpoint.

  Attributes:
    read: `read(index) -> float32 array` of `index` (one slice per dimension, jaxmoral layout).
    where: The file holding it, quoted in errors.
  """
  shape: tuple[int, ...]
  read: Callable[[Index], np.ndarray]
  where: str

  def full(self) -> np.ndarray:
    return self.read(tuple(slice(None) for _ in self.shape))


class CheckpointFiles(abc.ABC):
  """Named tensors of a checkpoint (HF layout), readable a slice at a time.

  Subclasses fill `_shapes` (name -> shape) and `_where` (name -> the file holding it).
  """
  _shapes: dict[str, tuple[int, ...]]
  _where: dict[str, str]

  def names(self) -> list[str]:
    return list(self._shapes)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._shapes[name]

  def where(self, name: str) -> str:
    return self._where[name]

  @abc.abstractmethod
  def read(self, name: str, index: Index) -> np.ndarray:
    """`index` of the tensor, as float32 (HF layout)."""


def _weight_map(index: pathlib.Path) -> dict[str, pathlib.Path]:
  try:
    weight_map = json.loads(index.read_text())["weight_map"]
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise ValueError(f"{index}: not a checkpoint index with a weight_map ({e})") from e
  files = {name: index.parent / file for name, file in weight_map.items()}
  for file in sorted(set(files.values())):
    if not file.is_file():
      raise FileNotFoundError(f"{index}: lists shard {file.name}, which does not exist")
  return files


class SafetensorsFiles(CheckpointFiles):
  """One `model.safetensors` or the shards of `model.safetensors.index.json`."""

  def __init__(self, directory: pathlib.Path):
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    self._open = safe_open
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    files = [single] if single.is_file() else sorted(set(_weight_map(index).values()))
    self._where, self._shapes = {}, {}
    for file in files:
      try:
        with safe_open(str(file), framework="numpy") as f:
          for name in f.keys():
            self._where[name] = str(file)
            self._shapes[name] = tuple(f.get_slice(name).get_shape())
      except Exception as e:  # pylint: disable=broad-except  (safetensors' own error types)
        raise ValueError(f"{file}: not a readable safetensors file "
                         f"({str(e).splitlines()[0]})") from e

  def read(self, name: str, index: Index) -> np.ndarray:
    with self._open(self._where[name], framework="numpy") as f:
      return np.asarray(f.get_slice(name)[index], np.float32)


class TorchFiles(CheckpointFiles):
  """One `pytorch_model.bin` or the shards of its index, memory-mapped (weights only)."""

  def __init__(self, directory: pathlib.Path):
    try:
      import torch  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ValueError(f"{directory} holds a PyTorch checkpoint ({BIN_FILE}); reading it needs "
                       "torch: pip install 'jaxmoral[torch]', or re-save it with "
                       "save_pretrained(safe_serialization=True)") from None
    self._torch = torch
    single, index = directory / BIN_FILE, directory / BIN_INDEX_FILE
    files = {None: single} if single.is_file() else _weight_map(index)
    self._tensors: dict[str, Any] = {}
    self._where, self._shapes = {}, {}
    for file in sorted(set(files.values())):
      try:
        state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
      except Exception as e:  # pylint: disable=broad-except  (torch raises many kinds)
        raise ValueError(f"{file}: cannot read it as a weights-only PyTorch checkpoint: "
                         f"{str(e).splitlines()[0]}") from e
      for name, tensor in state.items():
        self._tensors[name], self._where[name] = tensor, str(file)
        self._shapes[name] = tuple(tensor.shape)

  def read(self, name: str, index: Index) -> np.ndarray:
    return self._tensors[name][index].to(self._torch.float32).numpy()


class InMemoryTensors(CheckpointFiles):
  """A state dict already in memory (name -> array-like, e.g. torch tensors as NumPy)."""

  def __init__(self, tensors: Mapping[str, Any], source: str = "<HF tensors>"):
    self._tensors = dict(tensors)
    self._shapes = {name: tuple(np.shape(t)) for name, t in self._tensors.items()}
    self._where = dict.fromkeys(self._tensors, source)

  def read(self, name: str, index: Index) -> np.ndarray:
    return np.asarray(self._tensors[name], np.float32)[index]


def open_checkpoint(directory: str | os.PathLike) -> CheckpointFiles:
  """The tensors of a Hugging Face folder: safetensors first, else PyTorch `.bin`.

  Raises:
    FileNotFoundError: No checkpoint file (the message lists what was looked for).
    ValueError: A `.bin` checkpoint without torch installed, or an unreadable file.
  """
  directory = pathlib.Path(directory)
  if (directory / SINGLE_FILE).is_file() or (directory / INDEX_FILE).is_file():
    return SafetensorsFiles(directory)
  if (directory / BIN_FILE).is_file() or (directory / BIN_INDEX_FILE).is_file():
    return TorchFiles(directory)
  raise FileNotFoundError(f"{directory}: no Hugging Face checkpoint (looked for "
                          f"{', '.join(CHECKPOINT_FILES)})")


# -- tensors -> parameters ----------------------------------------------------------------------
def _linear(files: CheckpointFiles, name: str, scale: float = 1.0) -> TensorSource:
  """A (out, in) HF matrix as its transpose; `scale` multiplies every value."""
  def read(index: Index) -> np.ndarray:
    block = files.read(name, tuple(reversed(index))).T
    return block * np.float32(scale) if scale != 1.0 else block

  return TensorSource(tuple(reversed(files.shape(name))), read, files.where(name))


def _copy(files: CheckpointFiles, name: str) -> TensorSource:
  return TensorSource(files.shape(name), lambda index: files.read(name, index),
                      files.where(name))


def _same_table(files: CheckpointFiles, a: str, b: str) -> bool:
  return files.shape(a) == files.shape(b) and bool(
      np.array_equal(_copy(files, a).full(), _copy(files, b).full()))


def tensor_sources(files: CheckpointFiles, hf_config: Mapping[str, Any], *,
                   source: str = "<HF tensors>", **overrides: Any
                   ) -> tuple[T5Config, dict[tuple[str, ...], TensorSource]]:
  """The `T5Config` (with `overrides`, as `config_from_hf`) and every parameter of an HF
  checkpoint (`open_checkpoint`), as {jaxmoral path: TensorSource}: lazily read, float32
  whatever the files hold. `source` is quoted in errors.

  Raises:
    ValueError: A missing, unexpected or mis-shaped tensor (named, with its file), or
      embedding tables that differ from `shared`.
  """
  config = config_from_hf(hf_config, **overrides)
  names = set(files.names())
  for copy_name in _EMBEDDING_COPIES:
    if copy_name in names and "shared.weight" in names and not _same_table(
        files, copy_name, "shared.weight"):
      raise ValueError(f"{source}: {copy_name} (in {files.where(copy_name)}) differs from "
                       "shared.weight; jaxmoral's T5 has one token embedding for encoder and "
                       "decoder, so this checkpoint cannot be read without changing the model")

  # Which head the numbers describe (see the module docstring).
  head: Optional[TensorSource] = None
  if "lm_head.weight" in names:
    untied = "shared.weight" not in names or not _same_table(files, "lm_head.weight",
                                                             "shared.weight")
    if config.tie_word_embeddings and untied:  # Rescaled but untied: fold the scale in.
      config = config.replace(tie_word_embeddings=False)
      head = _linear(files, "lm_head.weight", scale=config.d_model ** -0.5)
    elif not config.tie_word_embeddings:
      head = _linear(files, "lm_head.weight")
  if not config.tie_word_embeddings and head is None and "shared.weight" in names:
    head = _linear(files, "shared.weight")  # Tied without rescale (transformers 5 for 1.1).

  table = name_table(config, lm_head=False)
  model = (f"a {config.feed_forward_proj} T5 with {config.num_encoder_layers}+"
           f"{config.num_decoder_layers} layers")
  missing = [name for name, _, _ in table if name not in names]
  if missing:
    searched = sorted({files.where(n) for n in names}) or [source]
    raise ValueError(f"{source}: missing tensors {missing} for {model} (searched {searched})")
  known = {name for name, _, _ in table} | {"lm_head.weight", *_IGNORED, *_EMBEDDING_COPIES}
  unexpected = sorted(names - known)
  if unexpected:
    raise ValueError(f"{source}: unexpected tensors " + ", ".join(
        f"{n} (in {files.where(n)})" for n in unexpected) + f" for {model}")
  sources = {path: (_copy(files, name) if kind == "copy" else _linear(files, name))
             for name, path, kind in table}
  if not config.tie_word_embeddings:
    assert head is not None  # Untied: lm_head.weight or shared.weight (checked above) gives it.
    sources[("decoder", "logits_dense", "kernel")] = head
  shapes = expected_shapes(config)
  hf_names = {path: name for name, path, _ in table}
  hf_names[("decoder", "logits_dense", "kernel")] = "lm_head.weight"

  def hf_shape(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[::-1] if path[-1] in ("kernel", "rel_embedding") else shape  # HF: transposed.

  bad = [f"{hf_names[path]} (in {tensor.where}): shape {hf_shape(path, tensor.shape)}, "
         f"expected {hf_shape(path, shapes[path])}"
         for path, tensor in sources.items() if tensor.shape != shapes[path]]
  if bad:
    raise ValueError(f"{source}: tensors do not fit config.json: " + "; ".join(bad))
  return config, sources


def params_from_hf(tensors: Mapping[str, Any], hf_config: Mapping[str, Any], *,
                   source: str = "<HF tensors>", **overrides: Any) -> tuple[T5Config, Params]:
  """Converts an in-memory HF T5 state dict (name -> array) to jaxmoral params (NumPy)."""
  config, sources = tensor_sources(InMemoryTensors(tensors, source), hf_config, source=source,
                                   **overrides)
  return config, flax.traverse_util.unflatten_dict(
      {path: tensor.full() for path, tensor in sources.items()})


# -- writing ------------------------------------------------------------------------------------
def export_hf_t5(params: Mapping[str, Any], config: T5Config, directory: str | os.PathLike, *,
                 dtype: Optional[str] = None, extra_files: Sequence[str | os.PathLike] = ()
                 ) -> str:
  """Writes `config.json` + `model.safetensors` that `T5ForConditionalGeneration` loads.

  Args:
    params: jaxmoral parameters (boxed or not, any sharding; a `scalar_head` is not exported).
    directory: A local folder (created if needed) or an object-store URL (gs://...); returned.
    dtype: Storage dtype ("float32" default, "bfloat16", "float16").
    extra_files: Files copied beside them (e.g. the vocabulary's `spiece.model`; local paths
      or URLs).
  """
  import tempfile  # pylint: disable=g-import-not-at-top

  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  validate_params(params, config, source="export_hf_t5 params")
  flat = flax.traverse_util.flatten_dict(nn.meta.unbox(dict(params)))
  np_dtype = {None: np.float32, "float32": np.float32, "float16": np.float16,
              "bfloat16": jax.numpy.bfloat16}[dtype]
  tensors = {}
  for name, path, kind in name_table(config, lm_head=not config.tie_word_embeddings):
    value = np.asarray(jax.device_get(flat[path]), dtype=np.float32)
    value = value.T if kind in ("linear", "relpos") else value
    tensors[name] = np.ascontiguousarray(value).astype(np_dtype)
  directory = os.fspath(directory)
  hf_config = {**config_to_hf(config), "torch_dtype": dtype or "float32"}
  # safetensors writes local files only: the weights go to a local file first (in the
  # folder itself, or a scratch folder for an object store) and are streamed from there.
  remote = fileio.is_url(directory)
  with tempfile.TemporaryDirectory() if remote else contextlib.nullcontext(directory) as local:
    fileio.makedirs(local)
    fileio.write_text(os.path.join(local, "config.json"),
                      json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, os.path.join(local, SINGLE_FILE), metadata={"format": "pt"})
    # safetensors writes through a private temporary file (mode 0600): give the weights the
    # mode every other file of the folder gets (the umask's), so whoever reads the export can.
    os.chmod(os.path.join(local, SINGLE_FILE),
             os.stat(os.path.join(local, "config.json")).st_mode & 0o777)
    if remote:
      for name in ("config.json", SINGLE_FILE):
        fileio.upload(os.path.join(local, name), fileio.join(directory, name))
  for extra in extra_files:
    fileio.write_bytes(fileio.join(directory, fileio.basename(extra)), fileio.read_bytes(extra))
  return directory
