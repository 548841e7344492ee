"""s3:// against a local S3 server (moto's, from the package index): what jaxmoral keeps there.

jaxmoral's own files go through `fileio` (etils.epath on s3fs), so data files and folders,
Hugging Face folders, exports in Hugging Face's format and exclusive creates work on s3:// as
on gs://. Orbax keeps checkpoints on local folders and gs:// only (its OCDBT layout has no S3
path), so a MODEL_DIR, an Orbax export or a T5X checkpoint on s3:// is one line before any
work. The server speaks the S3 API on localhost; clients find it through AWS_ENDPOINT_URL,
the variable every AWS SDK reads.
"""

import os

import numpy as np
import pytest

from conftest import free_port, set_environment, upload_folder, write_hf_t5
from jaxmoral import cli, fileio, model_dirs, params_export
from jaxmoral.data import readers

BUCKET = "s3://bucket"


@pytest.fixture(scope="module")
def s3():
  """A moto S3 server on localhost with one bucket, `bucket`; clients configured for it."""
  moto_server = pytest.importorskip("moto.server")
  pytest.importorskip("s3fs")
  port = free_port()
  server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
  server.start()
  url = f"http://127.0.0.1:{port}"
  env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
         "AWS_DEFAULT_REGION": "us-east-1"}
  try:
    with set_environment(env):
      fs, _ = fileio.filesystem(BUCKET)
      fs.mkdir("bucket")
      yield url
  finally:
    server.stop()


def test_an_exclusive_create_is_conditional_on_s3(s3, monkeypatch):
  del s3
  import s3fs  # pylint: disable=g-import-not-at-top
  path = f"{BUCKET}/locks/holder.json"
  assert fileio.create_exclusive(path, b"first")
  # The race a check-then-write loses: the object appears between the check and the write.
  # The store itself refuses the second create (If-None-Match: *, HTTP 412).
  monkeypatch.setattr(s3fs.S3FileSystem, "_exists", _never_exists)
  monkeypatch.setattr(s3fs.S3FileSystem, "exists", lambda self, path, **kwargs: False)
  assert not fileio.create_exclusive(path, b"second")
  monkeypatch.undo()
  assert fileio.read_bytes(path) == b"first"


async def _never_exists(self, path, **kwargs):
  del self, path, kwargs
  return False


def test_data_files_and_folders_read_from_s3_as_local_ones(s3, tmp_path):
  del s3
  from jaxmoral.clarify import data  # pylint: disable=g-import-not-at-top
  from test_clarify_data import _data_folder  # pylint: disable=g-import-not-at-top
  local = _data_folder(tmp_path / "data")
  bucket = upload_folder(local, f"{BUCKET}/clarify_data")
  assert data.build_pairs("multitask", bucket) == data.build_pairs("multitask", str(local))
  tsv = f"{bucket}/delta_clarify/train.tsv"
  assert list(readers.read_tsv(tsv)) == list(readers.read_tsv(local / "delta_clarify" /
                                                              "train.tsv"))


def test_hugging_face_folders_load_from_and_export_to_s3(s3, tmp_path):
  del s3
  from jaxmoral.models import hf_import  # pylint: disable=g-import-not-at-top
  write_hf_t5(tmp_path / "hf", d_model=16, num_layers=1, vocab_size=64)
  local = model_dirs.load(tmp_path / "hf")
  loaded = model_dirs.load(upload_folder(tmp_path / "hf", f"{BUCKET}/hf"))
  assert loaded.info.format == "hf" and loaded.config == local.config
  hf_import.export_hf_t5(loaded.params, loaded.config, f"{BUCKET}/hf_export")
  exported = model_dirs.load(f"{BUCKET}/hf_export")
  for a, b in zip(_leaves(exported.params), _leaves(local.params), strict=True):
    np.testing.assert_array_equal(a, b)
  assert not os.path.exists("s3:")  # Nothing went to a local "s3:" folder.


def _leaves(tree):
  import jax  # pylint: disable=g-import-not-at-top
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_checkpoints_on_s3_are_one_line_before_any_work(s3, capsys, tmp_path):
  del s3
  import gin  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  try:
    rc = cli.main(["train", "--gin_file=configs/core/tiny_cpu.gin",
                   f"--gin.MODEL_DIR='{BUCKET}/run'"])
  finally:
    gin.clear_config()
  err = capsys.readouterr().err.strip().splitlines()
  assert rc != 0 and len(err) == 1, err
  assert f"MODEL_DIR {BUCKET}/run" in err[0] and "gs://" in err[0] and "Traceback" not in err[0]
  assert fileio.listdir(BUCKET) and not fileio.exists(f"{BUCKET}/run")  # Nothing written.
  for load in (lambda: params_export.load_params(f"{BUCKET}/export"),
               lambda: params_export.export_params({"w": np.ones(2)}, f"{BUCKET}/export")):
    with pytest.raises(ValueError, match=r"Orbax .* not on s3://"):
      load()
