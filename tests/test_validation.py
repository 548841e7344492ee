"""validation.positive_int and non_negative_int: the one count check each that the configs and
entry functions share."""

import pytest

from jaxmoral import decoding, metrics, validation
from jaxmoral.models.config import t5_config


@pytest.mark.parametrize("value", [0, -1, 1.0, "2", None, True])
def test_positive_int_names_the_field_and_the_value(value):
  with pytest.raises(ValueError) as error:
    validation.positive_int(value, "Owner.field")
  assert str(error.value) == f"Owner.field must be a positive int, got {value!r}"


def test_positive_int_accepts_positive_ints():
  for value in (1, 7, 2**40):
    validation.positive_int(value, "Owner.field")


@pytest.mark.parametrize("value", [-1, 0.0, "0", None, False])
def test_non_negative_int_names_the_field_and_the_value(value):
  with pytest.raises(ValueError) as error:
    validation.non_negative_int(value, "Owner.field")
  assert str(error.value) == f"Owner.field must be an int >= 0, got {value!r}"


def test_non_negative_int_accepts_zero_and_positive_ints():
  for value in (0, 1, 2**40):
    validation.non_negative_int(value, "Owner.field")


@pytest.mark.parametrize("make, message", [
    (lambda: decoding.SampleConfig(max_decode_length=4, top_k=-1),
     "SampleConfig.top_k must be an int >= 0, got -1"),
    (lambda: decoding.BeamSearchConfig(beam_size=2, max_decode_length=4, eos_id=True),
     "BeamSearchConfig.eos_id must be an int >= 0, got True"),
    (lambda: decoding.SampleConfig(max_decode_length=4, num_samples=True),
     "SampleConfig.num_samples must be a positive int, got True"),
    (lambda: decoding.BeamSearchConfig(beam_size=0, max_decode_length=4),
     "BeamSearchConfig.beam_size must be a positive int, got 0"),
    (lambda: t5_config(size="tiny", d_model=0), "T5Config.d_model must be a positive int, got 0"),
    (lambda: metrics.distinct_n(["a b"], 0), "distinct_n: n must be a positive int, got 0"),
])
def test_configs_use_it(make, message):
  with pytest.raises(ValueError) as error:
    make()
  assert str(error.value).splitlines()[0] == message  # gin may add a line naming the call
