"""Reliability: refusals that change nothing, every file a run is read from verified, a trusted
compilation cache, preemption by signal, full disks, bad settings, gin files and data that fail
in one line.

One tiny trained run (module fixture) is copied into each test that changes it.
"""

import asyncio
import gc
import hashlib
import json
import logging
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import textwrap

import gin
import jax
import pytest

from conftest import child_xla_flags
from jaxmoral import cli, compilation_cache, integrity, model_dirs, partitioning, run_dirs
from jaxmoral import run_layout
from jaxmoral import train as train_lib
from jaxmoral.npov import task as npov_task

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = ["--gin_file=configs/core/tiny_cpu.gin", "--gin.WARMUP_STEPS=1", "--gin.BATCH_SIZE=8",
       "--gin.CHECKPOINT_EVERY=1", "--gin.EVAL_EVERY=0", "--gin.runs.train_run.eval_steps=0",
       "--gin.runs.train_run.log_every=1",
       # Short rows and one layer each side: what is checked is how a run refuses or fails,
       # not what it learns; smaller programs compile (and the data pass runs) faster.
       "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
       "--gin.config.t5_config.num_encoder_layers=1",
       "--gin.config.t5_config.num_decoder_layers=1",
       # One device: nothing here is about sharding (tests/test_on_mesh.py is), and a program
       # over 8 fake devices costs more to compile and run.
       "--gin.PARTITIONER=@test_reliability.one_device()"]


def one_device() -> partitioning.PjitPartitioner:
  return partitioning.PjitPartitioner(devices=jax.devices()[:1])


gin.external_configurable(one_device, module="test_reliability")


pytestmark = pytest.mark.usefixtures("one_device", "clean_gin")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> pathlib.Path:
  """A run at step 3 (checkpoints 1, 2 and 3)."""
  run = tmp_path_factory.mktemp("trained") / "run"
  gin.clear_config()
  assert cli.main(["train", *RUN, f"--gin.MODEL_DIR={run}", "--gin.TRAIN_STEPS=3"]) == 0
  gin.clear_config()
  return run


@pytest.fixture
def run(trained, tmp_path) -> pathlib.Path:
  copy = tmp_path / "run"
  shutil.copytree(trained, copy, symlinks=True)
  return copy


def snapshot(directory: pathlib.Path) -> dict[str, str]:
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def train(run: pathlib.Path, *flags: str) -> int:
  gin.clear_config()
  return cli.main(["train", *RUN, f"--gin.MODEL_DIR={run}", *flags])


def error_line(capsys) -> str:
  err = capsys.readouterr().err.strip().splitlines()
  assert err, "no message"
  assert not any(line.startswith("Traceback") for line in err), err
  return err[-1]


# -- 1, 8, 13: a refused resume changes nothing -------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--gin.config.t5_config.d_model=96", "--gin.TRAIN_STEPS=4"],
     "model_config.json: d_model=64 there, 96 here)"),
    (["--gin.TRAIN_STEPS=2"], "beyond train_steps=2"),
    (["--gin.SEED=1", "--gin.TRAIN_STEPS=4"], "seed=0 (this run: 1)"),
    (["--gin.BATCH_SIZE=16", "--gin.TRAIN_STEPS=4"], "batch_size=8 (this run: 16)"),
])
def test_a_refused_resume_changes_nothing(run, flags, message, capsys):
  before = snapshot(run)
  assert train(run, *flags) == 2
  line = error_line(capsys)
  assert message in line and "strict" not in line, line
  assert snapshot(run) == before
  assert model_dirs.inspect(run).step == 3  # eval / export still read the run.


def test_stale_data_on_another_process_is_refused_before_anything_is_written(
    run, capsys, monkeypatch):
  before = snapshot(run)
  monkeypatch.setattr(partitioning, "processes_that_differ", lambda value: [1])
  assert train(run, "--gin.TRAIN_STEPS=4") == 2
  assert "process 1 of" in error_line(capsys)
  assert snapshot(run) == before


