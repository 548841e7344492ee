"""Every model directory jaxmoral reads or writes, in one place: find, inspect, load, save.

`FORMATS`: hf (a Hugging Face folder: config.json + safetensors or pytorch_model.bin, read
with torch weights only; spiece.model), hub (a Hub id, through huggingface_hub's cache; with
HF_HUB_OFFLINE=1 only the cache), t5x (an Orbax T5X `checkpoint_<step>`), export (params/ +
config.json + vocab/), run (MODEL_DIR, `jaxmoral.run_layout`: its latest step, or `step`; a PPO
run gives its policy) and run_step (RUN/checkpoints/STEP). `load` creates every parameter in
the sharding a partitioner asks for, each device reading only its own slice.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pathlib
import re
from typing import Any, Callable, Mapping, Optional, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from jaxmoral import checkpoints
from jaxmoral import fileio
from jaxmoral import params_export
from jaxmoral import partitioning
from jaxmoral import run_dirs
from jaxmoral import run_layout
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import hf_import
from jaxmoral.models import t5
from jaxmoral.models import t5x_import
from jaxmoral.models.config import T5Config

logger = logging.getLogger(__name__)

PyTree = Any
FORMATS = ("hf", "hub", "t5x", "export", "run", "run_step")
# Hub ids: "name" or "org/name" (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_HUB_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
              "pytorch_model.bin.index.json", "spiece.model", "tokenizer_config.json")


# -- vocabulary ---------------------------------------------------------------------------------
def vocabulary_path(directory: str | os.PathLike) -> Optional[pathlib.Path]:
  """The SentencePiece model a model directory carries (vocab/spiece.model or HF's
  spiece.model), or None."""
  directory = fileio.path(directory)
  return next((path for path in (directory / run_layout.VOCAB_DIR / run_layout.SPIECE_FILE,
                                 directory / run_layout.SPIECE_FILE) if path.is_file()), None)


def _vocabulary(directory: pathlib.Path, spm: pathlib.Path) -> Any:
  """The seqio vocabulary of `spm`: extra ids from extra_ids.txt beside it, else from
  `directory`'s tokenizer_config.json (Hugging Face's T5 tokenizers), else T5's."""
  extra = spm.parent / run_layout.EXTRA_IDS_FILE
  tokenizer_config = directory / "tokenizer_config.json"
  extra_ids = vocab_lib.T5_EXTRA_IDS
  if extra.is_file():
    extra_ids = int(extra.read_text())
  elif tokenizer_config.is_file():
    try:
      extra_ids = int(fileio.read_json(tokenizer_config).get("extra_ids", extra_ids))
    except (TypeError, ValueError):
      pass
  return vocab_lib.get_vocabulary(fileio.local_copy(spm), extra_ids=extra_ids)


def vocabulary_from_file(path: str | os.PathLike) -> Any:
  """The seqio vocabulary of a SentencePiece `.model` file (extra ids read beside it)."""
  path = fileio.path(path)
  return _vocabulary(path.parent, path)


def load_vocabulary(directory: str | os.PathLike) -> Any:
  """The seqio vocabulary a model directory carries, or None when it has none."""
  directory = fileio.path(directory)
  spm = vocabulary_path(directory)
  return None if spm is None else _vocabulary(directory, spm)


def _read_config_json(path: pathlib.Path) -> T5Config:
  values = fileio.read_json(path)
  try:
    return T5Config.from_dict(values)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path}: {e}") from e


