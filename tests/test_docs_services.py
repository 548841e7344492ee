"""The documented commands that tests/test_docs.py only dry-runs, run in full.

Those commands need more than test_docs' shared tiny run: a method demo (minutes at demo
size), a model on the Hugging Face Hub, a web server, a bucket, a TPU pod. Each runs here
through the command line as written (in-process through `cli.main`; the explorer, which serves
until stopped, as a process), but for:

- the documented placeholders (`test_docs.PLACEHOLDERS`): `/tmp/...` paths and `demo_out` go
  into the test's folder, `BUCKET` is a folder of the storage emulator's bucket, and the
  explorer listens on a free port instead of 8765 or 8080;
- flags a user can pass as well that make the work tiny: the demos' own arguments
  (`DEMO_SHORTER`), test_docs' `SHORTER` for a training, a tiny model for the pod compiles
  (`TINY_POD_MODEL`; ClarifyDelphi's with the demo vocabulary);
- stand-ins for what is outside this machine: a Hugging Face Hub cache holding a tiny random
  T5 as `google/t5-v1_1-small` (offline; no connection leaves the machine), Google Cloud
  Storage (tests/gcs_server.py, and TensorFlow's client through tests/tls_proxy.py), v5e
  pods (libtpu compiles for their topologies on this CPU).
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from typing import Any, Callable, Iterator

import markupsafe
import numpy as np
import pytest
import test_docs
from conftest import child_xla_flags
from conftest import free_port
from conftest import tfds_pairs_task
from conftest import upload_folder

import gin
from jaxmoral import cli

# What runs is tested here, not how it is sharded (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_device")

ROOT = pathlib.Path(__file__).resolve().parents[1]
_ONE_LAYER = test_docs.ONE_LAYER
# Flags appended to a demo to make it tiny: each demo's own arguments (`jaxmoral clarify demo
# --help`), which a user may pass as well, and one layer on each side of its T5.
DEMO_SHORTER = {
    "clarify demo": ["--train_steps=2", "--batch_size=4", "--ppo_iterations=1",
                     "--ppo_batch_size=2", "--eval_situations=2", *_ONE_LAYER],
    "npov demo": ["--base_steps=2", "--prompt_steps=2", "--classifier_steps=2",
                  "--warmup_steps=1", "--batch_size=4", "--max_test_examples=1",
                  "--max_input_length=64", "--max_target_length=32", *_ONE_LAYER,
                  # Salience's backward passes over one chunk of a fixed shape: compiled once,
                  # not once per response length (the demo's own detectors read the gin).
                  "--gin.SalienceConfig.max_input_tokens=64",
                  "--gin.SalienceConfig.max_target_tokens=16"],
}
# Appended to a pod compile: T5 1.1 large to XXL is minutes and GBs to compile; the tiny T5
# with the pod config's partitioning, optimizer and dtypes compiles for the same chips in
# seconds. BATCH_SIZE 16: a multiple of each config's data axis (16 at most).
TINY_POD_MODEL = ["--gin.config.t5_config.size='tiny'", *_ONE_LAYER, "--gin.BATCH_SIZE=16",
                  "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}"]
# Every documented pod compile, each once.
POD_COMPILES = test_docs._once(  # pylint: disable=protected-access
    c for _, c in test_docs.COMMANDS if c.startswith("jaxmoral compile "))
HUB_ID = "google/t5-v1_1-small"
# Appended to the Hub fine-tune, with SHORTER's flags: the model and its stand-in stay small.
SMALLER_VOCABULARY = "--gin.config.t5_config.vocab_size=512"
# test_docs' placeholder filling and run-in-full rewriting, shared rather than copied.
_words = test_docs._words  # pylint: disable=protected-access
_in_full = test_docs._in_full  # pylint: disable=protected-access


def _documented(prefix: str) -> list[str]:
  """The documented commands that start with `prefix`, each once, in file order."""
  return test_docs._once(  # pylint: disable=protected-access
      c for _, c in test_docs.COMMANDS if c.startswith(prefix))


def _cli(words: list[str]) -> int:
  """`jaxmoral WORDS...` in this process, with a clean gin config before and after."""
  assert words[0] == "jaxmoral", words
  gin.clear_config()
  try:
    return cli.main(words[1:])
  finally:
    gin.clear_config()


def _is_png(path: pathlib.Path) -> bool:
  return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the explorer -------------------------------------------------------------------------------


class _Explorer:
  """`jaxmoral explore ...` as a process on a free port (the documented one may be taken)."""

  def __init__(self, command: str, replacements: dict[str, str], cwd: pathlib.Path,
               log: pathlib.Path):
    words = []
    for word in _words(command):
      words.append(replacements.get(word, word))
    self.port = free_port()
    # The documented port (8080), or the default one (8765) where none is given, is a
    # placeholder-like choice: a test takes a port nothing listens on.
    words = [w for w in words if not w.startswith("--port=")] + [f"--port={self.port}"]
    self.words = words
    self.url = f"http://127.0.0.1:{self.port}"
    self.log = log
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with open(log, "w", encoding="utf-8") as out:
      self.process = subprocess.Popen(  # pylint: disable=consider-using-with
          [sys.executable, "-m", "jaxmoral.cli", *words[1:]], cwd=cwd, env=env, stdout=out,
          stderr=subprocess.STDOUT)

  def wait(self, timeout: float = 180.0) -> None:
    """Until it answers (it imports what its pages use before it serves)."""
    deadline = time.time() + timeout
    while True:
      try:
        urllib.request.urlopen(self.url + "/favicon.ico", timeout=2).close()
        return
      except OSError:
        if self.process.poll() is not None or time.time() > deadline:
          self.stop()
          pytest.fail(f"{' '.join(self.words)} did not start: {self.log.read_text()}")
        time.sleep(0.2)

  def get(self, route: str, **query: str) -> str:
    url = f"{self.url}{route}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=30) as response:
      assert response.status == 200, url
      return response.read().decode()

  def stop(self) -> None:
    if self.process.poll() is None:
      self.process.terminate()
      try:
        self.process.wait(timeout=20)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def clarify_demo(one_device: None, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[dict[str, Any]]:
  """README's and docs/methods.md's `jaxmoral clarify demo --workdir=demo_out/clarify`, run in
  a folder of its own, and the two documented `jaxmoral explore` commands over its outputs.

  The explorers start beside the demo (the first before it: it reads its folder on each
  request), so that their start-up overlaps the work of this module's other tests.
  """
  del one_device  # Set up first: the demo runs on one device.
  folder = tmp_path_factory.mktemp("docs_services")
  (folder / "demo_out").mkdir()
  explore = {c.split()[2]: c for c in _documented("jaxmoral explore")}
  assert set(explore) == {"demo_out", "RUN_DIR"}, explore
  servers = {}
  try:
    # `jaxmoral explore demo_out`, in the folder that holds demo_out.
    servers["demo_out"] = _Explorer(explore["demo_out"], {}, folder,
                                    folder / "explore_demo_out.log")
    (command,) = _documented("jaxmoral clarify demo")
    words = _words(command) + DEMO_SHORTER["clarify demo"]
    printed = io.StringIO()
    with contextlib.chdir(folder), contextlib.redirect_stdout(printed):
      assert _cli(words) == 0, command
    workdir = folder / "demo_out" / "clarify"
    # docs/explore.md's `RUN_DIR experiments/results MODEL_DIR`: the demo's multitask run, the
    # project's experiment results (the docs' commands run in the project root), the demo's PPO
    # policy as the model.
    servers["run"] = _Explorer(
        explore["RUN_DIR"], {"RUN_DIR": str(workdir / "multitask_model"),
                             "MODEL_DIR": str(workdir / "ppo")}, ROOT, folder / "explore_run.log")
    yield {"command": command, "workdir": workdir, "servers": servers,
           "printed": printed.getvalue()}
  finally:
    for server in servers.values():
      server.stop()


def test_the_clarify_demo_runs_in_full(clarify_demo: dict[str, Any]) -> None:
  """Everything its docstring says it writes: the multitask run, the PPO run with its reward
  curve, the evaluation table of every system, the chat transcript."""
  workdir = clarify_demo["workdir"]
  assert test_docs.checkpoint_steps(workdir / "multitask_model") == [2]
  assert list((workdir / "multitask_model" / "train").glob("events.out.tfevents.*"))
  assert test_docs.checkpoint_steps(workdir / "ppo") == [1]
  assert _is_png(workdir / "ppo" / "reward_curve.png")
  evaluation = json.loads((workdir / "evaluation.json").read_text())
  assert {"why", "finetuned", "pipeline", "ppo"} <= set(evaluation), sorted(evaluation)
  assert len(evaluation["ppo"]["samples"]) == 2  # --eval_situations=2
  transcript = [json.loads(line) for line in
                (workdir / "chat_transcript.jsonl").read_text().splitlines()]
  assert transcript and all(turn["situation"] for turn in transcript), transcript
  # It says where its outputs went (relative to the folder it ran in, as the user typed it).
  printed = clarify_demo["printed"]
  assert "== ClarifyDelphi demo ==" in printed, printed
  for output in ("ppo", "ppo/reward_curve.png", "evaluation.json", "chat_transcript.jsonl"):
    assert f"demo_out/clarify/{output}" in printed, (output, printed)


# -- NPOV's demo --------------------------------------------------------------------------------


def _bound_demo(words: list[str]) -> dict[str, Any]:
  """The arguments `jaxmoral npov demo WORDS...` runs the demo with (as the command line binds
  its flags over its gin files), less the workdir."""
  import inspect  # pylint: disable=g-import-not-at-top
  from jaxmoral import action_commands, gin_utils  # pylint: disable=g-import-not-at-top
  from jaxmoral.npov import commands  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  try:
    gin_args, rest = gin_utils.split_gin_args(words[3:])
    run_demo = action_commands.bind_action(commands.ACTIONS, commands.OUTPUTS, "demo", rest,
                                           gin_args, prog="jaxmoral npov demo")
    arguments = {name: p.default for name, p in inspect.signature(run_demo).parameters.items()}
    arguments.update(gin.get_bindings("npov.demo.run_demo"))
    del arguments["workdir"]
    return arguments
  finally:
    gin.clear_config()


def test_the_npov_demos_run_in_full(tmp_path: pathlib.Path) -> None:
  """docs/methods.md's `npov demo` and the tiny config's, which writes every run, table and
  picture its docstring lists. With the flags that make them tiny the two bind the same run
  (the flags override the config's step counts; its other values are the defaults), so the
  config's stands for both."""
  commands = _documented("jaxmoral npov demo")
  assert len(commands) == 2 and any("tiny_cpu_demo.gin" in c for c in commands), commands
  bound = [_bound_demo(_in_full(c, tmp_path) + DEMO_SHORTER["npov demo"]) for c in commands]
  assert bound[0] == bound[1] and bound[0]["base_steps"] == 2, bound
  (command,) = [c for c in commands if "tiny_cpu_demo.gin" in c]
  words = _in_full(command, tmp_path) + DEMO_SHORTER["npov demo"]
  assert _cli(words) == 0, command
  workdir = pathlib.Path(next(w.split("=", 1)[1] for w in words if w.startswith("--workdir=")))
  assert workdir.is_relative_to(tmp_path), workdir
  assert (workdir / "vocab" / "demo_spm_400.model").is_file()
  for run in ("base_run", "generator", "classifier_hallucination", "classifier_coverage"):
    assert test_docs.checkpoint_steps(workdir / run) == [2], run
  for prompt_run in ("generator", "classifier_hallucination", "classifier_coverage"):
    assert any((workdir / prompt_run / "prompt").iterdir()), prompt_run
  results = json.loads((workdir / "eval" / "results.json").read_text())
  assert set(results) == {"unparaphrased", "paraphrased"}, sorted(results)
  assert all(set(r) == {"rouge", "salience", "classifier"} for r in results.values()), results
  assert (workdir / "eval" / "table.txt").read_text().strip()
  assert all(_is_png(workdir / "eval" / f"roc_{s}.png") for s in results)
  responses = (workdir / "detect" / "responses.jsonl").read_text().splitlines()
  scores = [json.loads(line) for line in
            (workdir / "detect" / "scores.jsonl").read_text().splitlines()]
  assert len(scores) == len(responses) > 0
  assert all(0 <= s["hallucination"] <= 1 for s in scores), scores
  assert len(list((workdir / "detect" / "heatmaps").glob("*.html"))) == len(responses)


# -- a fine-tune from a Hub id ------------------------------------------------------------------


@contextlib.contextmanager
def _no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
  """Within: every connection or name lookup to another machine is refused and recorded."""
  attempts: list[str] = []

  def loopback(host: Any) -> bool:
    if not isinstance(host, str) or host in ("localhost", ""):
      return True
    try:
      return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
      return False

  def guard(original: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: socket.socket, address: Any, *args: Any, **kwargs: Any) -> Any:
      if isinstance(address, tuple) and not loopback(address[0]):
        attempts.append(f"connect {address}")
        raise OSError(f"test: no network ({address})")
      return original(self, address, *args, **kwargs)
    return call

  original_lookup = socket.getaddrinfo

  def lookup(host: Any, *args: Any, **kwargs: Any) -> Any:
    if not loopback(host.decode() if isinstance(host, bytes) else host):
      attempts.append(f"lookup {host}")
      raise socket.gaierror(f"test: no network ({host})")
    return original_lookup(host, *args, **kwargs)

  monkeypatch.setattr(socket.socket, "connect", guard(socket.socket.connect))
  monkeypatch.setattr(socket.socket, "connect_ex", guard(socket.socket.connect_ex))
  monkeypatch.setattr(socket, "getaddrinfo", lookup)
  yield attempts


@pytest.fixture(scope="module")
def tuned(one_device: None, tmp_path_factory: pytest.TempPathFactory,
          demo_vocab_path: str) -> dict[str, Any]:
  """README's `jaxmoral train ... --gin.INIT_CHECKPOINT="'google/t5-v1_1-small'"` (made short
  by test_docs' SHORTER), offline, from a Hub cache that holds a tiny random T5 under that id.

  The run's model is the gin config's (gin/models/t5_1_1_small.gin, the checkpoint's
  architecture), made small as SHORTER makes a training short: one layer a side, and a
  vocabulary of 512 entries (`SMALLER_VOCABULARY`) instead of 32,128, which would make the
  stand-in 130 MB. The stand-in has those dimensions and the demo vocabulary.
  It is written as Hugging Face's files by the library's own writer (`export_hf_t5`, what
  `jaxmoral export --format=hf` writes for transformers), without importing torch.
  """
  del one_device
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top

  from jaxmoral import model_dirs  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import hf_import  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import t5  # pylint: disable=g-import-not-at-top
  folder = tmp_path_factory.mktemp("hub_fine_tune")
  hub = folder / "hf_home" / "hub"
  repo = hub / f"models--{HUB_ID.replace('/', '--')}"
  commit = "1" * 40
  config = config_lib.t5_config(size="small", num_encoder_layers=1, num_decoder_layers=1,
                                vocab_size=512)
  shapes = nn.meta.unbox(jax.eval_shape(
      lambda: t5.init_params(t5.T5(config), jax.random.PRNGKey(0))))
  rng = np.random.default_rng(7)
  stand_in = jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(np.float32), shapes)
  snapshot = repo / "snapshots" / commit
  hf_import.export_hf_t5(stand_in, config, snapshot)
  shutil.copyfile(demo_vocab_path, snapshot / "spiece.model")
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(commit)
  (command,) = [c for c in _documented("jaxmoral train") if HUB_ID in c]
  words = [*_in_full(command, folder), SMALLER_VOCABULARY]
  with pytest.MonkeyPatch.context() as patch:
    for name, value in (("HF_HOME", str(folder / "hf_home")), ("HF_HUB_CACHE", str(hub)),
                        ("HF_HUB_OFFLINE", "1")):
      patch.setenv(name, value)
    # huggingface_hub read the environment when it was imported.
    patch.setattr(constants, "HF_HUB_CACHE", str(hub))
    patch.setattr(constants, "HF_HUB_OFFLINE", True)
    patch.chdir(folder)  # No local folder google/t5-v1_1-small: the id is the Hub's.
    with _no_network(patch) as attempts:
      code = _cli(words)
      found = model_dirs.inspect(HUB_ID)
  return {"command": command, "code": code, "run": folder / "tuned", "stand_in": stand_in,
          "found": found, "attempts": attempts}


