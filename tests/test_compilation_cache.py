"""Tests for jaxmoral.compilation_cache: flag and directory resolution, and a second process that
loads its sampler (with the CPU kernels' custom calls) from the cache and samples the same tokens."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import child_xla_flags
from jaxmoral import cli, compilation_cache
from jaxmoral.backends import cpu_kernels


@pytest.mark.parametrize("argv, value, rest", [
    (["train", "--gin_file=a.gin"], None, ["train", "--gin_file=a.gin"]),
    (["train", "--compilation_cache_dir=/c", "--gin.X=1"], "/c", ["train", "--gin.X=1"]),
    (["--compilation_cache_dir", "/c", "npov", "detect"], "/c", ["npov", "detect"]),
    (["clarify", "chat", "--compilation_cache_dir=none"], "none", ["clarify", "chat"]),
    (["x", "--compilation_cache_dir=/a", "--compilation_cache_dir=/b"], "/b", ["x"]),
    (["x", "--compilation_cache_dir_extra=/a"], None, ["x", "--compilation_cache_dir_extra=/a"]),
])
def test_the_flag_is_taken_from_anywhere(argv, value, rest):
  flags, left = cli.split_flags(argv, [compilation_cache.FLAG])
  assert (flags.get(compilation_cache.FLAG), left) == (value, rest)


def test_the_flag_without_a_value_is_an_error():
  with pytest.raises(ValueError, match="--compilation_cache_dir needs a value"):
    cli.split_flags(["train", "--compilation_cache_dir"], [compilation_cache.FLAG])


def test_cli_reports_a_flag_without_a_value(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["export", "--compilation_cache_dir"])
  assert exit_info.value.code == 2
  assert "--compilation_cache_dir needs a value" in capsys.readouterr().err


def test_resolve_cache_dir_precedence():
  home = {"XDG_CACHE_HOME": "/xdg"}
  assert compilation_cache.resolve_cache_dir(None, home) == "/xdg/jaxmoral/xla"
  assert compilation_cache.resolve_cache_dir(
      None, {**home, "JAXMORAL_COMPILATION_CACHE_DIR": "/mine"}) == "/mine"
  assert compilation_cache.resolve_cache_dir(
      None, {**home, "JAXMORAL_COMPILATION_CACHE_DIR": "/mine",
             "JAX_COMPILATION_CACHE_DIR": "/jax"}) == "/jax"
  assert compilation_cache.resolve_cache_dir(
      "/flag", {**home, "JAX_COMPILATION_CACHE_DIR": "/jax"}) == "/flag"
  assert compilation_cache.resolve_cache_dir("none", home) is None
  assert compilation_cache.resolve_cache_dir("", home) is None
  assert compilation_cache.resolve_cache_dir(
      None, {**home, "JAXMORAL_COMPILATION_CACHE_DIR": "None"}) is None
  assert compilation_cache.resolve_cache_dir(None, {}).endswith(
      os.path.join(".cache", "jaxmoral", "xla"))


def test_enable_none_does_nothing_and_rejects_a_zero_cap(tmp_path):
  assert compilation_cache.enable(None) is None
  with pytest.raises(ValueError, match="max_bytes"):
    compilation_cache.enable(str(tmp_path), max_bytes=0)


def test_configure_leaves_a_directory_named_by_jax_to_jax(monkeypatch, tmp_path):
  calls = []
  monkeypatch.setattr(compilation_cache, "disable", lambda: calls.append("disable"))
  monkeypatch.setattr(compilation_cache, "enable", lambda d: calls.append(("enable", d)) or d)
  jax_env = {"JAX_COMPILATION_CACHE_DIR": "/jax"}
  assert compilation_cache.configure(None, jax_env) == "/jax"
  assert calls == []  # JAX already read its variables: dir, cap and minimum compile time.
  assert compilation_cache.configure("/flag", jax_env) == "/flag"
  assert compilation_cache.configure(None, {"JAX_COMPILATION_CACHE_DIR": "none"}) is None
  assert compilation_cache.configure(None, {"JAXMORAL_COMPILATION_CACHE_DIR": "/mine"}) == "/mine"
  assert calls == [("enable", "/flag"), "disable", ("enable", "/mine")]


def test_enable_leaves_a_directory_with_uncapped_entries_uncapped(monkeypatch, tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  updates = {}
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.__setitem__(name, value))
  (tmp_path / "jit_f-1-cache").write_bytes(b"x")
  (tmp_path / "jit_f-1-atime").write_bytes(b"t")
  compilation_cache.enable(str(tmp_path))
  assert updates["jax_compilation_cache_max_size"] == compilation_cache.DEFAULT_MAX_BYTES
  (tmp_path / "jit_g-2-cache").write_bytes(b"y")  # Written by a JAX without a cap.
  assert compilation_cache.uncapped_entries(str(tmp_path)) == ["jit_g-2-cache"]
  compilation_cache.enable(str(tmp_path))
  assert updates["jax_compilation_cache_max_size"] == -1


def test_a_capped_cache_cannot_write_beside_an_uncapped_entry(tmp_path):
  """Why the two rules above: JAX's capped cache reads every entry's access time to evict."""
  from jax._src import lru_cache  # pylint: disable=g-import-not-at-top
  lru_cache.LRUCache(str(tmp_path), max_size=-1).put("jit_g-2", b"y")
  with pytest.raises(FileNotFoundError, match="atime"):
    lru_cache.LRUCache(str(tmp_path), max_size=1 << 20).put("jit_f-1", b"x")


def test_an_entry_that_fails_its_signature_is_removed(tmp_path):
  """JAX writes back only slow compiles, so a refused entry left in place would be refused
  (and warned about) by every later run."""
  from jax._src import lru_cache  # pylint: disable=g-import-not-at-top
  cache = compilation_cache.SignedCache(lru_cache.LRUCache(str(tmp_path), max_size=-1),
                                        str(tmp_path), b"k" * 32)
  cache.put("jit_f-1", b"compiled f")
  assert cache.get("jit_f-1") == b"compiled f"
  (tmp_path / "jit_f-1-cache").write_bytes(b"compiled g")
  assert cache.get("jit_f-1") is None
  assert sorted(os.listdir(tmp_path)) == []
  assert cache.get("jit_f-1") is None  # a miss now, not another refusal


# A fresh process: enables the cache, samples greedily from a tiny random T5 (on a CPU the
# sampler's step runs the packed-kernel custom calls when they build) and reports the cache hits.
_SAMPLE_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from jax import monitoring
    from jaxmoral import compilation_cache, decoding
    from jaxmoral.backends import cpu_kernels
    from jaxmoral.models import t5
    from jaxmoral.models.config import t5_config
    import flax.linen as nn
    import numpy as np

    hits = []
    monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event.endswith("/cache_hits") else None)
    compilation_cache.enable(sys.argv[1], min_compile_seconds=0.0)
    model = t5.T5(t5_config(size="tiny"))
    params = nn.unbox(t5.init_params(model, jax.random.PRNGKey(0)))
    inputs = np.array(jax.random.randint(jax.random.PRNGKey(1), (3, 7), 2, 512), np.int32)
    weights = decoding.prepare_decode_weights(
        model, params, backend="cpu_packed" if cpu_kernels.available() else "xla")
    out = decoding.sample(model, params, encoder_input_tokens=inputs, max_decode_length=9,
                          greedy=True, decode_weights=weights)
    print(json.dumps({"hits": len(hits), "tokens": np.asarray(out.tokens).tolist(),
                      "kernels": weights.backend == "cpu_packed"}))
""")