# -- finding ------------------------------------------------------------------------------------
def resolve_hub_id(repo_id: str) -> pathlib.Path:
  """The local snapshot folder of a Hub model (downloaded unless HF_HUB_OFFLINE is set).

  Raises:
    FileNotFoundError: Offline (or unreachable) and not in the cache; one line saying how to
      get it there.
  """
  try:
    from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
    from huggingface_hub import errors as hub_errors  # pylint: disable=g-import-not-at-top
    from huggingface_hub import snapshot_download  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise FileNotFoundError(f"{repo_id!r} is neither a local folder nor loadable as a Hub id: "
                            "huggingface_hub is not installed") from None
  offline = bool(constants.HF_HUB_OFFLINE) or os.environ.get(
      "HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
  try:
    folder = snapshot_download(repo_id, allow_patterns=list(_HUB_FILES), local_files_only=offline)
  except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled):
    why = ("HF_HUB_OFFLINE is set" if offline else
           "the Hub is unreachable from here (HF_HUB_OFFLINE=1 skips trying)")
    raise FileNotFoundError(
        f"{repo_id!r}: no such local folder, and the Hub model is not in the cache "
        f"({constants.HF_HUB_CACHE}) while {why}; download it where the Hub is reachable "
        f"(`hf download {repo_id}`) and copy the cache, or give a local folder") from None
  except (hub_errors.RepositoryNotFoundError, hub_errors.RevisionNotFoundError) as e:
    raise FileNotFoundError(f"{repo_id!r}: no such local folder or Hub model "
                            f"({type(e).__name__})") from None
  except hub_errors.HfHubHTTPError as e:
    raise FileNotFoundError(f"{repo_id!r}: the Hub refused the download: "
                            f"{str(e).splitlines()[0]}") from None
  return pathlib.Path(folder)


def _run_checkpoint(path: pathlib.Path) -> Optional[tuple[pathlib.Path, Optional[int]]]:
  """(run directory, step) when `path` is a run or one of its steps; else None."""
  if ((path / run_layout.MODEL_CONFIG_FILE).is_file()
      and (path / run_layout.CHECKPOINTS_DIR).is_dir()):
    return path, None
  if (path.parent.name == run_layout.CHECKPOINTS_DIR and path.name.isdigit()
      and (path.parent.parent / run_layout.MODEL_CONFIG_FILE).is_file()):
    return path.parent.parent, int(path.name)
  return None


@dataclasses.dataclass(frozen=True)
class ModelInfo:
  """What a model directory holds, read without loading its parameters.

  Attributes:
    source: The path (or Hub id) as given.
    path: The local folder.
    format: One of `FORMATS`.
    vocabulary: Its seqio vocabulary, or None.
    settings: Method settings (settings.json), or {}.
    param_shapes: {'/'-joined path: shape} of the stored parameters (incl. heads, prompt).
    step: The checkpoint step (runs), else None.
  """
  source: str
  path: pathlib.Path
  format: str
  config: T5Config
  vocabulary: Any
  settings: Mapping[str, Any]
  param_shapes: Mapping[str, tuple[int, ...]]
  step: Optional[int] = None
  # Hugging Face formats: the parameters' lazily read sources (`hf_import.tensor_sources`).
  hf_sources: Optional[Mapping[tuple[str, ...], Any]] = dataclasses.field(
      default=None, repr=False, compare=False)

  @property
  def has_scalar_head(self) -> bool:
    return any(p.startswith("scalar_head/") for p in self.param_shapes)

  @property
  def prompt_shape(self) -> Optional[tuple[int, ...]]:
    """The soft prompt's (P, d_model) of a prompt-tuning run, else None."""
    return self.param_shapes.get("prompt")

  def describe(self) -> str:
    c = self.config
    extras = [x for x, on in (("scalar head", self.has_scalar_head),
                              ("soft prompt", self.prompt_shape is not None)) if on]
    step = f" step {self.step}" if self.step is not None else ""
    return (f"{self.source} ({self.format}{step}): T5 d_model={c.d_model} layers="
            f"{c.num_encoder_layers}+{c.num_decoder_layers} vocab={c.vocab_size}"
            + (f", {', '.join(extras)}" if extras else ""))


