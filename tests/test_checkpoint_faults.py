"""Checkpoint faults: damaged and incomplete steps, the MODEL_DIR lock, TensorBoard
points after a resume.

Damage is what a disk or a copy does: 16 bytes flipped in (or the end cut off) the largest data
file of a step, a step's `state/_METADATA` gone. Every reader (restore, `model_dirs.load` as
eval uses it, `export_model`, `load_exported`) refuses such a step naming it and the file, and
`train` resumes from the newest intact step.
"""

import json
import logging
import os
import shutil
import socket
import struct
import subprocess

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmoral import checkpoints as ck
from jaxmoral import integrity
from jaxmoral import metric_writers
from jaxmoral import model_dirs
from jaxmoral import params_export
from jaxmoral import partitioning
from jaxmoral import run_dirs
from jaxmoral import run_layout
from jaxmoral import train as train_lib
from jaxmoral import trainer as tr
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.data.pipeline import BatchSource
from jaxmoral.models import t5
from jaxmoral.models.config import t5_config

# What runs is tested here, not how it is sharded (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_device")

Error = integrity.CheckpointIntegrityError
STEPS = 4


# -- damage ---------------------------------------------------------------------------------------
def largest_data_file(item_dir: str) -> str:
  """The largest array-data file of an Orbax item (`<item>/ocdbt.process_0/d/<hash>`)."""
  data_dir = os.path.join(item_dir, "ocdbt.process_0", "d")
  names = sorted(os.listdir(data_dir), key=lambda n: os.path.getsize(os.path.join(data_dir, n)))
  return os.path.join(data_dir, names[-1])


