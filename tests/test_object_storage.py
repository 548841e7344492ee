"""Runs on object storage: every path of a pod job as gs://bucket/..., against a GCS-API server.

The server is `gcp-storage-emulator` from the package index, started on localhost by
conftest.py's `gcs` fixture (tests/gcs_server.py adds the generation header and preconditions
it leaves out). Every client is pointed at it the way it is pointed at a real endpoint:
gcsfs (through etils.epath, as jaxmoral's file layer and Orbax use it) and
google-cloud-storage (tensorboardX) read STORAGE_EMULATOR_HOST; TensorStore (Orbax's array
data) reads TENSORSTORE_GCS_HTTP_URL.
The server accepts any caller; tests/gcs_server.py refuses uploads to two buckets with the
service's own 401 (no credentials) and 403 (no permission) answers, so those lines are tested
beside a missing bucket and an unreachable endpoint.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import gin
import jax
import numpy as np
import pytest

from conftest import free_port, set_environment, start_storage_server
from jaxmoral import cli, fileio, integrity, model_dirs, run_dirs, run_layout
from jaxmoral import metric_writers
from jaxmoral.data import vocab as vocab_lib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BUCKET = "gs://bucket"
STEPS = 6
ONE_LAYER = ["--gin.config.t5_config.num_encoder_layers=1",
             "--gin.config.t5_config.num_decoder_layers=1"]
# The seq2seq runs read their rows from a DATA_CACHE in the bucket (written first, by the
# `run` fixture): the runs' data is read from object storage too, and the killed child imports
# no TensorFlow and tokenises nothing. Training runs do not evaluate (`eval` is tested on its
# own below).
DATA_CACHE = f"{BUCKET}/demo_data"
TINY = ["--gin_file=configs/core/tiny_cpu.gin", f"--gin.TRAIN_STEPS={STEPS}",
        "--gin.CHECKPOINT_EVERY=3", "--gin.EVAL_EVERY=0", "--gin.BATCH_SIZE=8",
        "--gin.runs.train_run.log_every=1", "--gin.WARMUP_STEPS=2", *ONE_LAYER,
        f"--gin.DATA_CACHE='{DATA_CACHE}'", "--gin.runs.train_run.eval_steps=0"]


# Storage, not sharding, is tested here: whatever runs without the explicit ONE_DEVICE below
# (export, loads, the other methods' commands) runs on one device too.
pytestmark = pytest.mark.usefixtures("one_device")


@gin.configurable(module="test_object_storage")
def first_device() -> list[jax.Device]:
  return jax.devices()[:1]


# What is tested here is storage, not sharding: the runs are on one device, cheaper to compile
# and run than data parallel over the 8 fake devices. The killed child binds the same (its
# driver registers the same function), so the resume here loads the programs it compiled: its
# device count stays 8, as the compilation cache's keys include the platform's devices.
ONE_DEVICE = "--gin.partitioning.PjitPartitioner.devices=@test_object_storage.first_device()"

# `jaxmoral train` with a hook that holds the loop after step 5 (step 3 saved, step 6 not),
# so that the kill below always lands mid-run, however slowly the machine runs.
KILLED_DRIVER = textwrap.dedent("""
    import sys, time
    import gin, jax
    from jaxmoral import cli, train
    gin.external_configurable(lambda: jax.devices()[:1], "first_device",
                              module="test_object_storage")  # As ONE_DEVICE below names it.
    class HoldAfterStep5(train.TrainHook):
      def after_step(self, loop, step, state, metrics):
        if step == 5:
          time.sleep(600)  # until killed
    gin.external_configurable(HoldAfterStep5, module="killed")
    sys.exit(cli.main(sys.argv[1:]))
