"""Process-wide settings jaxmoral wants before JAX starts a backend: `configure()`.

Importing jaxmoral changes nothing outside its own modules. A program that runs jaxmoral's
models (the CLI; a notebook or script, first thing) calls `configure()` before its first JAX
computation: it adds the XLA:CPU reduction workaround to `XLA_FLAGS` (`backends.xla_flags`;
without it some reductions compute wrong values) and, where `JAXMORAL_HOST_MALLOC=reuse` asks
for it, makes glibc's malloc keep the memory XLA:CPU frees between steps
(`backends.host_memory`). JAX reads both when it starts its backend, so a later call has no
effect (`xla_flags` warns). Also here: the other environment jaxmoral's processes start with.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import sys
from typing import MutableMapping, Optional

from jaxmoral.backends import host_memory
from jaxmoral.backends import xla_flags


@dataclasses.dataclass(frozen=True)
class RuntimeSettings:
  """What `configure()` set in this process (`xla_flags_added` is False where the workaround
  was already in `XLA_FLAGS` or the user chose their own value)."""
  xla_flags_added: bool
  malloc_keeps_freed_memory: bool


_SETTINGS: Optional[RuntimeSettings] = None


def configure() -> RuntimeSettings:
  """Sets the XLA flags and malloc settings jaxmoral's programs run with, before the first JAX
  computation (the CLI's `main` calls it); returns what the first call set (later calls: no-ops)."""
  global _SETTINGS
  folder = namespace_import_folder()
  if folder is not None:
    # jaxmoral/__init__.py never ran: do what it does, and say why the import is odd.
    platforms = platforms_without_absent_tpu()
    if platforms is not None and "jax" in sys.modules:
      sys.modules["jax"].config.update("jax_platforms", platforms)
    print(f"jaxmoral: imported {folder} as an empty namespace package (a folder named "
          "jaxmoral without __init__.py, such as the clone seen from its parent folder, comes "
          "first on sys.path); run from another folder", file=sys.stderr)
  if _SETTINGS is None:
    _SETTINGS = RuntimeSettings(xla_flags_added=xla_flags.apply_workarounds(),
                                malloc_keeps_freed_memory=host_memory.keep_freed_memory())
  return _SETTINGS


def namespace_import_folder() -> Optional[str]:
  """The folder `import jaxmoral` took as an empty namespace package (`configure` says why;
  the modules still load through an editable install, but jaxmoral/__init__.py never ran), or
  None where jaxmoral is the package."""
  package = sys.modules.get("jaxmoral")
  if package is None or getattr(package, "__file__", None):
    return None
  return str(next(iter(getattr(package, "__path__", [])), "?"))


# Device nodes of TPU chips (v4 and older: /dev/accel*; v5e and newer: VFIO) and of GPUs
# (JAX's own list for NVIDIA: jax._src.hardware_utils).
_TPU_DEVICES = ("/dev/accel*", "/dev/vfio")
_NVIDIA_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def _tpu_attached() -> bool:
  return any(glob.glob(pattern) for pattern in _TPU_DEVICES)


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):
    return False


def platforms_without_absent_tpu(environ: MutableMapping[str, str] = os.environ
                                 ) -> Optional[str]:
  """Sets JAX_PLATFORMS without "tpu" where libtpu is installed but no TPU is attached; returns
  the value set in `environ`, or None when nothing was set.

  With libtpu installed (the `tpu` extra) JAX starts the TPU runtime on every machine: on one
  without a TPU it prints TPU_WORKER_HOSTNAMES / accelerator-type errors before falling back.
  JAX reads JAX_PLATFORMS when it is imported, so this runs first. Left alone: a JAX_PLATFORMS
  the user set (even empty), JAX_FORCE_TPU_INIT, a machine with a TPU device node, and one
  with an NVIDIA GPU but no CUDA plugin for JAX (JAX's own choice then).
  """
  if ("JAX_PLATFORMS" in environ or "JAX_FORCE_TPU_INIT" in environ or _tpu_attached()
      or not _installed("libtpu")):
    return None
  platforms = ["cpu"]
  if any(os.path.exists(device) for device in _NVIDIA_DEVICES):
    if not any(_installed(plugin) for plugin in _CUDA_PLUGINS):
      return None
    platforms.insert(0, "cuda")
  environ["JAX_PLATFORMS"] = ",".join(platforms)
  return environ["JAX_PLATFORMS"]


# What libtpu's host runtime looks for when it starts (on a TPU VM, the metadata server gives
# them): without them it prints an accelerator-type warning and an INVALID_ARGUMENT error with a
# source trace, though a compile-only topology needs neither.
_COMPILE_ONLY_TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-4",
                         "TPU_WORKER_HOSTNAMES": "localhost"}


def quiet_compile_only_tpu(environ: MutableMapping[str, str] = os.environ) -> list[str]:
  """Gives libtpu the host settings it looks for, unless a TPU is attached or each is set
  already, before a compile-only topology starts it (`jaxmoral compile`); returns the names of
  those it set. The topology comes from its name (`v5e:8x8`): the report is the same without."""
  if _tpu_attached():
    return []
  added = [name for name in _COMPILE_ONLY_TPU_ENV if name not in environ]
  for name in added:
    environ[name] = _COMPILE_ONLY_TPU_ENV[name]
  return added


# What TensorFlow 2.21 writes to stderr on import, whatever TF_CPP_MIN_LOG_LEVEL says: about
# oneDNN, a missing CUDA driver on a CPU machine, absl's pre-init notice, a failed cuInit.
_TF_START_UP_NOISE = ("oneDNN custom operations are on", "Could not find cuda drivers",
                      "All log messages before absl::InitializeLog()", "failed call to cuInit")


# Set by `own_gpus_for_jax`: a library user's process leaves TensorFlow's GPUs to the user.
_GPUS_FOR_JAX_ONLY = False


def own_gpus_for_jax() -> None:
  """TensorFlow, whenever seqio imports it in this process, gets no GPU (the CLI's choice)."""
  global _GPUS_FOR_JAX_ONLY
  _GPUS_FOR_JAX_ONLY = True


def tensorflow_for_input_pipelines_only() -> None:
  """Imports TensorFlow (seqio's input pipelines) with its start-up lines filtered out of
  stderr, and, after `own_gpus_for_jax`, hides every GPU from it, as T5X does: TensorFlow would
  otherwise reserve GPU memory that JAX needs. The modules that define seqio Tasks call it
  before they import seqio; nothing else imports TensorFlow."""
  import tempfile  # pylint: disable=g-import-not-at-top
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+b") as captured:
    os.dup2(captured.fileno(), 2)
    try:
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
      if _GPUS_FOR_JAX_ONLY:
        tf.config.set_visible_devices([], "GPU")
    except (ImportError, RuntimeError):  # Missing (seqio says so if needed), or already ran.
      pass
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      for line in captured.read().decode(errors="replace").splitlines(keepends=True):
        if not any(noise in line for noise in _TF_START_UP_NOISE):
          sys.stderr.write(line)