def _run_sampler(cache_dir):
  # The suite's compile settings (conftest.py: unoptimised code, quick to compile) carry over;
  # one device, as a user's process has. Both processes share them, so the cache keys match.
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": child_xla_flags()}
  done = subprocess.run([sys.executable, "-c", _SAMPLE_SCRIPT, str(cache_dir)], env=env,
                        capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_sampler_from_the_cache(tmp_path):
  cache_dir = tmp_path / "xla"
  first = _run_sampler(cache_dir)
  entries = os.listdir(cache_dir)
  assert first["hits"] == 0 and entries, (first["hits"], entries)
  second = _run_sampler(cache_dir)
  assert second["hits"] >= 1
  assert second["tokens"] == first["tokens"]
  # Where the kernels build, the cached executables include their custom calls.
  assert first["kernels"] == second["kernels"] == cpu_kernels.available()


def test_cli_enables_the_cache_except_for_topology_compiles(monkeypatch, tmp_path):
  from jaxmoral import aot, runs  # pylint: disable=g-import-not-at-top
  calls = []
  monkeypatch.setattr(compilation_cache, "disable", lambda: calls.append("disable"))
  monkeypatch.setattr(compilation_cache, "enable", lambda d: calls.append(("enable", d)))
  monkeypatch.setattr(aot, "compile_for_topology", lambda **kwargs: None)
  monkeypatch.setattr(runs, "export_run", lambda **kwargs: None)
  assert cli.main(["compile", "--topology=cpu:8", f"--compilation_cache_dir={tmp_path}"]) == 0
  assert cli.main(["export", "--model_dir=m", "--output=o",
                   f"--compilation_cache_dir={tmp_path}"]) == 0
  assert cli.main(["export", "--model_dir=m", "--output=o", "--compilation_cache_dir=none"]) == 0
  assert calls == ["disable", ("enable", str(tmp_path)), "disable"]


@pytest.mark.parametrize("have_filelock", [True, False])
def test_enable_caps_the_cache_only_with_filelock(monkeypatch, tmp_path, have_filelock):
  import jax  # pylint: disable=g-import-not-at-top
  if not have_filelock:
    monkeypatch.setitem(sys.modules, "filelock", None)  # `import filelock` raises ImportError.
  updates = {}
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.__setitem__(name, value))
  assert compilation_cache.enable(str(tmp_path / "c")) == str(tmp_path / "c")
  assert (tmp_path / "c").is_dir()
  assert updates["jax_compilation_cache_dir"] == str(tmp_path / "c")
  assert updates["jax_compilation_cache_max_size"] == (
      compilation_cache.DEFAULT_MAX_BYTES if have_filelock else -1)
  assert updates["jax_persistent_cache_min_compile_time_secs"] == 1.0
