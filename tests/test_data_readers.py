"""Tests for jaxmoral.data.readers: line-numbered errors, report mode, quoting."""

import json
import logging

import pytest

from jaxmoral.data import readers
from jaxmoral.data.readers import DataError


def _write(tmp_path, name, text):
  p = tmp_path / name
  p.write_text(text, encoding="utf-8")
  return p


def test_tsv_reads_rows_and_quoted_fields(tmp_path):
  p = _write(tmp_path, "a.tsv",
             'id\tsource\tsituation\tquestion\n'
             '1\tMTurk\t"He says ""hi"" loudly."\tWho?\n'
             '2\tMTurk\tplain, with comma\tWhy?\n')
  rows = readers.read_tsv(p, columns=["id", "situation", "question"])
  assert rows == [{"id": "1", "situation": 'He says "hi" loudly.', "question": "Who?"},
                  {"id": "2", "situation": "plain, with comma", "question": "Why?"}]
  assert rows.errors == []


def test_tsv_wrong_column_count_names_line_and_field(tmp_path):
  p = _write(tmp_path, "b.tsv", "a\tb\tc\n1\t2\t3\n4\t5\n")
  with pytest.raises(DataError) as e:
    readers.read_tsv(p)
  assert (e.value.path, e.value.line, e.value.field) == (str(p), 3, "c")
  assert str(e.value) == f"{p}:3: expected 3 columns, got 2 (field 'c')"
  assert isinstance(e.value, ValueError)


def test_line_numbers_count_physical_lines_of_multiline_fields(tmp_path):
  # Row 1 spans lines 2-3 (a quoted newline); the bad row starts on line 4.
  p = _write(tmp_path, "c.csv", 'input,output\n"two\nlines",x\nonly_one\n')
  with pytest.raises(DataError, match=r"c\.csv:4: expected 2 columns"):
    readers.read_csv(p)


def test_csv_quoted_commas_and_empty_required_value(tmp_path):
  p = _write(tmp_path, "d.csv",
             'input,output\n"SITUATION: a, b. QUESTION: q? ANSWER: ""yes""",fused a\n'
             'SITUATION: c,\n')
  with pytest.raises(DataError) as e:
    readers.read_csv(p, columns=["input", "output"])
  assert (e.value.line, e.value.field, e.value.what) == (3, "output", "empty value")
  rows = readers.read_csv(p, on_error="report")  # No required fields: empty is allowed.
  assert rows[0]["input"] == 'SITUATION: a, b. QUESTION: q? ANSWER: "yes"'
  assert len(rows) == 2


def test_missing_header_column(tmp_path):
  p = _write(tmp_path, "e.tsv", "a\tb\n1\t2\n")
  with pytest.raises(DataError, match=r"e\.tsv:1: .*lacks column.*\(field 'z'\)"):
    readers.read_tsv(p, columns=["a", "z"])


def test_report_mode_collects_and_logs_bad_rows(tmp_path, caplog):
  p = _write(tmp_path, "f.tsv", "a\tb\n1\t2\n3\n\t4\n5\t6\n7\t8\t9\n")
  with caplog.at_level(logging.WARNING):
    rows = readers.read_tsv(p, columns=["a", "b"], on_error="report")
  assert rows == [{"a": "1", "b": "2"}, {"a": "5", "b": "6"}]
  assert [(e.line, e.field) for e in rows.errors] == [(3, "b"), (4, "a"), (6, "#3")]
  assert sum("f.tsv:" in r.getMessage() for r in caplog.records) == 3


def test_jsonl_errors(tmp_path):
  lines = [json.dumps({"query": "q", "pro": [["a"]]}), "", "{not json",
           json.dumps({"query": "", "pro": [["b"]]}), json.dumps([1, 2]),
           json.dumps({"pro": [["c"]]})]
  p = _write(tmp_path, "g.jsonl", "\n".join(lines) + "\n")
  with pytest.raises(DataError) as e:
    readers.read_jsonl(p, required=["query", "pro"])
  assert e.value.line == 3 and "invalid JSON" in str(e.value)
  rows = readers.read_jsonl(p, required=["query", "pro"], on_error="report")
  assert rows == [{"query": "q", "pro": [["a"]]}]
  assert [(e.line, e.field) for e in rows.errors] == [(3, ""), (4, "query"), (5, ""), (6, "query")]
  assert "missing required field (field 'query')" in str(rows.errors[-1])


def test_bad_on_error_and_empty_file(tmp_path):
  p = _write(tmp_path, "h.tsv", "")
  with pytest.raises(ValueError, match="on_error"):
    readers.read_tsv(p, on_error="ignore")
  with pytest.raises(DataError, match="empty file"):
    readers.read_tsv(p)


