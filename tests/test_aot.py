"""AOT compilation reports (`jaxmoral.aot`): fake-CPU mesh, memory check, optional libtpu."""

import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import time

import gin
import jax
import numpy as np
import pytest

from jaxmoral import aot
from jaxmoral import cli
from jaxmoral import gin_utils
from jaxmoral import runs

# The tiny seq2seq config on a 4 x 2 (data x model) mesh, small batch: compiles in seconds.
TINY = ["--gin_file=configs/core/tiny_cpu.gin", "--gin.BATCH_SIZE=8",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
        "--gin.partitioning.PjitPartitioner.num_partitions=2",
        # One layer each side: what is checked is the sharded step and its report, not depth.
        "--gin.config.t5_config.num_encoder_layers=1",
        "--gin.config.t5_config.num_decoder_layers=1"]


pytestmark = pytest.mark.usefixtures("clean_gin")


def _parse(extra=()):
  gin_args, rest = gin_utils.split_gin_args([*TINY, *extra])
  assert not rest
  gin_utils.parse_gin(gin_args)


def _shard_bytes(tree) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (independent of XLA)."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
  """One compile through the CLI with a fake 1 KiB HBM: (exit code, stdout, report)."""
  report_path = tmp_path_factory.mktemp("aot") / "report.json"
  gin.clear_config()
  code = cli.main(["compile", *TINY, "--gin.aot.compile_for_topology.hbm_bytes=1024",
                   "--topology=cpu:8", f"--report={report_path}"])
  gin.clear_config()
  return code, aot.CompileReport(**json.loads(report_path.read_text()))


def test_cpu_report_fields(cpu_run):
  _, r = cpu_run
  assert r.mesh == {"data": 4, "model": 2} and r.num_devices == 8 and r.platform == "cpu"
  for name in ("argument_bytes", "output_bytes", "temp_bytes", "peak_bytes", "num_params"):
    assert getattr(r, name) > 0, name
  assert r.flops_per_chip > 0 and r.model_flops_per_step > 0
  # No chip and no step time: no peak FLOP/s, no MFU is invented.
  assert r.mfu is None and r.min_step_time_s is None and r.peak_flops_per_s is None
  assert r.peak_bytes == (r.argument_bytes + r.output_bytes - r.alias_bytes + r.temp_bytes
                          + r.generated_code_bytes)
  assert "Seq2SeqModel" in r.description and "batch 8 x (encoder 16, decoder 8)" in r.description
  assert r.num_trainable_params == r.num_params
  # XLA's per-device FLOPs of the partitioned step, times 8 devices, are within a factor of
  # about two of the 6*N*D model estimate (attention scores, softmax, optimizer on top).
  assert 0.7 < r.flops_per_chip * 8 / r.model_flops_per_step < 2.5


def test_cpu_argument_bytes_match_shard_shapes(cpu_run):
  # The compiled step's arguments are the sharded state + batch + rng: recompute their
  # per-device bytes from the shardings alone.
  from jaxmoral import partitioning  # pylint: disable=g-import-not-at-top
  _, report = cpu_run
  _parse()
  model = copy.deepcopy(gin.query_parameter("runs.train_run.model"))
  optimizer = copy.deepcopy(gin.query_parameter("runs.train_run.optimizer"))
  partitioner = partitioning.PjitPartitioner(num_partitions=2, devices=jax.devices()[:8])
  trainer = runs.make_trainer(model=model, optimizer=optimizer, partitioner=partitioner)
  shapes = runs.Seq2SeqData(mixture_or_task_name="t").batch_shapes(
      batch_size=8, feature_lengths={"inputs": 16, "targets": 8})
  batch = {k: jax.ShapeDtypeStruct(v[0], np.int32, sharding=partitioner.data_sharding(2))
           for k, v in shapes.items()}
  rng = jax.ShapeDtypeStruct((2,), np.uint32, sharding=partitioner.replicated)
  expected = _shard_bytes((trainer.abstract_state(), batch, rng))
  # jit drops arguments the step never reads (a few scalar counters): at most 4 x 4 bytes.
  assert 0 <= expected - report.argument_bytes <= 16
  # The state is donated: its bytes are aliased to the new state.
  assert 0 <= _shard_bytes(trainer.abstract_state()) - report.alias_bytes <= 16


