"""Test setup: 8 fake CPU devices (mesh tests) before JAX is imported anywhere, and one
compilation cache per test run."""

import contextlib
import logging
import os
import shutil
import tempfile
from typing import Iterator, Optional

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# Most of the suite's time is XLA:CPU compiling hundreds of tiny programs, which run for
# milliseconds: LLVM's optimisation passes halve the compile time and buy nothing here. The
# subprocesses the tests start inherit these flags. Set them yourself to test optimised code.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# XLA:CPU's MLIR fusion emitters cost more compile time than the programs here run for (the
# microbatching tests: 24 -> 15 s without them); the classic emitters compute the same values.
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# Two pytest workers share two cores: Eigen's own thread pool inside each tiny matmul only adds
# switching (tests/test_trainer.py 54 -> 47 s, test_one_path.py 104 -> 95 s, alone).
if "xla_cpu_multi_thread_eigen" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_multi_thread_eigen=false"
# Nor does XLA:CPU's parallel code generation (the program split into 32 LLVM modules for a
# thread pool): a tiny T5's train step compiled in 1.61 s instead of 1.81 s (medians of 6
# interleaved processes each, 2-core VM, 2026-11-26).
if "xla_cpu_parallel_codegen_split_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_parallel_codegen_split_count=1"
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
  # Every program, however quick to compile: a resumed run, a second CLI process or the other
  # worker then loads what an earlier one compiled.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
else:
  _OWNED_CACHE_DIR = None
# The same for the data index caches (`jaxmoral.data.index_cache`): shared by the run's tests
# and processes (runs of the same Task and vocabulary read one copy), never the user's.
if "JAXMORAL_DATA_CACHE" not in os.environ:
  os.environ["JAXMORAL_DATA_CACHE"] = tempfile.mkdtemp(prefix="jaxmoral_tests_data_")
  _OWNED_DATA_CACHE_DIR: Optional[str] = os.environ["JAXMORAL_DATA_CACHE"]
else:
  _OWNED_DATA_CACHE_DIR = None

import pathlib  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from jaxmoral import runtime  # noqa: E402

# The suite runs jaxmoral's programs as the CLI does (XLA:CPU workaround, host memory);
# the processes it starts inherit the flags.
runtime.configure()

ROOT = str(pathlib.Path(__file__).resolve().parents[1])  # The project root.
SHARED_DATA = pathlib.Path(ROOT).parent / "shared"


@pytest.fixture
def shared_dir() -> pathlib.Path:
  """../shared (real data); skips the test with a message when a clone lacks it."""
  if not (SHARED_DATA / "data").is_dir():
    pytest.skip(f"{SHARED_DATA}/data not present (only developers and CI have it)")
  return SHARED_DATA


# Seconds each of the slowest test files took (summed test durations, 2-core VM, 2026-11-28).
# `make test` hands whole files to its two workers (pytest-xdist, --dist loadscope,
# --no-loadscope-reorder) in collection order: longest first, so no long file is left to run
# alone at the end (xdist's default order, by test count, ran the two slowest files last).
# Only the order matters; a file not listed goes after these, in its usual order.
MODULE_SECONDS = {
    "test_object_storage": 75, "test_one_path": 63, "test_docs_services": 55,
    "test_docs_experiments": 50, "test_on_mesh": 43, "test_data_tasks": 40,
    "test_t5": 37, "test_explore": 35, "test_aot": 33, "test_microbatching": 33, "test_wheel": 33,
    "test_decoding": 31, "test_multiprocess": 30, "test_trainer": 28, "test_cli": 28,
    "test_reliability": 27, "test_ppo_trainer": 24, "test_train": 24,
    "test_diamante_model": 20, "test_adafactor": 17, "test_data_span_corruption": 17,
    "test_partitioning": 16, "test_clarify_chat": 16, "test_docs": 15,
    "test_tpu_attention": 14, "test_model_dirs": 14, "test_npov_salience": 13,
    "test_host_memory": 12, "test_diamante_inference": 12, "test_api": 11,
    "test_clarify_training": 11, "test_rl_rollout": 11,
}


def pytest_collection_modifyitems(config, items):
  del config
  items.sort(key=lambda item: -MODULE_SECONDS.get(item.path.stem, 0))  # stable: ties keep order


def pytest_unconfigure(config):
  del config
  for owned in (_OWNED_CACHE_DIR, _OWNED_DATA_CACHE_DIR):
    if owned:  # Only the process that made the directory removes it.
      shutil.rmtree(owned, ignore_errors=True)


@pytest.fixture
def clean_gin():
  """An empty gin config before and after the test (gin's config is process-wide): files that
  parse configs use it for every test, `pytestmark = pytest.mark.usefixtures("clean_gin")`."""
  import gin  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  yield
  gin.clear_config()


