"""The training loop: resumed runs equal uninterrupted ones, NaN stop, TensorBoard, progress.

Run as a script (`python tests/test_train.py child MODEL_DIR POINTS_DIR`) this file is the child
process of the SIGKILL tests: it trains the same configuration as the in-process runs.
"""

import functools
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoral import checkpoints, integrity, losses, optimizers, params_export, partitioning
from jaxmoral import metric_writers, software
from jaxmoral import train as train_lib
from jaxmoral import trainer as tr
from jaxmoral.data.pipeline import BatchSource
from jaxmoral.models import config, t5

# What runs is tested here, not how it is sharded (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_device")

VOCAB = 128
STEPS = 10


def build_trainer() -> tuple[tr.Trainer, t5.T5]:
  """Tiny T5 with dropout on a 2 x 2 mesh; AdamW on a warm-up/decay schedule.

  Dropout and a step-dependent learning rate make a resume that got the rng or the optimizer
  count wrong visibly diverge. The mesh has both a data and a model axis (a resume restores
  sharded parameters and optimizer state), on 4 devices rather than all 8: programs over fewer
  fake devices compile and run faster.
  """
  model = t5.T5(config.t5_config(size="tiny", vocab_size=VOCAB, num_encoder_layers=1,
                                 num_decoder_layers=1, dropout_rate=0.1))
  schedule = optimizers.make_schedule(name="warmup_linear_decay", base_learning_rate=1e-2,
                                      warmup_steps=3, total_steps=STEPS)
  trainer = tr.Trainer(init_params_fn=functools.partial(t5.init_params, model),
                       loss_fn=losses.seq2seq_loss_fn(model),
                       optimizer=optimizers.make_optimizer(name="adamw", learning_rate=schedule),
                       partitioner=partitioning.PjitPartitioner(
                           num_partitions=2, devices=jax.devices()[:4]),
                       learning_rate_fn=schedule)
  return trainer, model


def make_features(n: int, seed: int) -> dict:
  rs = np.random.RandomState(seed)
  enc = rs.randint(2, VOCAB, (n, 10)).astype(np.int32)
  dec = rs.randint(2, VOCAB, (n, 6)).astype(np.int32)
  for i in range(n):
    dec[i, 6 - (i % 4):] = 0
  return {"encoder_input_tokens": enc, "decoder_target_tokens": dec,
          "decoder_input_tokens": np.asarray(t5.shift_right(jnp.asarray(dec))),
          "decoder_loss_weights": (dec > 0).astype(np.float32)}


def train_source() -> BatchSource:
  return BatchSource(features=make_features(40, 0), batch_size=8, seed=3)


def eval_source() -> BatchSource:
  # 12 examples at batch 8: the second eval batch is half padding.
  return BatchSource(features=make_features(12, 1), batch_size=8, shuffle=False)


class PoisonedSource:
  """Batch `bad_step` has NaN loss weights (a corrupt batch)."""

  def __init__(self, base: BatchSource, bad_step: int):
    self.base, self.bad_step = base, bad_step

  def iterate(self, start: int):
    for step, batch in enumerate(self.base.iterate(start), start):
      batch = dict(batch)
      if step == self.bad_step:
        batch["decoder_loss_weights"] = np.full_like(batch["decoder_loss_weights"], np.nan)
      yield batch


class KillingSource:
  """Reads batches on until batch `kill_at` is asked for (mid-run: the loop reads ahead), and
  once step 2's checkpoint is complete, writes metric points into `points_dir` and kills its
  own process (SIGKILL) right after: a kill -9 with checkpoints and points just written."""

  def __init__(self, base: BatchSource, model_dir: str, points_dir: str, kill_at: int = 6):
    self.base, self.model_dir, self.points_dir = base, model_dir, points_dir
    self.kill_at = kill_at

  def iterate(self, start: int):
    for step, batch in enumerate(self.base.iterate(start), start):
      if step == self.kill_at:
        step_2 = os.path.join(self.model_dir, "checkpoints", "2", integrity.INTEGRITY_FILE)
        deadline = time.time() + 240
        while not os.path.isfile(step_2) and time.time() < deadline:
          time.sleep(0.02)
        _write_points_then_die(self.points_dir)
      yield batch


