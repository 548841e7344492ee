"""Two processes on localhost (CPU collectives) train exactly like one process.

Two `runs.train_run` processes with 2 CPU devices each join through `jax.distributed`
(JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, the variables launch/local.sh
sets); each reads only its own rows of every global batch from the run's DATA_CACHE (written
first by `jaxmoral cache`, so the two import no TensorFlow, as accelerator hosts need not) and
contributes them. A one-process run on 4 devices that reads both shards and puts their rows
together the same way is the reference (run by the test's own process, on 4 of its 8, while
the two train): same per-step losses, and the two-process checkpoint restores in a single
process with the reference's parameters.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import gin
import jax
import numpy as np
import pytest

from conftest import child_xla_flags
from jaxmoral import cli, model_dirs

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The driver of each of the two processes is `jaxmoral train` plus a hook that records every
# step's loss: it connects the processes first (what the CLI must do before any JAX call), then
# runs the gin config, then checks the final checkpoint as a multi-host restore does.
DRIVER = textwrap.dedent("""
    import json, os, sys
    from jaxmoral import cli, partitioning, software
    # Process 1 connects as a host with another commit or jax installed: both are refused (the
    # job is connected by then); then it trains with the same software as process 0.
    fingerprint = software.fingerprint
    if os.environ["JAX_PROCESS_ID"] == "1":
      software.fingerprint = lambda: fingerprint().replace("jax==", "jax==9")
    try:
      partitioning.initialize_distributed()
      software_line = "connected"
    except ValueError as error:
      software_line = f"refused: {error}"
    software.fingerprint = fingerprint
    import jax
    import gin
    from jaxmoral import gin_utils, runs, trainer as trainer_lib
    losses = []
    step = trainer_lib.Trainer.train_step
    def recording_step(self, state, batch, rng):
      state, metrics = step(self, state, batch, rng)
      losses.append(float(metrics["loss"]))
      return state, metrics
    trainer_lib.Trainer.train_step = recording_step
    import numpy as np
    from jaxmoral.data import pipeline
    read, sources, iterate = [], [], pipeline.BatchSource.iterate
    def recording_iterate(self, start_step=0):
      sources.append(self)
      for batch in iterate(self, start_step):
        read.append(batch)
        yield batch
    pipeline.BatchSource.iterate = recording_iterate
    gin_args, rest = gin_utils.split_gin_args(sys.argv[2:])
    gin_utils.parse_gin(gin_args)
    vocab_path = gin.query_parameter("%VOCABULARY_PATH")
    runs.train_run()
    check = {"tensorflow_imported": "tensorflow" in sys.modules}
    # This process's shard resumed at step 2 (a new source, as a restarted process builds)
    # reads the rows it read at step 2 without stopping.
    import dataclasses
    resumed = next(iterate(dataclasses.replace(sources[0]), 2))
    check["shard"] = [sources[0].shard_index, sources[0].shard_count]
    check["resumed_shard_equal"] = all(np.array_equal(resumed[k], read[2][k]) for k in resumed)
    check["shard_rows"] = read[2]["encoder_input_tokens"].tolist()
    # The final step verified as a multi-host restore does it: each process hashes its
    # share; then a byte flipped in a file that only process 1 hashes is refused by both.
    import gin, os
    from jax.experimental import multihost_utils
    from jaxmoral import checkpoints, integrity, run_dirs
    shares, hash_all = [], integrity.hash_files
    integrity.hash_files = lambda root, rel: (shares.extend(rel), hash_all(root, rel))[1]
    ckpt_dir = run_dirs.checkpoints_dir(gin.query_parameter("%MODEL_DIR"))
    check["verified"] = checkpoints.verify_step(ckpt_dir, 3, shared=True)
    check["share"] = list(shares)
    files = sorted(json.load(open(os.path.join(ckpt_dir, "3", integrity.INTEGRITY_FILE)))["files"])
    victim = os.path.join(ckpt_dir, "3", files[1])  # process 1's share: files[1::2]
    def flip():
      with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    multihost_utils.sync_global_devices("verified")
    if jax.process_index() == 0:
      flip()
    multihost_utils.sync_global_devices("flipped")
    try:
      checkpoints.verify_step(ckpt_dir, 3, shared=True)
    except integrity.CheckpointIntegrityError as e:
      check["refused"] = list(e.files)
    multihost_utils.sync_global_devices("refused")
    if jax.process_index() == 0:
      flip()  # back: the next test restores this checkpoint
    check["files"], check["victim"] = files, files[1]
    # Each process parses the tiny config with its own bindings: a different step count.
    gin.clear_config()
    gin_args, _ = gin_utils.split_gin_args(
        ["--gin_file=configs/core/tiny_cpu.gin", "--gin.MODEL_DIR='/tmp/unused'",
         f"--gin.TRAIN_STEPS={3 + jax.process_index()}"])
    try:
      gin_utils.parse_gin(gin_args)
      config_line = "parsed"
    except ValueError as error:
      config_line = f"refused: {error}"
    # A host whose copy of the data file lacks a row.
    from jaxmoral import train as train_lib
    class StaleCopyOnProcess1:
      num_examples = 100 - jax.process_index()
    try:
      train_lib.train(model_dir=sys.argv[1] + ".stale", trainer=None,
                      train_source=StaleCopyOnProcess1(), train_steps=1)
      data_line = "trained"
    except ValueError as error:
      data_line = f"refused: {cli.user_error_message(error)}"  # one line, as the CLI prints it
    # Each process streams its shard of a two-Task Mixture (too big to cache), saving its own
    # positions in the one folder the run would (MODEL_DIR/data_position); a new source of
    # each (as a restarted process builds) restores its own shard's position at step 4 and
    # reads the uninterrupted stream's batches, reading none again.
    import seqio
    from jaxmoral.data import tasks, vocab
    vocabulary = vocab.get_vocabulary(vocab_path)
    words = [f"{x} {y}" for x in "abc" for y in "defghijklm"]
    tasks.register_text_pair_task("mp_a", vocabulary=vocabulary,
                                  examples=[(f"alpha {w}", "a") for w in words[:10]])
    tasks.register_text_pair_task("mp_b", vocabulary=vocabulary,
                                  examples=[(f"beta {w}", "b") for w in words])
    seqio.MixtureRegistry.add("mp_mix", [("mp_a", 1.0), ("mp_b", 2.0)])
    positions = sys.argv[1] + ".data_position"
    streamed = lambda: tasks.TaskSource(
        "mp_mix", "train", {"inputs": 8, "targets": 4}, 4, seed=1, max_cached_examples=1
    ).shard(jax.process_index(), jax.process_count()).keeping_position(positions, 2)
    stream = streamed().iterate(0)
    uninterrupted = [next(stream) for _ in range(6)]
    multihost_utils.sync_global_devices("positions saved")
    replayed, advance = [], tasks._advance
    tasks._advance = lambda it, n: (replayed.append(n), advance(it, n))
    stream = streamed().iterate(4)
    resumed = [next(stream) for _ in range(2)]
    check["stream_resumed_equal"] = all(np.array_equal(a[k], b[k]) for a, b in
                                        zip(resumed, uninterrupted[4:]) for k in b)
    check["stream_replayed"] = replayed
    check["stream_positions"] = sorted(os.listdir(os.path.join(positions, "4")))
    check["stream_rows"] = uninterrupted[4]["encoder_input_tokens"].tolist()
    with open(f"{sys.argv[1]}.{jax.process_index()}.json", "w") as f:
      json.dump({"losses": losses, "process_count": jax.process_count(),
                 "device_count": jax.device_count(),
                 "local_device_count": jax.local_device_count(), "check": check,
                 "refusals": {"software": software_line, "config": config_line,
                              "data": data_line}}, f)
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _child_env(*, devices=None, process_id=None, num_processes=1, port=None) -> dict:
  """The environment of a Python process a test starts: the suite's compile settings
  (conftest.py), `devices` CPU devices, and the job's variables when there are several."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_", "XLA_", "SLURM_", "TPU_"))}
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             XLA_FLAGS=child_xla_flags(device_count=devices))
  if num_processes > 1:
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(num_processes),
               JAX_PROCESS_ID=str(process_id))
  return env


def _launch(driver, out, model_dir, vocab, data_cache, *, devices, process_id=None,
            num_processes=1, port=None):
  args = [sys.executable, str(driver), str(out), *_train_args(model_dir, vocab, data_cache)]
  return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=_child_env(devices=devices, process_id=process_id,
                                                    num_processes=num_processes, port=port))


def _train_args(model_dir, vocab, data_cache):
  return ["--gin_file=configs/core/tiny_cpu.gin",
          f"--gin.MODEL_DIR='{model_dir}'", f"--gin.VOCABULARY_PATH='{vocab}'",
          f"--gin.DATA_CACHE='{data_cache}'",
          "--gin.TRAIN_STEPS=3", "--gin.CHECKPOINT_EVERY=3", "--gin.BATCH_SIZE=8",
          "--gin.WARMUP_STEPS=1", "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
          "--gin.runs.train_run.log_every=1",
          # Short rows and one layer each side: what is compared is the data and gradient
          # flow, not length or depth; smaller programs compile faster in all three processes.
          "--gin.config.t5_config.num_encoder_layers=1",
          "--gin.config.t5_config.num_decoder_layers=1",
          "--gin.runs.Seq2SeqData.eval_split='none'"]  # no eval: only training is compared


class _BothShards:
  """The reference's data: both processes' shards, their rows joined as two processes do."""

  def __init__(self, source):
    self.source, self.num_examples = source, source.num_examples

  def iterate(self, start):
    for parts in zip(*(self.source.shard(i, 2).iterate(start) for i in range(2))):
      yield {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def keeping_position(self, directory, every):
    del directory, every
    return self


def _train_reference(model_dir, vocab, data_cache, *, num_devices=4):
  """The one-process run, in this process on `num_devices` of its devices:
  {"losses", "process_count", "device_count"}."""
  from jaxmoral import gin_utils, partitioning, runs  # pylint: disable=g-import-not-at-top
  from jaxmoral import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  losses = []
  step, sources = trainer_lib.Trainer.train_step, runs.Seq2SeqData.sources

  def recording_step(self, state, batch, rng):
    state, metrics = step(self, state, batch, rng)
    losses.append(float(metrics["loss"]))
    return state, metrics

  def both_shards(self, **kw):
    train = sources(self, **kw)[0]
    assert train.data_fingerprint  # Its rows read from the DATA_CACHE.
    return _BothShards(train), None

  gin.clear_config()
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(trainer_lib.Trainer, "train_step", recording_step)
    patch.setattr(runs.Seq2SeqData, "sources", both_shards)
    gin_args, rest = gin_utils.split_gin_args(_train_args(model_dir, vocab, data_cache))
    assert not rest
    gin_utils.parse_gin(gin_args)
    partitioner = partitioning.PjitPartitioner(devices=jax.devices()[:num_devices])
    try:
      runs.train_run(partitioner=partitioner)
    finally:
      gin.clear_config()
  return {"losses": losses, "process_count": jax.process_count(),
          "device_count": partitioner.mesh.devices.size}


def _wait(procs, timeout=240):
  for name, proc in procs:
    try:
      output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for _, p in procs:
        p.kill()
      pytest.fail(f"{name} timed out")
    assert proc.returncode == 0, f"{name} failed:\n{output[-4000:]}"


@pytest.fixture(scope="module")
def runs_done(tmp_path_factory, demo_vocab_path):
  tmp = tmp_path_factory.mktemp("multiprocess")
  vocab = demo_vocab_path  # the session's copy: the same vocabulary, built once
  driver = tmp / "driver.py"
  driver.write_text(DRIVER)
  port = _free_port()
  data_cache = tmp / "data"
  gin.clear_config()
  try:
    assert cli.main(["cache", *_train_args(tmp / "unused", vocab, data_cache)]) == 0
  finally:
    gin.clear_config()
  procs = [(f"process {i} of 2", _launch(driver, tmp / "two", tmp / "two_run", vocab,
                                         data_cache, devices=2, process_id=i,
                                         num_processes=2, port=port))
           for i in range(2)]
  # The one-process reference, here, while the two train.
  try:
    (tmp / "one.0.json").write_text(json.dumps(_train_reference(tmp / "one_run", vocab,
                                                                data_cache)))
  finally:
    _wait(procs)
  assert len(procs) == 2
  return tmp


def _result(tmp, name, index):
  return json.loads((tmp / f"{name}.{index}.json").read_text())


def test_two_processes_match_one_process_losses(runs_done):
  one = _result(runs_done, "one", 0)
  two = [_result(runs_done, "two", i) for i in range(2)]
  assert one["process_count"] == 1 and one["device_count"] == 4
  for r in two:
    assert r["process_count"] == 2 and r["device_count"] == 4 and r["local_device_count"] == 2
  assert len(one["losses"]) == 3 and np.all(np.isfinite(one["losses"]))
  assert one["losses"][0] != one["losses"][-1]  # it trains
  # Both processes see the same (replicated) loss, equal to the one-process run's.
  np.testing.assert_array_equal(two[0]["losses"], two[1]["losses"])
  np.testing.assert_allclose(two[0]["losses"], one["losses"], rtol=1e-5, atol=1e-6)


def test_each_process_resumes_its_own_shard(runs_done):
  checks = [_result(runs_done, "two", i)["check"] for i in range(2)]
  assert not any(c["tensorflow_imported"] for c in checks)  # Its rows: the DATA_CACHE's.
  assert [c["shard"] for c in checks] == [[0, 2], [1, 2]]
  assert all(c["resumed_shard_equal"] for c in checks)
  assert checks[0]["shard_rows"] != checks[1]["shard_rows"]


def test_each_process_resumes_its_own_shard_of_a_streamed_mixture(runs_done):
  checks = [_result(runs_done, "two", i)["check"] for i in range(2)]
  for c in checks:
    assert c["stream_positions"] == ["process_0-of-2", "process_1-of-2"]
    assert c["stream_replayed"] == [0]  # restored at its own saved position
    assert c["stream_resumed_equal"]
  assert checks[0]["stream_rows"] != checks[1]["stream_rows"]


def test_processes_share_checkpoint_hashing_and_refuse_together(runs_done):
  checks = [_result(runs_done, "two", i)["check"] for i in range(2)]
  files = checks[0]["files"]
  assert all(c["verified"] for c in checks)
  # Each file hashed once, by one process; process i hashed files i, i + 2, ...
  assert checks[0]["share"] == files[0::2] and checks[1]["share"] == files[1::2]
  # A file only process 1 read, damaged: both processes refuse it.
  assert checks[0]["victim"] in checks[1]["share"]
  assert [c.get("refused") for c in checks] == [[checks[0]["victim"]]] * 2


def test_two_process_checkpoint_restores_in_one_process(runs_done):
  gin.clear_config()
  two = model_dirs.load(runs_done / "two_run").params
  one = model_dirs.load(runs_done / "one_run").params
  assert sorted(p.name for p in (runs_done / "two_run" / "checkpoints").iterdir()
                if p.name.isdigit()) == ["3"]
  assert jax.tree_util.tree_structure(two) == jax.tree_util.tree_structure(one)
  for a, b in zip(jax.tree_util.tree_leaves(two), jax.tree_util.tree_leaves(one)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# The refusals below run in the two training processes (DRIVER) once they are connected,
# rather than in three more pairs of processes: each pair costs two interpreter starts.
def _refusals(tmp, which):
  return [_result(tmp, "two", i)["refusals"][which] for i in range(2)]


def test_processes_started_with_different_configs_are_refused(runs_done):
  # Before: each went on with its own step count, and the job hung at its first collective
  # after the shorter one ended (or, with another learning rate, trained nonsense silently).
  assert _refusals(runs_done, "config") == [
      "refused: gin: process 1 of 2 parsed another configuration than process 0 "
      "(gin files, bindings or flags): every process of a job must be started "
      "with the same ones"] * 2


def test_processes_running_other_software_are_refused(runs_done):
  assert _refusals(runs_done, "software") == [
      "refused: initialize_distributed: process 1 of 2 runs other software than process 0 "
      "(jaxmoral's sources or jax, jaxlib, flax, optax, orbax-checkpoint): install the same "
      "commit and versions on every host"] * 2


def test_processes_reading_other_data_are_refused(runs_done):
  assert _refusals(runs_done, "data") == [
      f"refused: train: process 1 of 2 has another data position than process 0 (here "
      f"{{'num_examples': {100 - i}, 'seed': 0, 'batch_size': None, 'data': None}}): every host "
      "must read the "
      "same data with the "
      "same seed" for i in range(2)]
