"""The wheel (setup.py): an installed jaxmoral, without the checkout, runs the shipped configs.

One module-scoped build and install; the run is the README's quickstart train, shortened, from
an empty folder, so only the wheel's copies of configs/ and gin/ can be found.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from jaxmoral import gin_files

ROOT = gin_files.PROJECT_ROOT
# What building the wheel reads from a checkout.
SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md", "jaxmoral",
           "gin", "configs")

# Run with the installed package first on sys.path (asserted: not the checkout's): the command
# line given, then the Diamante config parsed, whose TRAIN_PATH names the package's demo data.
_RUN = """
import sys
import jaxmoral
assert jaxmoral.__file__.startswith(sys.argv[1]), jaxmoral.__file__
from jaxmoral import cli
status = cli.main(sys.argv[2:])
if status:
  sys.exit(status)
import gin
import jaxmoral.diamante.commands
from jaxmoral import gin_utils
gin.clear_config()
gin_utils.parse_gin(gin_utils.GinArgs(files=("configs/diamante/tiny_cpu.gin",),
                                      bindings=("MODEL_DIR = 'dm'",)))
print("TRAIN_PATH", gin.query_parameter("%TRAIN_PATH"))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
  """The wheel built from a copy of the checkout (the build writes build/ where it runs)."""
  source = tmp_path_factory.mktemp("source")
  for name in SOURCES:
    if (ROOT / name).is_dir():
      shutil.copytree(ROOT / name, source / name,
                      ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*_cache"))
    else:
      shutil.copy(ROOT / name, source / name)
  out = tmp_path_factory.mktemp("wheel")
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
                  "--no-build-isolation", "--wheel-dir", str(out), str(source)],
                 check=True, capture_output=True, text=True)
  (path,) = out.glob("jaxmoral-*.whl")
  return path


def test_the_wheel_ships_every_gin_file_of_the_checkout(wheel):
  shipped = {name.removeprefix("jaxmoral/shipped_configs/")
             for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".gin")}
  checkout = {str(path.relative_to(ROOT)) for folder in ("gin", "configs")
              for path in (ROOT / folder).rglob("*.gin")}
  assert shipped == checkout


def test_the_installed_wheel_trains_the_quickstart_config_from_an_empty_folder(wheel,
                                                                               tmp_path):
  target = tmp_path / "site"
  subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                  "--target", str(target), str(wheel)], check=True, capture_output=True)
  empty = tmp_path / "empty"
  empty.mkdir()
  # One CPU device, not the suite's 8: what is tested is where the files are found, and one
  # device compiles faster.
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f]
  env = {**os.environ, "PYTHONPATH": str(target), "XLA_FLAGS": " ".join(flags)}
  # The quickstart's config (its includes of gin/...) and a gin/ fragment on the command line.
  args = ["train", "--gin_file=configs/core/tiny_cpu.gin",
          "--gin_file=gin/partitioning/data_parallel.gin", "--gin.MODEL_DIR='run'",
          "--gin.TRAIN_STEPS=2", "--gin.CHECKPOINT_EVERY=2", "--gin.EVAL_EVERY=2",
          "--gin.BATCH_SIZE=8", "--gin.WARMUP_STEPS=1",
          "--gin.config.t5_config.num_encoder_layers=1",
          "--gin.config.t5_config.num_decoder_layers=1"]
  proc = subprocess.run([sys.executable, "-c", _RUN, str(target), *args], cwd=empty, env=env,
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (empty / "run" / "config.gin").is_file()
  assert "TRAIN_STEPS = 2" in (empty / "run" / "config.gin").read_text()
  (train_path,) = [line.split(" ", 1)[1] for line in proc.stdout.splitlines()
                   if line.startswith("TRAIN_PATH ")]
  assert train_path == str(target / "jaxmoral/data/demo/dialogues_train.jsonl")