def _flat_shapes(tree: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
  return {"/".join(k): tuple(v.shape)
          for k, v in flax.traverse_util.flatten_dict(dict(tree)).items()}


def _local(source: str | os.PathLike) -> tuple[pathlib.Path, bool]:
  """(local folder, whether it came from the Hub)."""
  text = os.fspath(source)
  if fileio.is_url(text):
    fileio.require_reachable(text, "model directory")
    path = fileio.path(fileio.abspath(text))
    if any((path / name).is_file() for name in hf_import.CHECKPOINT_FILES):
      # safetensors and torch read local files: a Hugging Face folder is read from a copy.
      return pathlib.Path(fileio.local_folder(text)), False
    if not path.is_dir():
      raise FileNotFoundError(f"{text}: no such model directory")
    return path, False
  path = pathlib.Path(os.path.expanduser(text))
  if path.exists():
    if not path.is_dir():
      raise FileNotFoundError(f"{text}: a model is a directory, not a file")
    return path, False
  if (path.name.isdigit() and path.parent.name == run_layout.CHECKPOINTS_DIR
      and (path.parent.parent / run_layout.MODEL_CONFIG_FILE).is_file()):
    steps = sorted(int(p.name) for p in path.parent.iterdir() if p.name.isdigit())
    raise FileNotFoundError(f"{text}: no checkpoint for step {path.name}; have {steps}")
  if _HUB_ID.match(text) and not text.startswith((".", "/", "~")):
    return resolve_hub_id(text), True
  raise FileNotFoundError(f"{text}: no such model directory")


def inspect(source: str | os.PathLike, *, step: Optional[int] = None,
            config: Optional[T5Config] = None, vocabulary: Any = None) -> ModelInfo:
  """Finds the format, config, vocabulary and parameter shapes of a model directory.

  Args:
    source: A folder of any format in `FORMATS`, or a Hub id.
    step: A run's checkpoint step (default: the latest).
    config: The T5Config for formats that carry none (T5X; an export without config.json).
    vocabulary: Overrides the directory's own vocabulary (a seqio vocabulary or a path).

  Raises:
    FileNotFoundError: Nothing there, or no known format (the message lists what was sought).
    ValueError: A damaged or inconsistent directory.
  """
  path, from_hub = _local(source)
  source = os.fspath(source)
  if isinstance(vocabulary, (str, os.PathLike)):
    vocabulary = vocabulary_from_file(vocabulary)

  def found(at: pathlib.Path, kind: str, model_config: T5Config,
            shapes: Mapping[str, tuple[int, ...]], *, settings: bool, **more: Any) -> ModelInfo:
    return ModelInfo(source=source, path=at, format=kind, config=model_config,
                     vocabulary=vocabulary or load_vocabulary(at),
                     settings=run_dirs.read_settings(at) if settings else {},
                     param_shapes=shapes, **more)

  run = _run_checkpoint(path)
  if run is not None:
    run_path, run_step = run
    if step is not None and run_step is not None and step != run_step:
      raise ValueError(f"{source}: is step {run_step}, but step={step} was asked for")
    step = run_step if run_step is not None else step
    run_dirs.verify_run_files(run_path)
    run_config = _read_config_json(run_path / run_layout.MODEL_CONFIG_FILE)
    step, (_, tree) = params_export.run_params_metadata(
        run_dirs.checkpoints_dir(run_path), step=step)
    return found(run_path, "run" if run_step is None else "run_step", config or run_config,
                 _flat_shapes(tree), settings=True, step=step)
  if hf_import.is_hf_checkpoint(path):
    # The tensors decide the head (tied / untied / rescaled), so their table is read too.
    hf_config = hf_import.read_hf_config(path)  # Its errors first: they name config.json.
    hf_config_used, sources = hf_import.tensor_sources(
        hf_import.open_checkpoint(path), hf_config, source=str(path))
    if config is not None and config.architecture() != hf_config_used.architecture():
      raise ValueError(f"{source}: its config.json describes {hf_config_used}, not the given "
                       f"{config}")
    return found(path, "hub" if from_hub else "hf", config or hf_config_used, settings=False,
                 shapes={"/".join(k): v.shape for k, v in sources.items()}, hf_sources=sources)
  if (path / run_layout.EXPORT_PARAMS_DIR).is_dir():
    tree = params_export.exported_metadata(path)
    if config is None:
      if not (path / run_layout.EXPORT_CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path}/{run_layout.EXPORT_CONFIG_FILE} not found: give the "
                                "model's config")
      config = _read_config_json(path / run_layout.EXPORT_CONFIG_FILE)
    return found(path, "export", config, _flat_shapes(tree), settings=True)
  if t5x_import.is_t5x_checkpoint(path):
    checkpoints.require_checkpoint_storage(source, "T5X checkpoint")
    located = t5x_import.locate(path, config=config)
    return found(path, "t5x", located.config, _flat_shapes(located.metadata), settings=False)
  raise FileNotFoundError(
      f"{source}: no model found (looked for {', '.join(hf_import.CHECKPOINT_FILES)} "
      f"(Hugging Face), {run_layout.EXPORT_PARAMS_DIR}/ (jaxmoral export), "
      f"{run_layout.MODEL_CONFIG_FILE} + {run_layout.CHECKPOINTS_DIR}/ (run), "
      f"RUN/{run_layout.CHECKPOINTS_DIR}/STEP (one step of a run), _METADATA (T5X / Orbax))")