def test_memory_check_raises_and_cli_exit_code(cpu_run, capsys):
  code, report = cpu_run
  # The fake 1 KiB HBM: `jaxmoral compile` printed the table, wrote the JSON and exited 2.
  assert code == 2 and report.fits is False and report.hbm_bytes == 1024
  with pytest.raises(aot.DoesNotFitError, match="per chip") as info:
    aot.check_fits(report)
  assert info.value.report is report


def test_mfu_only_with_a_step_time():
  topo = aot.Topology(name="fake", platform="tpu", devices=tuple(range(8)),
                      chip=aot.CHIPS["v5e"])

  class Fake:
    def memory_analysis(self):
      return type("M", (), dict(argument_size_in_bytes=10, output_size_in_bytes=10,
                                alias_size_in_bytes=10, temp_size_in_bytes=5,
                                generated_code_size_in_bytes=1))()

    def cost_analysis(self):
      return {"flops": 197e12 * 0.5}

  program = aot.CompileProgram(stages=(aot.Stage("step", None, ()),), description="fake",
                               model_flops_per_step=8 * 197e12 * 0.25)
  r = aot.analyze(Fake(), topology=topo, target="fake", program=program, mesh={"data": 8})
  assert r.peak_bytes == 16 and r.fits and r.hbm_bytes == 16 * aot.GiB
  assert r.min_step_time_s == pytest.approx(0.5) and r.mfu is None
  r = aot.analyze(Fake(), topology=topo, target="fake", program=program, mesh={"data": 8},
                  step_time_s=1.0, hbm_bytes=15)
  assert r.fits is False
  assert r.mfu == pytest.approx(0.5) and r.model_mfu == pytest.approx(0.25)


def test_stages_combine_worst_memory_and_summed_flops():
  topo = aot.Topology(name="fake", platform="tpu", devices=tuple(range(8)),
                      chip=aot.CHIPS["v5e"])

  def fake(temp, flops):
    class Fake:
      def memory_analysis(self):
        return type("M", (), dict(argument_size_in_bytes=10, output_size_in_bytes=10,
                                  alias_size_in_bytes=10, temp_size_in_bytes=temp))()

      def cost_analysis(self):
        return {"flops": flops}
    return Fake()

  program = aot.CompileProgram(stages=(aot.Stage("a", None, ()), aot.Stage("b", None, ())))
  a = aot.analyze(fake(5, 1e12), topology=topo, target="t", program=program, mesh={},
                  step_time_s=0.1, compile_seconds=2.0)
  b = aot.analyze(fake(50, 3e12), topology=topo, target="t", program=program, mesh={},
                  step_time_s=0.1, compile_seconds=3.0)
  r = aot.combine_stages([("a", a), ("b", b)])
  assert r.peak_bytes == 60 and r.temp_bytes == 50  # stage b, the larger peak
  assert r.flops_per_chip == 4e12 and r.compile_seconds == 5.0
  assert r.min_step_time_s == pytest.approx(4e12 / 197e12)
  assert r.mfu == pytest.approx(4e12 / (0.1 * 197e12))
  assert [s["name"] for s in r.stages] == ["a", "b"] and r.stages[0]["peak_bytes"] == 15
  assert aot.combine_stages([("a", a)]) is a
  # Every model stays on the chips: the resident bytes once, plus the largest working set of
  # a stage beyond its own persistent arguments (a: 15 - 4, b: 60 - 8).
  r = aot.combine_stages([("a", a), ("b", b)], persistent_bytes=[4, 8], resident_bytes=100)
  assert r.peak_bytes == 100 + 52 and r.resident_bytes == 100
  with pytest.raises(ValueError, match="no stages"):
    aot.CompileProgram(stages=(), description="none")


@pytest.mark.parametrize("bad", ["v5e", "v9:2x2", "cpu:2x2", "8x8", "cpu:10000"])
def test_bad_topologies_are_clear_errors(bad):
  with pytest.raises(ValueError, match="topology"):
    aot.get_topology(bad)


