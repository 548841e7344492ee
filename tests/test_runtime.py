"""jaxmoral.runtime: importing jaxmoral changes nothing process-wide; `configure()` sets the XLA
flags and malloc, once, before the backend starts."""

import json
import os
import subprocess
import sys
import types

from jaxmoral import runtime
from jaxmoral.backends import xla_flags

# Records every `mallopt` looked up through ctypes (how jaxmoral.backends.host_memory reaches glibc),
# imports jaxmoral and the modules a notebook uses, then configures.
_PROGRAM = """
import ctypes, json, os
looked_up = []
class _Recording(ctypes.CDLL):
  def __getattr__(self, name):
    if name == "mallopt":
      looked_up.append(name)
    return super().__getattr__(name)
ctypes.CDLL = _Recording
before = os.environ.get("XLA_FLAGS")
import jaxmoral, jaxmoral.decoding, jaxmoral.api, jaxmoral.models.t5
from jaxmoral import runtime
imported = {"flags": os.environ.get("XLA_FLAGS"), "mallopt": list(looked_up)}
first = runtime.configure()
second = runtime.configure()
import jax
jax.numpy.zeros(1).block_until_ready()
print(json.dumps({"before": before, "imported": imported,
                  "configured": {"flags": os.environ.get("XLA_FLAGS"),
                                 "mallopt": list(looked_up)},
                  "first": [first.xla_flags_added, first.malloc_keeps_freed_memory],
                  "same": first is second}))
"""


def test_import_has_no_process_wide_effects_and_configure_sets_them_once():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(XLA_FLAGS="--xla_cpu_multi_thread_eigen=false", JAXMORAL_HOST_MALLOC="reuse",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True,
                       text=True, check=True)
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["imported"] == {"flags": "--xla_cpu_multi_thread_eigen=false", "mallopt": []}
  assert result["configured"]["flags"] == ("--xla_cpu_multi_thread_eigen=false "
                                           + xla_flags.YNN_REDUCE_WORKAROUND)
  assert result["configured"]["mallopt"] == ["mallopt"]  # Once, though configured twice.
  assert result["first"] == [True, True] and result["same"]
  assert "cannot take effect" not in out.stderr


def test_configure_says_when_jaxmoral_was_imported_as_a_namespace_package(monkeypatch, capsys):
  """From the folder holding the clone, `import jaxmoral` makes the clone folder itself a
  namespace package (jaxmoral/__init__.py never runs): configure says so and guards JAX
  against an absent TPU, which that __init__ would have done."""
  assert runtime.namespace_import_folder() is None  # The package itself.
  namespace = types.ModuleType("jaxmoral")
  namespace.__path__ = ["/somewhere/jaxmoral"]
  monkeypatch.setitem(sys.modules, "jaxmoral", namespace)
  guarded = []
  monkeypatch.setattr(runtime, "platforms_without_absent_tpu", lambda: guarded.append(1))
  # Settings already made: this process's XLA flags and malloc stay as they are.
  monkeypatch.setattr(runtime, "_SETTINGS", runtime.RuntimeSettings(False, False))
  runtime.configure()
  assert runtime.namespace_import_folder() == "/somewhere/jaxmoral" and guarded == [1]
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "/somewhere/jaxmoral as an empty namespace package" in err
