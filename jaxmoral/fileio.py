"""The one file layer: every path a run touches may be local or an object-store URL.

Local paths go through `os` and `open` (atomic renames, fsync). URLs (gs://, s3://) go through
`etils.epath` on fsspec (gcsfs, s3fs), the layer Orbax writes checkpoints with, so a run's small
files and its checkpoints share one client, one set of credentials and one endpoint. An object
is written whole or not at all, which is what the atomic writes here need. A local GCS-API
server (`STORAGE_EMULATOR_HOST`) is also given to TensorStore (`TENSORSTORE_GCS_HTTP_URL`).
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import errno
import functools
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import uuid
from typing import IO, Any, Iterable, Iterator, Optional

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_configured = False
_configure_guard = threading.Lock()


def _is_not_missing_root_metadata(record: logging.LogRecord) -> bool:
  return not record.getMessage().startswith("Metadata file does not exist")


@contextlib.contextmanager
def reading_orbax_item() -> Iterator[None]:
  """Orbax's checkpointer, given an item folder (a run's step item, an export's params, a T5X
  checkpoint), reads it as a checkpoint's root and warns that the root's `_CHECKPOINT_METADATA`
  is missing; a manager writes that file one level up (`run_layout`) and T5X never wrote it, so
  for an item the warning is always false. Every item read goes through here."""
  absl_logger = logging.getLogger("absl")  # Orbax logs through absl.
  absl_logger.addFilter(_is_not_missing_root_metadata)
  try:
    yield
  finally:
    absl_logger.removeFilter(_is_not_missing_root_metadata)


def is_url(path: str | os.PathLike) -> bool:
  """True for an object-store URL (gs://bucket/..., s3://...), False for a local path."""
  return bool(_URL.match(os.fspath(path)))


def scheme(path: str | os.PathLike) -> Optional[str]:
  """'gs', 's3', ... for a URL; None for a local path."""
  match = _URL.match(os.fspath(path))
  return match.group(1).lower() if match else None


def _http_url(endpoint: str) -> str:
  return endpoint if endpoint.startswith(("http://", "https://")) else f"http://{endpoint}"


def _configure_clients() -> None:
  """Points every client at the same store before any of them is first used.

  fsspec (gcsfs) rather than tf.io.gfile, which epath picks when TensorFlow is installed, so
  that Orbax, this module and the endpoint settings agree (tf.io.gfile has no endpoint setting
  for a GCS-API server); gcsfs's bucket-type probe (gRPC) is off against a local server.
  """
  global _configured
  with _configure_guard:
    if _configured:
      return
    os.environ.setdefault("EPATH_USE_TF", "false")
    # etils decides once per process, at the first path of any kind it handles (Orbax's local
    # checkpoints included), whether URLs go through TensorFlow; decide again now.
    from etils.epath import gpath  # pylint: disable=g-import-not-at-top
    clear = getattr(getattr(gpath, "_is_tf_installed", None), "cache_clear", None)
    if clear is not None:
      clear()
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:
      os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", _http_url(emulator))
      os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    _configured = True


def path(location: str | os.PathLike) -> Any:
  """An `etils.epath.Path` for `location` (clients configured first)."""
  _configure_clients()
  from etils import epath  # pylint: disable=g-import-not-at-top
  location = os.fspath(location)
  if is_url(location):
    # epath keeps its own fsspec instance: its listings must not go stale either.
    from etils.epath import backend  # pylint: disable=g-import-not-at-top
    backend.fsspec_backend.fs(location).invalidate_cache()
  return epath.Path(location)


def filesystem(location: str | os.PathLike) -> tuple[Any, str]:
  """(fsspec filesystem, path without the scheme) of a URL: what epath does not expose
  (conditional creates, generations, recursive listings) goes through it."""
  _configure_clients()
  import fsspec  # pylint: disable=g-import-not-at-top
  fs, stripped = fsspec.core.url_to_fs(os.fspath(location))
  # Other writers (TensorStore, tensorboardX, other hosts) change the store behind this
  # process's back: listings are never served from fsspec's cache.
  fs.invalidate_cache()
  return fs, stripped


def join(base: str | os.PathLike, *parts: str) -> str:
  """`os.path.join` for local paths; '/'-joined for URLs."""
  base = os.fspath(base)
  if not is_url(base):
    return os.path.join(base, *parts)
  return "/".join([base.rstrip("/"), *(part.strip("/") for part in parts if part)])


def basename(location: str | os.PathLike) -> str:
  """The last component of a path or URL (a trailing '/' ignored)."""
  return os.fspath(location).rstrip("/").rsplit("/", 1)[-1]


def abspath(location: str | os.PathLike) -> str:
  """An absolute local path (user expanded); a URL as given, without a trailing '/'."""
  location = os.fspath(location)
  if is_url(location):
    return location.rstrip("/") if location.rstrip("/") != f"{scheme(location)}:/" else location
  return os.path.abspath(os.path.expanduser(location))


def _either(location: str | os.PathLike, local: Any, remote: str, *args: Any, **kwargs: Any
            ) -> Any:
  """`local(location)` for a local path; the fsspec method `remote` for a URL."""
  if not is_url(location):
    return local(location)
  fs, stripped = filesystem(location)
  return getattr(fs, remote)(stripped, *args, **kwargs)


def exists(location: str | os.PathLike) -> bool:
  return _either(location, os.path.exists, "exists")


def isfile(location: str | os.PathLike) -> bool:
  return _either(location, os.path.isfile, "isfile")


def isdir(location: str | os.PathLike) -> bool:
  return _either(location, os.path.isdir, "isdir")


def listdir(location: str | os.PathLike) -> list[str]:
  """Names in a folder (FileNotFoundError if missing: for a URL, a prefix without objects)."""
  if not is_url(location):
    return os.listdir(location)
  fs, stripped = filesystem(location)
  prefix = stripped.rstrip("/")
  try:
    entries = fs.ls(prefix, detail=False)
  except FileNotFoundError:
    entries = []
  names = [basename(e) for e in entries if e.rstrip("/") != prefix]
  if not names and not isdir(location):
    raise FileNotFoundError(f"{location}: no such folder")
  return names


def walk_files(root: str | os.PathLike) -> list[str]:
  """Every file under `root`, as sorted '/'-joined paths relative to it."""
  root = os.fspath(root)
  if not is_url(root):
    return sorted(os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
                  for folder, _, names in os.walk(root) for name in names)
  fs, stripped = filesystem(root)
  prefix = stripped.rstrip("/") + "/"
  return sorted(p[len(prefix):] for p in fs.find(stripped) if p.startswith(prefix))


def file_versions(root: str | os.PathLike, names: Iterable[str]
                  ) -> dict[str, tuple[int, tuple[Any, ...]]]:
  """{name: (size, version)} of those of `names` ('/'-joined, relative to `root`) that are
  files: `version` changes whenever the file is rewritten (local: inode, size and mtime in ns;
  object store: the object's generation), from one listing of the prefix on a store."""
  if not is_url(root):
    out = {}
    for name in names:
      try:
        st = os.stat(os.path.join(root, name))
      except OSError:
        continue
      if stat.S_ISREG(st.st_mode):
        out[name] = (st.st_size, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return out
  fs, stripped = filesystem(root)
  prefix = stripped.rstrip("/") + "/"
  listed = {name[len(prefix):]: (int(info.get("size") or 0),
                                 (info.get("generation"), info.get("md5Hash"),
                                  info.get("updated"), info.get("ETag")))
            for name, info in fs.find(stripped, detail=True).items() if name.startswith(prefix)}
  return {name: listed[name] for name in names if name in listed}


def is_within(location: str | os.PathLike, folder: str | os.PathLike) -> bool:
  """Whether `location` is `folder` or lies inside it (local paths with links resolved; URLs
  compared as normalised strings)."""
  if is_url(location) or is_url(folder):
    a, b = abspath(location).rstrip("/"), abspath(folder).rstrip("/")
    return a == b or a.startswith(b + "/")
  a, b = (os.path.realpath(os.path.expanduser(p)) for p in (location, folder))
  if os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b):
    return True  # A hard link to the same file.
  return os.path.commonpath([a, b]) == b


def makedirs(location: str | os.PathLike) -> None:
  """Creates a folder and its parents (object stores have no folders: nothing to do there)."""
  if not is_url(location):
    os.makedirs(location, exist_ok=True)


def upload(local_file: str | os.PathLike, location: str | os.PathLike) -> None:
  """Copies local file `local_file` to `location`, streamed (model weights)."""
  if not is_url(location):
    shutil.copyfile(local_file, location)
    return
  fs, stripped = filesystem(location)
  fs.put_file(os.fspath(local_file), stripped)


def getsize(location: str | os.PathLike) -> int:
  if not is_url(location):
    return os.path.getsize(location)
  fs, stripped = filesystem(location)
  try:
    return int(fs.size(stripped))
  except FileNotFoundError:
    raise FileNotFoundError(2, "No such file", os.fspath(location)) from None


def getmtime(location: str | os.PathLike) -> float:
  """Seconds since the epoch of the last write."""
  if not is_url(location):
    return os.path.getmtime(location)
  fs, stripped = filesystem(location)
  modified = fs.modified(stripped)
  if modified.tzinfo is None:
    modified = modified.replace(tzinfo=datetime.UTC)
  return modified.timestamp()


def open(location: str | os.PathLike, mode: str = "r", *,  # pylint: disable=redefined-builtin
         encoding: Optional[str] = None, newline: Optional[str] = None) -> IO[Any]:
  """`open` for local paths; the object store's file object for URLs (written on close)."""
  if not is_url(location):
    return builtins.open(location, mode, encoding=encoding, newline=newline)
  # fsspec's own file object (epath's TensorFlow backend returns no file): the same client.
  import io  # pylint: disable=g-import-not-at-top
  fs, stripped = filesystem(location)
  binary = fs.open(stripped, mode.replace("t", "") + ("" if "b" in mode else "b"))
  if "r" in mode:
    # fsspec's readline reads a whole block (MBs) per line and seeks back: quadratic in the
    # file's size (minutes for a 15 MB JSONL); a buffered reader reads each block once.
    binary = io.BufferedReader(binary, buffer_size=1 << 20)
  if "b" in mode:
    return binary
  return io.TextIOWrapper(binary, encoding=encoding or "utf-8", newline=newline)


def open_text_writer(location: str | os.PathLike) -> IO[str]:
  """A UTF-8 text file opened for writing, its local folder made first (an object is stored
  when it is closed): for records written line by line, e.g. chat transcripts."""
  makedirs(os.path.dirname(abspath(location)))
  return open(location, "w", encoding="utf-8")


def read_bytes(location: str | os.PathLike) -> bytes:
  with open(location, "rb") as f:
    return f.read()


def read_text(location: str | os.PathLike, encoding: str = "utf-8") -> str:
  with open(location, "r", encoding=encoding) as f:
    return f.read()


def read_json(location: str | os.PathLike) -> Any:
  """The JSON value of a file; a ValueError "LOCATION:LINE: invalid JSON: why" if it is none."""
  try:
    return json.loads(read_text(location))
  except json.JSONDecodeError as e:
    raise ValueError(f"{location}:{e.lineno}: invalid JSON: {e.msg}") from e


def write_bytes(location: str | os.PathLike, data: bytes, *, durable: bool = False) -> None:
  """Writes a whole file atomically: readers see the old content or the new, never a part.

  Local files are written under a temporary name (fsynced with `durable`) and renamed over.
  """
  location = os.fspath(location)
  if is_url(location):
    fs, stripped = filesystem(location)
    fs.pipe_file(stripped, data)
    return
  temporary = f"{location}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
  try:
    with builtins.open(temporary, "wb") as f:
      f.write(data)
      if durable:
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, location)
  except BaseException:
    if os.path.exists(temporary):
      os.remove(temporary)
    raise