def flip(path: str) -> None:
  with open(path, "r+b") as f:
    size = os.path.getsize(path)
    f.seek(size // 2)
    chunk = f.read(16)
    f.seek(size // 2)
    f.write(bytes(b ^ 0xFF for b in chunk))


def truncate(path: str) -> None:
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


DAMAGE = {"flip": flip, "truncate": truncate}
MESSAGE = {"flip": "differs from its checksum", "truncate": "when saved"}


# -- a tiny T5 run (model_dirs: eval's load, export) ----------------------------------------------
CFG = t5_config(size="tiny", vocab_size=64, num_encoder_layers=1, num_decoder_layers=1)


@pytest.fixture(scope="module")
def t5_run(tmp_path_factory):
  """A run directory with steps 1 and 2 of a one-layer T5 state (params + adam moments)."""
  run = str(tmp_path_factory.mktemp("t5_run"))
  # Random values of the T5's shapes: no initialiser needs compiling for a checksum test.
  shapes = nn.meta.unbox(jax.eval_shape(lambda rng: t5.init_params(t5.T5(CFG), rng),
                                        jax.ShapeDtypeStruct((2,), jnp.uint32)))
  rs = np.random.RandomState(0)
  params = jax.tree_util.tree_map(
      lambda s: (rs.randn(*s.shape) * 0.1).astype(s.dtype), shapes)
  tx = optax.adam(1e-3)
  with open(os.path.join(run, run_layout.MODEL_CONFIG_FILE), "w") as f:
    f.write(CFG.to_json())
  with ck.CheckpointManager(run_dirs.checkpoints_dir(run), save_interval_steps=1,
                            async_save=True) as manager:
    for step in (1, 2):
      manager.save(step, {"step": np.int32(step), "params": params,
                          "opt_state": tx.init(params)})
  return run, params


def _copy(run: str, tmp_path) -> str:
  out = str(tmp_path / "run")
  shutil.copytree(run, out)
  return out


def _step_dir(run: str, step: int) -> str:
  return os.path.join(run_dirs.checkpoints_dir(run), str(step))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_step_is_refused_by_every_reader(t5_run, tmp_path, damage):
  run = _copy(t5_run[0], tmp_path)
  victim = largest_data_file(os.path.join(_step_dir(run, 2), "state"))
  DAMAGE[damage](victim)
  name = os.path.relpath(victim, _step_dir(run, 2))
  expected = rf"step 2 is damaged: {name} .*{MESSAGE[damage]}"
  ckpt_dir = run_dirs.checkpoints_dir(run)
  with ck.CheckpointManager(ckpt_dir) as manager:
    target = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                                    manager.state_metadata(1))
    with pytest.raises(Error, match=expected) as caught:
      manager.restore(2, target=target)
    assert caught.value.step == 2 and caught.value.files == (name,)
    manager.restore(1, target=target)  # The intact step still loads.
  with pytest.raises(Error, match=expected):
    params_export.restore_params_from_run(ckpt_dir)
  with pytest.raises(Error, match=expected):
    model_dirs.load(run)  # What `jaxmoral eval` / `infer` load.
  out = tmp_path / "export"
  with pytest.raises(Error, match=expected):
    model_dirs.export_model(run, out)  # `jaxmoral export`
  assert not out.exists()  # Nothing half-written either.
  if damage == "truncate":  # Sizes are checked without reading data, e.g. by `inspect`.
    with pytest.raises(Error, match=expected):
      model_dirs.inspect(run)
  assert isinstance(caught.value, ValueError)  # The CLI prints ValueErrors as one line.
  assert "\n" not in str(caught.value)
  assert model_dirs.load(run, step=1).info.step == 1


def test_deleted_metadata_is_an_incomplete_step(t5_run, tmp_path):
  run = _copy(t5_run[0], tmp_path)
  os.remove(os.path.join(_step_dir(run, 2), "state", "_METADATA"))
  with pytest.raises(Error, match=r"step 2 is incomplete \(missing state/_METADATA\)"):
    model_dirs.inspect(run)
  with pytest.raises(Error, match=r"step 2 is incomplete \(missing state/_METADATA\)"):
    params_export.restore_params_from_run(run_dirs.checkpoints_dir(run))
  # The same for a step saved before manifests existed.
  os.remove(os.path.join(_step_dir(run, 1), "state", "_METADATA"))
  os.remove(os.path.join(_step_dir(run, 1), integrity.INTEGRITY_FILE))
  with pytest.raises(Error, match=r"step 1 is incomplete \(missing state/_METADATA\)"):
    model_dirs.load(run, step=1)


def test_step_without_manifest_loads_with_a_warning(t5_run, tmp_path, caplog):
  run = _copy(t5_run[0], tmp_path)
  os.remove(os.path.join(_step_dir(run, 2), integrity.INTEGRITY_FILE))
  # Only a run saved before manifests existed: one that records them never loads such a step.
  os.remove(os.path.join(run_dirs.checkpoints_dir(run), integrity.CHECKSUMMED_FILE))
  with caplog.at_level(logging.WARNING, logger="jaxmoral.integrity"):
    loaded = model_dirs.load(run)
  assert loaded.info.step == 2
  assert any("step 2 has no _INTEGRITY.json" in r.getMessage() and "unverified" in r.getMessage()
             for r in caplog.records), caplog.text
  np.testing.assert_array_equal(np.asarray(loaded.params["token_embedder"]["embedding"]),
                                t5_run[1]["token_embedder"]["embedding"])


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_export_is_refused(t5_run, tmp_path, damage, demo_vocab_path):
  run, params = t5_run
  out = str(tmp_path / "export")
  model_dirs.export_model(run, out)
  manifest = json.loads(open(os.path.join(out, integrity.INTEGRITY_FILE)).read())["files"]
  assert "config.json" in manifest and any(f.startswith("params/") for f in manifest)
  np.testing.assert_array_equal(
      np.asarray(params_export.load_params(out)["token_embedder"]["embedding"]),
      params["token_embedder"]["embedding"])
  victim = largest_data_file(os.path.join(out, "params"))
  DAMAGE[damage](victim)
  expected = rf"the export is damaged: {os.path.relpath(victim, out)} .*{MESSAGE[damage]}"
  with pytest.raises(Error, match=expected):
    params_export.load_exported(out)
  with pytest.raises(Error, match=expected):
    model_dirs.load(out)
  if damage == "truncate":
    with pytest.raises(Error, match=expected):
      model_dirs.inspect(out)
  os.remove(os.path.join(out, "params", "_METADATA"))
  with pytest.raises(Error, match=r"the export is incomplete \(missing params/_METADATA\)"):
    model_dirs.inspect(out)
  # A changed config.json is damage too.
  out2 = str(tmp_path / "export2")
  model_dirs.export_model(run, out2)
  with open(os.path.join(out2, "config.json"), "a") as f:
    f.write(" ")
  with pytest.raises(Error, match="the export is damaged: config.json"):
    params_export.load_exported(out2)
  # So is a changed vocabulary or settings file: the manifest covers all a load reads.
  if damage == "truncate":
    return
  with_files = _copy(run, tmp_path)
  run_dirs.save_vocabulary(with_files, vocab_lib.get_vocabulary(demo_vocab_path))
  run_dirs.write_settings(with_files, {"feature_lengths": {"inputs": 8, "targets": 4}})
  out3 = str(tmp_path / "export3")
  model_dirs.export_model(with_files, out3)
  manifest = json.loads(open(os.path.join(out3, integrity.INTEGRITY_FILE)).read())["files"]
  assert {"vocab/spiece.model", "settings.json"} <= set(manifest)
  with open(os.path.join(out3, "vocab", "spiece.model"), "r+b") as f:
    first = f.read(1)
    f.seek(0)
    f.write(bytes([first[0] ^ 1]))
  with pytest.raises(Error, match="the export is damaged: vocab/spiece.model"):
    model_dirs.load(out3)


# -- a tiny training run (resume, lock, TensorBoard) ----------------------------------------------
def _loss(params, batch, rng):
  del rng
  pred = batch["x"] @ params["w"] + params["b"]
  loss = jnp.mean((pred - batch["y"]) ** 2)
  return loss, {"num_examples": jnp.asarray(batch["x"].shape[0], jnp.float32)}


def _trainer() -> tr.Trainer:
  return tr.Trainer(
      init_params_fn=lambda rng: {"w": jax.random.normal(rng, (8, 4)), "b": jnp.zeros(4)},
      loss_fn=_loss, optimizer=optax.adam(1e-2),
      partitioner=partitioning.PjitPartitioner(devices=jax.devices()[:1]))


def _source(seed: int = 0) -> BatchSource:
  rs = np.random.RandomState(seed)
  x = rs.randn(32, 8).astype(np.float32)
  return BatchSource(features={"x": x, "y": (x[:, :4] * 2).astype(np.float32)}, batch_size=8,
                     seed=seed)


def _run(model_dir: str, trainer: tr.Trainer, train_steps: int = STEPS) -> dict:
  return train_lib.train(model_dir=model_dir, trainer=trainer, train_source=_source(),
                         train_steps=train_steps, eval_source=_source(1), eval_every=2,
                         eval_steps=1, checkpoint_every=2, log_every=1)


def _params(model_dir: str, step: int):
  return jax.device_get(params_export.restore_params_from_run(run_dirs.checkpoints_dir(model_dir),
                                                              step=step))


def _events(directory: str) -> list[tuple[str, int]]:
  """(tag, step) of every summary value in a folder's event files, duplicates kept."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  out = []
  for name in sorted(os.listdir(directory)):
    with open(os.path.join(directory, name), "rb") as f:
      data = f.read()
    pos = 0
    while pos + 12 <= len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      out.extend((value.tag, event.step) for value in event.summary.value)
  return out


class _Records(logging.Handler):
  def __init__(self):
    super().__init__(logging.INFO)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
  """An uninterrupted 4-step run, and a copy whose step 4 was damaged, resumed to step 4."""
  trainer = _trainer()
  reference = str(tmp_path_factory.mktemp("reference"))
  _run(reference, trainer)
  damaged = str(tmp_path_factory.mktemp("damaged"))
  shutil.copytree(reference, damaged, dirs_exist_ok=True)
  # The TensorBoard points of steps 3 and 4 stay, as after a kill following step 4.
  flip(largest_data_file(os.path.join(_step_dir(damaged, 4), "state")))
  records = _Records()
  logging.getLogger("jaxmoral").addHandler(records)
  try:
    result = _run(damaged, trainer)
  finally:
    logging.getLogger("jaxmoral").removeHandler(records)
  return trainer, reference, damaged, result, records.messages


def test_train_resumes_from_the_newest_intact_step(resumed):
  _, reference, damaged, result, messages = resumed
  assert result["step"] == STEPS
  assert any("skipping damaged checkpoint step 4" in m and "differs from its checksum" in m
             for m in messages), messages
  assert any("resuming from step 2, the newest intact checkpoint (skipped step 4)" in m
             for m in messages), messages
  ckpt_dir = run_dirs.checkpoints_dir(damaged)
  assert os.path.isdir(os.path.join(ckpt_dir, "4.damaged"))  # Kept for a post-mortem.
  assert ck.CheckpointManager(ckpt_dir).all_steps() == [2, 4]
  assert ck.verify_step(ckpt_dir, 4)  # Saved again, with its manifest.
  for step in (2, 4):
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
                           _params(reference, step), _params(damaged, step))
  assert not os.path.exists(os.path.join(damaged, run_layout.LOCK_FILE))  # Released.


def test_tensorboard_has_each_step_once_after_a_resume(resumed):
  trainer, reference, damaged, _, _ = resumed
  for run in (reference, damaged):
    train = _events(os.path.join(run, "train"))
    assert sorted(s for t, s in train if t == "loss") == [1, 2, 3, 4], run
    assert len(train) == len(set(train)), run
    evals = _events(os.path.join(run, "eval"))
    assert sorted(s for t, s in evals if t == "loss") == [2, 4], run
  # Resumed at its last step, a run evaluates that step again: still one point.
  again = _run(damaged, trainer)
  assert again["step"] == STEPS and "eval/loss" in again
  evals = _events(os.path.join(damaged, "eval"))
  assert sorted(s for t, s in evals if t == "loss") == [2, 4]
  # A torn last record (a kill mid-write) goes too; the rest is kept byte for byte.
  train_dir = os.path.join(damaged, "train")
  name = sorted(os.listdir(train_dir))[-1]
  with open(os.path.join(train_dir, name), "ab") as f:
    f.write(b"\x10\x00\x00")
  assert metric_writers.purge_events_after(train_dir, 3) > 0
  assert sorted(s for t, s in _events(train_dir) if t == "loss") == [1, 2, 3]


def test_train_refuses_when_every_step_is_damaged(resumed, tmp_path):
  trainer, reference, _, _, _ = resumed
  run = str(tmp_path / "run")
  shutil.copytree(reference, run)
  for step in (2, 4):
    os.remove(os.path.join(_step_dir(run, step), "state", "_METADATA"))
  with pytest.raises(Error, match=r"no intact checkpoint .*\(damaged: 4, 2\).*step 4 is "
                                  r"incomplete \(missing state/_METADATA\)"):
    _run(run, trainer)
  assert not os.path.exists(os.path.join(run, run_layout.LOCK_FILE))  # Released on errors too.
  assert ck.CheckpointManager(run_dirs.checkpoints_dir(run)).all_steps() == [2, 4]  # Untouched.


def _write_lock(model_dir: str, host: str, pid: int) -> str:
  path = os.path.join(model_dir, run_layout.LOCK_FILE)
  with open(path, "w") as f:
    json.dump({"host": host, "pid": pid, "started": "2025-01-01T00:00:00+00:00",
               "token": "other"}, f)
  return path


def test_second_run_is_refused_naming_the_holder(resumed, tmp_path):
  trainer = resumed[0]
  model_dir = str(tmp_path / "run")
  os.makedirs(model_dir)
  holder = os.getppid()  # A live process on this host.
  path = _write_lock(model_dir, socket.gethostname(), holder)
  with pytest.raises(run_dirs.RunDirLockedError,
                     match=rf"in use by another training run \(pid {holder} on "
                           rf"{socket.gethostname()}, started 2025-01-01"):
    _run(model_dir, trainer)
  assert json.load(open(path))["token"] == "other"  # Left alone.
  assert not os.path.exists(run_dirs.checkpoints_dir(model_dir))  # Refused before anything.
  # Another host's lock is refused while it is being refreshed.
  _write_lock(model_dir, "elsewhere", 1)
  with pytest.raises(run_dirs.RunDirLockedError, match="pid 1 on elsewhere"):
    run_dirs.RunDirLock(model_dir).acquire()


def test_stale_lock_is_taken_over_with_a_warning(tmp_path, caplog):
  model_dir = str(tmp_path)
  dead = subprocess.Popen(["true"])
  dead.wait()
  path = _write_lock(model_dir, socket.gethostname(), dead.pid)
  with caplog.at_level(logging.WARNING, logger="jaxmoral.run_dirs"):
    with run_dirs.RunDirLock(model_dir):
      mine = json.load(open(path))
      assert mine["pid"] == os.getpid() and mine["host"] == socket.gethostname()
      assert "started" in mine
      with run_dirs.RunDirLock(model_dir):  # Re-entrant in one process (setup, then the loop).
        pass
      assert os.path.exists(path)
  assert not os.path.exists(path)
  assert any(f"stale lock {path} of pid {dead.pid}" in r.getMessage()
             and "not running" in r.getMessage() for r in caplog.records), caplog.text
  # Another host's lock left unrefreshed for long is stale too.
  _write_lock(model_dir, "elsewhere", 1)
  old = os.path.getmtime(path) - run_dirs.LOCK_STALE_AFTER_S - 60
  os.utime(path, (old, old))
  with run_dirs.RunDirLock(model_dir):
    assert json.load(open(path))["pid"] == os.getpid()
  assert not os.path.exists(path)


def test_processes_share_the_hashing_and_all_refuse_a_damaged_file(tmp_path, monkeypatch):
  """Two processes (threads standing in for hosts, the collective a barrier): each hashes
  half of the files, and both refuse a file only the other one read."""
  import threading  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  root = tmp_path / "step"
  root.mkdir()
  for k in range(6):
    (root / f"f{k}").write_bytes(bytes([k]) * (100 + k))
  integrity.write_integrity_manifest(root)
  me, barrier, slots = threading.local(), threading.Barrier(2), [None, None]
  hashed: dict[int, list[str]] = {0: [], 1: []}
  real_hash_all = integrity.hash_files

  def allgather(x):
    slots[me.index] = np.asarray(x)
    barrier.wait()
    out = np.stack(slots)
    barrier.wait()
    return out

  def hash_all(root, relative):
    hashed[me.index].extend(relative)
    return real_hash_all(root, relative)

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: me.index)
  monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
  monkeypatch.setattr(multihost_utils, "sync_global_devices", lambda name: barrier.wait())
  monkeypatch.setattr(integrity, "hash_files", hash_all)

  def verify_as_both() -> list:
    results = [None, None]

    def process(index):
      me.index = index
      try:
        results[index] = integrity.verify_integrity(root, what="step", shared=True)
      except Error as e:
        results[index] = e
    threads = [threading.Thread(target=process, args=(i,)) for i in (0, 1)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=60)
    return results

  assert verify_as_both() == [True, True]
  assert sorted(hashed[0] + hashed[1]) == [f"f{k}" for k in range(6)]  # each file once
  assert hashed[0] and hashed[1] and not set(hashed[0]) & set(hashed[1])
  victim = hashed[1][0]
  flip(str(root / victim))  # same size, other bytes: only a digest finds it
  results = verify_as_both()
  assert all(isinstance(r, Error) and r.files == (victim,) for r in results), results
  # Unshared, one process hashes everything (what single-process callers get).
  hashed[0].clear()
  me.index = 0
  with pytest.raises(Error, match=victim):
    integrity.verify_integrity(root, what="step")
  assert sorted(hashed[0]) == [f"f{k}" for k in range(6)]


# -- manifests stay inside their folder -----------------------------------------------------------
def _plant_entry(manifest_path: str, entry: str) -> None:
  manifest = json.load(open(manifest_path))
  manifest["files"][entry] = {"size": 1, "sha256": "0" * 64}
  with open(manifest_path, "w") as f:
    json.dump(manifest, f)


@pytest.mark.parametrize("entry", ["../../../../../../etc/passwd", "/etc/hostname",
                                   "state/../../1/state/_METADATA", "leak"])
def test_manifest_naming_a_file_outside_its_step_is_refused_by_every_reader(
    t5_run, tmp_path, entry):
  """Whatever reads a manifest (train's restore, eval's load, export, the explorer's run page)
  refuses one that names a file outside the step: it reveals no size or digest of it."""
  import pathlib  # pylint: disable=g-import-not-at-top

  from jaxmoral.explore import sources  # pylint: disable=g-import-not-at-top
  run = _copy(t5_run[0], tmp_path)
  step = _step_dir(run, 2)
  if entry == "leak":  # A link in the step folder to a file outside it.
    (tmp_path / "secret").write_text("x")
    os.symlink(tmp_path / "secret", os.path.join(step, "leak"))
  _plant_entry(os.path.join(step, integrity.INTEGRITY_FILE), entry)
  expected = rf"step 2 is damaged: its _INTEGRITY.json names '{entry}', which is outside"
  with ck.CheckpointManager(run_dirs.checkpoints_dir(run)) as manager:
    target = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                                    manager.state_metadata(1))
    with pytest.raises(Error, match=expected):
      manager.restore(2, target=target)
  with pytest.raises(Error, match=expected):
    model_dirs.load(run)
  with pytest.raises(Error, match=expected):
    model_dirs.export_model(run, tmp_path / "export")
  rows = {row["step"]: row for row in sources.run_checkpoints(pathlib.Path(run))}
  assert not rows[2]["ok"] and "outside" in rows[2]["status"]
  assert "bytes" not in rows[2]["status"] and rows[1]["ok"]
  # The run's own manifest and an export's are read by the same check.
  integrity.write_integrity_manifest(run, [run_layout.MODEL_CONFIG_FILE])
  _plant_entry(os.path.join(run, integrity.INTEGRITY_FILE), "/etc/hostname")
  with pytest.raises(Error, match="the run's files is damaged: .* names '/etc/hostname'"):
    run_dirs.verify_run_files(run)


def test_verification_is_cached_per_step_until_a_file_changes(tmp_path, monkeypatch):
  root = tmp_path / "step"
  root.mkdir()
  for k in range(3):
    (root / f"f{k}").write_bytes(bytes([k]) * 100)
  integrity.write_integrity_manifest(root)
  hashed: list[str] = []
  real_hash_all = integrity.hash_files
  monkeypatch.setattr(integrity, "hash_files",
                      lambda r, rel: (hashed.extend(rel), real_hash_all(r, rel))[1])
  assert integrity.verify_integrity(root, what="step")
  assert sorted(hashed) == ["f0", "f1", "f2"]
  hashed.clear()
  assert integrity.verify_integrity(root, what="step")  # A second page view hashes nothing.
  assert not hashed
  flip(str(root / "f1"))
  with pytest.raises(Error, match="f1 differs"):
    integrity.verify_integrity(root, what="step")
  assert hashed == ["f1"]  # Only the rewritten file is hashed again.


def test_a_reader_names_the_newest_step_it_skips_and_retries_a_vanished_one(
    t5_run, tmp_path, monkeypatch, caplog):
  """eval and export (`model_dirs.load`) pass over a newest step without a manifest with a
  warning naming it (silent while a run holds the lock: it is still saving it); a step that a
  running train removes while it is read is replaced by the newest one."""
  run = _copy(t5_run[0], tmp_path)
  os.remove(os.path.join(_step_dir(run, 2), integrity.INTEGRITY_FILE))
  with caplog.at_level(logging.WARNING):
    with open(os.path.join(run, run_layout.LOCK_FILE), "w") as f:
      f.write("{}")
    assert model_dirs.load(run).info.step == 1
    assert not [r for r in caplog.records if "step 2 has no" in r.getMessage()]
    os.remove(os.path.join(run, run_layout.LOCK_FILE))
    assert model_dirs.load(run).info.step == 1
  assert any("checkpoint step 2 has no _INTEGRITY.json and no run holds the lock" in
             r.getMessage() and "reading step 1" in r.getMessage() for r in caplog.records)
  run = _copy(t5_run[0], tmp_path / "vanishing")
  real = params_export.restore_params_from_run

  def removed_while_read(directory, *, step=None, **kwargs):
    if step == 2:  # What a train's max_to_keep does between inspect and restore.
      shutil.rmtree(os.path.join(directory, "2"))
    return real(directory, step=step, **kwargs)
  monkeypatch.setattr(params_export, "restore_params_from_run", removed_while_read)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    assert model_dirs.load(run).info.step == 1
  assert any("checkpoint step 2 was removed while it was read" in r.getMessage()
             for r in caplog.records)
