"""jaxmoral.backends.xla_flags: the XLA:CPU workaround is added once, and a user's own choice is kept.

(That the workaround matters is tested where the miscompiled program lives:
tests/test_npov_salience.py::test_long_input_equals_per_token_grad fails without it.)
"""

import os
import subprocess
import sys

from jaxmoral.backends import xla_flags


def test_adds_the_flag_to_existing_flags():
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  assert xla_flags.apply_workarounds(env)
  assert env["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=8 "
                              + xla_flags.YNN_REDUCE_WORKAROUND)
  assert not xla_flags.apply_workarounds(env)  # Idempotent.
  assert env["XLA_FLAGS"].count("ynn_fusion_type") == 1


def test_keeps_the_users_setting():
  env = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=+reduce"}
  assert not xla_flags.apply_workarounds(env)
  assert env["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=+reduce"
  env = {}
  assert xla_flags.apply_workarounds(env)
  assert env["XLA_FLAGS"] == xla_flags.YNN_REDUCE_WORKAROUND


def test_configuring_jaxmoral_sets_it_before_the_backend_starts():
  code = ("import os, jaxmoral.runtime, jax; jaxmoral.runtime.configure(); "
          "jax.numpy.zeros(1).block_until_ready(); print(os.environ['XLA_FLAGS'])")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True)
  assert out.stdout.strip() == xla_flags.YNN_REDUCE_WORKAROUND
  assert "cannot take effect" not in out.stderr
