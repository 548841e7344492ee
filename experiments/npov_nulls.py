"""The nulls of `npov_table1.py` alone, with nothing trained (`npov_table1.run_null_check`).

ROUGE-1 and the salience and classifier pipelines on a randomly initialised model of the base's
config, scored on the experiment's PERSPECTRUM test examples against the input's and the
response's length: what every verdict of `npov_table1.py` must beat, measured where no trained
base is at hand.

  python experiments/npov_nulls.py --gin_file=configs/experiments/npov_table1_nulls_cpu.gin

Writes `<RESULTS_DIR>/<NAME>.md`, `.json` and `.png`.
"""

from __future__ import annotations

import sys

import experiment_lib as common  # noqa: F401  (puts the project root on sys.path)
import npov_table1  # pylint: disable=g-import-not-at-top,wrong-import-order

if __name__ == "__main__":
  sys.exit(common.main(npov_table1.run_null_check))
