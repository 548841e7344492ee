"""Tests for jaxmoral.data.pairs: the held-out split of a pairs file."""

import zlib

import numpy as np
import pytest

from jaxmoral.data import pairs as pairs_lib


def test_split_pairs_holds_out_by_hash_whatever_the_order():
  """"hash" holds out the pairs whose crc32 is 0 mod 10 (zlib reference), the same pairs in
  any order; a file alternating labels gets both in its held-out set (by position: one only);
  "position" is every 10th pair from the first."""
  pairs = [(f"input {i}", "yes" if i % 2 else "no") for i in range(2000)]
  split = pairs_lib.split_pairs(pairs)
  want = [p for p in pairs if zlib.crc32(f"{p[0]}\t{p[1]}".encode()) % 10 == 0]
  assert split["validation"] == want and 150 < len(want) < 250  # 200 +- 3.5 sigma
  assert split["train"] == [p for p in pairs if p not in set(want)]
  shuffled = [pairs[i] for i in np.random.default_rng(0).permutation(len(pairs))]
  assert set(pairs_lib.split_pairs(shuffled)["validation"]) == set(want)
  assert {t for _, t in want} == {"yes", "no"}
  by_position = pairs_lib.split_pairs(pairs, rule="position")
  assert by_position["validation"] == pairs[::10] and {t for _, t in pairs[::10]} == {"no"}
  # A pair keeps its side when pairs are added.
  more = pairs_lib.split_pairs(pairs + [(f"extra {i}", "yes") for i in range(100)])
  assert set(want) <= set(more["validation"])
  # Two or more pairs always hold one out.
  for n in range(2, 12):
    few = pairs_lib.split_pairs(pairs[:n])
    assert few["validation"] and len(few["train"]) + len(few["validation"]) == n
  with pytest.raises(ValueError, match="rule must be one of"):
    pairs_lib.split_pairs(pairs, rule="random")
