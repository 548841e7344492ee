"""Ahead-of-time compilation of a config's train step for a device topology (`jaxmoral compile`).

Proves from a CPU machine that a gin config compiles and fits on a TPU pod slice: the step is
lowered from abstract inputs (`ShapeDtypeStruct`s with their `NamedSharding`s, nothing is
allocated) for libtpu's compile-only devices (`jax.experimental.topologies`) and compiled by the
real TPU compiler; XLA's analyses give the per-chip memory and FLOPs.

What is compiled is a *compile target* (`register_compile_target`; "train_run" by default,
methods add theirs): the run's own step, built inside `partitioning.default_devices` so that the
partitioner the config binds is made on the topology's devices (docs/core_api.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import gin
import jax
import jax.numpy as jnp

from jaxmoral import fileio
from jaxmoral import partitioning
from jaxmoral import runtime
from jaxmoral import validation

GiB = 1024 ** 3


class DoesNotFitError(ValueError):
  """The compiled step needs more memory per chip than the chip has."""

  def __init__(self, message: str, report: CompileReport):
    super().__init__(message)
    self.report = report


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChipSpec:
  """What the report needs to know about one chip (`name` as in topology strings): its HBM, peak
  dense bf16 FLOP/s, and libtpu's chip configuration ("megacore" makes one device per chip on
  chips with two TensorCores, v4 and v5p, as JAX uses them)."""
  name: str
  hbm_bytes: int
  peak_flops_per_s: float
  chip_config_name: Optional[str] = None


# HBM and peak bf16 dense FLOP/s per chip as published in Google Cloud's TPU system architecture
# documentation: vendor figures, not measurements.
CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec(name="v4", hbm_bytes=32 * GiB, peak_flops_per_s=275e12,
                   chip_config_name="megacore"),
    "v5e": ChipSpec(name="v5e", hbm_bytes=16 * GiB, peak_flops_per_s=197e12),
    "v5p": ChipSpec(name="v5p", hbm_bytes=95 * GiB, peak_flops_per_s=459e12,
                    chip_config_name="megacore"),
    "v6e": ChipSpec(name="v6e", hbm_bytes=32 * GiB, peak_flops_per_s=918e12),
}

_TOPOLOGY_RE = re.compile(r"^(?P<chip>[a-z0-9]+):(?P<shape>\d+(x\d+)*)$")


@dataclasses.dataclass(frozen=True)
class Topology:
  """Devices to compile for: those of every slice of topology `name` ("v5e:8x8", "cpu:8"),
  compile-only for TPU; `chip` is None for CPU."""
  name: str
  platform: str
  devices: tuple[Any, ...]
  chip: Optional[ChipSpec]
  num_slices: int = 1


def get_topology(topology: str, *, num_slices: int = 1) -> Topology:
  """Devices of a topology string.

  Args:
    topology: "<chip>:<shape>" as libtpu names them, with chip in `CHIPS` (e.g. "v5e:8x8":
      64 chips, "v4:2x2x4", "v5p:4x4x4"; needs libtpu), or "cpu:N": N local CPU devices (set
      `XLA_FLAGS=--xla_force_host_platform_device_count=N`), for tests.
    num_slices: Multi-slice (DCN-connected) copies of the slice (TPU only).

  Raises:
    ValueError: Malformed or unknown topology, too few CPU devices, or libtpu missing.
  """
  validation.positive_int(num_slices, "get_topology: num_slices")
  match = _TOPOLOGY_RE.match(topology.strip().lower()) if isinstance(topology, str) else None
  if match is None:
    raise ValueError(f"topology {topology!r}: expected '<chip>:<shape>' such as 'v5e:8x8', "
                     f"'v4:2x2x4', 'v5p:4x4x4' or 'cpu:8'")
  chip_name, shape = match.group("chip"), match.group("shape")
  if chip_name == "cpu":
    if "x" in shape:
      raise ValueError(f"topology {topology!r}: CPU topologies are 'cpu:N'")
    if num_slices != 1:
      raise ValueError(f"topology {topology!r}: num_slices applies to TPU topologies only")
    count = int(shape)
    devices = jax.devices("cpu")
    if count < 1 or len(devices) < count:
      raise ValueError(f"topology {topology!r}: {len(devices)} CPU devices available; set "
                       f"XLA_FLAGS=--xla_force_host_platform_device_count={count} before "
                       "JAX starts")
    return Topology(name=topology, platform="cpu", devices=tuple(devices[:count]), chip=None)
  if chip_name not in CHIPS:
    raise ValueError(f"topology {topology!r}: unknown chip {chip_name!r}; known: "
                     f"{sorted(CHIPS)} and 'cpu'")
  chip = CHIPS[chip_name]
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  # Compile-only devices never touch a chip, so libtpu's one-process-per-host lock (held by any
  # other JAX process that probed for a TPU) must not block us.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  runtime.quiet_compile_only_tpu()
  kwargs: dict[str, Any] = ({} if chip.chip_config_name is None
                            else {"chip_config_name": chip.chip_config_name})
  if num_slices > 1:
    kwargs["num_slices"] = num_slices
  try:
    desc = topologies.get_topology_desc(topology_name=f"{chip_name}:{shape}", platform="tpu",
                                        **kwargs)
  except RuntimeError as error:
    if "TPU support not installed" in str(error):
      raise ValueError(f"topology {topology!r} needs libtpu: pip install "
                       f"'jax[tpu]=={jax.__version__}'") from error
    raise ValueError(f"topology {topology!r}: libtpu rejected it: {error}") from error
  return Topology(name=topology, platform="tpu", devices=tuple(desc.devices), chip=chip,
                  num_slices=num_slices)


def shard_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of sharded `ShapeDtypeStruct`s (or arrays)."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) else leaf.shape
    total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
  return int(total)


@dataclasses.dataclass(frozen=True)
class Stage:
  """One compiled program of a step ("step", "rollout", "update", ...): the very jitted
  `function` the run calls (anything with `.lower(*args)`), the abstract `args` (sharded
  `ShapeDtypeStruct`s) to lower it with, and the `persistent` ones that stay on the chips
  between programs (parameters, state: counted once, in `CompileProgram.resident`)."""
  name: str
  function: Any
  args: tuple[Any, ...]
  persistent: Any = ()

  def lower(self) -> Any:
    return self.function.lower(*self.args)


@dataclasses.dataclass(frozen=True)
class CompileProgram:
  """What a compile target hands back.

  Attributes:
    stages: The compiled programs of one step, in the order the run calls them; compiled one
      at a time (each frees the compiler's memory before the next).
    partitioner: The run's partitioner (its mesh is the topology's devices); required by
      `compile_for_topology`.
    resident: Everything that stays on the chips for the whole run (every model's parameters
      and optimizer state); None: each stage's own persistent arguments.
    description: One line for the report ("T5 large seq2seq, batch 512 x (512, 128)").
    num_params, num_trainable_params: Parameters of every model in the step, and those that
      get updates.
    tokens_per_step, model_flops_per_step: Tokens the step trains on and its analytic model
      FLOPs (all chips), where the target knows them.
    program: The method's own program the stages come from (e.g. ClarifyDelphi's
      `PPOProgram`), for notebooks and tests.
  """
  stages: tuple[Stage, ...]
  partitioner: Optional[partitioning.PjitPartitioner] = None
  resident: Any = None
  description: str = ""
  num_params: int = 0
  num_trainable_params: int = 0
  tokens_per_step: Optional[int] = None
  model_flops_per_step: Optional[float] = None
  program: Any = None

  def __post_init__(self):
    if not self.stages:
      raise ValueError("CompileProgram: no stages")


CompileTargetBuilder = Callable[[], CompileProgram]
_TARGETS: dict[str, CompileTargetBuilder] = {}


def register_compile_target(name: str, builder: CompileTargetBuilder) -> None:
  """Makes `builder() -> CompileProgram` available as `target=name`.

  The builder calls a run's entry point with the config's bindings (the CLI has parsed the
  config); `plan_compile` calls it inside `partitioning.default_devices`.
  """
  if not name or not isinstance(name, str):
    raise ValueError(f"register_compile_target: name must be a non-empty str, got {name!r}")
  if name in _TARGETS and _TARGETS[name] is not builder:
    raise ValueError(f"register_compile_target: {name!r} is already registered")
  _TARGETS[name] = builder


def compile_targets() -> list[str]:
  """Names of the registered compile targets."""
  return sorted(_TARGETS)


def _num_params(tree: Any) -> int:
  return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


def t5_forward_flops(config: Any, *, encoder_tokens: int, decoder_tokens: int) -> float:
  """Model FLOPs of one forward pass: 2 per weight per token (dense weights only).

  Encoder weights see the input tokens; decoder and logits weights the target tokens.
  Attention-score FLOPs are left out (small at these lengths). A training step with every
  weight trained is 3 forwards (backward = 2: activation and weight gradients); with frozen
  weights about 2 (activation gradients only).
  """
  d, h, kv, f = config.d_model, config.num_heads, config.d_kv, config.d_ff
  attn = 4 * d * h * kv
  mlp = (3 if config.is_gated else 2) * d * f
  enc_w = config.num_encoder_layers * (attn + mlp)
  dec_w = config.num_decoder_layers * (2 * attn + mlp) + config.vocab_size * d
  return 2.0 * (enc_w * encoder_tokens + dec_w * decoder_tokens)


@dataclasses.dataclass
class CompileReport:
  """Per-chip memory and FLOPs of a compiled step (all byte counts are per device).

  `peak_bytes` = arguments + outputs - aliased (donated) + temporaries + generated code: what
  the chip must hold at the step's peak. `flops_per_chip` comes from XLA's cost analysis of
  the partitioned program: it counts rematerialised recomputation (so MFU from it is really
  hardware FLOPs utilisation) and counts the body of a loop once (`lax.scan` over microbatches
  or PPO minibatches), so for steps with loops it undercounts; `model_flops_per_step` is the
  analytic 2-FLOPs-per-weight-per-token model estimate for all chips (`model_mfu`).
  """
  topology: str
  target: str
  description: str
  platform: str
  num_devices: int
  num_slices: int
  mesh: dict[str, int]
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  generated_code_bytes: int
  peak_bytes: int
  hbm_bytes: Optional[int]
  fits: Optional[bool]
  flops_per_chip: Optional[float]
  bytes_accessed_per_chip: Optional[float]
  num_params: int
  num_trainable_params: int
  tokens_per_step: Optional[int]
  model_flops_per_step: Optional[float]
  peak_flops_per_s: Optional[float]
  min_step_time_s: Optional[float]
  step_time_s: Optional[float]
  mfu: Optional[float]
  model_mfu: Optional[float]
  lower_seconds: float
  compile_seconds: float
  stages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  resident_bytes: Optional[int] = None

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

  def table(self) -> str:
    """A readable multi-line summary."""
    def gib(x: Optional[float]) -> str:
      return "-" if x is None else f"{x / GiB:8.3f} GiB"

    def num(x: Optional[float], fmt: str = ".3e") -> str:
      return "-" if x is None else format(x, fmt)

    fits = {None: "no limit given", True: "FITS", False: "DOES NOT FIT"}[self.fits]
    rows = [
        ("topology", f"{self.topology} ({self.platform}, {self.num_devices} devices, "
                     f"{self.num_slices} slice(s), mesh {self.mesh})"),
        ("target", f"{self.target}: {self.description}"),
        ("params", f"{self.num_params / 1e6:.3f}M total, "
                   f"{self.num_trainable_params / 1e6:.3f}M trainable"),
        ("arguments / chip", gib(self.argument_bytes)),
        ("outputs / chip", gib(self.output_bytes)),
        ("aliased (donated)", gib(self.alias_bytes)),
        ("temporaries / chip", gib(self.temp_bytes)),
        ("generated code", gib(self.generated_code_bytes)),
        ("resident / chip", gib(self.resident_bytes) + " (every model's parameters and "
         "state, all stages)" if self.resident_bytes is not None else "-"),
        ("peak / chip", gib(self.peak_bytes)),
        ("HBM / chip", gib(self.hbm_bytes)),
        ("memory", fits),
        ("FLOPs / step / chip", num(self.flops_per_chip) + " (XLA cost analysis; loop bodies "
         "counted once)"),
        ("model FLOPs / step",
         num(self.model_flops_per_step) + " (all chips, analytic model FLOPs)"),
        ("peak FLOP/s / chip", num(self.peak_flops_per_s)),
        ("min step time", "-" if self.min_step_time_s is None
         else f"{self.min_step_time_s * 1e3:.1f} ms (at 100% of peak)"),
        ("step time", "-" if self.step_time_s is None else f"{self.step_time_s * 1e3:.1f} ms "
         "(given)"),
        ("MFU (HLO / model)", "-" if self.mfu is None
         else f"{self.mfu:.1%} / {num(self.model_mfu, '.1%')}"),
        ("lower / compile", f"{self.lower_seconds:.1f} s / {self.compile_seconds:.1f} s"),
    ]
    rows += [(f"stage {stage['name']}", f"peak {stage['peak_bytes'] / GiB:.3f} GiB / chip "
              f"(temporaries {stage['temp_bytes'] / GiB:.3f} GiB), "
              f"{num(stage['flops_per_chip'])} FLOPs / chip, compiled in "
              f"{stage['compile_seconds']:.1f} s") for stage in self.stages]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def _speed(flops: Optional[float], peak_flops: Optional[float],
           step_time_s: Optional[float]) -> tuple[Optional[float], Optional[float]]:
  """`(min_step_time_s, mfu)`: the step at 100 % of peak, and the share of peak reached."""
  if not (flops and peak_flops):
    return None, None
  return flops / peak_flops, (flops / (step_time_s * peak_flops) if step_time_s else None)


def analyze(compiled: Any, *, topology: Topology, target: str, program: CompileProgram,
            mesh: Mapping[str, int], hbm_bytes: Optional[int] = None,
            step_time_s: Optional[float] = None, lower_seconds: float = 0.0,
            compile_seconds: float = 0.0) -> CompileReport:
  """The report of a compiled step (no fit check; see `check_fits`)."""
  mem = compiled.memory_analysis()
  if mem is None:
    raise ValueError(f"compile: the {topology.platform} compiler gave no memory analysis")
  arg, out = int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes)
  alias, temp = int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes)
  code = int(getattr(mem, "generated_code_size_in_bytes", 0) or 0)
  peak = arg + out - alias + temp + code
  chip = topology.chip
  if hbm_bytes is None and chip is not None:
    hbm_bytes = chip.hbm_bytes
  cost = dict(compiled.cost_analysis() or {})
  flops = float(cost["flops"]) if cost.get("flops", -1) >= 0 else None
  accessed = cost.get("bytes accessed")
  peak_flops = chip.peak_flops_per_s if chip is not None else None
  min_time, mfu = _speed(flops, peak_flops, step_time_s)
  all_chips_peak = peak_flops and peak_flops * len(topology.devices)  # Model FLOPs: all chips.
  _, model_mfu = _speed(program.model_flops_per_step, all_chips_peak, step_time_s)
  return CompileReport(
      topology=topology.name, target=target, description=program.description,
      platform=topology.platform, num_devices=len(topology.devices),
      num_slices=topology.num_slices, mesh=dict(mesh), argument_bytes=arg, output_bytes=out,
      alias_bytes=alias, temp_bytes=temp, generated_code_bytes=code, peak_bytes=peak,
      hbm_bytes=hbm_bytes, fits=None if hbm_bytes is None else peak <= hbm_bytes,
      flops_per_chip=flops, bytes_accessed_per_chip=None if accessed is None else float(accessed),
      num_params=program.num_params, num_trainable_params=program.num_trainable_params,
      tokens_per_step=program.tokens_per_step,
      model_flops_per_step=program.model_flops_per_step, peak_flops_per_s=peak_flops,
      min_step_time_s=min_time, step_time_s=step_time_s, mfu=mfu, model_mfu=model_mfu,
      lower_seconds=lower_seconds, compile_seconds=compile_seconds)


def combine_stages(reports: Sequence[tuple[str, CompileReport]], *,
                   persistent_bytes: Optional[Sequence[int]] = None,
                   resident_bytes: Optional[int] = None) -> CompileReport:
  """One report for a step run as several programs in sequence (`CompileProgram.stages`): the
  peak is `resident_bytes` plus the largest of what a stage needs beyond its own persistent
  arguments (`persistent_bytes[i]`: activations, caches, outputs), else the highest stage
  peak; FLOPs, minimum step time and compile times add up."""
  if len(reports) == 1 and resident_bytes is None:
    return reports[0][1]
  worst = max((r for _, r in reports), key=lambda r: r.peak_bytes)
  peak = worst.peak_bytes
  if resident_bytes is not None and persistent_bytes is not None:
    peak = resident_bytes + max(r.peak_bytes - own for (_, r), own in
                                zip(reports, persistent_bytes, strict=True))
  known = [r.flops_per_chip for _, r in reports if r.flops_per_chip is not None]
  flops = sum(known) if len(known) == len(reports) else None
  min_time, mfu = _speed(flops, worst.peak_flops_per_s, worst.step_time_s)
  return dataclasses.replace(
      worst, peak_bytes=peak, resident_bytes=resident_bytes,
      fits=None if worst.hbm_bytes is None else peak <= worst.hbm_bytes, flops_per_chip=flops,
      bytes_accessed_per_chip=sum(r.bytes_accessed_per_chip or 0.0 for _, r in reports),
      min_step_time_s=min_time, mfu=mfu,
      lower_seconds=sum(r.lower_seconds for _, r in reports),
      compile_seconds=sum(r.compile_seconds for _, r in reports),
      stages=[dict(name=name, peak_bytes=r.peak_bytes, temp_bytes=r.temp_bytes,
                   argument_bytes=r.argument_bytes, flops_per_chip=r.flops_per_chip,
                   compile_seconds=r.compile_seconds) for name, r in reports]
      if len(reports) > 1 else [])


def check_fits(report: CompileReport) -> None:
  """Raises `DoesNotFitError` when the report's peak exceeds its HBM limit."""
  if report.fits is False:
    assert report.hbm_bytes is not None  # `fits` is known only with the chip's HBM.
    raise DoesNotFitError(
        f"compile: {report.target} on {report.topology} needs {report.peak_bytes / GiB:.2f} GiB "
        f"per chip (arguments {report.argument_bytes / GiB:.2f} + outputs "
        f"{report.output_bytes / GiB:.2f} - donated {report.alias_bytes / GiB:.2f} + "
        f"temporaries {report.temp_bytes / GiB:.2f}) but the chip has "
        f"{report.hbm_bytes / GiB:.2f} GiB; use more model parallelism (MODEL_PARALLEL), 2-D "
        "parameter sharding (gin/partitioning/fsdp.gin), remat, microbatches or a bigger "
        "slice", report)


