"""The layout of a run directory (MODEL_DIR): the names of its files, described here only.

A run directory is self-describing: `eval`, `infer`, `export` and `api.Model.from_pretrained`
need nothing but its path. A local folder or gs://bucket/run (Orbax keeps checkpoints there:
`checkpoints.require_checkpoint_storage`)::

  train.lock              held while a run trains here (`run_dirs.RunDirLock`)
  config.gin              the operative gin config (`gin_utils.write_operative_config`)
  model_config.json       run file: the T5Config
  settings.json           run file: what the model and data add (e.g. Diamante's lengths)
  vocab/spiece.model      run file: the SentencePiece model (+ vocab/extra_ids.txt)
  _INTEGRITY.json         sizes and sha256 of the run files (`run_dirs.save_run_files`)
  software.jsonl          which code trained from which step (`software.record_start`)
  checkpoints/<step>/     Orbax checkpoints (`checkpoints.CheckpointManager`), each:
      state/              the whole state pytree (OCDBT/Zarr), e.g. a TrainState's step,
                          params, opt_state (static fields come from the restore target)
      extra/              a JSON dict (data position, reward normalisation, ...)
      _INTEGRITY.json     the step's checksums (`integrity`)
  checkpoints/_CHECKSUMMED.json   every later step carries checksums (`integrity`)
  data_position/<step>/process_<i>-of-<n>/   a streamed seqio split's tf.data position
  train/, eval/           TensorBoard event files (`metric_writers.MetricWriters`)
  eval_<step>.json        `jaxmoral eval`'s report
  prompt/                 a prompt-tuning run's soft prompt (`prompt_tuning`)
  reward_curve.json       a PPO run's learning curves (`rl.ppo_trainer`), drawn in .png
  data/                   a method's training pairs written for the run (ClarifyDelphi, NPOV)

An export (`params_export.export_params`) has params/ (the unboxed parameter tree) and
config.json (the T5Config) instead of checkpoints/ and model_config.json, the same vocab/ and
settings.json, and an _INTEGRITY.json of all of them.

This module imports nothing, so what reads runs without training them (the explorer) names
their files without starting JAX.
"""

LOCK_FILE = "train.lock"
CONFIG_FILE = "config.gin"
MODEL_CONFIG_FILE = "model_config.json"
SETTINGS_FILE = "settings.json"
VOCAB_DIR = "vocab"
SPIECE_FILE = "spiece.model"
EXTRA_IDS_FILE = "extra_ids.txt"
SOFTWARE_FILE = "software.jsonl"
CHECKPOINTS_DIR = "checkpoints"
DATA_POSITION_DIR = "data_position"
TENSORBOARD_DIRS = ("train", "eval")
REWARD_CURVE_FILE = "reward_curve.json"
PROMPT_DIR = "prompt"
EXPORT_CONFIG_FILE = "config.json"
EXPORT_PARAMS_DIR = "params"
# What a run's manifest (MODEL_DIR/_INTEGRITY.json) covers: what loading the run reads.
RUN_FILES = (MODEL_CONFIG_FILE, SETTINGS_FILE, VOCAB_DIR)