# -- loading ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
  """A model directory's parameters, placed, with everything needed to use them.

  Attributes:
    config: The T5Config in use (the stored one, maybe with another activation dtype).
    params: The T5 parameter tree (plus `scalar_head` when stored), unboxed, on device.
    prompt: The soft prompt (P, d_model) of a prompt-tuning run, else None.
    partitioner: The partitioner whose shardings hold `params` (None: placed without one).
  """
  info: ModelInfo
  config: T5Config
  params: PyTree
  prompt: Optional[jax.Array] = None
  partitioner: Any = None

  @property
  def vocabulary(self) -> Any:
    return self.info.vocabulary

  @property
  def has_scalar_head(self) -> bool:
    return "scalar_head" in self.params

  @property
  def lm_params(self) -> PyTree:
    """`params` without Diamante's scalar head: what a plain `t5.T5(config)` applies."""
    return {k: v for k, v in self.params.items() if k != "scalar_head"}

  @property
  def settings(self) -> Mapping[str, Any]:
    return self.info.settings


@functools.lru_cache(maxsize=32)
def param_shardings(config: T5Config, partitioner: Any, *,
                    with_scalar_head: bool = False) -> PyTree:
  """The partitioner's `NamedSharding` tree for a T5's parameters (logical-axis rules)."""
  # Cached: the jitted functions of a loaded model take it as their parameters' in_shardings.
  return partitioner.sharding_for(t5.abstract_params(t5.T5(config,
                                                          with_scalar_head=with_scalar_head)))


def jit_with_params(fn: Callable[..., Any], config: T5Config, partitioner: Any, *,
                    replicated: Sequence[bool], with_scalar_head: bool = False
                    ) -> partitioning.PartitionedFunction:
  """`fn(params, *inputs)` jitted for a loaded T5's parameters (a scalar head's too if so).

  With a partitioner it is compiled for its mesh: the parameters in its shardings (no copy
  after `load`), input i replicated if `replicated[i]` else as placed, the outputs replicated.
  """
  if partitioner is None:
    return partitioning.jit_in_context(fn)
  shardings = param_shardings(config, partitioner, with_scalar_head=with_scalar_head)
  inputs = tuple(partitioner.replicated if r else None for r in replicated)
  return partitioner.partition(fn, in_shardings=(shardings, *inputs),
                               out_shardings=partitioner.replicated)


def _target(shapes: Mapping[str, tuple[int, ...]], shardings: PyTree, dtype: Any,
            where: str) -> PyTree:
  """A ShapeDtypeStruct tree for the stored shapes, shardings matched by path."""
  if isinstance(shardings, Sharding):
    by_path = None
  else:
    by_path = {"/".join(k): s for k, s in flax.traverse_util.flatten_dict(
        shardings, is_leaf=lambda _, x: isinstance(x, Sharding)).items()}
    extra = sorted(set(by_path) - set(shapes))
    missing = sorted(set(shapes) - set(by_path))
    if missing or extra:
      raise ValueError(f"{where}: stored parameters do not match the model: missing from the "
                       f"model {missing[:5]}, missing from the checkpoint {extra[:5]}")
  flat = {tuple(path.split("/")): jax.ShapeDtypeStruct(
      shape, dtype, sharding=shardings if by_path is None else by_path[path])
          for path, shape in shapes.items()}
  return flax.traverse_util.unflatten_dict(flat)


def _place(sources: Mapping[tuple[str, ...], hf_import.TensorSource], target: PyTree) -> PyTree:
  """Arrays in `target`'s shardings, each device filled with its own slice of a source."""
  flat = flax.traverse_util.flatten_dict(target)

  def one(path: tuple[str, ...], spec: jax.ShapeDtypeStruct) -> jax.Array:
    source = sources[path]
    return jax.make_array_from_callback(
        spec.shape, spec.sharding,
        # jax types the callback's index as optional; it passes one for every shard.
        lambda index: np.asarray(source.read(index),  # type: ignore[arg-type]
                                 dtype=spec.dtype))

  return flax.traverse_util.unflatten_dict({path: one(path, spec) for path, spec in flat.items()})