def _default_target() -> str:
  with contextlib.suppress(ValueError, KeyError):  # jaxmoral.runs not imported by the config.
    # Unresolved: resolving would build the config's objects here (a pod config's partitioner
    # on this host's devices, which fails) only to learn whether anything is bound.
    if gin.get_bindings("runs.train_run", resolve_references=False):
      return "train_run"
  raise ValueError(f"compile: the gin config binds no runs.train_run; select a target with "
                   f"--gin.aot.compile_for_topology.target=NAME (registered: "
                   f"{compile_targets()})")


# Chips from which the TPU compiler's host memory and time are worth a warning (v5e:8x8 took
# more than 5 minutes and 10 GB of host memory for configs/core/large_tpu_pod.gin).
LARGE_TOPOLOGY_CHIPS = 32
HEARTBEAT_SECONDS = 30.0


def progress(line: str) -> None:
  """One progress line on stderr (the report goes to stdout)."""
  print(line, file=sys.stderr, flush=True)


def available_host_bytes() -> Optional[int]:
  """Host memory available now (Linux: MemAvailable), or None where unknown."""
  with contextlib.suppress(OSError, ValueError, IndexError):
    with open("/proc/meminfo", encoding="ascii") as f:
      return next((int(line.split()[1]) * 1024 for line in f
                   if line.startswith("MemAvailable:")), None)
  return None