def write_text(location: str | os.PathLike, text: str, *, durable: bool = False) -> None:
  write_bytes(location, text.encode("utf-8"), durable=durable)


def create_exclusive(location: str | os.PathLike, data: bytes) -> bool:
  """Creates a file only if none exists; False if one does. Of two callers exactly one wins:
  O_CREAT | O_EXCL locally, a conditional upload on gs:// and s3:// (refused with HTTP 412 when
  the object exists); other stores check, then write (not race-free: docs/reliability.md)."""
  if not is_url(location):
    try:
      fd = os.open(location, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    return True
  fs, stripped = filesystem(location)
  if scheme(location) in ("gs", "s3"):  # Their fsspec clients make a conditional create.
    try:
      fs.pipe_file(stripped, data, mode="create")
    except FileExistsError:
      return False
    return True
  if fs.exists(stripped):
    return False
  fs.pipe_file(stripped, data)
  return True


def generation(location: str | os.PathLike) -> Optional[str]:
  """A gs:// object's generation (None for other paths, or a missing object)."""
  if scheme(location) != "gs":
    return None
  fs, stripped = filesystem(location)
  try:
    return str(fs.info(stripped).get("generation") or "") or None
  except FileNotFoundError:
    return None


def version(location: str | os.PathLike) -> list[Any]:
  """What changes whenever a file is rewritten, for the fingerprints of cached data: its size
  and its modification time (ns locally) or a gs:// object's generation."""
  if not is_url(location):
    stat = os.stat(location)
    return [stat.st_size, stat.st_mtime_ns]
  return [getsize(location), generation(location) or getmtime(location)]


def remove(location: str | os.PathLike, *, if_generation: Optional[str] = None) -> None:
  """Deletes a file (FileNotFoundError if absent). `if_generation` (gs://): only that
  generation of the object; FileNotFoundError if it has been replaced since."""
  location = os.fspath(location)
  if if_generation is not None and scheme(location) == "gs":
    fs, stripped = filesystem(location)
    bucket, key, _ = fs.split_path(stripped)
    try:
      fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=if_generation)
    except FileExistsError:  # gcsfs maps 412 (precondition failed) to FileExistsError.
      raise FileNotFoundError(2, "replaced since it was read", location) from None
    fs.invalidate_cache(stripped)
    return
  _either(location, os.remove, "rm_file")


