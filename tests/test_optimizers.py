"""Schedule and optimizer argument errors name the argument, its gin macro and the real cause."""

import gin
import numpy as np
import pytest

from jaxmoral import gin_utils, optimizers


def _first_line(error: pytest.ExceptionInfo) -> str:
  # gin adds lines naming the configurable ("In call to configurable ...") after ours.
  return str(error.value).splitlines()[0]


pytestmark = pytest.mark.usefixtures("clean_gin")


@pytest.mark.parametrize("kwargs, error, message", [
    # A mistyped --gin.TRAIN_STEPS=abc reaches total_steps as a string.
    (dict(total_steps="abc", warmup_steps=30), TypeError,
     "make_schedule: total_steps must be a positive int (TRAIN_STEPS), got 'abc'"),
    # TRAIN_STEPS=0 (with or without a warm-up) is a bad run length, not a bad warm-up.
    (dict(total_steps=0, warmup_steps=0), ValueError,
     "make_schedule: total_steps must be a positive int (TRAIN_STEPS), got 0"),
    (dict(total_steps=0, warmup_steps=30), ValueError,
     "make_schedule: total_steps must be a positive int (TRAIN_STEPS), got 0"),
    (dict(total_steps=1e4, warmup_steps=30), TypeError,
     "make_schedule: total_steps must be a positive int (TRAIN_STEPS), got 10000.0"),
    (dict(total_steps=100, warmup_steps="30"), TypeError,
     "make_schedule: warmup_steps must be an int >= 0 (WARMUP_STEPS), got '30'"),
    (dict(total_steps=100, warmup_steps=0), ValueError,
     "make_schedule: 'warmup_linear_decay' needs warmup_steps > 0 (WARMUP_STEPS), got 0"),
    (dict(total_steps=20, warmup_steps=30), ValueError,
     "make_schedule: 'warmup_linear_decay' needs total_steps (TRAIN_STEPS) > warmup_steps "
     "(WARMUP_STEPS), got total_steps=20 and warmup_steps=30"),
    (dict(total_steps=100, warmup_steps=30, base_learning_rate="3e-3"), TypeError,
     "make_schedule: base_learning_rate must be a number >= 0 (LEARNING_RATE), got '3e-3'"),
])
def test_schedule_errors_name_the_argument_and_macro(kwargs, error, message):
  kwargs = {"name": "warmup_linear_decay", "base_learning_rate": 1e-3, **kwargs}
  with pytest.raises(error) as info:
    optimizers.make_schedule(**kwargs)
  assert _first_line(info) == message


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(learning_rate="abc"), TypeError,
     "make_optimizer: learning_rate must be a number >= 0 (LEARNING_RATE or "
     "PPO_LEARNING_RATE), got 'abc'"),
    (dict(learning_rate=-1.0), ValueError,
     "make_optimizer: learning_rate must be >= 0 (LEARNING_RATE or PPO_LEARNING_RATE), got -1.0"),
    (dict(learning_rate=1e-3, weight_decay="0.1"), TypeError,
     "make_optimizer: weight_decay must be a number >= 0, got '0.1'"),
    (dict(learning_rate=1e-3, grad_clip_norm=0.0), ValueError,
     "make_optimizer: grad_clip_norm must be > 0, got 0.0"),
])
def test_optimizer_errors_name_the_argument(kwargs, error, message):
  with pytest.raises(error) as info:
    optimizers.make_optimizer(name="adamw", **kwargs)
  assert _first_line(info) == message


def test_numbers_of_any_kind_are_numbers_and_strings_are_not():
  # NumPy integers and scalar arrays are numbers as much as Python's; a NumPy string is not.
  schedule = optimizers.make_schedule(name="warmup_linear_decay",
                                      base_learning_rate=np.float32(0.1),
                                      warmup_steps=np.int64(5), total_steps=np.int32(15))
  assert float(schedule(5)) == pytest.approx(0.1)
  opt = optimizers.make_optimizer(name="sgd", learning_rate=np.asarray(0.5), weight_decay=0)
  assert float(opt.learning_rate(0)) == 0.5
  with pytest.raises(TypeError) as info:
    optimizers.make_optimizer(name="sgd", learning_rate=np.str_("0.5"))
  assert _first_line(info).startswith("make_optimizer: learning_rate must be a number >= 0")


@pytest.mark.parametrize("flags, error, message", [
    (["--gin.TRAIN_STEPS=abc"], TypeError,
     "make_schedule: total_steps must be a positive int (TRAIN_STEPS), got 'abc'"),
    (["--gin.TRAIN_STEPS=0", "--gin.WARMUP_STEPS=0"], ValueError,
     "make_schedule: total_steps must be a positive int (TRAIN_STEPS), got 0"),
])
def test_bad_train_steps_flag_through_gin_names_the_flag(flags, error, message):
  # configs/core/tiny_cpu.gin binds make_schedule from TRAIN_STEPS and WARMUP_STEPS
  # (gin/optimizers/adamw_warmup_linear.gin), as the CLI parses it.
  gin_args, _ = gin_utils.split_gin_args(["--gin_file=configs/core/tiny_cpu.gin",
                                          "--gin.MODEL_DIR=/tmp/unused", *flags])
  gin_utils.parse_gin(gin_args)
  with pytest.raises(error) as info:
    gin.query_parameter("%OPTIMIZER").scoped_configurable_fn()
  assert _first_line(info) == message
