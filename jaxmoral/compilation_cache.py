"""A persistent XLA compilation cache: reruns and resumed `jaxmoral` commands skip compiling.

The command line turns JAX's on-disk cache of compiled executables on by default (as MaxText
does), so a resumed run, an `eval` after `train` or a rerun loads its steps (docs/cli.md).
Where the cache goes, first match wins:
1. `--compilation_cache_dir=DIR` on the command line (`none` or an empty value: no cache);
2. JAX's own `JAX_COMPILATION_CACHE_DIR` environment variable;
3. `$JAXMORAL_COMPILATION_CACHE_DIR` (`none`: no cache);
4. `$XDG_CACHE_HOME/jaxmoral/xla`, else `~/.cache/jaxmoral/xla`.

jaxmoral's own directories (1, 3, 4) are capped at `DEFAULT_MAX_BYTES`. A directory JAX's
variable names keeps JAX's own settings, and one that holds uncapped entries is not capped:
JAX's capped cache needs an access-time file beside every entry (one entry without it makes
every later write fail), so it cannot share a directory with uncapped writers. Library users
get no cache unless they call `enable` or set JAX's variable; `jaxmoral compile` runs without.

JAX runs whatever executable the cache hands it, so a local cache directory is trusted only
on the kernel cache's terms (`untrusted_reason`), and every entry jaxmoral writes is signed
(`SignedCache`, with the secret in `KEY_FILE`): docs/reliability.md. A `gs://...` cache is
trusted as far as the bucket's permissions go.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import importlib.util
import logging
import os
import secrets
import stat
import tempfile
from typing import Any, Mapping, Optional

FLAG = "--compilation_cache_dir"
ENV_DIR = "JAXMORAL_COMPILATION_CACHE_DIR"
JAX_ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
DISABLED = ("", "none")
DEFAULT_MAX_BYTES = 4 * 1024 ** 3
# JAX's default: programs that compile faster than this are not written (loading one costs
# about as much as compiling it).
DEFAULT_MIN_COMPILE_SECONDS = 1.0
# File names of JAX's cache (jax._src.lru_cache): an entry, and the access time a capped cache
# keeps beside it.
_CACHE_SUFFIX = "-cache"
_ATIME_SUFFIX = "-atime"

_LOG = logging.getLogger(__name__)
# The secret that signs a local cache's entries, and the suffix of an entry's signature file.
KEY_FILE = "jaxmoral-cache-key"
_SIGNATURE_SUFFIX = "-jaxmoral-hmac"
_OTHERS_ACCESS = stat.S_IRWXG | stat.S_IRWXO
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def untrusted_reason(cache_dir: str) -> Optional[str]:
  """Why another user could put an entry into local `cache_dir` (a real folder), or None."""
  # One rule for both caches of compiled code: the kernel cache's.
  from jaxmoral.backends.cpu_kernels import _folder_problem  # pylint: disable=g-import-not-at-top
  try:
    return _folder_problem(os.path.realpath(cache_dir))
  except OSError as error:
    return f"cannot be checked ({error.strerror or error})"


def _secret(cache_dir: str) -> bytes:
  """The directory's signing secret (made on first use), read only from this user's own
  regular file that no one else can read or write."""
  path = os.path.join(cache_dir, KEY_FILE)
  try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
  except FileExistsError:
    pass
  else:
    with os.fdopen(fd, "wb") as f:
      f.write(secrets.token_bytes(32))
  with os.fdopen(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb") as f:
    st = os.fstat(f.fileno())
    if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
        or st.st_mode & _OTHERS_ACCESS):
      raise PermissionError(f"{path} is not this user's private file "
                            f"(mode {stat.S_IMODE(st.st_mode):#o}, uid {st.st_uid})")
    secret = f.read()
  if len(secret) < 32:
    raise PermissionError(f"{path} is too short to be a signing key")
  return secret


class SignedCache:
  """JAX's file cache with each entry's HMAC beside it: `get` returns only entries this
  directory's secret signed for that very key (anything else is compiled again)."""

  def __init__(self, base: Any, cache_dir: str, secret: bytes):
    self._base, self._dir, self._secret = base, cache_dir, secret
    self._warned = False

  def __getattr__(self, name: str) -> Any:  # `_path` and whatever else JAX reads.
    return getattr(self._base, name)

  def _tag(self, key: str, value: bytes) -> bytes:
    return hmac.new(self._secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

  def _signature_path(self, key: str) -> str:
    return os.path.join(self._dir, key + _SIGNATURE_SUFFIX)

  def get(self, key: str) -> Optional[bytes]:
    value = self._base.get(key)
    if value is None:
      return None
    try:
      with os.fdopen(os.open(self._signature_path(key), os.O_RDONLY | _NOFOLLOW), "rb") as f:
        signature = f.read()
    except OSError:
      signature = b""
    if hmac.compare_digest(signature, self._tag(key, value)):
      return value
    if not self._warned:
      self._warned = True
      _LOG.warning("compilation cache %s: entry %s fails its signature check (changed, or "
                   "not written by jaxmoral): removed, compiling it again", self._dir, key)
    # JAX writes back only programs that were slow to compile, so an entry left in place
    # would be refused (and warned about) by every later run.
    for suffix in (_CACHE_SUFFIX, _ATIME_SUFFIX, _SIGNATURE_SUFFIX):
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(self._dir, key + suffix))
    return None

  def put(self, key: str, value: bytes) -> None:
    self._base.put(key, value)
    fd, partial = tempfile.mkstemp(prefix=key + ".", suffix=".tmp", dir=self._dir)
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(self._tag(key, value))
      os.replace(partial, self._signature_path(key))
    except BaseException:
      if os.path.lexists(partial):
        os.remove(partial)
      raise


