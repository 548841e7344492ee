"""T5X checkpoints: the format (where the parameters sit, their config), and the tree check.

jaxmoral's parameter names are T5X's (`models/t5.py`), so a T5X tree maps one to one once the
wrapper is removed (`target`, legacy `optimizer/target`, or `params` in some Orbax exports).
`locate` reads only the checkpoint's metadata; `jaxmoral.model_dirs` then restores the
parameters straight into the shardings it wants. T5X's *scanned* layer variant and the
pre-Orbax format (msgpack `checkpoint` + tensorstore folders) are detected and refused.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from typing import Any, Mapping, Optional

import flax
import flax.linen as nn

from jaxmoral import fileio
from jaxmoral.models import t5
from jaxmoral.models.config import T5Config

# Heads that a jaxmoral model may carry on top of the T5 tree.
OPTIONAL_PREFIXES = ("scalar_head",)
_WRAPPERS = ("target", "optimizer", "params")


def _shape(leaf: Any) -> tuple[int, ...]:
  return tuple(leaf.shape)  # Arrays and Orbax ArrayMetadata alike.


def expected_shapes(config: T5Config) -> dict[tuple[str, ...], tuple[int, ...]]:
  """Flat {path: shape} of the parameters `T5(config)` creates (no heads), from an eval_shape."""
  return dict(_expected_shapes(config))


# Every load validates against it, and tracing a model's init costs about a second.
@functools.lru_cache(maxsize=32)
def _expected_shapes(config: T5Config) -> tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]:
  abstract = nn.meta.unbox(t5.abstract_params(t5.T5(config)))
  return tuple((path, tuple(leaf.shape))
               for path, leaf in flax.traverse_util.flatten_dict(abstract).items())


def validate_params(params: Mapping[str, Any], config: T5Config, *, source: str) -> None:
  """Raises ValueError (quoting `source`) naming every missing, unexpected or mis-shaped
  parameter of the nested `params` (boxed or not; any leaves with a `.shape`)."""
  flat = flax.traverse_util.flatten_dict(nn.meta.unbox(dict(params)))
  expected = expected_shapes(config)
  problems = []
  for path, shape in expected.items():
    if path not in flat:
      problems.append(f"missing {'/'.join(path)} {shape}")
    elif _shape(flat[path]) != shape:
      problems.append(f"{'/'.join(path)}: shape {_shape(flat[path])}, expected {shape}")
  for path in flat:
    if path not in expected and path[0] not in OPTIONAL_PREFIXES:
      problems.append(f"unexpected {'/'.join(path)}")
  if problems:
    raise ValueError(f"{source}: parameters do not fit the T5 config: " + "; ".join(problems))


def find_param_tree(tree: Mapping[str, Any], source: str
                    ) -> tuple[tuple[str, ...], Mapping[str, Any]]:
  """(wrapper path, model tree) of a T5X tree (`target`, `optimizer/target`, `params`, root)."""
  node, prefix = tree, ()
  for _ in range(3):
    if "token_embedder" in node:
      break
    for wrapper in _WRAPPERS:
      if isinstance(node.get(wrapper), Mapping):
        node, prefix = node[wrapper], prefix + (wrapper,)
        break
    else:
      break
  if "token_embedder" not in node:
    raise ValueError(f"{source}: no T5X parameter tree found (looked for token_embedder under "
                     f"target/, optimizer/target/, params/ or the root; top-level keys: "
                     f"{sorted(tree)})")
  flat = flax.traverse_util.flatten_dict(dict(node))
  if any(len(k) > 2 and k[1] in ("encoder", "decoder") and k[2] == "layers" for k in flat) or any(
      len(k) > 1 and k[1] == "layers" for k in flat):
    raise ValueError(f"{source}: scanned-layer T5X checkpoints (stacked `layers` axis) are not "
                     "supported; use an unscanned T5X config (layers_0, layers_1, ...)")
  return prefix, node


def infer_config(params: Mapping[str, Any], **overrides: Any) -> T5Config:
  """A T5Config read off parameter shapes (T5X checkpoints carry no config).

  What shapes cannot give takes T5's defaults unless overridden: relative_attention_max_distance
  128, layer_norm_epsilon 1e-6, dropout_rate 0, gelu for gated MLPs (relu otherwise).
  """
  flat = {"/".join(k): v for k, v in flax.traverse_util.flatten_dict(dict(params)).items()}
  vocab, d_model = _shape(flat["token_embedder/embedding"])
  heads, buckets = _shape(flat["encoder/relpos_bias/rel_embedding"])
  joined = _shape(flat["encoder/layers_0/attention/query/kernel"])[1]
  gated = "encoder/layers_0/mlp/wi_0/kernel" in flat
  d_ff = _shape(flat[f"encoder/layers_0/mlp/{'wi_0' if gated else 'wi'}/kernel"])[1]

  def count(stack: str) -> int:
    return len({k.split("/")[1] for k in flat if k.startswith(f"{stack}/layers_")})

  values = dict(vocab_size=int(vocab), d_model=int(d_model), d_kv=int(joined // heads),
                d_ff=int(d_ff), num_heads=int(heads), num_encoder_layers=count("encoder"),
                num_decoder_layers=count("decoder"), relative_attention_num_buckets=int(buckets),
                feed_forward_proj="gated-gelu" if gated else "relu",
                tie_word_embeddings="decoder/logits_dense/kernel" not in flat, dropout_rate=0.0)
  return T5Config(**{**values, **overrides})


def _item_dir(directory: pathlib.Path) -> pathlib.Path:
  """The Orbax item folder: the directory itself, or its one item subfolder (e.g. `state/`)."""
  if (directory / "_METADATA").exists():
    return directory
  if (directory / "checkpoint").is_file():
    raise ValueError(f"{directory}: legacy (pre-Orbax) T5X checkpoint (msgpack `checkpoint` + "
                     "tensorstore folders) is not supported; re-save it with Orbax")
  candidates = [p for p in sorted(directory.iterdir()) if (p / "_METADATA").exists()]
  if len(candidates) == 1:
    return candidates[0]
  raise ValueError(f"{directory}: not an Orbax checkpoint (no _METADATA here or in exactly one "
                   f"subfolder; found {[p.name for p in candidates]})")


def is_t5x_checkpoint(directory: str | os.PathLike) -> bool:
  """Whether `directory` looks like an Orbax checkpoint (or a legacy T5X one)."""
  directory = fileio.path(directory)
  return ((directory / "_METADATA").is_file() or (directory / "checkpoint").is_file()
          or any((p / "_METADATA").is_file() for p in directory.iterdir() if p.is_dir()))


@dataclasses.dataclass(frozen=True)
class T5XCheckpoint:
  """Where a T5X checkpoint keeps the model parameters.

  Attributes:
    item_dir: The Orbax item folder.
    prefix: The wrapper keys above the model tree (e.g. ("target",)).
    metadata: The model tree with Orbax `ArrayMetadata` leaves (shape, dtype).
    config: The T5Config (given, or inferred from the shapes).
  """
  item_dir: pathlib.Path
  prefix: tuple[str, ...]
  metadata: Mapping[str, Any]
  config: T5Config


def locate(directory: str | os.PathLike, *, config: Optional[T5Config] = None) -> T5XCheckpoint:
  """Finds the parameters of a T5X (Orbax) checkpoint from its metadata alone.

  Args:
    directory: T5X's `checkpoint_<step>` folder or its item folder.
    config: The model config; inferred from the shapes (see `infer_config`) when None.

  Raises:
    ValueError: scanned layers, legacy format, or a tree that does not fit the config (the
      message names the parameter and the checkpoint).
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  directory = fileio.path(directory)  # gs://: Orbax reads the bucket itself.
  if not directory.is_dir():
    raise FileNotFoundError(f"T5X checkpoint directory not found: {directory}")
  item = _item_dir(directory)
  with fileio.reading_orbax_item():
    metadata = ocp.PyTreeCheckpointer().metadata(item).item_metadata
  tree = getattr(metadata, "tree", metadata)
  prefix, node = find_param_tree(tree, str(item))
  config = config or infer_config(node)
  validate_params(node, config, source=str(item))
  return T5XCheckpoint(item_dir=item, prefix=prefix, metadata=node, config=config)