# -- 2, 7: every file a run is read from is verified --------------------------------------------
def flip(path: pathlib.Path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x01
  data[len(data) // 2 + 7] ^= 0x10
  path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["vocab/spiece.model", "model_config.json", "settings.json"])
def test_a_run_file_that_changed_is_refused(run, name):
  flip(run / name)
  with pytest.raises(integrity.CheckpointIntegrityError, match=f"{name} differs"):
    model_dirs.inspect(run)


def test_a_step_of_a_checksummed_run_never_loads_without_its_manifest(run, caplog):
  (run / "checkpoints" / "3" / integrity.INTEGRITY_FILE).unlink()
  with caplog.at_level(logging.WARNING):
    # The latest readable step is the newest finalised one (a save still being finalised, or
    # one whose manifest is gone, is not read), without the "unverified" warning.
    assert model_dirs.inspect(run).step == 2
    with pytest.raises(integrity.CheckpointIntegrityError, match="has no _INTEGRITY.json"):
      model_dirs.inspect(run, step=3)
  assert "checksums" not in caplog.text
  (run / "checkpoints" / "2" / integrity.INTEGRITY_FILE).write_text("")  # emptied
  with pytest.raises(integrity.CheckpointIntegrityError, match="unreadable"):
    model_dirs.inspect(run, step=2)


def test_a_run_written_before_manifests_loads_with_a_warning(run, caplog):
  (run / integrity.INTEGRITY_FILE).unlink()
  for step in ("1", "2", "3"):
    (run / "checkpoints" / step / integrity.INTEGRITY_FILE).unlink()
  with pytest.raises(integrity.CheckpointIntegrityError, match="the run's files has no"):
    model_dirs.inspect(run)  # A checksummed run: its manifests may not go missing.
  (run / "checkpoints" / integrity.CHECKSUMMED_FILE).unlink()  # an older run
  with caplog.at_level(logging.WARNING):
    assert model_dirs.inspect(run).step == 3
  assert "loading it unverified" in caplog.text


# -- 3: a trusted compilation cache --------------------------------------------------------------
def test_an_untrusted_cache_directory_is_refused(tmp_path, caplog):
  shared = tmp_path / "shared"
  shared.mkdir(mode=0o700)
  shared.chmod(0o777)
  theirs = tmp_path / "theirs"
  theirs.mkdir(mode=0o700)
  os.chown(theirs, 12345, 12345) if os.geteuid() == 0 else pytest.skip("needs root")
  with caplog.at_level(logging.WARNING):
    assert compilation_cache.enable(str(shared)) is None
    assert compilation_cache.enable(str(theirs)) is None
  assert "writable by group/others" in caplog.text and "owned by uid 12345" in caplog.text


_CHILD = textwrap.dedent("""
    import json, sys
    from jaxmoral import compilation_cache
    compilation_cache.enable(sys.argv[1], min_compile_seconds=0)
    import jax
    f = jax.jit(lambda x: x + 1.0)
    g = jax.jit(lambda x: x * 10.0 - 5.0)
    print(json.dumps({"f": float(f(3.0)), "g": float(g(3.0))}))
""")


def test_a_swapped_cache_entry_never_runs(tmp_path):
  cache = tmp_path / "cache"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
         "XLA_FLAGS": child_xla_flags()}  # one device, as a user's process has

  def child() -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(cache)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])

  assert child() == {"f": 4.0, "g": 25.0}
  entries = sorted(cache.glob("*-cache"))
  assert len(entries) == 2
  first, second = (p.read_bytes() for p in entries)
  entries[0].write_bytes(second)
  entries[1].write_bytes(first)
  assert child() == {"f": 4.0, "g": 25.0}  # compiled again, not each other's code


# -- 4: SIGTERM / SIGINT save at the next step boundary ------------------------------------------
class SignalAt(train_lib.TrainHook):
  """Sends this process a signal after one step, as a scheduler would."""

  def __init__(self, step: int, signum: int):
    self.step, self.signum = step, signum

  def after_step(self, loop, step, state, metrics):
    if step == self.step:
      # Without a handler the signal would end the test process itself.
      assert signal.getsignal(self.signum) not in (signal.SIG_DFL, signal.default_int_handler)
      os.kill(os.getpid(), self.signum)


gin.external_configurable(SignalAt, module="test_reliability")


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_the_next_step_and_releases_the_lock(run, signum, status, capsys):
  hook = ["--gin.runs.train_run.hooks=[@test_reliability.SignalAt()]",
          "--gin.test_reliability.SignalAt.step=4",
          f"--gin.test_reliability.SignalAt.signum={int(signum)}"]
  # The handler pytest started with: SIG_IGN for SIGINT where a shell started it in the
  # background, and the run must leave that as it found it too.
  before = signal.getsignal(signum)
  assert train(run, "--gin.TRAIN_STEPS=8", "--gin.CHECKPOINT_EVERY=100", *hook) == status
  line = error_line(capsys)
  assert f"stopped by {signal.Signals(signum).name}: saved step 4" in line
  assert run_dirs.saved_steps(run)[-1] == 4
  assert not (run / run_layout.LOCK_FILE).exists()
  assert signal.getsignal(signum) == before


