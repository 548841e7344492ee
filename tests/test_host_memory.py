"""jaxmoral.host_memory: XLA:CPU's temporaries stop faulting in on every call; the choice is the user's."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from jaxmoral import host_memory

needs_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's")


class Recorder:

  def __init__(self, result: int = 1):
    self.calls = []
    self.result = result

  def __call__(self, param: int, value: int) -> int:
    self.calls.append((param, value))
    return self.result


def no_devices(_: str) -> bool:
  return False


def gpu_host(pattern: str) -> bool:
  return pattern == "/dev/nvidiactl"


@pytest.mark.parametrize("environ, exists, applied", [
    ({}, no_devices, True),                                   # auto, CPU-only host
    ({}, gpu_host, False),                                    # auto, GPU host
    ({"JAX_PLATFORMS": "cpu"}, gpu_host, True),               # auto, told to use the CPU
    ({"JAX_PLATFORMS": "cuda,cpu"}, no_devices, False),       # auto, told to use a GPU
    ({"JAXMORAL_HOST_MALLOC": "reuse"}, gpu_host, True),
    ({"JAXMORAL_HOST_MALLOC": "system"}, no_devices, False),
    ({"JAXMORAL_HOST_MALLOC": " System "}, no_devices, False),
])
def test_who_gets_the_setting(environ, exists, applied):
  mallopt = Recorder()
  assert host_memory.keep_freed_memory(environ=environ, mallopt=mallopt,
                                       exists=exists) is applied
  assert mallopt.calls == (list(host_memory.SETTINGS) if applied else [])


def test_settings_are_one_arena_no_mmap_no_trim():
  assert dict(host_memory.SETTINGS) == {
      host_memory.M_ARENA_MAX: 1, host_memory.M_MMAP_MAX: 0,
      host_memory.M_TRIM_THRESHOLD: 2**31 - 1, host_memory.M_TOP_PAD: 64 << 20}


def test_unknown_value_is_named_and_treated_as_auto(caplog):
  assert host_memory.choice({"JAXMORAL_HOST_MALLOC": "tcmalloc"}) == "auto"
  assert "JAXMORAL_HOST_MALLOC='tcmalloc' is not one of auto, reuse, system" in caplog.text


def test_a_refused_setting_is_reported(caplog):
  assert not host_memory.keep_freed_memory(environ={"JAXMORAL_HOST_MALLOC": "reuse"},
                                           mallopt=Recorder(result=0), exists=no_devices)
  assert "glibc refused some malloc settings" in caplog.text


# A jitted program whose 64 MiB temporary (tanh(x)) is freed after every call. The heap
# settles after a few calls (XLA's aligned requests are a little larger than the block a call
# frees, so reuse starts once freed neighbours have merged, and under load a call's block may
# be freed after the next call allocated): so the median over single calls is compared.
_FAULTS_PER_CALL = textwrap.dedent("""
    import resource, statistics, jaxmoral, jax, jax.numpy as jnp
    x = jnp.ones((4096, 4096), jnp.float32)
    f = jax.jit(lambda x: jnp.tanh(x) @ x[0])
    for _ in range(8):
      f(x).block_until_ready()
    faults = []
    for _ in range(9):
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      f(x).block_until_ready()
      faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(statistics.median(faults))
""")


@needs_glibc
def test_importing_jaxmoral_stops_temporaries_faulting_in_again():
  faults = {}
  for choice in ("system", "reuse"):
    env = dict(os.environ, JAXMORAL_HOST_MALLOC=choice, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _FAULTS_PER_CALL], env=env,
                         capture_output=True, text=True, check=True)
    faults[choice] = int(float(out.stdout.split()[-1]))
  pages = 4096 * 4096 * 4 // 4096  # the temporary, in 4 KiB pages
  assert faults["system"] >= pages // 2, faults  # glibc maps it fresh on each call ...
  assert faults["reuse"] < pages // 100, faults  # ... and keeps it with jaxmoral's settings.