def test_the_hub_fine_tune_runs_offline_from_the_hub_cache(tuned: dict[str, Any]) -> None:
  from jaxmoral import metric_writers  # pylint: disable=g-import-not-at-top
  from jaxmoral import model_dirs  # pylint: disable=g-import-not-at-top
  assert tuned["code"] == 0, tuned["command"]
  assert tuned["attempts"] == [], tuned["attempts"]
  run = tuned["run"]
  assert test_docs.checkpoint_steps(run) == [4]  # SHORTER's TRAIN_STEPS
  scalars = metric_writers.read_scalars(str(run / "train"))
  losses = [v for tag, points in scalars.items() if tag.endswith("loss") for v in points.values()]
  assert losses and np.isfinite(losses).all(), scalars
  # It started from the stand-in's weights: four small AdamW steps from them, not a fresh init
  # (whose entries differ from these by about one).
  loaded = model_dirs.load(run)
  embedding = np.asarray(loaded.params["token_embedder"]["embedding"])
  stand_in = tuned["stand_in"]["token_embedder"]["embedding"]
  assert embedding.shape == stand_in.shape
  assert 0 < np.abs(embedding - stand_in).max() < 0.05
  # The id resolved to the Hub cache's snapshot: a Hugging Face folder with its vocabulary.
  assert tuned["found"].format == "hub" and tuned["found"].vocabulary is not None


