"""Readers for the project's tabular and JSON-lines data, with line-numbered errors.

Every reader returns a `ReadResult` (a list of dicts, each row's line in `.lines`). A malformed
row raises `DataError` naming the file, the 1-based physical line and the field
(`data/train.tsv:17: expected 4 columns, got 3 (field 'question')`), or with
`on_error="report"` is logged and collected, so a caller sees all problems at once; nothing is
dropped silently. Files are UTF-8; TSV and CSV fields may be quoted with `""` escapes. A TSV
row is one line, as seqio and T5X read TSVs (a quote left open is an error of its line, not a
field swallowing the lines after it); a CSV field may span lines (RFC 4180).
"""

from __future__ import annotations

import csv
import difflib
import json
import logging
import os
from typing import IO, Any, Callable, Iterable, Iterator, Literal, Mapping, Optional, Sequence

from jaxmoral import fileio

OnError = Literal["raise", "report"]
PathLike = str | os.PathLike
Report = Callable[["DataError"], None]


class DataError(ValueError):
  """A malformed row: `"{path}:{line}: {what} (field '{field}')"` (`"{path}: ..."` for a file).

  Attributes:
    line: 1-based physical line where the bad row starts (0 for whole-file problems).
    field: The column / key at fault ("" when no single field is).
    what: The problem, without location.
  """

  def __init__(self, path: PathLike, line: int, what: str, field: str = ""):
    self.path = str(path)
    self.line = line
    self.field = field
    self.what = what
    where = f" (field '{field}')" if field else ""
    # Line 0 means the whole file; "file:0:" would read as a line number.
    super().__init__(f"{f'{self.path}:{line}' if line else self.path}: {what}{where}")


class UnknownFieldError(DataError):
  """A key or header column the reader does not know, e.g.
  `"f.jsonl:3: unknown field 'pros' (did you mean 'pro'?); known fields: con, pro, query"`.

  Attributes:
    known: The known names (sorted).
    suggestion: The closest known name, or None when none is close.
  """

  def __init__(self, path: PathLike, line: int, field: str, known: Iterable[str], *,
               kind: str = "field"):
    self.known = tuple(sorted(set(known)))
    leaf = field.rsplit(".", 1)[-1]  # Nested keys ("conversation[1].x") match on the last part.
    close = difflib.get_close_matches(leaf, self.known, n=1, cutoff=0.6)
    self.suggestion = close[0] if close else None
    hint = f" (did you mean '{self.suggestion}'?)" if self.suggestion else ""
    super().__init__(path, line, f"unknown {kind} '{field}'{hint}; known {kind}s: "
                     f"{', '.join(self.known)}")
    self.field = field


def unknown_field(obj: Iterable[str], known: Iterable[str], path: PathLike, line: int, *,
                  prefix: str = "", kind: str = "field") -> Optional[UnknownFieldError]:
  """The error of the first key of `obj` (a mapping or names) not in `known`, or None.

  `prefix` goes before the key in the message (`"conversation[1]."`). A caller that also checks
  required keys reports an unknown key with a `suggestion` first (the likely typo of a required
  one), then a missing required key, then any other unknown key, as `read_jsonl` does.
  """
  known = set(known)
  return next((UnknownFieldError(path, line, f"{prefix}{key}", known, kind=kind)
               for key in obj if key not in known), None)


class ReadResult(list):
  """The rows read (a list of dicts), with `lines` (where each row starts) and `errors` (the
  DataErrors of report mode)."""

  def __init__(self, rows: Sequence[dict[str, Any]] = (), errors: Sequence[DataError] = (),
               lines: Optional[Sequence[int]] = None):
    super().__init__(rows)
    self.errors: list[DataError] = list(errors)
    self.lines: list[int] = list(lines) if lines is not None else []


class _Collector:
  """Raises or records errors according to `on_error`."""

  def __init__(self, on_error: OnError):
    if on_error not in ("raise", "report"):
      raise ValueError(f"on_error must be 'raise' or 'report', got {on_error!r}")
    self.on_error = on_error
    self.errors: list[DataError] = []

  def __call__(self, error: DataError) -> None:
    if self.on_error == "raise":
      raise error
    logging.warning("skipping bad row: %s", error)
    self.errors.append(error)


