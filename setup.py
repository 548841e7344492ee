"""Builds jaxmoral; the metadata is in setup.cfg.

The wheel also ships the project's gin fragments (gin/) and configs (configs/) inside the
package, under jaxmoral/shipped_configs/, as T5X ships its gin files inside `t5x`: an installed
jaxmoral then finds `--gin_file=configs/core/tiny_cpu.gin` or an include of
'gin/decoding/beam_search.gin' from any folder (`jaxmoral.gin_files.SHIPPED_ROOT`). An editable
install reads them from the checkout instead.
"""

import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

# The project folders of gin files, relative to this file and to the shipped folder.
CONFIG_FOLDERS = ("gin", "configs")
SHIPPED = "jaxmoral/shipped_configs"


class BuildWithConfigs(build_py):
  """build_py that also copies every .gin file of CONFIG_FOLDERS into the built package."""

  def run(self) -> None:
    super().run()
    if getattr(self, "editable_mode", False):
      return  # The checkout's files are read where they are.
    root = pathlib.Path(__file__).resolve().parent
    for folder in CONFIG_FOLDERS:
      for path in sorted((root / folder).rglob("*.gin")):
        target = pathlib.Path(self.build_lib, SHIPPED, path.relative_to(root))
        self.mkpath(str(target.parent))
        self.copy_file(str(path), str(target))


setup(cmdclass={"build_py": BuildWithConfigs})