def warn_host_memory(topology: Topology, stages: Sequence[str]) -> None:
  """Says, before a large topology, what the compiler will need and how to bound it."""
  chips = len(topology.devices)
  if chips < LARGE_TOPOLOGY_CHIPS:
    return
  available = available_host_bytes()
  have = f"; {available / GiB:.1f} GiB available here" if available else ""
  split = (f"; compile one program per process to bound it: "
           f"--gin.aot.compile_for_topology.stages=\"('{stages[0]}',)\"" if len(stages) > 1
           else "")
  progress(f"compile: {chips} chips: the TPU compiler may need 10 GB or more of host memory "
           f"and minutes per program{have}{split}")


def interruptible(fn: Callable[[], Any], *, what: str,
                  heartbeat_seconds: float = HEARTBEAT_SECONDS) -> Any:
  """`fn()` in a worker thread, so that Ctrl-C stops the process at once and a long call
  says it is alive.

  XLA's compiler runs in C++, where Python sees a SIGINT only when the call returns (minutes
  for a pod program); here the main thread waits and takes it. Nothing of a compile is kept,
  so the process ends right there (status 130), the compiler thread with it.
  """
  outcome: dict[str, Any] = {}

  def work() -> None:
    try:
      outcome["value"] = fn()
    except BaseException as error:  # pylint: disable=broad-except
      outcome["error"] = error

  thread = threading.Thread(target=work, name=f"jaxmoral {what}", daemon=True)
  start = time.perf_counter()
  thread.start()
  try:
    while thread.is_alive():
      thread.join(timeout=heartbeat_seconds)
      if thread.is_alive():
        available = available_host_bytes()
        memory = f", {available / GiB:.1f} GiB host memory available" if available else ""
        progress(f"compile: still {what}: {time.perf_counter() - start:.0f} s{memory}")
  except KeyboardInterrupt:
    progress(f"compile: interrupted while {what}; stopped")
    sys.stdout.flush()
    os._exit(130)  # pylint: disable=protected-access
  if "error" in outcome:
    raise outcome["error"]
  return outcome["value"]