def _required_error(row: dict[str, Any], required: Sequence[str], path: PathLike,
                    line: int) -> Optional[DataError]:
  """The first required field that is missing or empty (null, blank text, [] or {})."""
  for name in required:
    if name not in row:
      return DataError(path, line, "missing required field", name)
    value = row[name]
    if value is None or (isinstance(value, (list, dict)) and not value) or (
        isinstance(value, str) and not value.strip()):
      return DataError(path, line, "empty value", name)
  return None


def _text_error(obj: dict[str, Any], text: Sequence[str], path: PathLike,
                line: int) -> Optional[DataError]:
  """The first of the `text` fields present whose value is not a JSON string."""
  for name in text:
    if name in obj and not isinstance(obj[name], str):
      return DataError(path, line, f"expected a string, got {json.dumps(obj[name])[:40]}", name)
  return None


def _utf8_lines(f: IO[bytes], path: PathLike) -> Iterator[tuple[int, str, Optional[DataError]]]:
  """(line number, text, error) per physical line, a byte-order mark dropped from the first.
  A line that is not UTF-8 comes with the error naming its first bad byte (and its text
  decoded with replacement characters)."""
  for number, raw in enumerate(f, start=1):
    try:
      text = raw.decode("utf-8")
      yield number, text.removeprefix("\ufeff") if number == 1 else text, None
    except UnicodeDecodeError as e:
      yield number, raw.decode("utf-8", errors="replace"), DataError(
          path, number, f"not UTF-8: byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line")


def _quote_error(error: csv.Error, unclosed: str) -> str:
  """The message of a row `csv` cannot parse; `unclosed`: that of a quote left open."""
  message = str(error)
  if "unexpected end of data" in message:
    return unclosed
  if "expected after" in message:
    return (f"text after a closing quote ({message}): quote the whole field and double the "
            f"quotes inside it")
  return f"unparsable row: {message}"


def _tsv_rows(lines: Iterator[tuple[int, str, Optional[DataError]]], path: PathLike,
              report: Report) -> Iterator[tuple[int, list[str]]]:
  """(line, values) of each line of a TSV; a line is one row."""
  for number, text, bad in lines:
    if bad is not None:
      report(bad)
      continue
    try:
      values = next(csv.reader([text], delimiter="\t", strict=True))
    except csv.Error as e:
      report(DataError(path, number, _quote_error(e, "a quoted field is not closed on its line "
                                                     "(a TSV row is one line; double a quote "
                                                     "inside a quoted field)")))
      continue
    yield number, values


def _csv_rows(lines: Iterator[tuple[int, str, Optional[DataError]]], path: PathLike,
              report: Report) -> Iterator[tuple[int, list[str]]]:
  """(first line, values) of each row of a CSV; a quoted field may span lines."""
  not_utf8: dict[int, DataError] = {}

  def texts() -> Iterator[str]:
    for number, text, bad in lines:
      if bad is not None:
        not_utf8[number] = bad
      yield text

  reader = csv.reader(texts(), delimiter=",", strict=True)
  # `reader.line_num` counts the physical lines read so far, so a row spanning lines ends at
  # it; remember where each row starts, for messages.
  start = 1
  while True:
    try:
      values = next(reader)
    except StopIteration:
      return
    except csv.Error as e:
      report(DataError(path, start, _quote_error(
          e, f"a quoted field opened on this line is never closed (it runs to the end of the "
             f"file, line {reader.line_num})")))
      start = reader.line_num + 1
      continue
    first, start = start, reader.line_num + 1
    bad = [not_utf8[n] for n in range(first, start) if n in not_utf8]
    if bad:
      report(bad[0])
      continue
    yield first, values


