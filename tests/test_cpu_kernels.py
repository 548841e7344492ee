"""jaxmoral.backends.cpu_kernels: the packed-panel CPU product against NumPy, and its build."""

import ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import types
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoral.backends import cpu_kernels

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))


@pytest.fixture(scope="module")
def kernel():
  if not HAS_COMPILER:
    pytest.skip("no C++ compiler on this machine")
  # Where a compiler exists the kernel must build: a failure here is a real failure.
  assert cpu_kernels.available(), "packed matmul failed to build with a compiler present"
  return cpu_kernels.packed_matmul


@pytest.mark.parametrize("rows,k,n", [
    (1, 64, 64), (5, 96, 100), (6, 128, 192), (7, 512, 1152), (13, 33, 64), (32, 256, 320)])
def test_packed_matmul_matches_numpy(kernel, rows, k, n):
  """Every register-block size (1-6 rows and remainders), padded and unpadded columns."""
  rng = np.random.default_rng(rows * 1000 + n)
  x = rng.standard_normal((rows, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  packed = cpu_kernels.pack_columns(jnp.asarray(w))
  assert packed.shape == (-(-n // cpu_kernels.PANEL), k, cpu_kernels.PANEL)
  got = np.asarray(jax.jit(kernel, static_argnums=2)(x, packed, n))
  want = x.astype(np.float64) @ w.astype(np.float64)
  assert got.shape == (rows, n) and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_packed_matmul_keeps_leading_axes_and_feature_shape(kernel):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 3, 48)).astype(np.float32)
  w = rng.standard_normal((48, 3, 40)).astype(np.float32)  # Stacked kernels, flattened.
  got = np.asarray(kernel(x, cpu_kernels.pack_columns(jnp.asarray(w)), 120))
  want = np.tensordot(x.astype(np.float64), w.reshape(48, 120).astype(np.float64), axes=1)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_packed_matmul_under_vmap(kernel):
  rng = np.random.default_rng(2)
  x = rng.standard_normal((4, 2, 64)).astype(np.float32)
  w = rng.standard_normal((64, 70)).astype(np.float32)
  packed = cpu_kernels.pack_columns(jnp.asarray(w))
  got = np.asarray(jax.vmap(lambda r: kernel(r, packed, 70))(x))
  np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


def test_packed_matmul_rejects_mismatched_shapes(kernel):
  packed = cpu_kernels.pack_columns(jnp.ones((32, 64)))
  with pytest.raises(ValueError, match=r"does not fit packed kernel \(1, 32, 64\)"):
    kernel(jnp.ones((2, 16)), packed, 64)


def test_build_is_cached_and_reports_a_failing_compiler(tmp_path, monkeypatch):
  if not HAS_COMPILER:
    pytest.skip("no C++ compiler on this machine")
  monkeypatch.setenv("JAXMORAL_KERNEL_CACHE", str(tmp_path / "cache"))
  monkeypatch.delenv("CXX", raising=False)
  first = cpu_kernels.build()
  mtime = os.stat(first).st_mtime_ns
  assert cpu_kernels.build() == first and os.stat(first).st_mtime_ns == mtime  # Not rebuilt.

  monkeypatch.setenv("CXX", str(tmp_path / "missing-c++"))
  with pytest.raises(cpu_kernels.BuildError, match="missing-c\\+\\+.*is not a program"):
    cpu_kernels.build()
  broken = tmp_path / "broken-c++"
  broken.write_text("#!/bin/sh\necho 'error: this compiler is broken' >&2\nexit 1\n")
  broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
  monkeypatch.setenv("CXX", str(broken))
  with pytest.raises(cpu_kernels.BuildError, match="this compiler is broken"):
    cpu_kernels.build()
  assert not [p for p in os.listdir(tmp_path / "cache") if p.endswith(".tmp")]


def test_switch_turns_the_kernel_off(monkeypatch):
  for off in ("0", "false", "OFF"):
    monkeypatch.setenv("JAXMORAL_CPU_KERNELS", off)
    assert not cpu_kernels.enabled() and not cpu_kernels.available()
  monkeypatch.setenv("JAXMORAL_CPU_KERNELS", "1")
  assert cpu_kernels.enabled()


def _np_attention(q, k, v, bias):
  scores = np.einsum("rhd,rhld->rhl", q.astype(np.float64), k) + bias
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("rhl,rhld->rhd", weights, v)


@pytest.mark.parametrize("rows,heads,keys,depth,bias_shape", [
    (8, 6, 64, 64, (8, 1, 64)),   # Cross-attention: a padding mask per row.
    (3, 4, 32, 64, (1, 4, 32)),   # Self-attention: relative-position bias per head.
    (2, 3, 7, 24, (2, 3, 7)),     # Depth not a multiple of 16, few keys.
    (1, 1, 1, 16, (1, 1, 1))])
def test_decode_attention_matches_numpy(kernel, rows, heads, keys, depth, bias_shape):
  rng = np.random.default_rng(rows * 100 + keys)
  q, k, v = (rng.standard_normal(s).astype(np.float32) for s in
             [(rows, heads, depth), (rows, heads, keys, depth), (rows, heads, keys, depth)])
  bias = rng.standard_normal(bias_shape).astype(np.float32)
  if keys > 2:
    bias[..., keys // 2:] = -1e10  # Masked positions (the model's NEG_INF) get no weight.
  got = np.asarray(jax.jit(cpu_kernels.decode_attention)(q, k, v, bias))
  want = _np_attention(q, k, v, np.broadcast_to(bias, (rows, heads, keys)))
  assert got.shape == (rows, heads, depth) and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [2, 5])
def test_decode_attention_groups_of_query_rows_share_a_key_row(kernel, group):
  rng = np.random.default_rng(group)
  rows, heads, keys, depth = 3, 4, 40, 32
  q = rng.standard_normal((rows * group, heads, depth)).astype(np.float32)
  k, v = (rng.standard_normal((rows, heads, keys, depth)).astype(np.float32) for _ in "kv")
  bias = np.zeros((rows, 1, keys), np.float32)
  bias[1, :, 25:] = -1e10  # Input 1 is shorter: every sample of it must skip those keys.
  got = np.asarray(jax.jit(cpu_kernels.decode_attention)(q, k, v, bias))
  kv_row = np.arange(rows * group) // group
  want = _np_attention(q, k[kv_row], v[kv_row],
                       np.broadcast_to(bias, (rows, heads, keys))[kv_row])
  assert got.shape == q.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_rejects_mismatched_shapes(kernel):
  with pytest.raises(ValueError, match="do not fit"):
    cpu_kernels.decode_attention(jnp.ones((2, 3, 8)), jnp.ones((2, 3, 5, 16)),
                                 jnp.ones((2, 3, 5, 16)), jnp.zeros((2, 3, 5)))
  with pytest.raises(ValueError, match="do not fit"):  # 5 query rows over 2 key rows.
    cpu_kernels.decode_attention(jnp.ones((5, 3, 16)), jnp.ones((2, 3, 5, 16)),
                                 jnp.ones((2, 3, 5, 16)), jnp.zeros((2, 3, 5)))


# The kernel cache's safety. A stand-in compiler copies one good build (no recompiling), and a
# "planted" library, whose constructor leaves a marker file, shows whether a library was loaded.

PLANTED_SOURCE = """
#include <cstdio>
#include <cstdlib>
__attribute__((constructor)) static void planted() {
  if (const char* marker = std::getenv("JAXMORAL_TEST_PLANTED_MARKER")) {
    if (std::FILE* f = std::fopen(marker, "w")) std::fclose(f);
  }
}
"""


@pytest.fixture(scope="module")
def good_library(tmp_path_factory) -> types.SimpleNamespace:
  """A real build of the kernels (the one the other tests use, cached), and a copy of it."""
  if not HAS_COMPILER:
    pytest.skip("no C++ compiler on this machine")
  original = cpu_kernels.build()
  copy = tmp_path_factory.mktemp("good") / "good.so"
  shutil.copyfile(original, copy)
  return types.SimpleNamespace(original=original, copy=str(copy), sha256=_sha256(copy))


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory) -> str:
  """Another user's library: no kernels; its constructor creates $JAXMORAL_TEST_PLANTED_MARKER."""
  if not HAS_COMPILER:
    pytest.skip("no C++ compiler on this machine")
  folder = tmp_path_factory.mktemp("planted")
  (folder / "planted.cc").write_text(PLANTED_SOURCE)
  compiler = next(shutil.which(c) for c in ("c++", "g++", "clang++") if shutil.which(c))
  subprocess.run([compiler, "-shared", "-fPIC", str(folder / "planted.cc"), "-o",
                  str(folder / "planted.so")], check=True, capture_output=True)
  return str(folder / "planted.so")


@pytest.fixture
def fake_cache(tmp_path, monkeypatch, good_library) -> Iterator[types.SimpleNamespace]:
  """A fresh cache folder, a compiler that logs its `-o` and copies `good_library` there, a
  marker path for the planted constructor, and `_load` forgotten before and after."""
  log = tmp_path / "compiler.log"
  compiler = tmp_path / "copying-c++"
  compiler.write_text(f"""#!/bin/sh
while [ "$#" -gt 0 ]; do
  if [ "$1" = "-o" ]; then out="$2"; fi
  shift
done
echo "$out" >> '{log}'
cp '{good_library.copy}' "$out"
""")
  compiler.chmod(0o755)
  cache = tmp_path / "cache"
  monkeypatch.setenv("CXX", str(compiler))
  monkeypatch.setenv("JAXMORAL_KERNEL_CACHE", str(cache))
  monkeypatch.setenv("JAXMORAL_TEST_PLANTED_MARKER", str(tmp_path / "planted-ran"))
  loaded = []
  real_load_library = ctypes.cdll.LoadLibrary

  def load_library(path):
    loaded.append(_sha256(path))
    # XLA refuses a second registration of a target from another copy of the kernels: the
    # good bytes load the one original build; anything else really loads (and runs).
    return real_load_library(good_library.original if loaded[-1] == good_library.sha256
                             else path)

  monkeypatch.setattr(ctypes.cdll, "LoadLibrary", load_library)
  cpu_kernels._load.cache_clear()
  yield types.SimpleNamespace(cache=cache, log=log, marker=tmp_path / "planted-ran",
                              loaded=loaded, good=good_library)
  cpu_kernels._load.cache_clear()


def _sha256(path) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def _plant(planted: str, path: str, *, record_hash: bool = True) -> None:
  """Puts `planted` at the cached library's name, with its hash recorded beside it (as an
  attacker who could write there would), both ours and mode 0o755 unless changed after."""
  os.remove(path)
  shutil.copyfile(planted, path)
  os.chmod(path, 0o755)
  if record_hash:
    with open(path + ".sha256", "w") as f:
      f.write(f"{_sha256(path)}  {os.path.basename(path)}\n")


def _assert_rebuilt_and_loaded_good(fake: types.SimpleNamespace, path: str) -> None:
  good = fake.good.sha256
  assert not fake.marker.exists(), "the planted library was loaded: its constructor ran"
  assert fake.loaded == [good]
  assert not os.path.islink(path) and _sha256(path) == good
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o755


def test_cache_folder_others_can_write_is_refused(fake_cache, tmp_path):
  for mode in (0o777, 0o770, 0o1777):  # The folder itself: world-, group-writable, sticky.
    cache = tmp_path / f"cache-{mode:o}"
    cache.mkdir()
    cache.chmod(mode)
    os.symlink(cache, tmp_path / f"link-{mode:o}")
    for given in (cache, tmp_path / f"link-{mode:o}"):  # Through a symlink: the real folder.
      os.environ["JAXMORAL_KERNEL_CACHE"] = str(given)  # monkeypatch (fake_cache) restores it.
      with pytest.warns(RuntimeWarning, match=rf"not using kernel cache {given}.*: it is "
                        rf"writable by group/others \(mode {oct(mode)}\); building in "):
        path = cpu_kernels.build()
      assert not path.startswith(str(tmp_path)) and os.path.exists(path)
      assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert not os.listdir(cache)
  loose = tmp_path / "loose"  # A parent others can write to without the sticky bit.
  loose.mkdir()
  loose.chmod(0o777)
  (loose / "mine").mkdir(mode=0o700)
  os.environ["JAXMORAL_KERNEL_CACHE"] = str(loose / "mine")
  with pytest.warns(RuntimeWarning, match=rf"its parent {loose} is writable by group/others "
                    r"and not sticky"):
    assert not cpu_kernels.build().startswith(str(loose))
  assert not os.listdir(loose / "mine")

  shared = tmp_path / "shared"  # Sticky and world-writable, like /tmp: fine as a parent.
  shared.mkdir()
  shared.chmod(0o1777)
  ok = shared / "mine"
  ok.mkdir(mode=0o700)
  os.symlink(ok, tmp_path / "link-to-mine")
  for cache in (ok, tmp_path / "link-to-mine"):
    os.environ["JAXMORAL_KERNEL_CACHE"] = str(cache)
    assert os.path.dirname(cpu_kernels.build()) == str(ok)


def test_cache_folder_is_created_private_and_must_be_ours(fake_cache, tmp_path):
  cpu_kernels.build()
  assert stat.S_IMODE(os.stat(fake_cache.cache).st_mode) == 0o700
  if os.geteuid() != 0:
    pytest.skip("making a folder another user's needs root")
  theirs = tmp_path / "theirs"
  theirs.mkdir(mode=0o755)
  os.chown(theirs, 65534, 65534)
  os.environ["JAXMORAL_KERNEL_CACHE"] = str(theirs)
  with pytest.warns(RuntimeWarning, match=rf"not using kernel cache {theirs}: it is owned by "
                    r"uid 65534"):
    assert not cpu_kernels.build().startswith(str(theirs))


@pytest.mark.parametrize("loose", ["library", "hash file"])
def test_planted_library_writable_by_others_is_not_loaded(fake_cache, planted_library, loose):
  path = cpu_kernels.build()
  _plant(planted_library, path)
  os.chmod(path if loose == "library" else path + ".sha256", 0o666)
  with pytest.warns(RuntimeWarning, match=rf"not loading cached {path}: {loose} .* is "
                    r"writable by group/others \(mode 0o666\); rebuilding it"):
    assert cpu_kernels._load() == path
  _assert_rebuilt_and_loaded_good(fake_cache, path)


def test_planted_library_of_another_user_is_not_loaded(fake_cache, planted_library):
  if os.geteuid() != 0:
    pytest.skip("making a file another user's needs root")
  path = cpu_kernels.build()
  _plant(planted_library, path)
  os.chown(path, 65534, 65534)
  os.chown(path + ".sha256", 65534, 65534)
  with pytest.warns(RuntimeWarning, match=rf"not loading cached {path}: library .* is owned "
                    r"by uid 65534, not this user \(0\)"):
    assert cpu_kernels._load() == path
  _assert_rebuilt_and_loaded_good(fake_cache, path)


def test_library_changed_after_its_build_is_not_loaded(fake_cache, planted_library, monkeypatch):
  path = cpu_kernels.build()
  _plant(planted_library, path, record_hash=False)  # The bytes change, the hash stays.
  with pytest.warns(RuntimeWarning, match=rf"not loading cached {path}: its SHA-256 \w+\.\.\. "
                    r"does not match the \w+\.\.\. recorded when it was built"):
    assert cpu_kernels._load() == path
  _assert_rebuilt_and_loaded_good(fake_cache, path)

  # Swapped between build() and loading, even after a rebuild: decoding falls back to XLA.
  build = cpu_kernels.build

  def build_then_swap(**kwargs) -> str:
    built = build(**kwargs)
    shutil.copyfile(planted_library, built)
    return built

  monkeypatch.setattr(cpu_kernels, "build", build_then_swap)
  cpu_kernels._load.cache_clear()
  fake_cache.loaded.clear()
  with pytest.warns(RuntimeWarning) as record:
    assert cpu_kernels._load() is None
  messages = [str(w.message) for w in record]
  assert any(f"not loading {path}: its SHA-256" in m for m in messages), messages
  assert any("kernels unavailable" in m and "even after rebuilding" in m for m in messages)
  assert not fake_cache.loaded and not fake_cache.marker.exists()


def test_symlinked_library_is_not_loaded(fake_cache, planted_library, tmp_path):
  path = cpu_kernels.build()
  _plant(planted_library, path)  # Its hash file matches what the symlink leads to.
  os.rename(path, tmp_path / "elsewhere.so")
  os.symlink(tmp_path / "elsewhere.so", path)
  with pytest.warns(RuntimeWarning, match=rf"not loading cached {path}: library .* is a "
                    r"symlink; rebuilding it"):
    assert cpu_kernels._load() == path
  _assert_rebuilt_and_loaded_good(fake_cache, path)


def test_build_writes_an_unpredictable_temporary_name_and_leaves_no_partial_file(
    fake_cache, tmp_path, monkeypatch):
  path = cpu_kernels.build()
  # Another user's symlink at the name an older build wrote through: it must not be followed.
  victim = tmp_path / "victim"
  victim.write_bytes(b"untouched")
  predictable = f"{path}.{os.getpid()}.tmp"
  os.symlink(victim, predictable)
  fake_cache.log.unlink()
  assert cpu_kernels.build(force=True) == path
  (written,) = fake_cache.log.read_text().split()
  assert victim.read_bytes() == b"untouched"
  assert os.path.dirname(written) == str(fake_cache.cache)
  assert written not in (path, predictable) and not os.path.lexists(written)
  name = os.path.basename(path)
  assert sorted(os.listdir(fake_cache.cache)) == sorted(
      [name, name + ".sha256", os.path.basename(predictable)])
  with open(path + ".sha256") as f:
    assert f.read() == f"{_sha256(path)}  {name}\n"

  broken = tmp_path / "broken-c++"  # Writes half a library, then fails.
  broken.write_text("#!/bin/sh\nfor a; do out=$a; done\necho half > \"$out\"\nexit 1\n")
  broken.chmod(0o755)
  monkeypatch.setenv("CXX", str(broken))
  with pytest.raises(cpu_kernels.BuildError):
    cpu_kernels.build()
  assert sorted(os.listdir(fake_cache.cache)) == sorted(
      [name, name + ".sha256", os.path.basename(predictable)])
