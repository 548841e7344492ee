"""jaxmoral.token_rows: the one EOS convention and the one bucketing rule, against direct
re-computations."""

import numpy as np
import pytest

from jaxmoral import token_rows


def test_text_ids_stop_at_first_eos_and_drop_padding():
  assert token_rows.text_ids([5, 0, 7, 1, 9, 1, 0], eos_id=1) == [5, 7]  # 0 emitted mid-row.
  assert token_rows.text_ids(np.array([[4, 3, 0, 0]]), eos_id=1) == [4, 3]  # No EOS.
  assert token_rows.text_ids([2, 8, 1], eos_id=8) == [2]
  assert token_rows.text_ids([], eos_id=1) == []


def test_emitted_lengths_match_a_loop_over_each_row():
  rows = np.random.default_rng(0).integers(0, 4, (3, 5, 7))
  want = np.zeros(rows.shape[:-1], np.int32)
  for index in np.ndindex(*rows.shape[:-1]):
    row = list(rows[index])
    want[index] = row.index(1) + 1 if 1 in row else len(row)
  got = token_rows.emitted_lengths(rows, eos_id=1)
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("minimum", [1, 8, 12, 64])
def test_bucket_is_the_smallest_power_of_two_multiple(minimum):
  for n in range(0, 300):
    size = token_rows.bucket(n, minimum)
    powers = [minimum * 2 ** k for k in range(12)]
    assert size == min(p for p in powers if p >= n)


def test_bucket_refuses_a_minimum_below_one():
  with pytest.raises(ValueError, match="minimum must be >= 1"):
    token_rows.bucket(3, 0)


@pytest.mark.parametrize("batch", [None, 5])
def test_padded_rows_are_the_ids_from_the_left_then_zeros(batch):
  rows = [[3, 4, 5], [], [7], [9, 9, 9, 9]]
  got = token_rows.padded(rows, 6, batch)
  want = np.zeros((batch or len(rows), 6), np.int32)
  for i, row in enumerate(rows):
    for j, token in enumerate(row):
      want[i, j] = token
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, want)