_SIGNING: dict[str, bytes] = {}  # Local cache directory (real path) -> its secret.


def _sign_entries(cache_dir: str) -> None:
  """Makes JAX open local `cache_dir` as a `SignedCache` (JAX opens it at its first compile)."""
  from jax._src import compilation_cache as jax_cache  # pylint: disable=g-import-not-at-top
  _SIGNING[os.path.realpath(cache_dir)] = _secret(cache_dir)
  original = getattr(jax_cache.get_file_cache, "__wrapped__", jax_cache.get_file_cache)

  def get_file_cache(path: str) -> Any:
    opened = original(path)
    secret = _SIGNING.get(os.path.realpath(path)) if "://" not in path else None
    if opened is None or secret is None:
      return opened
    return SignedCache(opened[0], os.path.realpath(path), secret), opened[1]

  get_file_cache.__wrapped__ = original  # type: ignore[attr-defined]
  jax_cache.get_file_cache = get_file_cache


def _trusted(cache_dir: str) -> bool:
  """Checks local `cache_dir` and signs its entries; False (one warning) where it is not
  safe to run code from."""
  problem = untrusted_reason(cache_dir)
  if problem is None:
    try:
      _sign_entries(cache_dir)
    except OSError as error:
      problem = f"has an unusable signing key ({error.strerror or error})"
  if problem is not None:
    _LOG.warning("not using compilation cache %s: it %s; compiling without a cache", cache_dir,
                 problem)
  return problem is None


def resolve_cache_dir(flag_value: Optional[str] = None,
                      environ: Mapping[str, str] = os.environ) -> Optional[str]:
  """The cache directory by the precedence in the module docstring; None: no cache."""
  for value in (flag_value, environ.get(JAX_ENV_DIR), environ.get(ENV_DIR)):
    if value is not None:
      return None if value.strip().lower() in DISABLED else os.path.expanduser(value)
  base = environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
  return os.path.join(base, "jaxmoral", "xla")


def configure(flag_value: Optional[str] = None,
              environ: Mapping[str, str] = os.environ) -> Optional[str]:
  """Turns the cache on or off for a command, by `--compilation_cache_dir`'s `flag_value` and
  `environ` (precedence: module docstring); call before the first compilation. Returns the
  directory in use, or None."""
  cache_dir = resolve_cache_dir(flag_value, environ)
  if cache_dir is not None and flag_value is None and environ.get(JAX_ENV_DIR) is not None:
    # JAX configured it from its own variables when it was imported; trusted on jaxmoral's
    # terms all the same.
    if "://" in cache_dir or not os.path.isdir(cache_dir) or _trusted(cache_dir):
      return cache_dir
    cache_dir = None
  if cache_dir is None:  # Also overrides a JAX_COMPILATION_CACHE_DIR that JAX read itself.
    disable()
    return None
  return enable(cache_dir)


def uncapped_entries(cache_dir: str) -> list[str]:
  """Entries of a local cache directory that an uncapped JAX wrote (no access-time file)."""
  try:
    names = set(os.listdir(cache_dir))
  except OSError:
    return []
  return sorted(name for name in names if name.endswith(_CACHE_SUFFIX)
                and name[:-len(_CACHE_SUFFIX)] + _ATIME_SUFFIX not in names)


def enable(cache_dir: Optional[str], *, max_bytes: int = DEFAULT_MAX_BYTES,
           min_compile_seconds: float = DEFAULT_MIN_COMPILE_SECONDS) -> Optional[str]:
  """Points JAX's persistent compilation cache at `cache_dir` and returns the directory in
  use, or None. Call before the first compilation: JAX opens the cache once, at its first compile.

  Args:
    cache_dir: A local directory (created if missing) or any path JAX's cache accepts
      (e.g. `gs://...`); None does nothing.
    max_bytes: Size cap; least recently used entries are deleted beyond it (-1: no cap; also
      what a local directory that holds uncapped entries gets).
    min_compile_seconds: Programs that compiled faster than this are not written.
  """
  if cache_dir is None:
    return None
  if max_bytes == 0 or max_bytes < -1:
    raise ValueError(f"compilation_cache.enable: max_bytes must be positive or -1 (no cap), "
                     f"got {max_bytes}")
  import jax  # pylint: disable=g-import-not-at-top  (the CLI resolves flags before JAX loads)
  if "://" not in cache_dir:
    try:
      os.makedirs(cache_dir, mode=0o700, exist_ok=True)
    except OSError as error:  # A read-only home: run without a cache rather than fail.
      _LOG.warning("no compilation cache: cannot create %s (%s)", cache_dir, error)
      return None
    if not _trusted(cache_dir):
      return None
    if max_bytes != -1 and uncapped_entries(cache_dir):
      _LOG.info("compilation cache %s holds entries written without a cap; leaving it uncapped",
                cache_dir)
      max_bytes = -1
  if max_bytes != -1 and importlib.util.find_spec("filelock") is None:
    # JAX needs filelock to cap the cache; an uncapped cache beats none.
    _LOG.warning("filelock is not installed: the compilation cache in %s is not capped",
                 cache_dir)
    max_bytes = -1
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_compilation_cache_max_size", max_bytes)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
  _LOG.debug("XLA compilation cache: %s", cache_dir)
  return cache_dir


def disable() -> None:
  """Turns JAX's persistent compilation cache off for this process (even one set by
  `JAX_COMPILATION_CACHE_DIR`). Call before the first compilation."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_enable_compilation_cache", False)