""")


def _cli(*args: str) -> int:
  gin.clear_config()
  try:
    return cli.main(list(args))
  finally:
    gin.clear_config()


def _objects(prefix: str) -> list[str]:
  return fileio.walk_files(prefix)


@pytest.fixture(scope="module")
def unreachable_train(gcs):
  """`train` into a bucket behind an endpoint nobody listens on, started first: gcsfs retries
  a refused connection for about 30 s (mostly asleep), so it runs beside the training below."""
  endpoint = f"http://127.0.0.1:{free_port()}"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", STORAGE_EMULATOR_HOST=endpoint,
             TENSORSTORE_GCS_HTTP_URL=endpoint)
  child = subprocess.Popen([sys.executable, "-m", "jaxmoral.cli", "train", *TINY,
                            "--gin.MODEL_DIR='gs://bucket/unreachable'"], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  yield child, endpoint
  if child.poll() is None:
    child.kill()
  child.communicate()


@pytest.fixture(scope="module")
def run(gcs, unreachable_train, tmp_path_factory):
  """gs://bucket/run: trained in a subprocess that is killed (SIGKILL) once step 3 is saved
  and verified, then resumed here to the end; and a local uninterrupted reference run."""
  model_dir = f"{BUCKET}/run"
  assert _cli("cache", *TINY, f"--gin.MODEL_DIR={model_dir}") == 0  # (MODEL_DIR unused)
  # TMPDIR: a SIGKILLed process cannot remove its local copies of bucket files (fileio's
  # private folder is removed at exit), so they go to this test's folder, not /tmp.
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path_factory.mktemp("killed_tmp")))
  child = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER, "train", *TINY, ONE_DEVICE,
                            f"--gin.MODEL_DIR='{model_dir}'",
                            "--gin.runs.train_run.hooks=[@killed.HoldAfterStep5()]"],
                           cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  try:
    manifest = f"{model_dir}/checkpoints/3/{integrity.INTEGRITY_FILE}"
    deadline = time.time() + 240
    while not fileio.exists(manifest):
      assert child.poll() is None, child.stderr.read().decode()[-3000:]
      assert time.time() < deadline, "step 3 was never saved"
      time.sleep(0.05)
  finally:
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stderr.close()
  assert child.returncode == -signal.SIGKILL
  killed_at = run_dirs.saved_steps(model_dir)
  # After the child, not beside it: both runs here load the programs it compiled.
  assert _cli("train", *TINY, ONE_DEVICE, f"--gin.MODEL_DIR={model_dir}") == 0
  reference = str(tmp_path_factory.mktemp("reference"))
  assert _cli("train", *TINY, ONE_DEVICE, f"--gin.MODEL_DIR={reference}") == 0
  return model_dir, reference, killed_at


def test_killed_run_resumes_to_the_uninterrupted_loss_curve(run):
  model_dir, reference, killed_at = run
  assert killed_at == [3]  # Killed mid-run, not after its end.
  resumed = metric_writers.read_scalars(f"{model_dir}/train")["loss"]
  uninterrupted = metric_writers.read_scalars(os.path.join(reference, "train"))["loss"]
  assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
  assert resumed == pytest.approx(uninterrupted, rel=1e-6)
  # The two starts (0 and the resume) are recorded in the bucket, and every run file is there.
  steps = [json.loads(line)["step"]
           for line in fileio.read_text(f"{model_dir}/software.jsonl").splitlines()]
  assert steps[0] == 0 and steps[-1] in killed_at and len(steps) == 2
  names = set(_objects(model_dir))
  assert {"config.gin", "model_config.json", "settings.json", "vocab/spiece.model",
          f"checkpoints/{STEPS}/_INTEGRITY.json"} <= names
  assert not os.path.exists(os.path.join(ROOT, "gs:"))  # Nothing went to a local "gs:" folder.


def test_eval_infer_export_and_init_from_the_bucket(run, tmp_path):
  model_dir, reference, _ = run
  assert _cli("eval", *TINY, ONE_DEVICE, f"--gin.MODEL_DIR={model_dir}") == 0
  report = json.loads(fileio.read_text(f"{model_dir}/eval_latest.json"))
  assert np.isfinite(report["metrics"]["loss"])

  fileio.write_text(f"{BUCKET}/inputs.txt", "lying about grades\n\nhelping a friend move\n")
  assert _cli("infer", *TINY, ONE_DEVICE, f"--gin.MODEL_DIR={model_dir}",
              f"--gin.INFER_INPUT='{BUCKET}/inputs.txt'",
              f"--gin.INFER_OUTPUT='{BUCKET}/out.jsonl'") == 0
  rows = [json.loads(line) for line in fileio.read_text(f"{BUCKET}/out.jsonl").splitlines()]
  assert [r["input"] for r in rows] == ["lying about grades", "", "helping a friend move"]

  export = f"{BUCKET}/export"
  assert _cli("export", f"--model_dir={model_dir}", f"--output={export}") == 0
  from_bucket = model_dirs.load(export)
  local = model_dirs.load(reference)  # Same parameters as the uninterrupted run's.
  for a, b in zip(_leaves(from_bucket.params), _leaves(local.params), strict=True):
    np.testing.assert_array_equal(a, b)

  # A second run fine-tuned from the first one's bucket folder (as many steps as the first,
  # so it loads the first one's compiled train step; saved once, at its end).
  second = f"{BUCKET}/second"
  assert _cli("train", *TINY, ONE_DEVICE, f"--gin.CHECKPOINT_EVERY={STEPS}",
              f"--gin.MODEL_DIR={second}", f"--gin.INIT_CHECKPOINT='{model_dir}'") == 0
  first_loss = metric_writers.read_scalars(f"{model_dir}/train")["loss"]
  second_loss = metric_writers.read_scalars(f"{second}/train")["loss"]
  assert second_loss[3] < first_loss[3] - 0.5  # Started from the trained parameters.


def _leaves(tree):
  import jax  # pylint: disable=g-import-not-at-top
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_a_damaged_or_missing_object_is_refused_naming_it(run):
  model_dir, _, _ = run
  step_dir = f"{model_dir}/checkpoints/{STEPS}"
  data = [name for name in _objects(step_dir) if "/ocdbt.process_0/d/" in name]
  victim = max(data, key=lambda name: fileio.getsize(f"{step_dir}/{name}"))
  original = fileio.read_bytes(f"{step_dir}/{victim}")
  flipped = bytearray(original)
  flipped[len(flipped) // 2] ^= 0xFF
  fileio.write_bytes(f"{step_dir}/{victim}", bytes(flipped))
  try:
    with pytest.raises(integrity.CheckpointIntegrityError, match="differs from its checksum"
                       ) as error:
      model_dirs.load(model_dir)
    message = str(error.value)
    assert victim in message and f"{model_dir}/checkpoints: checkpoint step {STEPS}" in message
  finally:
    fileio.write_bytes(f"{step_dir}/{victim}", original)
  # The run's own files (vocabulary, settings, model config) are verified in the bucket too.
  vocabulary = f"{model_dir}/vocab/spiece.model"
  original = fileio.read_bytes(vocabulary)
  fileio.write_bytes(vocabulary, original[:-2] + bytes([original[-2] ^ 1, original[-1] ^ 1]))
  try:
    with pytest.raises(integrity.CheckpointIntegrityError, match="vocab/spiece.model"):
      model_dirs.load(model_dir)
  finally:
    fileio.write_bytes(vocabulary, original)
  metadata = "state/_METADATA"
  saved = fileio.read_bytes(f"{step_dir}/{metadata}")
  fileio.remove(f"{step_dir}/{metadata}")
  try:
    with pytest.raises(integrity.CheckpointIntegrityError, match="missing") as error:
      model_dirs.load(model_dir)
    assert metadata in str(error.value)
  finally:
    fileio.write_bytes(f"{step_dir}/{metadata}", saved)


def test_a_second_train_into_the_same_bucket_folder_is_refused_naming_the_holder(run, capsys):
  model_dir, _, _ = run
  lock = f"{model_dir}/{run_layout.LOCK_FILE}"
  holder = {"host": "tpu-vm-7", "pid": 4242, "token": "other", "started": "2026-11-27T10:00"}
  assert fileio.create_exclusive(lock, json.dumps(holder).encode())
  try:
    assert _cli("train", *TINY, f"--gin.MODEL_DIR={model_dir}") == 2
    err = capsys.readouterr().err
    assert "in use by another training run (pid 4242 on tpu-vm-7" in err and lock in err
  finally:
    fileio.remove(lock)


def test_the_lock_is_a_conditional_create_and_a_stale_one_is_taken_over(gcs, monkeypatch,
                                                                         caplog):
  folder = f"{BUCKET}/locked"
  path = f"{folder}/{run_layout.LOCK_FILE}"
  # The store refuses the second create (ifGenerationMatch=0): no check-then-write race.
  assert fileio.create_exclusive(path, b'{"host": "a", "pid": 1, "token": "a"}')
  assert not fileio.create_exclusive(path, b'{"host": "b", "pid": 2, "token": "b"}')
  assert json.loads(fileio.read_bytes(path))["token"] == "a"
  # A delete on the generation judged stale misses a lock rewritten since.
  stale = fileio.generation(path)
  fileio.write_bytes(path, b'{"host": "a", "pid": 1, "token": "a2"}')
  with pytest.raises(FileNotFoundError):
    fileio.remove(path, if_generation=stale)
  assert fileio.exists(path)
  with pytest.raises(run_dirs.RunDirLockedError, match="pid 1 on a"):
    run_dirs.RunDirLock(folder).acquire()
  monkeypatch.setattr(run_dirs, "LOCK_STALE_AFTER_S", 0.0)  # Any other host's lock is stale.
  with caplog.at_level("WARNING"), run_dirs.RunDirLock(folder) as taken:
    assert json.loads(fileio.read_bytes(path))["token"] == taken._token  # pylint: disable=protected-access
  assert "taking over the stale lock" in caplog.text
  assert not fileio.exists(path)  # Released.


def test_every_process_of_a_bucket_run_watches_its_storage_and_only_process_0_writes_the_lock(
    gcs, monkeypatch):
  """Process 1 of a multi-host bucket run (process 0 holds the lock) reads the lock on every
  heartbeat without rewriting it, and ends itself, naming the folder, once the store has not
  answered for STORAGE_DEADLINE_S: it cannot count on hearing that process 0 ended."""
  import threading  # pylint: disable=g-import-not-at-top
  folder = f"{BUCKET}/hosts"
  path = f"{folder}/{run_layout.LOCK_FILE}"
  assert fileio.create_exclusive(path, b'{"host": "h0", "pid": 1, "token": "process-0"}')
  generation = fileio.generation(path)
  # Margins a loaded machine keeps: a read of the local store takes milliseconds.
  monkeypatch.setattr(run_dirs, "LOCK_HEARTBEAT_S", 0.1)
  monkeypatch.setattr(run_dirs, "STORAGE_DEADLINE_S", 2.0)
  monkeypatch.setattr(run_dirs.jax, "process_index", lambda: 1)
  lost, ended = [], threading.Event()
  monkeypatch.setattr(run_dirs, "_storage_lost",
                      lambda model_dir, silent, error: (lost.append((model_dir, error)),
                                                        ended.set()))
  with run_dirs.RunDirLock(folder):
    time.sleep(3.0)  # Past the deadline, the store answering: nothing ends.
    assert not lost
    assert fileio.generation(path) == generation  # Read, never rewritten.
    read = fileio.read_bytes

    def dead_store(location, *args, **kwargs):
      if location == path:
        raise ConnectionError("Cannot connect to host 127.0.0.1")
      return read(location, *args, **kwargs)
    monkeypatch.setattr(fileio, "read_bytes", dead_store)
    assert ended.wait(10), "process 1 kept running on a dead store"
  assert lost[0][0] == folder and isinstance(lost[0][1], ConnectionError)
  monkeypatch.undo()
  assert json.loads(fileio.read_bytes(path))["token"] == "process-0"  # Process 0's, kept.
  fileio.remove(path)


def test_a_missing_bucket_credentials_permission_or_endpoint_is_one_line_before_any_work(
    gcs, unreachable_train):
  with pytest.raises(OSError, match=r"^MODEL_DIR gs://no-such-bucket/run: bucket "
                     r"no-such-bucket does not exist"):
    run_dirs.make_run_dir("gs://no-such-bucket/run")
  with pytest.raises(OSError, match=r"^MODEL_DIR gs://needs-credentials/run: no credentials: "
                     r"run `gcloud auth application-default login`"):
    run_dirs.make_run_dir("gs://needs-credentials/run")
  with pytest.raises(OSError, match=r"^MODEL_DIR gs://read-only/run: permission denied: the "
                     r"credentials may not write to bucket read-only"):
    run_dirs.make_run_dir("gs://read-only/run")
  child, endpoint = unreachable_train
  _, stderr = child.communicate(timeout=300)
  assert child.returncode == 2
  errors = [line for line in stderr.splitlines() if line.startswith("jaxmoral train: error:")]
  assert errors == ["jaxmoral train: error: MODEL_DIR gs://bucket/unreachable: the storage "
                    f"endpoint {endpoint} is unreachable (ClientConnectorError)"], stderr[-2000:]
  assert "Traceback" not in stderr


def test_one_action_per_method_reads_and_writes_the_bucket(gcs, demo_vocab_path):
  # ClarifyDelphi: a judge trained into the bucket, its vocabulary read from the bucket.
  vocab = f"{BUCKET}/spm/demo.model"
  fileio.write_bytes(vocab, fileio.read_bytes(demo_vocab_path))
  judge = f"{BUCKET}/clarify/judge"
  assert _cli("clarify", "train-model", "--which=judge", f"--model_dir={judge}",
              "--train_steps=2", "--batch_size=8", f"--vocabulary_path={vocab}",
              "--judge_classes=wrong,okay,good", *ONE_LAYER, ONE_DEVICE,
              "--feature_lengths={'inputs': 64, 'targets': 8}",
              "--gin.runs.train_run.eval_steps=0") == 0  # Its held-out pairs: not storage.
  assert fileio.isfile(f"{judge}/data/judge_train.jsonl")
  info = model_dirs.inspect(judge)
  assert info.step == 2 and info.vocabulary.vocab_size == vocab_lib.get_vocabulary(
      demo_vocab_path).vocab_size

  # Diamante: the joint model trained into the bucket, evaluated from there on a test file
  # in the bucket, its report written there.
  dialogues = f"{BUCKET}/diamante/dialogues.jsonl"
  fileio.write_bytes(dialogues, fileio.read_bytes(
      os.path.join(ROOT, "jaxmoral", "data", "demo", "dialogues.jsonl")))
  diamante = f"{BUCKET}/diamante/run"
  assert _cli("diamante", "train", "--gin_file=configs/diamante/tiny_cpu.gin",
              f"--gin.MODEL_DIR={diamante}", "--gin.TRAIN_STEPS=2", "--gin.CHECKPOINT_EVERY=2",
              f"--gin.TRAIN_PATH='{dialogues}'", *ONE_LAYER, ONE_DEVICE) == 0
  report = f"{BUCKET}/diamante/eval.json"
  assert _cli("diamante", "eval", f"--model_dir={diamante}", f"--test_path={dialogues}",
              f"--output_path={report}", "--max_contexts=2", "--num_generate=0") == 0
  assert json.loads(fileio.read_text(report))["num_contexts"] == 2

  # NPOV: detect reads its input from the bucket and writes its records and ROC there.
  from jaxmoral.npov import task  # pylint: disable=g-import-not-at-top
  clean = task.NpovExample(
      id="a", topic="t", query="Should zoos be banned?",
      pro=("Animals suffer in small cages",), con=("Zoos protect endangered species",),
      response="Some say animals suffer in small cages. Others say zoos protect endangered "
               "species.", hallucination=False, coverage=False)
  dropped = clean.replace(id="h", con=(), hallucination=True,
                          removed_argument="Zoos protect endangered species")
  task.write_examples([clean, dropped], f"{BUCKET}/npov/in.jsonl")
  assert _cli("npov", "detect", f"--input_path={BUCKET}/npov/in.jsonl",
              f"--output_path={BUCKET}/npov/out.jsonl", f"--roc_dir={BUCKET}/npov/roc") == 0
  records = [json.loads(x) for x in fileio.read_text(f"{BUCKET}/npov/out.jsonl").splitlines()]
  assert [r["id"] for r in records] == ["a", "h"]
  assert records[1]["hallucination"] > records[0]["hallucination"]
  assert fileio.getsize(f"{BUCKET}/npov/roc/roc_input.png") > 1000


def test_hugging_face_and_t5x_folders_load_from_and_export_to_the_bucket(gcs, tmp_path,
                                                                        demo_vocab_path):
  import flax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from conftest import write_hf_t5  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import hf_import  # pylint: disable=g-import-not-at-top
  model = write_hf_t5(tmp_path / "hf", d_model=16, num_layers=1, vocab_size=64)
  for name in os.listdir(tmp_path / "hf"):
    fileio.write_bytes(f"{BUCKET}/hf/{name}", (tmp_path / "hf" / name).read_bytes())
  tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  config, params = hf_import.params_from_hf(tensors, model.config.to_dict())
  expected = flax.traverse_util.flatten_dict(params)
  from_hf = model_dirs.load(f"{BUCKET}/hf")
  assert from_hf.info.format == "hf"
  # T5X's layout (params under target/), written by Orbax straight into the bucket.
  ocp.PyTreeCheckpointer().save(f"{BUCKET}/t5x/checkpoint_100",
                                {"target": params, "state": {"step": np.int32(100)}})
  from_t5x = model_dirs.load(f"{BUCKET}/t5x/checkpoint_100")
  assert from_t5x.info.format == "t5x" and from_t5x.config == from_hf.config
  # A Hugging Face export written straight into the bucket (nothing under a local "gs:").
  pieces = pathlib.Path(demo_vocab_path).read_bytes()
  fileio.write_bytes(f"{BUCKET}/vocab/spiece.model", pieces)
  hf_import.export_hf_t5(from_t5x.params, from_t5x.config, f"{BUCKET}/hf_export",
                         extra_files=[f"{BUCKET}/vocab/spiece.model"])
  assert set(_objects(f"{BUCKET}/hf_export")) == {"config.json", hf_import.SINGLE_FILE,
                                                   "spiece.model"}
  assert fileio.read_bytes(f"{BUCKET}/hf_export/spiece.model") == pieces
  assert not os.path.exists(os.path.join(os.getcwd(), "gs:"))
  exported = model_dirs.load(f"{BUCKET}/hf_export")
  assert exported.info.format == "hf" and exported.config == from_hf.config
  for loaded in (from_hf, from_t5x, exported):
    flat = flax.traverse_util.flatten_dict(loaded.params)
    for key, value in expected.items():
      np.testing.assert_array_equal(np.asarray(flat[key]), value)


def test_a_data_cache_in_the_bucket_serves_the_batches_it_was_written_with(gcs, demo_vocab_path,
                                                                           tmp_path):
  """DATA_CACHE as gs://: `cache_run` uploads the rows, a reader gets the same batches."""
  from jaxmoral import runs  # pylint: disable=g-import-not-at-top
  pairs = tmp_path / "pairs.tsv"
  pairs.write_text("inputs\ttargets\n" + "".join(f"help friend {i}\tanswer {i % 5}\n"
                                                 for i in range(40)))
  lengths = {"inputs": 16, "targets": 8}
  data = runs.Seq2SeqData(train_file=str(pairs), vocabulary_path=demo_vocab_path,
                          cache_dir=f"{BUCKET}/data")
  spec = runs.cache_run(data=data, feature_lengths=lengths, seed=1)
  assert {"spec.json", "vocabulary.model", "train/meta.json", "eval/meta.json"} <= set(
      _objects(f"{BUCKET}/data"))
  local = runs.Seq2SeqData(train_file=str(pairs), vocabulary_path=demo_vocab_path)
  vocabulary = vocab_lib.get_vocabulary(demo_vocab_path)
  kwargs = dict(vocabulary=vocabulary, batch_size=4, feature_lengths=lengths, seed=1)
  (want, _), (got, got_eval) = local.sources(**kwargs), data.sources(**kwargs)
  assert got.num_examples == spec["rows"]["train"] and got_eval is not None
  for k, v in want.batch(5).items():
    np.testing.assert_array_equal(got.batch(5)[k], v)