@pytest.fixture(scope="module")
def setup():
  return build_trainer()


@pytest.fixture(scope="module")
def run_a(setup, tmp_path_factory):
  """The uninterrupted reference: 10 steps straight, eval every 5."""
  trainer, _ = setup
  model_dir = str(tmp_path_factory.mktemp("run_a"))
  result = train_lib.train(model_dir=model_dir, trainer=trainer, train_source=train_source(),
                           train_steps=STEPS, eval_source=eval_source(), eval_every=5,
                           checkpoint_every=5, log_every=1, async_checkpoint=False)
  return model_dir, result


def final_params(model_dir: str):
  params = params_export.restore_params_from_run(os.path.join(model_dir, "checkpoints"))
  return jax.tree_util.tree_map(np.asarray, jax.device_get(params))


def test_resumed_run_equals_uninterrupted_run(setup, run_a, killed_child, tmp_path, caplog):
  del killed_child  # Started here, once `run_a` is done: see the fixture.
  trainer, model = setup
  dir_a, result_a = run_a
  dir_b = str(tmp_path / "run_b")
  common = dict(trainer=trainer, train_source=train_source(), checkpoint_every=3, log_every=1)
  first = train_lib.train(model_dir=dir_b, train_steps=6, **common)
  assert first["step"] == 6
  assert checkpoints.CheckpointManager(os.path.join(dir_b, "checkpoints")).all_steps() == [3, 6]
  with caplog.at_level("INFO", logger="jaxmoral.train"):
    second = train_lib.train(model_dir=dir_b, train_steps=STEPS, **common)  # a new call resumes
  assert second["step"] == STEPS
  assert any("resuming" in r.getMessage() and "step 6" in r.getMessage() for r in caplog.records)
  # Each start recorded which code trained from there on, and said it.
  records = software.read_records(dir_b)
  assert [r["step"] for r in records] == [0, 6]
  assert all(r["versions"]["jax"] == jax.__version__ for r in records)
  assert any(r.getMessage() == f"train: {software.describe(records[1])}" for r in caplog.records)
  texts = metric_writers.read_texts(os.path.join(dir_b, "train"))
  assert texts["software"] == {0: software.describe(records[0]),
                               6: software.describe(records[1])}
  assert "config" not in texts  # no config.gin: this run was not started from gin
  progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 10/10")]
  assert progress and all(w in progress[0] for w in ("loss", "tokens/s", "steps/s", "ETA"))

  losses_a = metric_writers.read_scalars(os.path.join(dir_a, "train"))["loss"]
  losses_b = metric_writers.read_scalars(os.path.join(dir_b, "train"))["loss"]
  assert sorted(losses_a) == list(range(1, STEPS + 1)) == sorted(losses_b)
  for step in range(7, STEPS + 1):
    assert losses_b[step] == pytest.approx(losses_a[step], rel=1e-6, abs=1e-7), step
  assert losses_a[STEPS] < losses_a[1]
  lr = metric_writers.read_scalars(os.path.join(dir_a, "train"))["learning_rate"]
  assert lr[1] == pytest.approx(0.0) and lr[4] == pytest.approx(1e-2)  # schedule(step - 1)
  params_a, params_b = final_params(dir_a), final_params(dir_b)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), params_a,
                         params_b)

  # Eval: token-weighted over the padded eval pass == the loss fn on the 12 examples at once.
  eval_scalars = metric_writers.read_scalars(os.path.join(dir_a, "eval"))
  assert sorted(eval_scalars["loss"]) == [5, 10]
  whole = eval_source().features
  # One program, rather than op by op (each op its own compile).
  ref_loss, _ = jax.jit(losses.seq2seq_loss_fn(model))(params_a, whole, None)
  assert result_a["eval/loss"] == pytest.approx(float(ref_loss), rel=1e-5)
  assert eval_scalars["loss"][10] == pytest.approx(result_a["eval/loss"], rel=1e-6)


