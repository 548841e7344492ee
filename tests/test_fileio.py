"""fileio.check_writable: the one check that a local path or bucket URL can be written."""

import errno
import os
import tempfile

import pytest

from jaxmoral import fileio, run_dirs


@pytest.fixture
def unwritable_folder(tmp_path):
  """A folder no new file can be made in (root ignores permissions: then /sys)."""
  folder = tmp_path / "read_only"
  folder.mkdir()
  folder.chmod(0o555)
  try:
    for candidate in (folder, "/sys"):
      try:
        with tempfile.TemporaryFile(dir=candidate):
          pass
      except OSError:
        yield str(candidate)
        return
  finally:
    folder.chmod(0o755)
  pytest.skip("no read-only folder on this machine")


def test_an_unwritable_output_raises_what_writing_would_naming_the_path(unwritable_folder):
  path = os.path.join(unwritable_folder, "new", "out.jsonl")
  with pytest.raises(OSError) as raised:
    fileio.check_writable(path)
  assert raised.value.filename == path and raised.value.errno in (errno.EACCES, errno.EROFS)
  assert not os.path.exists(os.path.dirname(path))  # Nothing created.
  with pytest.raises(PermissionError, match=rf"^MODEL_DIR {path}: not writable$"):
    fileio.check_writable(path, directory=True, what="MODEL_DIR")
  with pytest.raises(PermissionError, match=r"^MODEL_DIR .*/run: not writable$"):
    run_dirs.make_run_dir(os.path.join(unwritable_folder, "run"))


def test_a_file_for_a_folder_and_a_folder_for_a_file_are_refused(tmp_path):
  a_file = tmp_path / "file"
  a_file.write_text("")
  with pytest.raises(NotADirectoryError):
    fileio.check_writable(a_file, directory=True)
  with pytest.raises(IsADirectoryError):
    fileio.check_writable(tmp_path)
  fileio.check_writable(a_file)  # An existing writable file, left as it is.
  assert a_file.read_text() == ""
  fileio.check_writable(tmp_path / "a" / "b" / "c.txt")
  assert not (tmp_path / "a").exists()
  run = tmp_path / "run"
  assert run_dirs.make_run_dir(run) == str(run) and run.is_dir()


def test_a_url_is_probed_only_when_named(monkeypatch):
  written = []
  monkeypatch.setattr(fileio, "write_bytes", lambda path, data: written.append(path))
  monkeypatch.setattr(fileio, "remove", lambda path: None)
  fileio.check_writable("gs://bucket/run/out.jsonl")  # Left to its client.
  assert written == []
  fileio.check_writable("gs://bucket/run/out.jsonl", what="output")
  fileio.check_writable("gs://bucket/run", directory=True, what="MODEL_DIR")
  assert [path.rsplit("/", 1)[0] for path in written] == ["gs://bucket/run"] * 2


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_text_writers_versions_and_local_folders_work_on_both_kinds_of_path(where, gcs,
                                                                           tmp_path):
  del gcs
  base = str(tmp_path) if where == "local" else "gs://bucket/fileio_writer"
  path = fileio.join(base, "nested", "transcript.jsonl")  # A missing folder is made.
  with fileio.open_text_writer(path) as out:
    out.write('{"turn": 1}\n')
    out.flush()  # What a chat does after each turn.
    out.write('{"turn": 2}\n')
  assert fileio.read_text(path) == '{"turn": 1}\n{"turn": 2}\n'
  # A file's version changes when it is rewritten, even to the same size.
  before = fileio.version(path)
  assert before[0] == len('{"turn": 1}\n{"turn": 2}\n')
  fileio.write_text(path, '{"turn": 3}\n{"turn": 4}\n')
  assert fileio.version(path) != before and fileio.version(path)[0] == before[0]
  folder = fileio.local_folder_for(path)
  assert os.path.isdir(folder) and folder == fileio.local_folder_for(path)
  assert not os.path.exists("gs:")