def test_real_shared_files(shared_dir):
  data = shared_dir / "data"
  dev = readers.read_tsv(data / "delta_clarify" / "dev.tsv",
                         columns=["id", "source", "situation", "question"])
  assert len(dev) == 2490 and not dev.errors
  assert any('"fun"' in r["situation"] for r in dev)  # "" escapes decoded.
  silver = readers.read_tsv(data / "delta_clarify_silver" / "sc_dev_questions_gpt.tsv",
                            columns=["Hypothesis", "Update", "UpdateType", "situation"])
  assert len(silver) == 1676
  assert {r["UpdateType"] for r in silver} == {"weakener", "strengthener"}
  fusion = readers.read_csv(data / "fusion" / "fusion_dev.csv", columns=["input", "output"],
                            on_error="report")
  assert len(fusion) + len(fusion.errors) == 9928
  assert all(r["input"].startswith("SITUATION: ") for r in fusion)


def _write_bytes(tmp_path, name, data: bytes):
  p = tmp_path / name
  p.write_bytes(data)
  return p


@pytest.mark.parametrize("name,data,line", [
    ("u.tsv", b"inputs\ttargets\na\tb\nc\xff\xfe\td\ne\tf\n", 3),
    # The error names the line of the bad byte (4), inside the row that starts on line 3.
    ("u.csv", b"inputs,targets\na,b\n\"multi\nline \xe9\",d\ne,f\n", 4),
    ("u.jsonl", b'{"inputs": "a", "targets": "b"}\n{"inputs": "c\xff", "targets": "d"}\n'
                b'{"inputs": "e", "targets": "f"}\n', 2),
])
def test_bytes_that_are_not_utf8_are_an_error_of_their_row(tmp_path, name, data, line):
  p = _write_bytes(tmp_path, name, data)
  read = {"tsv": readers.read_tsv, "csv": readers.read_csv,
          "jsonl": readers.read_jsonl}[name.split(".")[1]]
  with pytest.raises(DataError, match=rf"u\.{name[2:]}:{line}: not UTF-8: byte 0x(ff|e9)"):
    read(p)
  rows = read(p, on_error="report")
  assert [r["inputs"] for r in rows] == ["a", "e"]
  assert [e.line for e in rows.errors] == [line]


def test_read_lines_skips_blank_lines_and_names_a_bad_one(tmp_path):
  p = _write_bytes(tmp_path, "in.txt", b"\xef\xbb\xbffirst\r\n\n  \nsecond\nbad \xc3(\n")
  with pytest.raises(DataError, match=r"in\.txt:5: not UTF-8: byte 0xc3 at byte 5"):
    readers.read_lines(p)
  rows = readers.read_lines(p, on_error="report")
  assert [r["text"] for r in rows] == ["first", "second"] and rows.lines == [1, 4]


def test_tsv_quote_errors_stay_on_their_line(tmp_path):
  p = _write(tmp_path, "q.tsv",
             'inputs\ttargets\n'
             '"Stop it," she said.\tbad\n'        # 2: text after a closing quote
             '"Hello there\tok\n'                 # 3: a quote never closed on its line
             'second row\tgood"\n'                # 4: a quote inside an unquoted field is text
             'last\tfine\n')
  with pytest.raises(DataError, match=r"q\.tsv:2: text after a closing quote"):
    readers.read_tsv(p)
  rows = readers.read_tsv(p, on_error="report")
  assert rows == [{"inputs": "second row", "targets": 'good"'},
                  {"inputs": "last", "targets": "fine"}]
  assert rows.lines == [4, 5]
  assert [e.line for e in rows.errors] == [2, 3]
  assert "not closed on its line" in rows.errors[1].what


def test_csv_quote_errors(tmp_path):
  p = _write(tmp_path, "q.csv", 'input,output\n"ab"c,x\nok,1\n"open,2\nmore,3\n')
  rows = readers.read_csv(p, on_error="report")
  assert rows == [{"input": "ok", "output": "1"}] and rows.lines == [3]
  assert [(e.line, e.what.split(" (")[0]) for e in rows.errors] == [
      (2, "text after a closing quote"),
      (4, "a quoted field opened on this line is never closed")]
  assert "line 5" in rows.errors[1].what


def test_rows_know_their_lines(tmp_path):
  p = _write(tmp_path, "l.csv", 'input,output\n\n"two\nlines",x\nthree,y\n')
  rows = readers.read_csv(p)
  assert rows.lines == [3, 5]
  p = _write(tmp_path, "l.jsonl", '\n{"a": 1}\n\n{"a": 2}\n')
  assert readers.read_jsonl(p).lines == [2, 4]


def test_jsonl_text_fields_must_be_strings(tmp_path):
  p = _write(tmp_path, "t.jsonl", '\ufeff{"inputs": "x", "targets": "y"}\n'
             '{"inputs": ["x", "y"], "targets": "z"}\n{"inputs": "x", "targets": true}\n')
  rows = readers.read_jsonl(p, required=["inputs"], text=["inputs", "targets"],
                            on_error="report")
  assert rows == [{"inputs": "x", "targets": "y"}]
  assert [(e.line, e.field) for e in rows.errors] == [(2, "inputs"), (3, "targets")]
  assert str(rows.errors[0]).endswith('expected a string, got ["x", "y"] (field \'inputs\')')