# -- a bucket -----------------------------------------------------------------------------------


def _in_bucket(command: str, prefix: str) -> list[str]:
  """The command's words with BUCKET a folder of the emulator's bucket of its own."""
  words = _words(command)
  return [w.replace("gs://BUCKET/", f"gs://{test_docs.PLACEHOLDERS['BUCKET']}/{prefix}/")
          for w in words]


def test_the_bucket_export_runs_in_full(gcs: str, tuned: dict[str, Any]) -> None:
  """docs/scaling.md's `export --model_dir=gs://BUCKET/run --output=gs://BUCKET/export
  --format=hf`, of the fine-tuned run uploaded to the bucket: the Hugging Face files land in
  the bucket and hold the run's weights."""
  del gcs
  assert tuned["code"] == 0, "the fine-tune to export failed (see the Hub test)"
  from jaxmoral import fileio  # pylint: disable=g-import-not-at-top
  from jaxmoral import model_dirs  # pylint: disable=g-import-not-at-top
  (command,) = [c for c in _documented("jaxmoral export") if "gs://" in c]
  words = _in_bucket(command, "docs_export")
  model_dir = next(w.split("=", 1)[1] for w in words if w.startswith("--model_dir="))
  output = next(w.split("=", 1)[1] for w in words if w.startswith("--output="))
  upload_folder(tuned["run"], model_dir)
  assert _cli(words) == 0, command
  objects = set(fileio.walk_files(output))
  assert {"config.json", "model.safetensors", "spiece.model"} <= objects, objects
  exported, run = model_dirs.load(output), model_dirs.load(tuned["run"])
  assert exported.info.format == "hf" and exported.config.architecture() == \
      run.config.architecture()
  np.testing.assert_array_equal(np.asarray(exported.params["token_embedder"]["embedding"]),
                                np.asarray(run.params["token_embedder"]["embedding"]))


