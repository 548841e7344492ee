"""jaxmoral.software: versions, the commit of the checkout, the multi-host fingerprint, and
`jaxmoral --version`."""

import importlib.metadata
import shutil

import flax
import jax
import pytest

from conftest import git
from jaxmoral import cli
from jaxmoral import software

def test_versions_are_the_installed_ones():
  found = software.versions()
  assert found["jax"] == jax.__version__ and found["flax"] == flax.__version__
  assert found["jaxmoral"] == importlib.metadata.version("jaxmoral")
  assert set(found) == {"jaxmoral", *software.LIBRARIES}


def test_source_commit_of_a_checkout_clean_and_modified(tmp_path):
  package = tmp_path / "repo" / "jaxmoral"
  package.mkdir(parents=True)
  (package / "__init__.py").write_text("x = 1\n")
  assert software.source_commit(package) == (None, False)  # no checkout: an installed copy
  git(tmp_path / "repo", "init", "-q")
  # A checkout that does not track the package (a project whose venv holds it): not ours.
  assert software.source_commit(package) == (None, False)
  git(tmp_path / "repo", "add", "-A")
  git(tmp_path / "repo", "commit", "-q", "-m", "one")
  head = git(tmp_path / "repo", "rev-parse", "HEAD")
  assert software.source_commit(package) == (head, False)
  (package / "__init__.py").write_text("x = 2\n")
  assert software.source_commit(package) == (head, True)


def test_describe_a_record():
  record = {"commit": "0123456789abcdef", "modified": True,
            "versions": {"jaxmoral": "0.1.0", "jax": "0.10.2", "jaxlib": "0.10.2",
                         "flax": None, "optax": "0.2.8", "orbax-checkpoint": "0.12.8"}}
  assert software.describe(record) == (
      "jaxmoral 0.1.0 (commit 0123456789ab, modified), jax 0.10.2, jaxlib 0.10.2, "
      "flax not installed, optax 0.2.8, orbax-checkpoint 0.12.8")
  assert software.describe({**record, "commit": None}).startswith("jaxmoral 0.1.0, jax ")


def test_fingerprint_follows_the_sources_and_the_versions(tmp_path, monkeypatch):
  package = tmp_path / "jaxmoral"
  shutil.copytree(software.PACKAGE_DIR / "rl", package / "rl")
  monkeypatch.setattr(software, "PACKAGE_DIR", package)
  first = software.fingerprint()
  assert f"jax=={jax.__version__}" in first.split()
  assert software.fingerprint() == first
  (package / "rl" / "ppo.py").write_text((package / "rl" / "ppo.py").read_text() + "# edit\n")
  edited = software.fingerprint()
  assert edited != first
  monkeypatch.setattr(software, "versions",
                      lambda: {name: "9" for name in ("jaxmoral", *software.LIBRARIES)})
  assert software.fingerprint() != edited  # another jax on that host


def test_version_flag(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--version"])
  assert exit_info.value.code == 0
  assert capsys.readouterr().out == software.describe() + "\n"


def test_record_start_appends(tmp_path):
  first = software.record_start(tmp_path, step=0)
  software.record_start(tmp_path, step=300)
  records = software.read_records(tmp_path)
  assert [r["step"] for r in records] == [0, 300] and records[0] == first
  assert first["versions"] == software.versions()
  assert (first["commit"], first["modified"]) == software.source_commit()