_VANISHED_RETRIES = 3


def load(source: str | os.PathLike, *, step: Optional[int] = None, **kwargs: Any
         ) -> LoadedModel:
  """Loads a model directory of any format into the shardings a partitioner asks for.

  The latest step of a run that is still training can be removed while it is read (the run
  keeps its newest steps only): then the newest step is read instead, with a warning.

  Args:
    source, step, config, vocabulary: As in `inspect`.
    partitioner: Places every parameter by the partitioner's logical-axis rules; None and no
      `shardings`: `params_export.default_sharding`.
    shardings: Explicit `Sharding`s instead: one for all, or a tree with the parameters'
      structure.
    dtype: Activation dtype of the returned config ("float32", "bfloat16"); default: stored.
    param_dtype: Floating-point parameters are cast to this while read; None keeps what is
      stored (e.g. a bfloat16 export).

  Raises:
    FileNotFoundError / ValueError: See `inspect`; also parameters that do not fit the model.
  """
  for attempt in range(_VANISHED_RETRIES):
    tried: dict[str, Any] = {}
    try:
      return _load(source, step=step, tried=tried, **kwargs)
    except (OSError, ValueError) as error:
      # The step picked, or the one whose files went missing while `inspect` read them.
      gone = tried.get("step", getattr(error, "step", None))
      run = tried.get("path", os.fspath(source))
      if (step is not None or gone is None or attempt == _VANISHED_RETRIES - 1
          or gone in run_dirs.saved_steps(run)):
        raise
      logger.warning("%s: checkpoint step %d was removed while it was read (the run keeps its "
                     "newest steps only): reading the newest step", run, gone)
  raise AssertionError("unreachable")


def _load(source: str | os.PathLike, *, partitioner: Any = None, shardings: PyTree = None,
          step: Optional[int] = None, dtype: Optional[str] = None,
          param_dtype: Optional[str] = "float32", config: Optional[T5Config] = None,
          vocabulary: Any = None, tried: dict[str, Any]) -> LoadedModel:
  """`load`, once; `tried` gets the run step it picked (and the run's path)."""
  info = inspect(source, step=step, config=config, vocabulary=vocabulary)
  if info.format == "run" and info.step is not None:
    tried.update(step=info.step, path=str(info.path))
  model_config = info.config.replace(dtype=dtype) if dtype else info.config
  where = str(info.path)
  prompted = info.prompt_shape is not None
  t5_shapes = {p[len("base/"):] if prompted else p: s for p, s in info.param_shapes.items()
               if p != "prompt"}
  t5x_import.validate_params(
      flax.traverse_util.unflatten_dict({tuple(p.split("/")): jax.ShapeDtypeStruct(s, jnp.float32)
                                         for p, s in t5_shapes.items()}),
      info.config, source=where)
  if shardings is None:
    shardings = (param_shardings(info.config, partitioner, with_scalar_head=info.has_scalar_head)
                 if partitioner is not None else params_export.default_sharding())
  read_dtype = jnp.dtype(param_dtype) if param_dtype else None
  prompt = None
  if info.format in ("hf", "hub", "t5x"):
    target = _target(t5_shapes, shardings, read_dtype or jnp.float32, where)
    if info.hf_sources is not None:  # Set for every HF model directory.
      params = _place(info.hf_sources, target)
    else:
      located = t5x_import.locate(info.path, config=info.config)
      params = params_export.restore_subtree(located.item_dir, located.prefix, target)
  else:
    tree_shardings = shardings
    if prompted and not isinstance(shardings, Sharding):
      # The prompt is small: every device keeps all of it.
      replicated = (partitioner.replicated if partitioner is not None
                    else params_export.default_sharding())
      tree_shardings = {"base": shardings, "prompt": replicated}
    if info.format == "export":
      params = params_export.load_params(info.path, shardings=tree_shardings, dtype=read_dtype)
    else:
      params = params_export.restore_params_from_run(
          run_dirs.checkpoints_dir(info.path), step=info.step, shardings=tree_shardings,
          dtype=read_dtype)
    if prompted:
      params, prompt = params["base"], params["prompt"]
  logger.info("loaded %s", info.describe())
  return LoadedModel(info=info, config=model_config, params=params, prompt=prompt,
                     partitioner=partitioner)