def test_each_bucket_run_builds_its_vocabulary_from_its_own_data(tmp_path):
  """SentencePiece writes local files, so a bucket run trains its vocabulary in a local folder
  first: one of its own. A folder shared by every bucket run of the host handed a second run,
  trained on other dialogues, the first run's pieces."""
  from jaxmoral import runs  # pylint: disable=g-import-not-at-top
  from jaxmoral.diamante import data as diamante_data  # pylint: disable=g-import-not-at-top
  lines = pathlib.Path(ROOT, "jaxmoral/data/demo/dialogues.jsonl").read_text().splitlines()
  files = {}
  for name, part in (("a", lines[:30]), ("b", lines[30:])):
    files[name] = tmp_path / f"{name}.jsonl"
    files[name].write_text("\n".join(part) + "\n")

  def pieces(train_path, build_dir):
    vocabulary = diamante_data.DialogueData(train_path=str(train_path)).vocabulary(build_dir)
    model = vocabulary.tokenizer
    return [model.id_to_piece(i) for i in range(model.get_piece_size())]

  first = pieces(files["a"], run_dirs.vocabulary_build_dir(f"{BUCKET}/a"))
  second = pieces(files["b"], run_dirs.vocabulary_build_dir(f"{BUCKET}/b"))
  assert second != first, "the second run was given the first run's vocabulary"
  assert second == pieces(files["b"], str(tmp_path / "local_b"))  # Built from b's dialogues.