def test_nan_loss_stops_naming_the_step_and_saves_nothing_bad(setup, tmp_path):
  trainer, _ = setup
  model_dir = str(tmp_path / "nan_run")
  with pytest.raises(train_lib.NonFiniteLossError,
                     match=r"non-finite loss=nan.* at step 4 \(batch 3\)"):
    train_lib.train(model_dir=model_dir, trainer=trainer,
                    train_source=PoisonedSource(train_source(), bad_step=3),
                    train_steps=STEPS, checkpoint_every=2, log_every=1)
  steps = checkpoints.CheckpointManager(os.path.join(model_dir, "checkpoints")).all_steps()
  assert steps == [2]
  params = final_params(model_dir)
  assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(params))


def test_nan_found_at_a_later_log_or_checkpoint_still_names_its_step(setup, tmp_path):
  # Metrics are fetched every 8 steps: the NaN of step 4 is found at step 6's checkpoint,
  # which is not written.
  trainer, _ = setup
  model_dir = str(tmp_path / "late_nan_run")
  with pytest.raises(train_lib.NonFiniteLossError,
                     match=r"non-finite loss=nan.* at step 4 \(batch 3\).*last checkpoint: none"):
    train_lib.train(model_dir=model_dir, trainer=trainer,
                    train_source=PoisonedSource(train_source(), bad_step=3),
                    train_steps=STEPS, checkpoint_every=6, log_every=8)
  assert checkpoints.CheckpointManager(os.path.join(model_dir, "checkpoints")).all_steps() == []


class RecordingHook(train_lib.TrainHook):
  """Records the loss of every step, as a hook that needs its step's metrics does."""

  def __init__(self):
    self.losses = {}

  def after_step(self, loop, step, state, metrics):
    self.losses[step] = metrics["loss"]


def test_the_loop_fetches_metrics_once_per_log_window(setup, run_a, tmp_path, monkeypatch):
  """No per-step host sync: 10 steps logged every 5 fetch metrics a handful of times, not
  once a step; a hook that reads its step's metrics gets exactly that step's values."""
  trainer, _ = setup
  fetches = []
  device_get = jax.device_get
  monkeypatch.setattr(jax, "device_get", lambda x: (fetches.append(1), device_get(x))[1])
  train_lib.train(model_dir=str(tmp_path / "quiet"), trainer=trainer,
                  train_source=train_source(), train_steps=STEPS, checkpoint_every=STEPS,
                  log_every=5, async_checkpoint=False)
  # The first step (compilation), two logs, the final step count; not 10.
  assert len(fetches) <= 5, len(fetches)
  monkeypatch.setattr(jax, "device_get", device_get)
  hook = RecordingHook()
  train_lib.train(model_dir=str(tmp_path / "hooked"), trainer=trainer,
                  train_source=train_source(), train_steps=STEPS, checkpoint_every=STEPS,
                  log_every=5, async_checkpoint=False, hooks=[hook])
  reference = metric_writers.read_scalars(os.path.join(run_a[0], "train"))["loss"]  # log_every=1
  assert sorted(hook.losses) == list(range(1, STEPS + 1))
  for step, loss in hook.losses.items():
    assert loss == pytest.approx(reference[step], rel=1e-6)


