"""Tests for jaxmoral.progress: the lines long loops log (count, share, rate, ETA; throttled)."""

import logging

import pytest

from jaxmoral import progress


def test_progress_lines_rate_eta_and_throttle(monkeypatch, caplog):
  clock = [100.0]
  monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
  shown = progress.ProgressLog("salience examples", 10, every_s=30)
  with caplog.at_level(logging.INFO, logger="jaxmoral.progress"):
    clock[0] = 110.0
    assert shown.update(2) is None  # 10 s since the start: under every_s
    clock[0] = 140.0
    # 4 done in 40 s: 0.1/s, 6 left: 60 s.
    assert shown.update(4) == "salience examples: 4/10 (40 %) 0.1/s ETA 0:01:00"
    clock[0] = 150.0
    assert shown.update(5) is None  # 10 s since the last line
    clock[0] = 150.5
    assert shown.update(10) == "salience examples: 10/10 (100 %) 0.198/s ETA 0:00:00"  # last
  assert [r.getMessage() for r in caplog.records] == [
      "salience examples: 4/10 (40 %) 0.1/s ETA 0:01:00",
      "salience examples: 10/10 (100 %) 0.198/s ETA 0:00:00"]


def test_progress_without_a_rate_and_bad_total(monkeypatch):
  monkeypatch.setattr(progress.time, "monotonic", lambda: 5.0)
  assert progress.ProgressLog("x", 0).update(0) == "x: 0/0 nan/s ETA ?"
  assert progress.format_seconds(float("inf")) == "?"
  assert progress.format_seconds(3725.9) == "1:02:05"
  with pytest.raises(ValueError, match="total must be >= 0"):
    progress.ProgressLog("x", -1)


def test_work_shorter_than_min_total_logs_nothing(monkeypatch, caplog):
  clock = [0.0]
  monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
  with caplog.at_level(logging.INFO, logger="jaxmoral.progress"):
    quick = progress.ProgressLog("stages", 3, every_s=30, min_total_s=30)
    clock[0] = 29.0
    assert quick.update(3) is None  # Done in 29 s: silent, the end included.
    slow = progress.ProgressLog("stages", 3, every_s=30, min_total_s=30)
    clock[0] = 70.0
    assert slow.update(1) == "stages: 1/3 (33 %) 0.0244/s ETA 0:01:22"
    clock[0] = 75.0
    assert slow.update(3) == "stages: 3/3 (100 %) 0.0652/s ETA 0:00:00"
  assert len(caplog.records) == 2