def json_object(path: PathLike, line: int, text: str) -> dict[str, Any] | DataError:
  """The JSON object of one line of `path`, or the DataError saying why it is none."""
  try:
    obj = json.loads(text)
  except json.JSONDecodeError as e:
    return DataError(path, line, f"invalid JSON: {e.msg} at column {e.colno}")
  if not isinstance(obj, dict):
    return DataError(path, line, f"expected a JSON object, got {type(obj).__name__}")
  return obj


def columns_row(header: Sequence[str], values: Sequence[str], path: PathLike,
                line: int) -> dict[str, str] | DataError:
  """`{column: value}` of a TSV or CSV row, or the DataError of a row of another width."""
  if len(values) == len(header):
    return dict(zip(header, values, strict=True))
  field = header[len(values)] if len(values) < len(header) else f"#{len(values)}"
  return DataError(path, line, f"expected {len(header)} columns, got {len(values)}", field)


def _no_rows_error(path: PathLike, what: str, bad: int) -> DataError:
  """The error of a file without good rows (`allow_empty=False`)."""
  what = f"no good rows: all {bad} rows are bad (each logged above)" if bad else what
  return DataError(path, 0, what)


def _read_delimited(path: PathLike, *, delimiter: str, columns: Optional[Sequence[str]],
                    required: Optional[Sequence[str]], optional: Optional[Sequence[str]],
                    allow_empty: bool, on_error: OnError) -> ReadResult:
  report = _Collector(on_error)

  def report_row(error: DataError) -> None:
    if error.line == 1:  # Whatever `on_error` says: without a header no row has names.
      raise DataError(path, 1, f"unparsable header: {error.what}")
    report(error)

  rows: list[dict[str, Any]] = []
  lines: list[int] = []
  split_rows = _tsv_rows if delimiter == "\t" else _csv_rows
  with fileio.open(path, "rb") as f:
    numbered_rows = split_rows(_utf8_lines(f, path), path, report_row)
    try:
      header_line, header = next(numbered_rows)
    except StopIteration:
      raise DataError(path, 0, "empty file (no header, no rows)") from None
    header = [h.strip() for h in header]
    # A misspelt column would otherwise be dropped (or read as a missing optional one).
    unknown = None if optional is None else unknown_field(
        header, [*(columns or ()), *(required or ()), *optional], path, header_line, kind="column")
    if unknown is not None and unknown.suggestion:  # The typo before the column it misses.
      raise unknown
    if columns is not None:
      missing = [c for c in columns if c not in header]
      if missing:
        raise DataError(path, header_line, f"header {header} lacks column(s) {missing}",
                        missing[0])
    if unknown is not None:
      raise unknown
    keep = None if columns is None else [
        *columns, *(c for c in optional or () if c in header and c not in columns)]
    required = list(columns if required is None and columns is not None else required or [])
    for line, values in numbered_rows:
      if not values:  # A blank line.
        continue
      row = columns_row(header, values, path, line)
      error = row if isinstance(row, DataError) else _required_error(row, required, path, line)
      if error is not None:
        report(error)
      elif isinstance(row, dict):
        rows.append(row if keep is None else {c: row[c] for c in keep})
        lines.append(line)
  if not rows and not allow_empty:
    raise _no_rows_error(path, f"has a header (line {header_line}) but no data rows",
                         len(report.errors))
  return ReadResult(rows, report.errors, lines)


def read_tsv(path: PathLike, *, columns: Optional[Sequence[str]] = None,
             required: Optional[Sequence[str]] = None,
             optional: Optional[Sequence[str]] = None, allow_empty: bool = True,
             on_error: OnError = "raise") -> ReadResult:
  """Reads a tab-separated file with a header row into a `ReadResult` of `{column: str}` dicts.

  Args:
    columns: Columns to keep (in this order); the header must contain them.
    required: Fields that must be non-empty (default: `columns`, or none).
    optional: Other columns the header may have (kept after `columns` when present). Given
      (even `()`), any other header column is an `UnknownFieldError` (a misspelt column would
      otherwise read as an absent one); None passes them through (dropped given `columns`).
    allow_empty: False: a file without data rows is a `DataError` naming the file.
    on_error: "raise" (first bad row raises `DataError`) or "report" (bad rows are logged and
      collected in the result's `errors`). Header problems always raise.
  """
  return _read_delimited(path, delimiter="\t", columns=columns, required=required,
                         optional=optional, allow_empty=allow_empty, on_error=on_error)