def _timed(fn: Callable[[], Any], *, what: str) -> tuple[Any, float]:
  """`interruptible(fn)` and the seconds it took."""
  tick = time.perf_counter()
  return interruptible(fn, what=what), time.perf_counter() - tick


@dataclasses.dataclass(frozen=True)
class CompilePlan:
  """What `compile_for_topology` will compile: everything it decides before the first
  lowering (the topology, the run's target, its program and partitioner, the stages)."""
  topology: Topology
  target: str
  program: CompileProgram
  partitioner: partitioning.PjitPartitioner  # The program's, on the topology's devices.
  stages: tuple[Stage, ...]


def plan_compile(*, topology: str, target: Optional[str] = None,
                 num_slices: Optional[int] = None,
                 stages: Optional[Sequence[str]] = None) -> CompilePlan:
  """The topology, target, program and stages of a compile, checked, before any lowering
  (`compile_for_topology`'s arguments of the same names; a dry run stops here).

  Raises:
    ValueError: Bad topology, target, slices or stages.
  """
  try:
    bound_slices: Optional[int] = int(
        gin.query_parameter("partitioning.PjitPartitioner.num_slices"))
  except ValueError:
    bound_slices = None
  if num_slices is None:
    num_slices = bound_slices or 1
  elif num_slices != (bound_slices or 1):  # The run's partitioner must have as many.
    raise ValueError(f"compile_for_topology: num_slices={num_slices} disagrees with the run's "
                     f"partitioning.PjitPartitioner.num_slices ({bound_slices or 'unbound: 1'}); "
                     f"bind partitioning.PjitPartitioner.num_slices = {num_slices}")
  topo = get_topology(topology, num_slices=num_slices)
  target = target or _default_target()
  if target not in _TARGETS:
    raise ValueError(f"compile_for_topology: unknown target {target!r}; registered: "
                     f"{compile_targets()}")
  with partitioning.default_devices(topo.devices):
    program = _TARGETS[target]()
  partitioner = program.partitioner
  if partitioner is None:
    raise ValueError(f"compile_for_topology: target {target!r} handed back no partitioner")
  if set(partitioner.mesh.devices.flat) != set(topo.devices):
    raise ValueError(f"compile_for_topology: target {target!r} built its mesh on other "
                     f"devices than {topology}'s (a partitioner bound with explicit devices)")
  selected = program.stages
  if stages is not None:
    known = [stage.name for stage in selected]
    unknown = sorted(set(stages) - set(known))
    if unknown:
      raise ValueError(f"compile_for_topology.stages: {unknown} not in target {target!r}'s "
                       f"stages {known}")
    selected = tuple(stage for stage in selected if stage.name in stages)
  return CompilePlan(topology=topo, target=target, program=program, partitioner=partitioner,
                     stages=tuple(selected))