def test_the_tfds_bucket_cache_runs_in_full(tensorflow_gcs: list[str],
                                            tmp_path: pathlib.Path) -> None:
  """docs/cli.md's `cache --tfds_data_dir=gs://BUCKET/tfds ... MIXTURE_OR_TASK_NAME=
  'my_tfds_task' ... DATA_CACHE='gs://BUCKET/data'`: 'my_tfds_task' is what a user registers
  (a seqio Task over a TFDS dataset, in their module), here over a tiny prepared dataset in the
  bucket, which TensorFlow's own client reads; the rows land in the bucket's data cache."""
  import seqio  # pylint: disable=g-import-not-at-top

  from jaxmoral import fileio  # pylint: disable=g-import-not-at-top
  from jaxmoral import runs  # pylint: disable=g-import-not-at-top
  from jaxmoral.data import vocab  # pylint: disable=g-import-not-at-top
  (command,) = [c for c in _documented("jaxmoral cache") if "gs://" in c]
  words = _in_bucket(command, "docs_tfds")
  tfds_dir = next(w.split("=", 1)[1] for w in words if w.startswith("--tfds_data_dir="))
  cache = next(w.split("=", 1)[1].strip("'") for w in words
               if w.startswith("--gin.DATA_CACHE="))
  pairs = {"inputs": [f"question: skipping class {i}" for i in range(40)],
           "targets": [f"why did you skip it {i % 7}" for i in range(40)]}
  # The run's own vocabulary, as the command builds it (tiny_cpu.gin names none): the demo's.
  vocabulary_path = vocab.build_demo_vocabulary(output_dir=tmp_path / "vocab")
  try:
    with tfds_pairs_task("my_tfds_task", "jaxmoral_docs_pairs", tmp_path / "tfds", pairs,
                         vocabulary_path=vocabulary_path, validation_rows=8):
      upload_folder(tmp_path / "tfds", tfds_dir)
      assert _cli(words) == 0, command
  finally:
    seqio.set_tfds_data_dir_override(None)
  read = [urllib.parse.unquote(r) for r in tensorflow_gcs]
  record = f"{tfds_dir.removeprefix('gs://')}/jaxmoral_docs_pairs/1.0.0/" \
           "jaxmoral_docs_pairs-train.tfrecord-00000-of-00001"
  assert f"storage.googleapis.com /{record}" in read, read[-5:]
  assert fileio.walk_files(cache)
  # A run given that cache reads its batches from the bucket, without the Task.
  train, _ = runs.Seq2SeqData(mixture_or_task_name="my_tfds_task", cache_dir=cache).sources(
      vocabulary=vocab.get_vocabulary(vocabulary_path), batch_size=4,
      feature_lengths={"inputs": 48, "targets": 24}, seed=0)
  assert train.num_examples == len(pairs["inputs"])
  assert train.batch(0)["encoder_input_tokens"].shape == (4, 48)