def test_unknown_target_and_duplicate_registration():
  _parse()
  with pytest.raises(ValueError, match="unknown target 'nope'"):
    aot.compile_for_topology(topology="cpu:8", target="nope")
  with pytest.raises(ValueError, match="already registered"):
    aot.register_compile_target("train_run", lambda: None)
  assert "train_run" in aot.compile_targets()


def _tpu_topology_or_skip():
  try:
    return aot.get_topology("v5e:2x2")
  except ValueError as error:
    pytest.skip(f"no usable libtpu for compile-only TPU topologies: {error}")


def test_tiny_compiles_for_a_tpu_topology():
  topo = _tpu_topology_or_skip()
  assert len(topo.devices) == 4 and topo.chip.hbm_bytes == 16 * aot.GiB
  _parse()
  report = aot.compile_for_topology(topology="v5e:2x2", print_table=False)
  assert report.platform == "tpu" and report.mesh == {"data": 2, "model": 2}
  assert report.fits and 0 < report.peak_bytes < 16 * aot.GiB
  assert report.min_step_time_s == pytest.approx(report.flops_per_chip / 197e12)


def test_a_compile_only_topology_starts_libtpu_quietly_without_a_tpu():
  """libtpu's host runtime prints accelerator-type and worker-hostname errors where no TPU VM
  describes the host; `jaxmoral compile` gives it those settings, so stderr stays clean."""
  _tpu_topology_or_skip()
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
  result = subprocess.run(
      [sys.executable, "-c", "from jaxmoral import aot; print(len(aot.get_topology('v5e:2x2')"
       ".devices))"], capture_output=True, text=True, timeout=120,
      env={**env, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0 and result.stdout.split() == ["4"], result.stderr
  assert result.stderr == "", result.stderr


def test_clarify_ppo_target_lowers_the_functions_train_ppo_runs(tmp_path):
  """`jaxmoral compile` of a ClarifyDelphi PPO config: every program of an iteration, the very
  function objects train-ppo calls, with all five models on the mesh."""
  import random_model_dirs  # pylint: disable=g-import-not-at-top
  from jaxmoral.clarify import training  # pylint: disable=g-import-not-at-top
  from jaxmoral.data import vocab as vocab_lib  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import config as config_lib  # pylint: disable=g-import-not-at-top
  vocab_path = vocab_lib.build_demo_vocabulary(output_dir=tmp_path / "vocab")
  gin_args, _ = gin_utils.split_gin_args([
      "--gin_file=configs/clarify/tiny_cpu.gin",
      "--gin.aot.compile_for_topology.target='clarify_ppo'",
      "--gin.training.ppo_compile_target.policy_config=%MODEL_CONFIG",
      f"--gin.training.ppo_compile_target.vocabulary_path='{vocab_path}'",
      "--gin.training.train_clarify_model.model_config=%MODEL_CONFIG",
      "--gin.ppo_trainer.PPOConfig.num_ppo_epochs=1",
      "--gin.ppo_trainer.PPOConfig.max_prompt_length=16",
      "--gin.ppo_trainer.PPOConfig.max_response_length=4",
      "--gin.reward.RewardConfig.batch_size=8", "--gin.reward.RewardConfig.input_length=16",
      "--gin.reward.RewardConfig.max_answer_length=4",
      "--gin.reward.RewardConfig.max_fusion_length=6",
      "--gin.partitioning.PjitPartitioner.num_partitions=2",
      # One layer each: the shapes matter here, not the depth (compiles in half the time).
      "--gin.config.t5_config.num_encoder_layers=1",
      "--gin.config.t5_config.num_decoder_layers=1"])
  gin_utils.parse_gin(gin_args)
  # Two devices hold the bound model axis: what is checked is which programs are lowered and
  # what the report adds up, not data parallelism (the 4 x 2 mesh: test_cpu_report_fields),
  # and seven programs for two devices compile in less time than for eight.
  report = aot.compile_for_topology(topology="cpu:2", print_table=False)
  names = [s["name"] for s in report.stages]
  assert names == ["rollout", "answer", "nli", "fusion", "judge", "score", "update"]
  tiny = config_lib.t5_config(size="tiny", num_encoder_layers=1,
                              num_decoder_layers=1).num_params()
  # Policy, reference, four reward models (tiny T5s) and the value model (+ its scalar head).
  assert 6 * tiny < report.num_params - tiny <= 6 * tiny + 2 * 64
  assert report.mesh == {"data": 1, "model": 2}
  # Everything stays on the chips: the report's peak holds all of it plus the worst stage.
  assert report.resident_bytes > 0
  assert report.peak_bytes > report.resident_bytes
  assert report.flops_per_chip == pytest.approx(sum(s["flops_per_chip"] for s in report.stages))
  with pytest.raises(ValueError, match=r"\['nope'\] not in target 'clarify_ppo'"):
    aot.compile_for_topology(topology="cpu:2", stages=("nope",))
  # The same objects: the compile target's stages are the functions a run's program calls
  # (made on the same two devices: the models below are read onto its mesh).
  from jaxmoral import partitioning  # pylint: disable=g-import-not-at-top
  with partitioning.default_devices(jax.devices()[:2]):
    target = training.ppo_compile_target(policy_config=config_lib.t5_config(
        size="tiny", num_encoder_layers=1, num_decoder_layers=1), vocabulary_path=vocab_path)
  partitioner = target.partitioner
  assert dict(partitioner.mesh.shape) == {"data": 1, "model": 2}  # The bound num_partitions.
  by_name = {stage.name: stage.function for stage in target.stages}
  model_dir = random_model_dirs.random_model_dir(tmp_path / "model", vocabulary_path=vocab_path)
  from jaxmoral.clarify import reward as reward_lib  # pylint: disable=g-import-not-at-top
  reward_config = copy.deepcopy(gin.query_parameter("training.train_clarify_ppo.reward_config"))
  run_reward = reward_lib.DefeasibilityReward.from_dirs(
      answer_model_dir=model_dir, fusion_model_dir=model_dir, judge_model_dir=model_dir,
      nli_model_dir=model_dir, config=reward_config, partitioner=partitioner)
  run_program = training.PPOProgram(trainer=None, reward=run_reward)
  for name, (function, _) in run_program.reward_functions().items():
    assert by_name[name] is function, name  # Not rebuilt: the run's cached functions.
  trainer = target.program.trainer
  for name in ("rollout", "score", "update"):
    # The trainer's own functions; test_ppo_trainer checks an iteration runs exactly these.
    assert by_name[name] is trainer.functions[name]


def test_diamante_config_compiles_through_the_train_run_target(tmp_path):
  """`runs.compile_run` with what gin binds `runs.train_run`: it touches neither MODEL_DIR nor
  the data file."""
  gin_args, _ = gin_utils.split_gin_args(["--gin_file=configs/diamante/tiny_cpu.gin",
                                          f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
                                          "--gin.TRAIN_PATH='/nowhere/needed.jsonl'"])
  gin_utils.parse_gin(gin_args)
  # One device: what is checked is the train_run target, not its data parallelism
  # (a sharded step's report: test_cpu_report_fields).
  report = aot.compile_for_topology(topology="cpu:1", print_table=False)  # default target
  assert report.target == "train_run" and "DiamanteModel" in report.description
  assert not (tmp_path / "run").exists()
  assert report.peak_bytes > 0 and report.flops_per_chip > 0
  # One context, three responses per row (human, model, random).
  assert "batch 16 x (encoder 64, decoder 3x24)" in report.description


def test_cpu_only_weight_gradient_form_is_off_for_a_tpu_topology():
  """The model's CPU backward form (`backends.cpu_products.cpu_rows_matmul`) follows the
  traced program's devices, not the host's: off under a TPU topology's mesh compiled from this
  CPU host."""
  from jaxmoral.backends import cpu_products  # pylint: disable=g-import-not-at-top
  topo = _tpu_topology_or_skip()
  tpu_mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(2, 2), ("data", "model"))
  cpu_mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  with jax.set_mesh(tpu_mesh):
    assert not cpu_products.tracing_for_cpu()
  with jax.set_mesh(cpu_mesh):
    assert cpu_products.tracing_for_cpu()


def test_ctrl_c_stops_a_long_compile_at_once():
  """The compiler runs in C++, where a SIGINT waits for the call to return; `interruptible`
  takes it in the main thread and ends the process (130) while the call still runs."""
  # Python's own Ctrl-C handler, as at a terminal: a suite started in the background (`make
  # test &`, nohup) passes SIGINT on ignored, and Python then installs none.
  code = ("import os, signal, threading, time\n"
          "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
          "from jaxmoral import aot\n"
          "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
          "aot.interruptible(lambda: time.sleep(60), what='compiling x', heartbeat_seconds=0.2)\n")
  start = time.time()
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 130 and time.time() - start < 30, result.stderr
  assert "still compiling x" in result.stderr and "interrupted while compiling x" in result.stderr
  assert aot.interruptible(lambda: 7, what="x") == 7
  with pytest.raises(ValueError, match="inner"):
    aot.interruptible(lambda: (_ for _ in ()).throw(ValueError("inner")), what="x")


def test_clarify_ppo_compile_is_train_ppo_on_the_run_directories_without_data_or_weights(
    tmp_path, demo_vocab_path, monkeypatch):
  """No stand-ins bound: the target is `train_clarify_ppo` in its compile-only mode on the
  directories the run binds. It reads their configs, not their weights, reads no data and
  writes nothing; a run refuses a stand-in before it writes anything."""
  from jaxmoral import model_dirs  # pylint: disable=g-import-not-at-top
  import random_model_dirs  # pylint: disable=g-import-not-at-top
  from jaxmoral.clarify import training  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import config as config_lib  # pylint: disable=g-import-not-at-top
  small = config_lib.t5_config(size="tiny", num_encoder_layers=1, num_decoder_layers=1)
  question = random_model_dirs.random_model_dir(
      tmp_path / "question", vocabulary_path=demo_vocab_path, config=small)
  judge = random_model_dirs.random_model_dir(
      tmp_path / "judge", vocabulary_path=demo_vocab_path,
      config=dataclasses.replace(small, d_model=96))
  gin_args, _ = gin_utils.split_gin_args([
      "--gin_file=configs/clarify/tiny_cpu.gin",
      f"--gin.training.train_clarify_ppo.question_model_dir='{question}'",
      f"--gin.training.train_clarify_ppo.answer_model_dir='{question}'",
      f"--gin.training.train_clarify_ppo.fusion_model_dir='{question}'",
      f"--gin.training.train_clarify_ppo.judge_model_dir='{judge}'",
      "--gin.training.train_clarify_ppo.source='/nowhere/delta_clarify'",
      "--gin.reward.RewardConfig.use_nli=False"])
  gin_utils.parse_gin(gin_args)
  def no_weights(*args, **kwargs):
    raise AssertionError(f"weights read: {args}")
  with monkeypatch.context() as patch:  # Only the directories' configs are read.
    patch.setattr(model_dirs, "load", no_weights)
    patch.setattr(model_dirs, "load_on_mesh", no_weights)
    target = training.ppo_compile_target()
  # No NLI model (use_nli off: a run never calls it); the judge's own width.
  assert [s.name for s in target.stages] == ["rollout", "answer", "fusion", "judge", "score",
                                             "update"]
  judge_params = target.program.reward.judge_model.params
  assert judge_params["token_embedder"]["embedding"].shape[-1] == 96
  assert target.program.trainer.config.batch_size == gin.query_parameter(
      "ppo_trainer.PPOConfig.batch_size")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["judge", "question"]

  stand_in = training.ModelShape(config=small, vocabulary_path=demo_vocab_path)
  with pytest.raises(ValueError, match="ModelShape stands in for a model only in `jaxmoral "
                     "compile`"):
    training.train_clarify_ppo(model_dir=str(tmp_path / "ppo"), question_model_dir=question,
                               answer_model_dir=question, fusion_model_dir=question,
                               judge_model_dir=stand_in, source="demo")
  assert not (tmp_path / "ppo").exists()
