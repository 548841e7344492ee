"""AOT compilation reports (`jaxmoral.aot`): fake-CPU mesh, memory check, optional libtpu."""

import copy
import json
import math

import gin
import jax
import numpy as np
import pytest

from jaxmoral import aot
from jaxmoral import cli
from jaxmoral import gin_utils

# The tiny seq2seq config on a 4 x 2 (data x model) mesh, small batch: compiles in seconds.
TINY = ["--gin_file=configs/core/tiny_cpu.gin", "--gin.BATCH_SIZE=8",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}",
        "--gin.partitioning.PjitPartitioner.num_partitions=2"]


@pytest.fixture(autouse=True)
def _clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


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
  assert "seq2seq" in r.description and "batch 8 x (16, 8)" in r.description
  assert r.num_trainable_params == r.num_params
  # XLA's per-device FLOPs of the partitioned step, times 8 devices, are within a factor of
  # about two of the 6*N*D model estimate (attention scores, softmax, optimizer on top).
  assert 0.7 < r.flops_per_chip * 8 / r.model_flops_per_step < 2.5


def test_cpu_argument_bytes_match_shard_shapes(cpu_run):
  # The compiled step's arguments are the sharded state + batch + rng: recompute their
  # per-device bytes from the shardings alone.
  from jaxmoral import partitioning, runs  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import t5  # pylint: disable=g-import-not-at-top
  _, report = cpu_run
  _parse()
  model_config = copy.deepcopy(gin.query_parameter("runs.train_run.model_config"))
  optimizer = copy.deepcopy(gin.query_parameter("runs.train_run.optimizer"))
  partitioner = partitioning.PjitPartitioner(num_partitions=2, devices=jax.devices()[:8])
  trainer = runs.build_trainer(model=t5.T5(model_config), optimizer=optimizer,
                               partitioner=partitioner)
  shapes = aot.seq2seq_batch_shapes(batch_size=8, feature_lengths={"inputs": 16, "targets": 8})
  batch = {k: jax.ShapeDtypeStruct(v, np.int32, sharding=partitioner.data_sharding(2))
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

  program = aot.CompileProgram(lower=lambda: None, description="fake",
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

  program = aot.CompileProgram(stages=(("a", lambda: None), ("b", lambda: None)))
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
  with pytest.raises(ValueError, match="exactly one of lower, stages"):
    aot.CompileProgram(description="neither")


@pytest.mark.parametrize("bad", ["v5e", "v9:2x2", "cpu:2x2", "8x8", "cpu:10000"])
def test_bad_topologies_are_clear_errors(bad):
  with pytest.raises(ValueError, match="topology"):
    aot.get_topology(bad)


def test_unknown_target_and_duplicate_registration():
  _parse()
  with pytest.raises(ValueError, match="unknown target 'nope'"):
    aot.compile_for_topology(topology="cpu:8", target="nope")
  with pytest.raises(ValueError, match="already registered"):
    aot.register_compile_target("seq2seq", lambda p: None)
  assert {"seq2seq", "prompt_tuning"} <= set(aot.compile_targets())


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


def test_ppo_target_compiles_policy_value_reference_and_judge():
  from jaxmoral.models import config as config_lib  # pylint: disable=g-import-not-at-top
  gin_args, _ = gin_utils.split_gin_args([
      "--gin_file=gin/optimizers/adafactor_constant.gin",
      "--gin_file=gin/partitioning/model_parallel.gin",
      "--gin_bindings=from jaxmoral.rl import ppo_trainer",
      "--gin_bindings=from jaxmoral.models import config",
      "--gin.aot.ppo_target.policy_config=@config.t5_config()",
      "--gin.aot.ppo_target.ppo_config=@ppo_trainer.PPOConfig()",
      "--gin.aot.ppo_target.optimizer=%OPTIMIZER",
      "--gin.ppo_trainer.PPOConfig.batch_size=8", "--gin.ppo_trainer.PPOConfig.num_minibatches=1",
      "--gin.ppo_trainer.PPOConfig.num_ppo_epochs=1",
      "--gin.ppo_trainer.PPOConfig.max_prompt_length=8",
      "--gin.ppo_trainer.PPOConfig.max_response_length=4"])
  gin_utils.parse_gin(gin_args)
  report = aot.compile_for_topology(topology="cpu:8", target="ppo", print_table=False)
  tiny = config_lib.t5_config(size="tiny").num_params()
  # Policy, frozen reference and judge are tiny T5s; the value model adds a scalar head.
  assert tiny <= report.num_params - 3 * tiny <= tiny + 2 * 64
  assert report.num_trainable_params == report.num_params - 2 * tiny
  assert report.mesh == {"data": 4, "model": 2}
  assert report.peak_bytes > 0 and report.flops_per_chip > 0
  # Scoring (judge, policy, reference, values) and the update compile as the trainer runs them.
  assert [s["name"] for s in report.stages] == ["score", "update"]
  assert report.peak_bytes == max(s["peak_bytes"] for s in report.stages)
  assert report.flops_per_chip == pytest.approx(sum(s["flops_per_chip"] for s in report.stages))
  assert "PPO step" in report.description and "batch 8 x (prompt 8, response 4)" in report.description
  update = aot.compile_for_topology(topology="cpu:8", target="ppo", stages=("update",),
                                    print_table=False)
  assert update.stages == [] and update.peak_bytes == report.stages[1]["peak_bytes"]
  with pytest.raises(ValueError, match=r"\['nope'\] not in target 'ppo'"):
    aot.compile_for_topology(topology="cpu:8", target="ppo", stages=("nope",))


def test_diamante_target_compiles_the_joint_step():
  gin_args, _ = gin_utils.split_gin_args(["--gin_file=configs/diamante/tiny_cpu.gin",
                                          "--gin.MODEL_DIR=/unused"])
  gin_utils.parse_gin(gin_args)
  report = aot.compile_for_topology(topology="cpu:8", print_table=False)  # default target
  assert report.target == "diamante"
  assert report.peak_bytes > 0 and report.flops_per_chip > 0
  assert "3 x response 24" in report.description and "batch 16" in report.description