def load_on_mesh(source: str | os.PathLike, *, partitioner: Any = None,
                 **kwargs: Any) -> LoadedModel:
  """`load` for the commands that use a model (eval, infer, export, the methods' detectors,
  evaluations and chats): into the shardings of `partitioner` (the run's PARTITIONER, as gin
  binds it; None: `partitioning.inference_partitioner`'s default), which the result keeps
  (`LoadedModel.partitioner`) so that the calls using the model run on its mesh."""
  return load(source, partitioner=partitioning.inference_partitioner(partitioner), **kwargs)


# -- saving -------------------------------------------------------------------------------------
def export(directory: str | os.PathLike, *, params: PyTree, config: T5Config,
           vocabulary: Any = None, settings: Optional[Mapping[str, Any]] = None,
           dtype: Optional[str] = None, overwrite: bool = False) -> str:
  """Writes a self-contained jaxmoral export: `params` (boxed or not, any sharding, a
  `scalar_head` kept) cast to `dtype` in params/, config.json, vocab/ and settings.json.

  Raises:
    FileExistsError: The export exists and `overwrite` is False.
  """

  def write_extra(directory: str) -> list[str]:  # In the manifest too: a load reads them.
    written = []
    if vocabulary is not None:
      run_dirs.save_vocabulary(directory, vocabulary)
      written.append(run_layout.VOCAB_DIR)
    if settings:
      run_dirs.write_settings(directory, settings)
      written.append(run_layout.SETTINGS_FILE)
    return written

  return params_export.export_params(params, directory, dtype=dtype, config=config.to_dict(),
                                     overwrite=overwrite, write_extra=write_extra)


def refuse_output_inside(source: str | os.PathLike, output_dir: str | os.PathLike) -> None:
  """Refuses an export into the model directory it reads (or a folder inside it): it would
  replace the run's manifest, settings and vocabulary."""
  if fileio.is_within(output_dir, source):
    raise ValueError(f"export: --output {output_dir} is inside the model directory {source} "
                     "(it would replace the run's own files); give a folder outside it")


def export_model(source: str | os.PathLike, output_dir: str | os.PathLike, *,
                 step: Optional[int] = None, dtype: Optional[str] = None,
                 output_format: str = "jaxmoral", overwrite: bool = False,
                 partitioner: Any = None) -> str:
  """`jaxmoral export`: a run (or any model directory) as a jaxmoral or Hugging Face export.

  Args:
    source: The model directory (usually a run); `step`: a run's step (default: the latest).
    dtype: Storage dtype of floating-point parameters.
    output_format: "jaxmoral" (see `export`) or "hf" (config.json + model.safetensors +
      spiece.model: loads in transformers).
    partitioner: The mesh the parameters are read onto and written from (see `load_on_mesh`).

  Raises:
    FileExistsError: `output_dir` holds an export and `overwrite` is False.
  """
  if output_format not in ("jaxmoral", "hf"):
    raise ValueError(f"export: format must be 'jaxmoral' or 'hf', got {output_format!r}")
  refuse_output_inside(source, output_dir)
  loaded = load_on_mesh(source, step=step, partitioner=partitioner)
  output = fileio.path(output_dir)
  if output_format == "hf":
    if (output / hf_import.SINGLE_FILE).exists() and not overwrite:
      raise FileExistsError(f"{output}/{hf_import.SINGLE_FILE} exists; pass --overwrite to "
                            "replace it")
    if loaded.has_scalar_head or loaded.prompt is not None:
      raise ValueError(f"export: {source} has a scalar head or a soft prompt, which Hugging "
                       "Face's T5ForConditionalGeneration cannot hold; export format 'jaxmoral'")
    extra = [loaded.vocabulary.sentencepiece_model_file] if loaded.vocabulary else []
    hf_import.export_hf_t5(loaded.params, loaded.config, output, dtype=dtype, extra_files=extra)
  else:
    params = loaded.params
    if loaded.prompt is not None:
      params = {"base": params, "prompt": loaded.prompt}
    export(output, params=params, config=loaded.config, vocabulary=loaded.vocabulary,
           settings=loaded.settings, dtype=dtype, overwrite=overwrite)
  print(f"exported {loaded.info.describe()} -> {output}" + (f" ({dtype})" if dtype else ""))
  return str(output)