def test_the_host_dispatches_a_step_only_once_the_one_two_before_has_run(setup, tmp_path,
                                                                         monkeypatch):
  """Double buffering, not an unbounded queue: while step n runs, step n + 1 is queued, and
  step n + 2 is dispatched only after step n has finished. So a preemption notice or a NaN is
  acted on within two steps, and queued steps hold no device memory."""
  trainer, _ = setup
  issued, events = [], []
  step_fn, block = trainer.train_step, jax.block_until_ready

  def train_step(*args):
    state, metrics = step_fn(*args)
    issued.append(metrics)
    events.append(("dispatch", len(issued)))
    return state, metrics

  def block_until_ready(tree):
    events.extend(("wait", i + 1) for i, m in enumerate(issued) if m is tree)
    return block(tree)

  monkeypatch.setattr(trainer, "train_step", train_step)
  monkeypatch.setattr(jax, "block_until_ready", block_until_ready)
  # One log at the end: between step 1 (fetched: compilation) and the last, only the
  # in-flight bound makes the host wait.
  train_lib.train(model_dir=str(tmp_path / "bounded"), trainer=trainer,
                  train_source=train_source(), train_steps=STEPS, checkpoint_every=STEPS,
                  log_every=STEPS, async_checkpoint=False)
  finished = {1}
  for event, step in events:
    if event == "wait":
      finished.add(step)
    else:
      assert step < 3 or step - 2 in finished, events
  assert len(issued) == STEPS


def test_prefetcher_prepares_batches_ahead_and_passes_errors_on():
  produced = []

  def batches():
    for i in range(5):
      produced.append(i)
      yield {"x": np.full((2, 3), i)}
    raise ValueError("bad row 5")

  placed = train_lib._Prefetcher(batches(), lambda b: {k: v + 100 for k, v in b.items()},
                                 depth=2)
  try:
    batch, rows, tokens = next(placed)
    assert batch["x"][0, 0] == 100 and rows == 2 * jax.process_count() and tokens == 0.0
    deadline = time.time() + 10
    while len(produced) < 3 and time.time() < deadline:
      time.sleep(0.01)
    time.sleep(0.1)
    # The one taken, two queued ahead and at most one waiting to be queued.
    assert 3 <= len(produced) <= 4, produced
    assert [next(placed)[0]["x"][0, 0] for _ in range(4)] == [101, 102, 103, 104]
    with pytest.raises(ValueError, match="bad row 5"):
      next(placed)
  finally:
    placed.close()


def test_resume_over_changed_data_is_refused_in_one_line(setup, tmp_path):
  trainer, _ = setup
  model_dir = str(tmp_path / "fingerprinted")
  first = BatchSource(features=make_features(40, 0), batch_size=8, seed=3,
                      data_fingerprint="rows-of-version-1")
  train_lib.train(model_dir=model_dir, trainer=trainer, train_source=first, train_steps=2,
                  checkpoint_every=2, log_every=2, async_checkpoint=False)
  changed = BatchSource(features=make_features(40, 5), batch_size=8, seed=3,
                        data_fingerprint="rows-of-version-2")
  with pytest.raises(ValueError, match="data would not continue the same run") as error:
    train_lib.train(model_dir=model_dir, trainer=trainer, train_source=changed, train_steps=4,
                    checkpoint_every=2, log_every=2, async_checkpoint=False)
  line = str(error.value).splitlines()[0]  # gin adds its "In call to configurable" below
  assert "rows-of-version-1" in line and "rows-of-version-2" in line and "MODEL_DIR" in line


def _child(model_dir: str, points_dir: str) -> None:
  trainer, _ = build_trainer()
  source = KillingSource(train_source(), model_dir, points_dir)
  train_lib.train(model_dir=model_dir, trainer=trainer, train_source=source, train_steps=STEPS,
                  checkpoint_every=2, log_every=1, async_checkpoint=True)


@pytest.fixture(scope="module")
def killed_child(run_a, tmp_path_factory):
  """The child of the kill -9 tests, started after the reference run (`run_a`): its programs
  are then in the persistent compilation cache, and it loads them rather than compiling them
  again alongside this process (which cost a second compile of the train step). It runs while
  the tests below it in this file run here."""
  del run_a
  tmp = tmp_path_factory.mktemp("killed")
  model_dir, points_dir = str(tmp / "run"), str(tmp / "points")
  os.makedirs(model_dir)
  cmd = [sys.executable, os.path.abspath(__file__), "child", model_dir, points_dir]
  from conftest import child_xla_flags  # pylint: disable=g-import-not-at-top  (not in the child)
  # conftest's JAX_PLATFORMS and compile settings carry over. 8 fake devices, as this process
  # has (the mesh takes 4 of them): the compilation cache's key includes the process's device
  # count, so with 8 the child loads the programs `run_a` compiled instead of compiling them.
  env = {**os.environ, "XLA_FLAGS": child_xla_flags(device_count=8)}
  child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  yield child, model_dir, points_dir
  if child.poll() is None:
    child.kill()
  child.communicate()