# -- 5: a full disk -----------------------------------------------------------------------------
def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(run, capsys, monkeypatch):
  # The run's data cache (this process's copy of the demo Task's rows) is written first, so
  # the limit below hits a checkpoint save.
  assert train(run, "--gin.TRAIN_STEPS=3") == 0
  # The aborted save's other writes complete into a closed event loop; each would print a
  # traceback through this hook. Garbage of earlier tests is collected first: the failed
  # reads of the damaged-checkpoint tests leave futures in reference cycles, and whichever
  # test the collector happens to run in would report their errors.
  gc.collect()
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  # The kernel's own refusal: writes past RLIMIT_FSIZE fail with EFBIG, as ENOSPC would.
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))
  try:
    # TRAIN_STEPS is in the learning-rate schedule, a constant of the train step: 8, as in
    # the signal tests above, is a program the compilation cache already holds.
    code = train(run, "--gin.TRAIN_STEPS=8")
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, previous)
  assert code == 2
  line = error_line(capsys)
  assert line.startswith("jaxmoral train: error: File too large: ")
  assert f"{run / 'checkpoints'} (step 4 was not saved; the last complete checkpoint is 3" in line
  assert sorted(os.listdir(run / "checkpoints")) == ["1", "2", "3", integrity.CHECKSUMMED_FILE]
  assert model_dirs.inspect(run).step == 3
  assert [str(u.exc_value) for u in unraisable] == []


def test_unretrieved_writer_tasks_of_a_full_disk_are_not_reported_again(caplog):
  """An aborted save's other writer tasks fail with the same full disk and nobody awaits
  them; asyncio would log each one with its traceback when it is collected (at exit, after
  the one-line error). Those reports are dropped; any other failure is still reported."""
  # Installed by the command line's set-up; again here, for a test run alone.
  cli.report_disk_full_once()

  async def write(message):
    raise ValueError(message)

  full = ("OUT_OF_RANGE: Error writing \"params/0\": Failed to write 1 bytes to file 3: File "
          "too large [os_error_code='27']")
  loop = asyncio.new_event_loop()
  tasks = [loop.create_task(write(full)), loop.create_task(write("another failure"))]
  loop.run_until_complete(asyncio.sleep(0.01))  # Both ran and failed; nothing awaits them.
  loop.close()
  with caplog.at_level(logging.ERROR, logger="asyncio"):
    del tasks
    gc.collect()
  reported = [str(r.exc_info[1]) for r in caplog.records if r.name == "asyncio"]
  assert reported == ["another failure"]


# -- 6: a non-finite loss -----------------------------------------------------------------------
def test_a_non_finite_loss_is_one_line_with_its_causes(run, capsys):
  assert train(run, "--gin.TRAIN_STEPS=8", "--gin.LEARNING_RATE=1e12") == 2
  line = error_line(capsys)
  assert "non-finite" in line and "at step" in line and "learning rate" in line


# -- 9: gin files -------------------------------------------------------------------------------
def test_a_gin_import_of_a_missing_module_is_one_line(tmp_path, capsys):
  config = tmp_path / "bad.gin"
  config.write_text("import jaxmoral_no_such_module\n")
  assert cli.main(["train", f"--gin_file={config}"]) == 2
  line = error_line(capsys)
  assert "bad.gin:1: import failed: No module named 'jaxmoral_no_such_module'" in line


def test_a_gin_file_shadowing_a_project_config_is_named(tmp_path, monkeypatch, capsys, caplog):
  shadow = tmp_path / "configs" / "core" / "tiny_cpu.gin"
  shadow.parent.mkdir(parents=True)
  shadow.write_text("TRAIN_STEPS = (\n")
  monkeypatch.chdir(tmp_path)
  with caplog.at_level(logging.WARNING):
    assert cli.main(["train", "--gin_file=configs/core/tiny_cpu.gin"]) == 2
  assert f"is read from {shadow}, which shadows the project's" in caplog.text
  assert str(shadow) in error_line(capsys)


# -- 10: the run lock and MODEL_DIR -------------------------------------------------------------
def test_a_lock_path_that_is_a_folder_is_one_line(run, capsys):
  (run / run_layout.LOCK_FILE).mkdir()
  assert train(run, "--gin.TRAIN_STEPS=4") == 2
  assert "lock path is a folder" in error_line(capsys)
  assert (run / run_layout.LOCK_FILE).is_dir()


def test_a_dangling_model_dir_link_names_its_target(tmp_path, capsys):
  link = tmp_path / "link"
  link.symlink_to(tmp_path / "gone")
  assert train(link, "--gin.TRAIN_STEPS=3") == 2
  line = error_line(capsys)
  assert str(link) in line and str(tmp_path / "gone") in line


