"""jaxmoral.backends.host_memory: XLA:CPU's temporaries stop faulting in on every call; the choice is the user's."""

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from conftest import child_xla_flags
from jaxmoral.backends import host_memory

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


@pytest.mark.parametrize("environ, applied", [
    ({}, False),                                   # the default: malloc as it is
    ({"JAXMORAL_HOST_MALLOC": "reuse"}, True),
    ({"JAXMORAL_HOST_MALLOC": " Reuse "}, True),
    ({"JAXMORAL_HOST_MALLOC": "system"}, False),
])
def test_who_gets_the_setting(environ, applied):
  mallopt = Recorder()
  assert host_memory.keep_freed_memory(environ=environ, mallopt=mallopt) is applied
  assert mallopt.calls == (list(host_memory.SETTINGS) if applied else [])


def test_settings_are_one_arena_no_mmap_no_trim():
  assert dict(host_memory.SETTINGS) == {
      host_memory.M_ARENA_MAX: 1, host_memory.M_MMAP_MAX: 0,
      host_memory.M_TRIM_THRESHOLD: 2**31 - 1, host_memory.M_TOP_PAD: 64 << 20}


def test_unknown_value_is_named_and_treated_as_the_default(caplog):
  assert host_memory.choice({"JAXMORAL_HOST_MALLOC": "tcmalloc"}) == "system"
  assert ("JAXMORAL_HOST_MALLOC='tcmalloc' is not one of system, reuse; using 'system'"
          in caplog.text)


def test_a_refused_setting_is_reported(caplog):
  assert not host_memory.keep_freed_memory(environ={"JAXMORAL_HOST_MALLOC": "reuse"},
                                           mallopt=Recorder(result=0))
  assert "glibc refused some malloc settings" in caplog.text


# A jitted program whose 64 MiB temporary (tanh(x)) is freed after every call. The heap takes
# some calls to settle: XLA's aligned requests are a little larger than the block a call frees,
# and small allocations land between freed blocks, so reuse starts once enough freed
# neighbours have merged (on a 2-core VM: within 10-30 calls, a few calls later under load;
# CI's median over calls 9-17 once still faulted). So calls 41-60 are counted; without the
# settings every call faults, from the first.
_FAULTS_PER_CALL = textwrap.dedent("""
    import json, resource, sys, jaxmoral.runtime, jax, jax.numpy as jnp
    jaxmoral.runtime.configure()
    x = jnp.ones((4096, 4096), jnp.float32)
    f = jax.jit(lambda x: jnp.tanh(x) @ x[0])
    for _ in range(int(sys.argv[1])):
      f(x).block_until_ready()
    faults = []
    for _ in range(20):
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      f(x).block_until_ready()
      faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps(faults))
""")


@needs_glibc
def test_configuring_jaxmoral_stops_temporaries_faulting_in_again():
  pages = 4096 * 4096 * 4 // 4096  # the temporary, in 4 KiB pages
  faulting_calls = {}
  # The child compiles as a user's process does (one device, XLA's default optimisation): the
  # suite's -O0 makes the 64 MiB tanh about five times slower per call (some 10 CPU-seconds per
  # child), and what is measured is the allocator, not the compiled code.
  flags = " ".join(f for f in child_xla_flags().split() if "optimization_level" not in f)
  for choice, warm_up_calls in (("system", 2), ("reuse", 40)):
    env = dict(os.environ, JAXMORAL_HOST_MALLOC=choice, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    out = subprocess.run([sys.executable, "-c", _FAULTS_PER_CALL, str(warm_up_calls)], env=env,
                         capture_output=True, text=True, check=True)
    faults = json.loads(out.stdout.splitlines()[-1])
    faulting_calls[choice] = sum(count >= pages // 2 for count in faults)
  assert faulting_calls["system"] >= 18, faulting_calls  # glibc maps it fresh on each call ...
  assert faulting_calls["reuse"] <= 2, faulting_calls  # ... and keeps it with jaxmoral's settings.