def rmtree(location: str | os.PathLike) -> None:
  _either(location, shutil.rmtree, "rm", recursive=True)


def rename(source: str | os.PathLike, target: str | os.PathLike) -> None:
  """Renames a file or folder: atomic locally; on an object store a copy then a delete, so
  callers must not rely on atomicity there."""
  if not is_url(source) and not is_url(target):
    os.replace(source, target)
    return
  fs, stripped = filesystem(source)
  _, stripped_target = filesystem(target)
  fs.mv(stripped, stripped_target, recursive=True)
  fs.invalidate_cache()


def check_writable(path: str | os.PathLike, *, directory: bool = False,
                   what: Optional[str] = None) -> None:
  """Raises the OSError that writing `path` would meet, before any work is done.

  `eval` or `npov detect` would otherwise compute everything and then lose it to a read-only
  disk, a mistyped folder or a missing bucket. Nothing is created: a missing local path needs
  its nearest existing ancestor to accept a new file (probed with a temporary file, so a
  read-only file system, permissions and quotas all count, for root too).

  Args:
    path: The file (or, with `directory`, the folder it writes files into) a command writes.
    what: What `path` is (e.g. "MODEL_DIR"), for a one-line message naming it. Only then is a
      URL probed (a small object written and deleted: a missing bucket, credentials or
      permission, or an unreachable endpoint is told); otherwise it is left to its client.

  Raises:
    OSError: Without `what`: the `errno`, `strerror` and `filename` (= `path`) that writing
      would raise (PermissionError, IsADirectoryError, ...); with it one line "WHAT PATH: cause".
    ValueError: `path` is a symbolic link to nothing.
  """
  shown = os.fspath(path)
  if is_url(shown):
    if what is not None:
      _probe_bucket_folder(shown if directory else shown.rsplit("/", 1)[0], what)
    return
  import pathlib  # pylint: disable=g-import-not-at-top
  target = pathlib.Path(shown)
  if target.is_symlink() and not target.exists():
    raise ValueError(f"{shown} is a symbolic link to {os.readlink(shown)}, which does not "
                     "exist; create the target or give another path")
  if target.exists():
    if directory != target.is_dir():
      code = errno.ENOTDIR if directory else errno.EISDIR
      raise OSError(code, os.strerror(code), shown)
    if directory:
      _probe_directory(target, shown, what)
    elif target.is_file():  # Opened for writing, not truncated; a device or FIFO is left be.
      try:
        os.close(os.open(target, os.O_WRONLY))
      except OSError as error:
        _raise_as(error, shown, what)
    return
  ancestor = target.absolute().parent
  while not ancestor.exists() and ancestor != ancestor.parent:
    ancestor = ancestor.parent
  if not ancestor.is_dir():
    raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), shown)
  _probe_directory(ancestor, shown, what)