# -- 11: empty data -----------------------------------------------------------------------------
def test_an_empty_train_split_names_the_file(tmp_path, capsys):
  pairs = tmp_path / "pairs.tsv"
  pairs.write_text("inputs\ttargets\n")
  assert train(tmp_path / "new", "--gin.TRAIN_STEPS=3", "--gin.MIXTURE_OR_TASK_NAME=None",
               f"--gin.runs.Seq2SeqData.train_file='{pairs}'") == 2
  assert f"{pairs} has 0 pairs" in error_line(capsys)


def test_an_npov_example_without_arguments_is_an_error(tmp_path):
  path = tmp_path / "examples.jsonl"
  path.write_text(json.dumps({"query": "q?", "pro": ["a b"], "con": [], "response": "a"}) + "\n"
                  + json.dumps({"query": "q?", "pro": [], "con": [], "response": "a"}) + "\n")
  with pytest.raises(ValueError, match=r"examples\.jsonl:2: no arguments"):
    npov_task.read_examples(path, require_response=True)


def test_storage_clients_log_warnings_only():
  """A bucket run's log: not fsspec's INFO line per file opened, nor google.auth's warning
  per metadata-server probe."""
  cli.quiet_logs()
  assert not logging.getLogger("fsspec.caching").isEnabledFor(logging.INFO)
  assert not logging.getLogger("gcsfs").isEnabledFor(logging.INFO)
  assert not logging.getLogger("google.auth.compute_engine._metadata").isEnabledFor(
      logging.WARNING)


def test_a_knowledge_base_without_arguments_names_the_file_and_cause(tmp_path):
  from jaxmoral.npov import actions  # pylint: disable=g-import-not-at-top
  kb = tmp_path / "kb.jsonl"
  kb.write_text("".join(json.dumps({"query": f"q{i}?", "split": "train"}) + "\n"
                        for i in range(3)))
  with pytest.raises(ValueError, match=rf"no examples in split 'train' of {kb}: none of its 3 "
                     r"topics there has both a pro and a con argument \(of 3 topics, 0 have"):
    actions._topics_and_examples(action="train", kb_path=str(kb), perspectrum_dir=None,
                                 examples_path=None, split="train", seed=0, max_examples=None)


# -- 12: no binding accepted and then ignored ---------------------------------------------------
def test_infer_uses_the_decoding_backend_gin_names(trained, tmp_path, capsys):
  inputs = tmp_path / "in.txt"
  inputs.write_text("a question\n")
  argv = ["infer", *RUN, f"--gin.MODEL_DIR={trained}", f"--gin.INFER_INPUT='{inputs}'",
          f"--gin.INFER_OUTPUT='{tmp_path / 'out.jsonl'}'",
          "--gin.decoding.prepare_decode_weights.backend='no_such_backend'"]
  assert cli.main(argv) == 2
  assert "unknown backend 'no_such_backend'" in error_line(capsys)


# -- 13: a peer that dies ------------------------------------------------------------------------
PEER_DRIVER = textwrap.dedent("""
    import os
    from jaxmoral import partitioning
    partitioning.initialize_distributed()
    import jax, numpy as np
    from jax.experimental import multihost_utils
    from jaxmoral import cli
    multihost_utils.sync_global_devices("connected")
    if jax.process_index() == 1:
      os._exit(3)  # as a host that crashed or was preempted
    try:
      multihost_utils.process_allgather(np.ones(3))
      print("gathered")
    except RuntimeError as error:
      print(f"error: {error}", flush=True)
      print(f"message: {cli.peer_failure_message(error)}", flush=True)
    os._exit(0)
""")


def test_a_dead_peer_is_named_in_one_line(tmp_path):
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), JAX_NUM_PROCESSES="2",
             JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}")
  procs = [subprocess.Popen([sys.executable, "-c", PEER_DRIVER], cwd=ROOT,
                            env={**env, "JAX_PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True) for i in range(2)]
  output = procs[0].communicate(timeout=120)[0]
  procs[1].wait(timeout=30)
  line = output.strip().splitlines()[-1]
  assert line.startswith("message: ") and "of this job stopped" in line, output[-3000:]
  assert "process 1" in line or "the process at 127.0.0.1" in line


@pytest.mark.parametrize("text, who", [
    ("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] "
     "Connection closed by peer [127.0.0.1]:25514", "the process at 127.0.0.1 (port 25514)"),
    ("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:538] "
     "Read error [10.0.0.7]:33196: Connection reset by peer",
     "the process at 10.0.0.7 (port 33196)"),
    ("UNAVAILABLE: Task 3 heartbeat timeout. This indicates that the remote task has failed",
     "process 3"),
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB", None),
])
def test_what_names_a_dead_peer(text, who):
  message = cli.peer_failure_message(RuntimeError(text))
  assert message is None if who is None else message.startswith(f"{who} of this job stopped")