@pytest.fixture(scope="session")
def demo_vocab_path(tmp_path_factory) -> str:
  """The demo SentencePiece vocabulary (400 pieces + 100 extra ids), built once a session."""
  from jaxmoral.data import vocab as vocab_lib  # pylint: disable=g-import-not-at-top
  return vocab_lib.build_demo_vocabulary(output_dir=tmp_path_factory.mktemp("demo_vocab"))


def write_hf_t5(directory: pathlib.Path, *, seed: int = 0, vocab_path: Optional[str] = None,
                vocab_size: int = 512, d_model: int = 32, num_layers: int = 2,
                safe: bool = True, **config: Any) -> Any:
  """A random tiny T5 1.1 saved by transformers (`save_pretrained`), as a user would have one;
  returns the torch model. Weights are perturbed so that layer norms are not all ones."""
  import shutil as _shutil  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(seed)
  values = dict(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model,
                num_layers=num_layers, num_heads=4, dropout_rate=0.0,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False)
  values.update(config)
  model = transformers.T5ForConditionalGeneration(transformers.T5Config(**values)).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.mul_(1.0 + 0.3 * torch.randn_like(p))
    if not values["tie_word_embeddings"]:
      model.lm_head.weight = torch.nn.Parameter(
          torch.randn(vocab_size, d_model) * d_model ** -0.5)
  model.save_pretrained(directory, safe_serialization=safe)
  if vocab_path is not None:
    _shutil.copyfile(vocab_path, pathlib.Path(directory) / "spiece.model")
  return model


def git(cwd: Any, *args: str) -> str:
  """Runs git in `cwd` as a test identity ("main" as a new repository's branch): its output."""
  return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com",
                         "-c", "init.defaultBranch=main", *args], cwd=cwd, check=True,
                        capture_output=True, text=True).stdout.strip()


def child_xla_flags(*, device_count: Optional[int] = None) -> str:
  """XLA_FLAGS for a Python process a test starts: the suite's compile settings (above), and
  `device_count` fake CPU devices (None: one, as a user's process has)."""
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
  if device_count is not None:
    kept.insert(0, f"--xla_force_host_platform_device_count={device_count}")
  return " ".join(kept)


def hf_logits(model: Any, enc: Any, dec: Any) -> Any:
  """The torch model's logits (numpy) for encoder ids `enc` (0: padding) and decoder inputs
  `dec`: the reference the JAX forward passes are checked against."""
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(input_ids=torch.tensor(enc, dtype=torch.long),
                 attention_mask=torch.tensor(enc != 0, dtype=torch.long),
                 decoder_input_ids=torch.tensor(dec, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="session")
def hf_t5(tmp_path_factory, demo_vocab_path) -> tuple[pathlib.Path, Any]:
  """(folder, torch model): a tiny T5 1.1 in Hugging Face's format with the demo vocabulary."""
  pytest.importorskip("transformers")
  directory = tmp_path_factory.mktemp("hf_t5")
  return directory, write_hf_t5(directory, vocab_path=demo_vocab_path, num_layers=1)


@pytest.fixture(scope="module")
def one_device():
  """Meshes made without explicit devices use one device instead of the 8 fake ones, for the
  tests of a module that checks what runs, not how it is sharded: one device's programs
  compile and run faster. Request it with `pytest.mark.usefixtures("one_device")`."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxmoral import partitioning  # pylint: disable=g-import-not-at-top
  with partitioning.default_devices(jax.devices()[:1]):
    yield


def free_port() -> int:
  """A TCP port on localhost that nothing listens on now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def set_environment(env: dict[str, str]) -> Iterator[None]:
  """`env` in os.environ (this process and those it starts) within `with`; the old values,
  or their absence, after (for fixtures wider than a test, where `monkeypatch` is not)."""
  with pytest.MonkeyPatch.context() as patch:
    for key, value in env.items():
      patch.setenv(key, value)
    yield


@pytest.fixture(autouse=True)
def no_log_handler_outlives_its_test():
  """Removes the root-logger handlers a test installed (pytest's own stay).

  A process's start-up (`cli.quiet_logs(force=True)`, which every experiment's `main` calls)
  puts a handler on the root logger bound to the test's captured stderr. pytest closes that
  stream after the test, so every later test in the worker would log into a closed file
  ("--- Logging error ---" in the one-line errors that tests read).
  """
  before, level = set(logging.root.handlers), logging.root.level
  yield
  for handler in list(logging.root.handlers):
    if handler not in before and not type(handler).__module__.startswith("_pytest"):
      logging.root.removeHandler(handler)
      handler.close()
  logging.root.setLevel(level)


BUCKET_FIXTURES = frozenset({"gcs", "tensorflow_gcs", "s3"})


@pytest.fixture(autouse=True)
def bucket_paths_stay_in_the_bucket(request):
  """After each test that uses a storage server: no bucket URL ended up on the local disk.

  `pathlib.Path("gs://b/run")` is the relative path `gs:/b/run`, and `os.makedirs` or
  `open` given the URL write there: a module that handles a run path without `fileio` fails
  the test that reached it, instead of silently keeping the run in the working folder.
  """
  yield
  if not BUCKET_FIXTURES & set(request.fixturenames):
    return
  strays = sorted({os.path.join(folder, f"{scheme}:") for folder in (os.getcwd(), ROOT)
                   for scheme in ("gs", "s3")
                   if os.path.lexists(os.path.join(folder, f"{scheme}:"))})
  for stray in strays:
    shutil.rmtree(stray, ignore_errors=True)  # So that the next test is judged on its own.
  assert not strays, f"a bucket path was written to the local disk as {strays}"


def start_storage_server() -> tuple[subprocess.Popen, str]:
  """(process, URL) of a new GCS-API server (tests/gcs_server.py), once it answers."""
  port = free_port()
  server = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).parent / "gcs_server.py"),
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f"http://127.0.0.1:{port}"
  deadline = time.time() + 30
  while True:
    try:
      urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).read()
      return server, url
    except OSError:
      if time.time() > deadline or server.poll() is not None:
        server.kill()
        raise RuntimeError("the GCS-API server did not start") from None
      time.sleep(0.1)