def _raise_as(error: OSError, path: str, what: Optional[str]) -> None:
  """Raises `error`'s kind naming `path`, as the user gave it."""
  if what is not None:
    raise PermissionError(f"{what} {path}: not writable") from None
  raise OSError(error.errno, error.strerror, path) from None


def _probe_directory(directory: Any, shown: str, what: Optional[str]) -> None:
  try:
    with tempfile.TemporaryFile(dir=directory):
      pass
  except OSError as error:
    _raise_as(error, shown, what)


def _probe_bucket_folder(folder: str, what: str) -> None:
  """Writes and deletes a small probe object in `folder`; one line naming `what` if refused."""
  import logging  # pylint: disable=g-import-not-at-top
  probe = join(folder, f".write_probe.{uuid.uuid4().hex[:12]}")
  client_log = logging.getLogger("gcsfs")
  level = client_log.level
  client_log.setLevel(logging.CRITICAL)  # Its traceback of the last retry: the line below says it.
  try:
    write_bytes(probe, b"")
    remove(probe)
  except Exception as e:  # pylint: disable=broad-except
    raise OSError(f"{what} {folder}: {describe_storage_error(e, folder)}") from None
  finally:
    client_log.setLevel(level)


def require_reachable(location: str | os.PathLike, what: str) -> None:
  """For a gs:// URL: raises one OSError naming `what` unless the storage endpoint answers at
  all (any HTTP reply) within three tries, instead of every request's retries and tracebacks
  (about 30 s each). Credentials and permissions are the clients' to report."""
  import time  # pylint: disable=g-import-not-at-top
  import urllib.error  # pylint: disable=g-import-not-at-top
  import urllib.request  # pylint: disable=g-import-not-at-top
  location = os.fspath(location)
  if scheme(location) != "gs":
    return
  endpoint = _http_url(os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com")
  error: Optional[BaseException] = None
  for attempt in range(3):
    if attempt:
      time.sleep(1.0)
    try:
      with urllib.request.urlopen(f"{endpoint.rstrip('/')}/storage/v1/b/x", timeout=10):
        return
    except urllib.error.HTTPError:
      return  # It answered.
    except (OSError, ValueError) as e:  # URLError, a refused connection, a timeout.
      error = e
  assert error is not None
  raise OSError(f"{what} {location}: {describe_storage_error(error, location)}") from None


_URL_IN_TEXT = re.compile(r"[a-z][a-z0-9+.-]*://\S+")


def describe_storage_error(error: BaseException, location: str) -> str:
  """The cause of an object-store failure in a few words (no traceback)."""
  text = f"{type(error).__name__}: {error}"
  # Status codes and words are read outside URLs and as whole numbers: a client's message is
  # often just the URL it called, whose port (e.g. 127.0.0.1:40397) may hold "403".
  lowered = _URL_IN_TEXT.sub(" ", text.lower())

  def has_status(code: int) -> bool:
    return re.search(rf"(?<![\d.:]){code}(?!\d)", lowered) is not None

  bucket = location.split("://", 1)[-1].split("/", 1)[0]
  endpoint = os.environ.get("STORAGE_EMULATOR_HOST")
  if isinstance(error, ImportError):
    return (f"the client for {scheme(location)}:// is not installed ({error.name}); "
            "pip install gcsfs (gs://) or s3fs (s3://)")
  if any(word in lowered for word in ("cannot connect", "connection refused", "name or service",
                                      "timeout", "timed out", "clientconnector", "unreachable")):
    where = f" {endpoint}" if endpoint else ""
    return f"the storage endpoint{where} is unreachable ({type(error).__name__})"
  if has_status(401) or any(word in lowered
                            for word in ("credential", "anonymous", "login required")):
    return ("no credentials: run `gcloud auth application-default login`, or set "
            "GOOGLE_APPLICATION_CREDENTIALS (on a Cloud TPU VM the VM's service account is used)")
  if has_status(403) or "forbidden" in lowered or "permission" in lowered or isinstance(
      error, PermissionError):
    return (f"permission denied: the credentials may not write to bucket {bucket} "
            "(needs roles/storage.objectAdmin)")
  if (has_status(404) or "not found" in lowered or "nosuchbucket" in lowered
      or isinstance(error, FileNotFoundError)):
    return f"bucket {bucket} does not exist (create it: gcloud storage buckets create gs://{bucket})"
  return text.splitlines()[0]


_DISK_FULL = {errno.ENOSPC: ("No space left on device", "os_error_code='28'"),
              errno.EFBIG: ("File too large", "os_error_code='27'"),
              errno.EDQUOT: ("Disk quota exceeded", "os_error_code='122'")}


def disk_full_errno(error: BaseException) -> Optional[int]:
  """ENOSPC, EFBIG or EDQUOT where `error` or what it wraps (TensorStore's messages, Orbax's
  thread errors) is a full disk, a file size limit or a quota; else None."""
  seen = 0
  while error is not None and seen < 16:
    if isinstance(error, OSError) and error.errno in _DISK_FULL:
      return error.errno
    text = str(error)
    for code, markers in _DISK_FULL.items():
      if any(marker in text for marker in markers):
        return code
    error = error.__cause__ or error.__context__
    seen += 1
  return None


def append_text(location: str | os.PathLike, text: str) -> None:
  """Appends to a text file; an object is rewritten whole (fine for small record files)."""
  if not is_url(location):
    with builtins.open(location, "a", encoding="utf-8") as f:
      f.write(text)
    return
  old = read_bytes(location) if isfile(location) else b""
  write_bytes(location, old + text.encode("utf-8"))


@functools.cache
def _process_folder() -> str:
  """This process's private local folder (`mkdtemp`: mode 0700), removed at exit."""
  import atexit  # pylint: disable=g-import-not-at-top
  folder = tempfile.mkdtemp(prefix="jaxmoral-objects-")
  atexit.register(shutil.rmtree, folder, ignore_errors=True)
  return folder


def local_folder_for(location: str | os.PathLike, suffix: str = "") -> str:
  """This process's local folder (made if missing) for `location`'s files that only local
  readers and writers handle (SentencePiece, safetensors)."""
  import hashlib  # pylint: disable=g-import-not-at-top
  folder = os.path.join(_process_folder(),
                        hashlib.sha256(os.fspath(location).encode()).hexdigest()[:16] + suffix)
  os.makedirs(folder, exist_ok=True)
  return folder


def local_copy(location: str | os.PathLike) -> str:
  """A local path with `location`'s content (for a URL a copy in `local_folder_for`)."""
  location = os.fspath(location)
  if not is_url(location):
    return location
  target = os.path.join(local_folder_for(location), basename(location))
  write_bytes(target, read_bytes(location))
  return target


def local_folder(location: str | os.PathLike) -> str:
  """A local folder with the files directly in `location` (a URL's copied to `local_folder_for`)."""
  location = os.fspath(location)
  if not is_url(location):
    return location
  folder = local_folder_for(location, "_dir")
  for name in listdir(location):
    source = join(location, name)
    if isfile(source):
      write_bytes(os.path.join(folder, name), read_bytes(source))
  return folder