@pytest.fixture(scope="module")
def killed(killed_child):
  """A run killed (SIGKILL) mid-run in a child process, once step 2 is saved and right after
  writing metric points: (model_dir, points_dir). One child serves both kill -9 tests."""
  child, model_dir, points_dir = killed_child
  _, stderr = child.communicate(timeout=300)
  assert child.returncode == -signal.SIGKILL, stderr.decode()[-3000:]
  return model_dir, points_dir


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_matches_uninterrupted(setup, run_a, killed):
  dir_a, _ = run_a
  model_dir, _ = killed
  saved = checkpoints.CheckpointManager(os.path.join(model_dir, "checkpoints")).all_steps()
  assert saved and 2 <= max(saved) < STEPS  # killed mid-run, after a checkpoint
  # The resume runs here: the kill is what needs its own process, not the restart.
  trainer, _ = setup
  train_lib.train(model_dir=model_dir, trainer=trainer, train_source=train_source(),
                  train_steps=STEPS, checkpoint_every=2, log_every=1, async_checkpoint=True)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
                         final_params(dir_a), final_params(model_dir))
  # The TensorBoard curve has every step, each as in the uninterrupted run.
  losses_a = metric_writers.read_scalars(os.path.join(dir_a, "train"))["loss"]
  losses_killed = metric_writers.read_scalars(os.path.join(model_dir, "train"))["loss"]
  assert sorted(losses_killed) == list(range(1, STEPS + 1))
  for step, loss in losses_killed.items():
    assert loss == pytest.approx(losses_a[step], rel=1e-6, abs=1e-7), step


def _write_points_then_die(model_dir: str) -> None:
  writers = metric_writers.MetricWriters(model_dir)
  for step in (1, 2, 3):
    writers.scalars("train", step, {"loss": 1.0 / step})
  writers.text("eval", 3, "samples", "| a | b |")
  os.kill(os.getpid(), signal.SIGKILL)


def test_metric_points_are_on_disk_when_written(killed):
  """A process killed right after writing a point (as after a checkpoint) keeps it."""
  _, model_dir = killed
  assert metric_writers.read_scalars(os.path.join(model_dir, "train")) == {
      "loss": {1: 1.0, 2: 0.5, 3: pytest.approx(1 / 3)}}
  events = "".join(open(os.path.join(model_dir, "eval", name), "rb").read().decode(
      errors="replace") for name in os.listdir(os.path.join(model_dir, "eval")))
  assert "| a | b |" in events


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] == "child":
    _child(sys.argv[2], sys.argv[3])
  else:
    raise SystemExit("usage: python tests/test_train.py child MODEL_DIR POINTS_DIR")


def test_tensorboard_events_are_written_without_loading_pytorch(tmp_path):
  """tensorboardX's package import would load PyTorch (installed here, for the Hugging Face
  parity tests) into every training process; the writers and readers go without it, and torch
  can still be imported afterwards."""
  code = ("import sys\n"
          "from jaxmoral import metric_writers\n"
          "writers = metric_writers.MetricWriters(sys.argv[1])\n"
          "writers.scalars('train', 3, {'loss': 0.25})\n"
          "writers.text('eval', 3, 'samples', 'a | b')\n"
          "writers.close()\n"
          "assert 'torch' not in sys.modules, 'tensorboardX loaded torch'\n"
          "print(metric_writers.read_scalars(sys.argv[1] + '/train'))\n"
          "import torch\n")
  out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                       text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == "{'loss': {3: 0.25}}"