@pytest.fixture(scope="session")
def gcs():
  """A GCS-API server (tests/gcs_server.py) with one bucket, `bucket`; every client of this
  process and the processes it starts is configured for it (its URL is returned)."""
  server, url = start_storage_server()
  env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
         "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "EPATH_USE_TF": "false",
         "NO_GCE_CHECK": "true", "GOOGLE_CLOUD_PROJECT": "test"}
  try:
    with set_environment(env):  # Before any client is first used; subprocesses inherit it.
      yield url
  finally:
    server.kill()
    server.wait()


def upload_folder(local: pathlib.Path, url: str) -> str:
  """Copies every file under `local` to the same relative names under `url`; returns `url`."""
  from jaxmoral import fileio  # pylint: disable=g-import-not-at-top
  for path in sorted(p for p in local.rglob("*") if p.is_file()):
    fileio.upload(path, f"{url}/{path.relative_to(local).as_posix()}")
  return url


@contextlib.contextmanager
def tfds_pairs_task(task: str, dataset: str, folder: pathlib.Path,
                    pairs: dict[str, list[str]], *, vocabulary_path: str,
                    validation_rows: int) -> Iterator[None]:
  """A seqio Task `task` over a prepared TFDS dataset `dataset` (version 1.0.0, written under
  `folder`) of text `pairs` ({"inputs": [...], "targets": [...]}: the train split, its first
  `validation_rows` the validation split), tokenized with the vocabulary at `vocabulary_path`:
  what a user's module registers for `--tfds_data_dir`. Registered within, removed after."""
  # pylint: disable=g-import-not-at-top
  import seqio
  import tensorflow as tf
  import tensorflow_datasets as tfds

  from jaxmoral.data import vocab
  # pylint: enable=g-import-not-at-top
  tfds.dataset_builders.store_as_tfds_dataset(
      name=dataset, version="1.0.0", data_dir=str(folder),
      features=tfds.features.FeaturesDict({"inputs": tfds.features.Text(),
                                           "targets": tfds.features.Text()}),
      split_datasets={"train": tf.data.Dataset.from_tensor_slices(pairs),
                      "validation": tf.data.Dataset.from_tensor_slices(
                          {k: v[:validation_rows] for k, v in pairs.items()})})
  vocabulary = vocab.as_seqio(vocab.get_vocabulary(vocabulary_path))
  features = {k: seqio.Feature(vocabulary, add_eos=True) for k in ("inputs", "targets")}
  seqio.TaskRegistry.remove(task)
  seqio.TaskRegistry.add(task, source=seqio.TfdsDataSource(f"{dataset}:1.0.0"),
                         preprocessors=[seqio.preprocessors.tokenize], output_features=features)
  try:
    yield
  finally:
    seqio.TaskRegistry.remove(task)


@pytest.fixture(scope="session")
def tensorflow_gcs(gcs, tmp_path_factory):
  """TensorFlow's own GCS client (tf.io.gfile, tf.data, TFDS) pointed at the `gcs` server
  through tests/tls_proxy.py; yields the list of requests it made ("HOST PATH")."""
  import tls_proxy  # pylint: disable=g-import-not-at-top
  proxy, ca_bundle, stop, seen = tls_proxy.start(gcs, str(tmp_path_factory.mktemp("tls_proxy")))
  env = {"https_proxy": proxy, "CURL_CA_BUNDLE": ca_bundle,
         "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token", "no_proxy": "127.0.0.1,localhost",
         "GCS_RETRY_CONFIG_MAX_RETRIES": "2"}
  try:
    with set_environment(env):
      yield seen
  finally:
    stop()