# -- processes on this machine -----------------------------------------------------------------


def test_the_documented_local_launch_runs_in_full(tmp_path: pathlib.Path) -> None:
  """docs/scaling.md's `launch/local.sh -n 2 -d 2 -- train ...`: two jaxmoral processes of two
  CPU devices each join as one job and train the tiny config (`...`, made short by test_docs'
  SHORTER), as written but for the coordinator's port (a free one, as `-p` or
  JAXMORAL_COORDINATOR_PORT let a user choose)."""
  (command,) = _documented("launch/local.sh")
  words = [*_in_full(command, tmp_path), *test_docs.SHORTER["train"]]
  assert words[:words.index("--") + 2] == ["launch/local.sh", "-n", "2", "-d", "2", "--",
                                           "train"], words
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=child_xla_flags(),
             JAXMORAL_COORDINATOR_PORT=str(free_port()),
             JAXMORAL=str(pathlib.Path(sys.executable).with_name("jaxmoral")))
  result = subprocess.run([str(ROOT / words[0]), *words[1:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-3000:]
  lines = output.splitlines()
  assert all(any(line.startswith(f"[process {i}] ") for line in lines) for i in (0, 1)), output
  model_dir = pathlib.Path(next(w.split("=", 1)[1] for w in words
                                if w.startswith("--gin.MODEL_DIR=")).strip("'"))
  assert test_docs.checkpoint_steps(model_dir) == [4]  # SHORTER's TRAIN_STEPS, saved once.
  # One job: each process wrote its share of that checkpoint (Orbax, one folder a process).
  state = model_dir / "checkpoints" / "4" / "state"
  assert sorted(p.name for p in state.glob("ocdbt.process_*")) == [
      "ocdbt.process_0", "ocdbt.process_1"], output


# -- pod compiles -------------------------------------------------------------------------------


@pytest.mark.parametrize("command", POD_COMPILES,
                         ids=lambda c: c.split("--gin_file=")[1].split()[0])
def test_the_pod_compiles_run_in_full(command: str, demo_vocab_path: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
  """Every documented `jaxmoral compile` (README.md, docs/, the pod configs' headers), with a
  tiny model: each program compiles for the topology's chips and the report says what each
  chip holds."""
  import jax  # pylint: disable=g-import-not-at-top

  from jaxmoral import aot  # pylint: disable=g-import-not-at-top
  words = _words(command)
  topology = next(w.split("=", 1)[1] for w in words if w.startswith("--topology="))
  try:
    aot.get_topology(topology)
  except ValueError as error:
    pytest.skip(f"no usable libtpu for compile-only TPU topologies: {error}")
  chips = int(np.prod([int(n) for n in topology.split(":")[1].split("x")]))
  if "--gin_file=configs/clarify/tpu_pod.gin" in words:
    # PPO's five models are built from the config's own settings; its vocabulary is under
    # ../shared, which a clone may lack: the demo one instead, as a data flag, with judge
    # classes of one token each in it.
    from jaxmoral.clarify import formats  # pylint: disable=g-import-not-at-top
    words += ["--gin.config.t5_config.size='tiny'", *_ONE_LAYER,
              f"--gin.VOCABULARY_PATH='{demo_vocab_path}'",
              f"--gin.reward.RewardConfig.judge_classes={formats.DEMO_JUDGE_CLASSES!r}"]
  else:
    words += TINY_POD_MODEL
  # `compile` turns the persistent compilation cache off for its process (compile-only TPU
  # programs cannot be loaded back): on again after, for the tests that follow in this one.
  cached = jax.config.jax_enable_compilation_cache
  try:
    assert _cli(words) == 0, command
  finally:
    jax.config.update("jax_enable_compilation_cache", cached)
  out, err = capsys.readouterr()
  compiled = re.findall(rf"compile \[(\d+)/(\d+)\] \S+ \(\S+ for {re.escape(topology)}\): "
                        r"compiled in", err)
  assert compiled and compiled[-1][0] == compiled[-1][1], err
  assert f"jaxmoral compile {topology}:" in out, out
  assert f"(tpu, {chips} devices, 1 slice(s), mesh " in out, out
  assert "memory               FITS" in out, out
  peak = next(line for line in out.splitlines() if line.strip().startswith("peak / chip"))
  assert 0 < float(peak.split()[-2]) < 16, peak
  assert "HBM / chip             16.000 GiB" in out, out
  if words[2:4] == ["--gin_file=configs/core/large_tpu_pod.gin", "--topology=v5e:8x8"]:
    assert "mesh {'data': 16, 'model': 4})" in out, out  # The README's: MODEL_PARALLEL 4.


# -- the explorer -------------------------------------------------------------------------------


def test_the_documented_explorers_serve_their_folders(clarify_demo: dict[str, Any]) -> None:
  """`jaxmoral explore demo_out` and `jaxmoral explore RUN_DIR experiments/results MODEL_DIR`:
  the index names what the folders hold, and the pages read the demo's files."""
  servers = clarify_demo["servers"]
  for server in servers.values():
    server.wait()
  demo_out = servers["demo_out"]
  index = demo_out.get("/")
  for shown in ("clarify/multitask_model", "clarify/ppo", "clarify/evaluation.json",
                "clarify/chat_transcript.jsonl"):
    assert shown in index, shown
  evaluation = json.loads((clarify_demo["workdir"] / "evaluation.json").read_text())
  page = demo_out.get("/clarify", root="0", path="clarify/evaluation.json")
  situation = evaluation["ppo"]["samples"][0]["situation"]
  assert str(markupsafe.escape(situation)) in page, situation
  config = demo_out.get("/file", root="0", path="clarify/multitask_model/config.gin")
  assert config == (clarify_demo["workdir"] / "multitask_model" / "config.gin").read_text()
  run = servers["run"]
  index = run.get("/")
  assert "multitask_model" in index and "Models (live input)" in index
  assert any(p.stem in index for p in (ROOT / "experiments" / "results").glob("*.json"))
  # The run's page: its one checkpoint step, its integrity checked against the manifest.
  page = run.get("/runs", root="0", path="")
  assert '<tr class="ok" data-step="2"><td class="num">2</td><td>verified</td>' in page, page