@gin.configurable(module="aot")
def compile_for_topology(*, topology: str, report_path: Optional[str] = None,
                         target: Optional[str] = None, num_slices: Optional[int] = None,
                         hbm_bytes: Optional[int] = None, step_time_s: Optional[float] = None,
                         stages: Optional[Sequence[str]] = None, check: bool = True,
                         print_table: bool = True) -> CompileReport:
  """Compiles the gin config's train step for `topology` and reports per-chip memory/FLOPs.

  Call after the gin config is parsed (the CLI does).

  Args:
    topology: "v5e:8x8", "v4:2x2x4", "v5p:4x4x4", ... (libtpu) or "cpu:N".
    report_path: Also write the report as JSON here.
    target: A registered compile target (default: "train_run" when `runs.train_run` is bound).
    num_slices: Multi-slice count (default: `partitioning.PjitPartitioner.num_slices` or 1).
    hbm_bytes: Memory limit per chip (default: the chip's HBM; CPU has none unless given).
    step_time_s: A measured or assumed step time; only then MFU is reported.
    stages: Compile only these stages of a multi-stage target (e.g. `("update",)` for PPO);
      one process per stage bounds the host memory the TPU compiler needs.

  Raises:
    DoesNotFitError: `check` and the peak memory per chip exceeds `hbm_bytes`.
    ValueError: Bad topology, target or config.
  """
  for name, value in (("step_time_s", step_time_s), ("hbm_bytes", hbm_bytes)):
    if value is not None and value <= 0:
      raise ValueError(f"compile_for_topology.{name} must be positive, got {value}")
  plan = plan_compile(topology=topology, target=target, num_slices=num_slices, stages=stages)
  topo, target, program, selected = plan.topology, plan.target, plan.program, plan.stages
  warn_host_memory(topo, [stage.name for stage in selected])
  stage_reports = []
  for number, stage in enumerate(selected, 1):
    what = f"[{number}/{len(selected)}] {stage.name} ({target} for {topology})"
    progress(f"compile {what}: lowering")
    lowered, lower_seconds = _timed(stage.lower, what=f"lowering {what}")
    progress(f"compile {what}: lowered in {lower_seconds:.1f} s; compiling")
    compiled, compile_seconds = _timed(lowered.compile, what=f"compiling {what}")
    progress(f"compile {what}: compiled in {compile_seconds:.1f} s")
    stage_reports.append((stage.name, analyze(
        compiled, topology=topo, target=target, program=program,
        mesh=dict(plan.partitioner.mesh.shape), hbm_bytes=hbm_bytes, step_time_s=step_time_s,
        lower_seconds=lower_seconds, compile_seconds=compile_seconds)))
    del lowered, compiled  # Free the compiler's memory before the next stage.
  report = combine_stages(
      stage_reports, persistent_bytes=[shard_bytes(stage.persistent) for stage in selected],
      resident_bytes=None if program.resident is None else shard_bytes(program.resident))
  if print_table:
    print(f"jaxmoral compile {topology}:\n{report.table()}", flush=True)
  if report_path:
    fileio.makedirs(os.path.dirname(fileio.abspath(report_path)))
    fileio.write_text(report_path, report.to_json() + "\n")
  if check:
    check_fits(report)
  return report