# `jaxmoral train` that checks its storage every half second and gives it 4 s, held after
# step 4 (step 3 committed) until the test has stopped the storage.
DYING_DRIVER = textwrap.dedent("""
    import os, sys, time
    import gin, jax
    from jaxmoral import cli, run_dirs, train
    run_dirs.LOCK_HEARTBEAT_S, run_dirs.STORAGE_DEADLINE_S = 0.5, 4.0
    gin.external_configurable(lambda: jax.devices()[:1], "first_device",
                              module="test_object_storage")
    class HoldAtStep4(train.TrainHook):
      def after_step(self, loop, step, state, metrics):
        if step == 4:
          open(os.environ["HELD"], "w").close()
          while not os.path.exists(os.environ["RELEASE"]):
            time.sleep(0.05)
    gin.external_configurable(HoldAtStep4, module="dying")
    sys.exit(cli.main(sys.argv[1:]))
""")


def test_a_bucket_run_whose_storage_dies_stops_in_bounded_time_naming_it(run, tmp_path,
                                                                            capsys):
  """The storage server goes away mid-run: a run stops within seconds with one line naming
  its bucket folder and the last committed step; one sent SIGTERM first exits as a local run
  does (143), saying it could not save. eval and export against it: one line too."""
  data = tmp_path / "data"  # The rows from a local copy: only the run's folder is in the store.
  for name in fileio.walk_files(DATA_CACHE):
    (data / name).parent.mkdir(parents=True, exist_ok=True)
    (data / name).write_bytes(fileio.read_bytes(f"{DATA_CACHE}/{name}"))
  server, endpoint = start_storage_server()
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", STORAGE_EMULATOR_HOST=endpoint,
             TENSORSTORE_GCS_HTTP_URL=endpoint, RELEASE=str(tmp_path / "release"))
  flags = [*[f for f in TINY if not f.startswith("--gin.DATA_CACHE")], ONE_DEVICE,
           f"--gin.DATA_CACHE='{data}'", "--gin.runs.train_run.hooks=[@dying.HoldAtStep4()]"]
  children = {}
  try:
    for name in ("plain", "sigterm"):
      children[name] = subprocess.Popen(
          [sys.executable, "-c", DYING_DRIVER, "train", *flags,
           f"--gin.MODEL_DIR='gs://bucket/{name}'"], cwd=ROOT,
          env={**env, "HELD": str(tmp_path / f"held_{name}")}, stdout=subprocess.DEVNULL,
          stderr=subprocess.PIPE, text=True)
    def committed(name: str) -> bool:  # Step 3's manifest is in the store.
      try:
        urllib.request.urlopen(f"{endpoint}/storage/v1/b/bucket/o/{name}%2Fcheckpoints%2F3%2F"
                               f"{integrity.INTEGRITY_FILE}", timeout=5).read()
        return True
      except OSError:
        return False
    deadline = time.time() + 300
    while not all((tmp_path / f"held_{name}").exists() and committed(name)
                  for name in children):
      assert all(c.poll() is None for c in children.values()), [
          c.stderr.read()[-3000:] for c in children.values() if c.poll() is not None]
      assert time.time() < deadline, "step 4 was never reached"
      time.sleep(0.1)
    children["sigterm"].send_signal(signal.SIGTERM)
    time.sleep(0.5)
  finally:
    server.kill()
    server.wait()
  stopped = time.time()
  (tmp_path / "release").touch()
  status, lines = {}, {}
  for name, child in children.items():
    _, err = child.communicate(timeout=120)
    status[name] = child.returncode
    lines[name] = [line for line in err.splitlines() if line.startswith("jaxmoral train:")]
  took = time.time() - stopped
  assert status == {"plain": 1, "sigterm": 143}, (status, lines)
  assert took < 90, took
  assert len(lines["plain"]) == 1, lines
  assert lines["plain"][0].startswith("jaxmoral train: error: gs://bucket/plain: its storage "
                                      "has not answered for ")
  assert "the last committed step is 3" in lines["plain"][0]
  assert len(lines["sigterm"]) == 1, lines
  assert lines["sigterm"][0].startswith("jaxmoral train: stopped by SIGTERM: could not save to "
                                        "gs://bucket/sigterm: its storage has not answered")
  assert "the last committed step is 3" in lines["sigterm"][0]
  assert "(exit status 143)" in lines["sigterm"][0]
  # Readers of a folder on a store nobody answers at: one line each, within seconds.
  with set_environment({"STORAGE_EMULATOR_HOST": endpoint, "TENSORSTORE_GCS_HTTP_URL": endpoint}):
    for argv, what in ((["eval", *TINY, ONE_DEVICE, "--gin.MODEL_DIR='gs://bucket/plain'"],
                        "MODEL_DIR"),
                       (["export", "--model_dir=gs://bucket/plain",
                         f"--output={tmp_path / 'export'}"], "--model_dir")):
      started = time.time()
      capsys.readouterr()
      assert _cli(*argv) == 2
      err = capsys.readouterr().err
      assert [line for line in err.splitlines() if line.startswith("jaxmoral")] == [
          f"jaxmoral {argv[0]}: error: {what} gs://bucket/plain: the storage endpoint "
          f"{endpoint} is unreachable (URLError)"], err
      assert time.time() - started < 15