def read_csv(path: PathLike, *, columns: Optional[Sequence[str]] = None,
             required: Optional[Sequence[str]] = None,
             optional: Optional[Sequence[str]] = None, allow_empty: bool = True,
             on_error: OnError = "raise") -> ReadResult:
  """Reads a comma-separated file with a header row (RFC 4180 quoting). See `read_tsv`."""
  return _read_delimited(path, delimiter=",", columns=columns, required=required,
                         optional=optional, allow_empty=allow_empty, on_error=on_error)


def _read_lines(path: PathLike, parse: Callable[[int, str], dict[str, Any] | DataError], *,
                allow_empty: bool, on_error: OnError) -> ReadResult:
  """The rows `parse(line, text)` makes of a file's non-blank lines (a DataError: a bad row)."""
  report = _Collector(on_error)
  rows: list[dict[str, Any]] = []
  lines: list[int] = []
  with fileio.open(path, "rb") as f:
    for number, text, bad in _utf8_lines(f, path):
      row = bad or (parse(number, text) if text.strip() else None)
      if isinstance(row, DataError):
        report(row)
      elif row is not None:
        rows.append(row)
        lines.append(number)
  if not rows and not allow_empty:
    what = "empty file (no rows)" if fileio.getsize(path) == 0 else "no rows (only blank lines)"
    raise _no_rows_error(path, what, len(report.errors))
  return ReadResult(rows, report.errors, lines)


def read_lines(path: PathLike, *, allow_empty: bool = True,
               on_error: OnError = "raise") -> ReadResult:
  """Reads plain text: a row `{"text": line}` for each non-blank line, newline dropped.

  `allow_empty` and `on_error` as `read_tsv`'s (a line that is not UTF-8 is the only bad row).
  """
  return _read_lines(path, lambda _, text: {"text": text.rstrip("\r\n")},
                     allow_empty=allow_empty, on_error=on_error)


def read_jsonl(path: PathLike, *, required: Optional[Sequence[str]] = None,
               text: Sequence[str] = (), optional: Optional[Sequence[str]] = None,
               allow_empty: bool = True, on_error: OnError = "raise") -> ReadResult:
  """Reads one JSON object per line (blank lines are skipped).

  Args:
    required: Keys every object must have with a non-empty value (not `""`, `[]`, `{}`, null).
    text: Keys whose values, where present, must be JSON strings (not a list or a number).
    optional: The other keys an object may have. Given (even `()`), any other key is an
      `UnknownFieldError` of its line (one close to a known key before a missing required
      key, as the typo it likely is); None passes unknown keys through.
    allow_empty: False: a file without objects is a `DataError` naming the file.
    on_error: See `read_tsv`.
  """
  known = None if optional is None else [*(required or ()), *text, *optional]

  def parse(number: int, line: str) -> dict[str, Any] | DataError:
    obj = json_object(path, number, line)
    if isinstance(obj, DataError):
      return obj
    unknown = unknown_field(obj, known, path, number) if known is not None else None
    # A misspelt key is reported as the typo, before the missing key it stands for.
    typo = unknown if unknown is not None and unknown.suggestion else None
    error = typo or _required_error(obj, required or (), path, number) or unknown or (
        _text_error(obj, text, path, number))
    return obj if error is None else error

  return _read_lines(path, parse, allow_empty=allow_empty, on_error=on_error)


def write_jsonl(path: PathLike, rows: Iterable[Mapping[str, Any]]) -> str:
  """Writes one JSON object a line (UTF-8, non-ASCII kept), creating the folder; returns the
  path. The counterpart of `read_jsonl`."""
  fileio.makedirs(os.path.dirname(fileio.abspath(path)) or ".")
  with fileio.open(path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(dict(row), ensure_ascii=False) + "\n")
  return os.fspath(path)