def test_urls_go_through_fsspec_even_after_another_library_used_epath_first(gcs):
  """etils picks TensorFlow's client for URLs once per process, at the first path it sees of
  any kind: a process that opened a local checkpoint with Orbax before its first bucket file
  (an export of a local run to gs://) must still read and list the bucket through fsspec."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  del gcs
  code = ("from etils import epath\n"
          "epath.Path('/tmp').exists()\n"  # As Orbax does with a local folder.
          "from jaxmoral import fileio\n"
          "fileio.write_text('gs://bucket/fileio_order/a.txt', 'x')\n"
          "assert fileio.read_text('gs://bucket/fileio_order/a.txt') == 'x'\n"
          "print(sorted(p.name for p in fileio.path('gs://bucket/fileio_order').glob('*.txt')))\n")
  env = {k: v for k, v in os.environ.items() if k != "EPATH_USE_TF"}
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=120, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == "['a.txt']"


def test_a_bucket_file_read_line_by_line_is_fetched_once(gcs, monkeypatch):
  """fsspec's own readline reads a whole block per line and seeks back: reading an object
  line by line moved (lines x block) bytes, minutes for a 15 MB JSONL. Through fileio.open the
  bytes read from the object are about its size."""
  import fsspec  # pylint: disable=g-import-not-at-top
  from jaxmoral.data import readers  # pylint: disable=g-import-not-at-top
  url = "gs://bucket/line_by_line/pairs.jsonl"
  rows = [{"inputs": f"situation {i} " * 8, "targets": f"question {i}?"} for i in range(20000)]
  readers.write_jsonl(url, rows)
  size = fileio.getsize(url)
  moved = []
  read = fsspec.spec.AbstractBufferedFile.read
  monkeypatch.setattr(fsspec.spec.AbstractBufferedFile, "read",
                      lambda self, length=-1: moved.append(len(out := read(self, length))) or out)
  assert [r["targets"] for r in readers.read_jsonl(url, required=["targets"])] == [
      r["targets"] for r in rows]
  with fileio.open(url) as f:  # Text mode too.
    assert sum(1 for _ in f) == len(rows)
  assert sum(moved) <= 2 * size + (2 << 20), (sum(moved), size)


@pytest.mark.parametrize("last", [b"\r", b"\n", b"\r\n", b"x"])
def test_an_upload_is_stored_byte_for_byte_whatever_its_last_byte(gcs, tmp_path, last):
  """The bucket stand-in keeps every byte of a small (multipart) upload: the emulator's own
  parser dropped a final carriage return, which damaged one checkpoint file in 256."""
  del gcs
  data = bytes(range(256)) + last
  local = tmp_path / "weights"
  local.write_bytes(data)
  fileio.upload(local, f"gs://bucket/fileio_bytes/{len(last)}{last[-1]}")
  assert fileio.read_bytes(f"gs://bucket/fileio_bytes/{len(last)}{last[-1]}") == data
  fileio.write_bytes(f"gs://bucket/fileio_bytes/written{last[-1]}", data)
  assert fileio.read_bytes(f"gs://bucket/fileio_bytes/written{last[-1]}") == data


@pytest.mark.parametrize("port", [40397, 40197, 40497, 8080])
def test_a_storage_error_is_read_by_its_status_not_by_digits_in_its_url(port):
  """A client's error is often just the URL it called: a port holding "403" or "401" is not
  a refusal, and a missing bucket is told as one whatever the port."""
  url = f"http://127.0.0.1:{port}/upload/storage/v1/b/no-such-bucket/o"
  assert fileio.describe_storage_error(FileNotFoundError(url), "gs://no-such-bucket/run") == (
      "bucket no-such-bucket does not exist (create it: gcloud storage buckets create "
      "gs://no-such-bucket)")
  forbidden = fileio.describe_storage_error(OSError(f"Forbidden: {url}\ndenied"), "gs://b/run")
  assert forbidden.startswith("permission denied: the credentials may not write to bucket b")
  assert fileio.describe_storage_error(
      RuntimeError(f"HTTP 401 from {url}: Anonymous caller"), "gs://b/run").startswith(
          "no credentials")
  assert fileio.describe_storage_error(RuntimeError(f"{url} answered 403"), "gs://b/run") \
      .startswith("permission denied")
