"""Test setup: 8 fake CPU devices (mesh tests) before JAX is imported anywhere, and one
compilation cache per test run."""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One persistent compilation cache per run, made by the first process that loads this file and
# inherited by pytest-xdist's workers: tests that compile the same program share it (CLI-heavy
# test files ran 17 % faster), and `cli.main` in a test never writes to the user's cache.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxmoral_tests_xla_")
  _OWNED_CACHE_DIR = os.environ["JAX_COMPILATION_CACHE_DIR"]
else:
  _OWNED_CACHE_DIR = None

import pathlib  # noqa: E402

import pytest  # noqa: E402

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture
def shared_dir() -> pathlib.Path:
  """../shared (real data); skips the test with a message when a clone lacks it."""
  if not (SHARED_DATA / "data").is_dir():
    pytest.skip(f"{SHARED_DATA}/data not present (only developers and CI have it)")
  return SHARED_DATA


def pytest_unconfigure(config):
  del config
  if _OWNED_CACHE_DIR:  # Only the process that made the directory removes it.
    shutil.rmtree(_OWNED_CACHE_DIR, ignore_errors=True)
