"""Tests for sleuth.corpus: the streaming corpus readers."""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from sleuth.corpus import FORMATS, CorpusError, CorpusReader, detect_format, read_corpus, split_contents
from sleuth.records import Passage


def write_lines(path: Path, lines: list[str]) -> Path:
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def jl(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False)


def summaries_obj() -> dict[str, dict[str, str]]:
    return {
        "Paris": {
            "title": "Paris",
            "extract": "Paris is the capital of France.",
            "description": "City",
            "topic": "Geo",
        },
        "Hamlet": {
            "title": "Hamlet",
            "extract": "Hamlet is a tragedy by Shakespeare.",
            "description": "Play",
            "topic": "Arts",
        },
    }


# ------------------------------------------------------------------------------------------------------- happy paths


def test_searchr1_happy_path(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "c.jsonl",
        [
            jl({"id": "0", "contents": '"Paris"\nParis is the capital of France.'}),
            jl({"id": 7, "contents": '"Hamlet"\nHamlet is a play.\nIt has five acts.', "source": "wiki", "n": 3}),
        ],
    )
    reader = CorpusReader(path)
    assert reader.format == "searchr1"
    got = list(reader)
    assert got == [
        Passage("0", "Paris", "Paris is the capital of France."),
        Passage("7", "Hamlet", "Hamlet is a play.\nIt has five acts.", meta={"source": "wiki", "n": 3}),
    ]
    assert got[0].contents == '"Paris"\nParis is the capital of France.'
    assert reader.read == 2 and reader.skipped == 0 and reader.errors == []
    assert reader.summary() == f"read 2 passages from {path}"


@pytest.mark.parametrize(
    "contents, title, text",
    [
        ("no newline at all", "", "no newline at all"),
        ("  just text, padded  ", "", "just text, padded"),
        ('"The "Best" Song"\nA song.', 'The "Best" Song', "A song."),
        ('  "Padded"  \n   text with spaces \n', "Padded", "text with spaces"),
        ("Unquoted Title\nSome text.", "Unquoted Title", "Some text."),
        ('""\ntext', "", "text"),
        ('"\ntext', '"', "text"),
        ('""Double""\ntext', '"Double"', "text"),
        ('"T"\nline one\n\nline two', "T", "line one\n\nline two"),
    ],
)
def test_split_contents_edge_cases(contents: str, title: str, text: str) -> None:
    assert split_contents(contents) == (title, text)


def test_searchr1_contents_edge_cases_through_reader(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "c.jsonl",
        [
            jl({"id": "a", "contents": "no newline"}),
            jl({"id": "b", "contents": '"Say "Hi" now"\n  text  '}),
        ],
    )
    got = [(p.id, p.title, p.text) for p in read_corpus(path)]
    assert got == [("a", "", "no newline"), ("b", 'Say "Hi" now', "text")]


def test_jsonl_happy_path(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "c.jsonl",
        [
            jl({"id": "1", "title": "Paris", "text": "Paris is in France."}),
            jl({"id": 2, "text": "No title here."}),
            jl({"id": "3", "title": "X", "text": "Extra keys.", "url": "http://x", "views": 5}),
            jl(Passage("4", "Round", "Trip.", meta={"k": "v"}).to_dict()),
        ],
    )
    reader = CorpusReader(path)
    assert reader.format == "jsonl"
    assert list(reader) == [
        Passage("1", "Paris", "Paris is in France."),
        Passage("2", "", "No title here."),
        Passage("3", "X", "Extra keys.", meta={"url": "http://x", "views": 5}),
        Passage("4", "Round", "Trip.", meta={"k": "v"}),
    ]


def test_tsv_dpr_with_header_and_quotes(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "psgs.tsv",
        [
            "id\ttext\ttitle",
            '1\t"Aaron Aaron ( or ; ""Ahärôn"") is a prophet."\tAaron',
            '2\t"has\ta tab and ""quotes"" inside"\tTab "Title"',
            "3\tplain text\tPlain",
            "4\tno title\t",
        ],
    )
    reader = CorpusReader(path)
    assert reader.format == "tsv"
    assert [(p.id, p.title, p.text) for p in reader] == [
        ("1", "Aaron", 'Aaron Aaron ( or ; "Ahärôn") is a prophet.'),
        ("2", 'Tab "Title"', 'has\ta tab and "quotes" inside'),
        ("3", "Plain", "plain text"),
        ("4", "", "no title"),
    ]
    assert reader.skipped == 0


def test_tsv_without_header_keeps_first_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.tsv", ["10\tfirst passage\tFirst", "11\tsecond passage\tSecond"])
    assert [p.id for p in read_corpus(path)] == ["10", "11"]


def test_tsv_crlf_line_endings(tmp_path: Path) -> None:
    path = tmp_path / "p.tsv"
    path.write_bytes(b"id\ttext\ttitle\r\n1\tsome text\tT\r\n")
    assert list(read_corpus(path)) == [Passage("1", "T", "some text")]


def test_wiki_summaries_happy_path(tmp_path: Path) -> None:
    path = tmp_path / "summaries_en-us.json"
    path.write_text(json.dumps(summaries_obj(), indent=2), encoding="utf-8")
    reader = CorpusReader(path)
    assert reader.format == "wiki-summaries"
    assert list(reader) == [
        Passage("Paris", "Paris", "Paris is the capital of France.", meta={"description": "City", "topic": "Geo"}),
        Passage(
            "Hamlet", "Hamlet", "Hamlet is a tragedy by Shakespeare.", meta={"description": "Play", "topic": "Arts"}
        ),
    ]
    assert reader.read == 2
    assert reader.bytes_read == reader.total_bytes == path.stat().st_size


def test_wiki_summaries_malformed_entries(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = summaries_obj()
    data["Foo"] = {"title": "Foo", "extract": "", "description": "", "topic": ""}
    data["Bar"] = {"title": "Bar", "description": "no extract"}
    data["Baz"] = "not an object"
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    reader = CorpusReader(path, format="wiki-summaries")
    with caplog.at_level(logging.WARNING, logger="sleuth.corpus"):
        assert [p.id for p in reader] == ["Paris", "Hamlet"]
    assert reader.skipped == 3
    assert reader.errors[0] == f"{path}:entry 'Foo': missing or empty extract"
    assert reader.errors[1] == f"{path}:entry 'Bar': missing or empty extract"
    assert reader.errors[2].startswith(f"{path}:entry 'Baz': expected an object")
    assert reader.summary().startswith(
        f"read 2 passages from {path}; skipped 3 malformed entries (first: {path}:entry"
    )
    assert [r.getMessage() for r in caplog.records] == [reader.summary()]

    with pytest.raises(CorpusError, match=r":entry 'Foo': missing or empty extract"):
        list(CorpusReader(path, format="wiki-summaries", strict=True))


def test_wiki_summaries_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(CorpusError, match="one JSON object"):
        list(CorpusReader(path, format="wiki-summaries"))
    path.write_text("{broken", encoding="utf-8")
    with pytest.raises(CorpusError, match="not a valid wiki-summaries JSON"):
        list(CorpusReader(path, format="wiki-summaries"))


# -------------------------------------------------------------------------------------------------------------- gzip


def test_gzip_each_format(tmp_path: Path) -> None:
    sr1 = write_lines(tmp_path / "a.jsonl.gz", [jl({"id": "1", "contents": '"T"\ntext one'})])
    jsl = write_lines(tmp_path / "b.jsonl.gz", [jl({"id": "2", "title": "U", "text": "text two"})])
    tsv = write_lines(tmp_path / "c.tsv.gz", ["id\ttext\ttitle", '3\t"text ""three"""\tV'])
    summ = tmp_path / "d.json.gz"
    summ.write_bytes(gzip.compress(json.dumps(summaries_obj()).encode()))
    assert list(read_corpus(sr1)) == [Passage("1", "T", "text one")]
    assert list(read_corpus(jsl)) == [Passage("2", "U", "text two")]
    assert list(read_corpus(tsv)) == [Passage("3", "V", 'text "three"')]
    assert [p.id for p in read_corpus(summ)] == ["Paris", "Hamlet"]
    reader = CorpusReader(sr1)
    list(reader)
    # progress is measured in compressed bytes: the position reached is the compressed file size
    assert reader.total_bytes == sr1.stat().st_size
    assert reader.bytes_read == reader.total_bytes


def test_corrupt_gzip_raises_corpus_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(b"this is not gzip data at all\n")
    with pytest.raises(CorpusError, match="bad.jsonl.gz:1: cannot read, the .gz file is damaged"):
        list(CorpusReader(path, format="jsonl"))


# --------------------------------------------------------------------------------------------------------- detection


def test_detect_format_each_format(tmp_path: Path) -> None:
    sr1 = write_lines(tmp_path / "a.jsonl", ["", "not json", jl({"id": "1", "contents": "x"})])
    jsl = write_lines(tmp_path / "b.jsonl", [jl({"id": "1", "text": "x"})])
    json_lines = write_lines(tmp_path / "c.json", [jl({"id": "1", "contents": "x", "text": "y"})])
    tsv = write_lines(tmp_path / "d.tsv", ["1\tx\tT"])
    summ = tmp_path / "e.json"
    summ.write_text(json.dumps(summaries_obj(), indent=2))
    summ_compact = tmp_path / "f.json"
    summ_compact.write_text(json.dumps(summaries_obj()))
    assert detect_format(sr1) == "searchr1"
    assert detect_format(jsl) == "jsonl"
    assert detect_format(json_lines) == "searchr1"
    assert detect_format(tsv) == "tsv"
    assert detect_format(str(summ)) == "wiki-summaries"
    assert detect_format(summ_compact) == "wiki-summaries"
    gz = write_lines(tmp_path / "g.jsonl.gz", [jl({"id": "1", "text": "x"})])
    assert detect_format(gz) == "jsonl"
    assert detect_format(tmp_path / "whatever.tsv.gz") == "tsv"
    assert set(FORMATS) == {"searchr1", "jsonl", "tsv", "wiki-summaries"}


@pytest.mark.parametrize(
    "name, lines",
    [
        ("u.jsonl", [jl({"id": "1", "body": "x"})]),
        ("v.jsonl", ["not json", ""]),
        ("w.json", [jl({"Paris": {"title": "Paris", "description": "no extract"}})]),
        ("x.txt", ["plain text"]),
    ],
)
def test_detect_format_undetectable(tmp_path: Path, name: str, lines: list[str]) -> None:
    path = write_lines(tmp_path / name, lines)
    with pytest.raises(CorpusError, match="cannot tell the corpus format") as info:
        detect_format(path)
    assert str(path) in str(info.value) and "--format" in str(info.value)
    with pytest.raises(CorpusError):
        CorpusReader(path)


def test_unknown_format_name_and_missing_file(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "a.jsonl", [jl({"id": "1", "text": "x"})])
    with pytest.raises(CorpusError, match="unknown corpus format 'parquet'"):
        CorpusReader(path, format="parquet")
    with pytest.raises(FileNotFoundError):
        CorpusReader(tmp_path / "missing.jsonl")
    # an explicit format overrides detection
    assert list(read_corpus(path, format="jsonl")) == [Passage("1", "", "x")]


# --------------------------------------------------------------------------------------------------- malformed lines

MALFORMED: dict[str, tuple[list[str], list[str], list[str]]] = {
    # format: (lines, expected ids, expected error messages after "PATH:")
    "searchr1": (
        [
            jl({"id": "ok1", "contents": '"A"\ntext a'}),
            "",
            "{not json",
            "[1, 2]",
            jl({"contents": '"B"\ntext b'}),
            jl({"id": "", "contents": '"C"\ntext c'}),
            jl({"id": "d"}),
            jl({"id": "e", "contents": '"E"\n   '}),
            "   ",
            jl({"id": "ok2", "contents": '"F"\ntext f'}),
        ],
        ["ok1", "ok2"],
        [
            "3: invalid JSON",
            "4: expected a JSON object, got list",
            "5: missing id",
            "6: empty id",
            "7: missing contents",
            "8: empty text",
        ],
    ),
    "jsonl": (
        [
            "",
            jl({"id": "ok1", "text": "a"}),
            "nope",
            '"a string"',
            jl({"title": "T", "text": "b"}),
            jl({"id": "", "text": "c"}),
            jl({"id": "d", "title": "D"}),
            jl({"id": "e", "text": "  "}),
            jl({"id": "ok2", "text": "f"}),
        ],
        ["ok1", "ok2"],
        [
            "3: invalid JSON",
            "4: expected a JSON object, got str",
            "5: missing id",
            "6: empty id",
            "7: missing text",
            "8: empty text",
        ],
    ),
    "tsv": (
        [
            "id\ttext\ttitle",
            "ok1\ttext a\tA",
            "",
            "2\tonly two columns",
            "3\ttoo\tmany\tcolumns",
            "\tno id\tT",
            "5\t\tEmpty",
            '6\t"unterminated\tT',
            "ok2\ttext b\tB",
        ],
        ["ok1", "ok2"],
        [
            "4: expected 3 tab-separated columns (id, text, title), got 2",
            "5: expected 3 tab-separated columns (id, text, title), got 4",
            "6: empty id",
            "7: empty text",
            "8: bad quoting",
        ],
    ),
}


@pytest.mark.parametrize("fmt", sorted(MALFORMED))
def test_malformed_lines_skipped_and_counted(tmp_path: Path, fmt: str, caplog: pytest.LogCaptureFixture) -> None:
    lines, ids, messages = MALFORMED[fmt]
    path = write_lines(tmp_path / ("c.tsv" if fmt == "tsv" else "c.jsonl"), lines)
    reader = CorpusReader(path, format=fmt)
    with caplog.at_level(logging.WARNING, logger="sleuth.corpus"):
        assert [p.id for p in reader] == ids
    assert reader.read == len(ids)
    assert reader.skipped == len(messages)
    assert len(reader.errors) == len(messages)
    for err, expected in zip(reader.errors, messages, strict=True):
        assert err.startswith(f"{path}:{expected}"), (err, expected)
    summary = reader.summary()
    assert summary.startswith(f"read 2 passages from {path}; skipped {len(messages)} malformed lines (first: {path}:")
    assert reader.errors[0] in summary
    warnings = [r for r in caplog.records if r.name == "sleuth.corpus"]
    assert [(r.levelno, r.getMessage()) for r in warnings] == [(logging.WARNING, summary)]


@pytest.mark.parametrize("fmt", sorted(MALFORMED))
def test_malformed_lines_strict_raises(tmp_path: Path, fmt: str) -> None:
    lines, _, messages = MALFORMED[fmt]
    path = write_lines(tmp_path / ("c.tsv" if fmt == "tsv" else "c.jsonl"), lines)
    it = iter(CorpusReader(path, format=fmt, strict=True))
    assert next(it).id == "ok1"
    with pytest.raises(CorpusError) as info:
        next(it)
    assert str(info.value).startswith(f"{path}:{messages[0]}")


def test_strict_mode_reads_clean_file(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "c.jsonl", [jl({"id": str(i), "text": f"t{i}"}) for i in range(5)] + [""])
    reader = CorpusReader(path, strict=True)
    assert [p.text for p in reader] == [f"t{i}" for i in range(5)]


def test_blank_lines_ignored_silently(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_lines(
        tmp_path / "c.jsonl",
        ["", jl({"id": "1", "contents": '"T"\nx'}), "", "  \t ", jl({"id": "2", "contents": '"U"\ny'}), ""],
    )
    reader = CorpusReader(path, strict=True)
    with caplog.at_level(logging.WARNING, logger="sleuth.corpus"):
        assert [p.id for p in reader] == ["1", "2"]
    assert reader.skipped == 0 and reader.errors == []
    assert caplog.records == []


def test_errors_capped_at_twenty_and_counters_reset(tmp_path: Path) -> None:
    lines = [jl({"id": "good", "text": "x"})] + ["bad"] * 25
    path = write_lines(tmp_path / "c.jsonl", lines)
    reader = CorpusReader(path, format="jsonl")
    for _ in range(2):  # a second pass starts over
        assert len(list(reader)) == 1
        assert reader.read == 1
        assert reader.skipped == 25
        assert len(reader.errors) == 20
        assert reader.errors[0].startswith(f"{path}:2: invalid JSON")
        assert reader.errors[-1].startswith(f"{path}:21: invalid JSON")
    assert "skipped 25 malformed lines" in reader.summary()


# --------------------------------------------------------------------------------------------------------- streaming


def test_streaming_reads_only_a_prefix(tmp_path: Path) -> None:
    text = "word " * 200
    lines = [jl({"id": str(i), "contents": f'"T{i}"\n{text}'}) for i in range(10_000)]
    path = write_lines(tmp_path / "big.jsonl", lines)
    size = path.stat().st_size
    assert size > 8_000_000
    reader = CorpusReader(path)
    assert reader.total_bytes == size
    it = iter(reader)
    first = next(it)
    assert first.id == "0" and first.title == "T0"
    assert reader.read == 1
    assert reader.bytes_read is not None and 0 < reader.bytes_read < size // 4
    assert sum(1 for _ in it) == 9_999
    assert reader.bytes_read == size


def test_streaming_gzip_reads_only_a_prefix(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as f:
        for i in range(6_000):
            f.write(jl({"id": str(i), "text": os.urandom(600).hex()}) + "\n")
    size = path.stat().st_size
    assert size > 3_000_000
    reader = CorpusReader(path)
    it = iter(reader)
    assert next(it).id == "0"
    assert reader.bytes_read is not None and 0 < reader.bytes_read < size // 2
    it.close()  # stopping early closes the file
    assert reader.bytes_read is not None and reader.bytes_read < size // 2


# ------------------------------------------------------------------------------------------------------ encodings

LATIN1_ROWS = [{"id": "1", "title": "Café", "text": "Crème brûlée."}, {"id": "2", "text": "Naïve Zürich."}]


def _jsonl_text(rows: list[dict[str, str]]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def test_a_latin1_corpus_names_the_line_and_byte_not_the_format(tmp_path: Path) -> None:
    # The reproduction: format detection said "cannot tell the corpus format" for a Latin-1 file.
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(_jsonl_text(LATIN1_ROWS).encode("latin-1"))
    byte = _jsonl_text(LATIN1_ROWS[:1]).encode("latin-1").index(b"\xe9")
    expected = f"{path}:1: invalid UTF-8 at byte {byte} (0xe9: invalid continuation byte)"
    for attempt in (lambda: detect_format(path), lambda: list(read_corpus(path))):
        with pytest.raises(CorpusError) as info:
            attempt()
        message = str(info.value)
        assert message.startswith(expected) and "iconv -f LATIN1 -t UTF-8" in message, message
        assert "cannot tell" not in message
    with pytest.raises(CorpusError, match=r"latin1\.jsonl:1: invalid UTF-8"):  # with --format, as before
        list(read_corpus(path, format="jsonl", strict=True))


def test_a_latin1_wiki_summaries_file_names_the_line_and_byte(tmp_path: Path) -> None:
    path = tmp_path / "summaries.json"
    data = {"Paris": {"title": "Paris", "extract": "Paris is a city."}, "Zürich": {"extract": "A city."}}
    content = json.dumps(data, ensure_ascii=False, indent=1).encode("latin-1")
    path.write_bytes(content)
    line = next(i for i, text in enumerate(content.split(b"\n"), 1) if b"\xfc" in text)
    byte = content.split(b"\n")[line - 1].index(b"\xfc")
    assert line > 1 and byte > 0  # the position is counted within the line
    with pytest.raises(CorpusError) as info:
        list(read_corpus(path, format="wiki-summaries"))
    assert str(info.value).startswith(f"{path}:{line}: invalid UTF-8 at byte {byte} (0xfc: invalid start byte)")


_BOM = "\ufeff"
_ENCODERS: dict[str, Callable[[str], bytes]] = {
    "bom16le.jsonl": lambda t: (_BOM + t).encode("utf-16-le"),
    "bom16be.jsonl": lambda t: (_BOM + t).encode("utf-16-be"),
    "bom32le.jsonl": lambda t: (_BOM + t).encode("utf-32-le"),
    "bare16le.jsonl": lambda t: t.encode("utf-16-le"),
    "bare16be.tsv": lambda t: t.encode("utf-16-be"),
    "bom16le.jsonl.gz": lambda t: gzip.compress((_BOM + t).encode("utf-16-le")),
}


@pytest.mark.parametrize(
    ("name", "looks_like", "iconv"),
    [
        ("bom16le.jsonl", "UTF-16-LE: it has a byte-order mark", "UTF-16"),
        ("bom16be.jsonl", "UTF-16-BE: it has a byte-order mark", "UTF-16"),
        ("bom32le.jsonl", "UTF-32-LE: it has a byte-order mark", "UTF-32"),
        ("bare16le.jsonl", "UTF-16-LE without a byte-order mark", "UTF-16LE"),
        ("bare16be.tsv", "UTF-16-BE without a byte-order mark", "UTF-16BE"),
        ("bom16le.jsonl.gz", "UTF-16-LE: it has a byte-order mark", "UTF-16"),
    ],
)
def test_a_utf16_or_utf32_corpus_is_named_with_the_fix(tmp_path: Path, name: str, looks_like: str, iconv: str) -> None:
    path = tmp_path / name
    path.write_bytes(_ENCODERS[name](_jsonl_text(LATIN1_ROWS)))
    expected = f"{path}: not UTF-8 (looks like {looks_like}"
    attempts = [lambda: CorpusReader(path), lambda: CorpusReader(path, format="jsonl")]
    if not name.endswith(".tsv"):
        attempts.append(lambda: detect_format(path))
    for attempt in attempts:  # with or without --format: before, every line was skipped or the format unknown
        with pytest.raises(CorpusError) as info:
            attempt()
        message = str(info.value)
        assert message.startswith(expected) and f"convert it with iconv -f {iconv} -t UTF-8" in message, message


def test_a_utf8_bom_is_accepted_and_nul_bytes_are_named(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _jsonl_text(LATIN1_ROWS).encode("utf-8"))
    assert detect_format(path) == "jsonl"
    assert [p.title for p in read_corpus(path, strict=True)] == ["Café", ""]
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"id": "1", "text": "a\x00\x00\x00\x01\x02"}\n' * 3)
    with pytest.raises(CorpusError, match=r"binary\.jsonl: not UTF-8 text \(it holds NUL bytes"):
        CorpusReader(binary)


# --------------------------------------------------------------------------------------------------------- real file


@pytest.mark.integration
def test_real_wiki_summaries_file() -> None:
    from sleuth.assets import default_corpus_path

    path = default_corpus_path()  # under $SLEUTH_HOME; `make test` fetches it first
    if not path.exists():
        pytest.skip(f"bundled summaries_en-us.json not found at {path} (run `sleuth assets fetch`)")
    assert detect_format(path) == "wiki-summaries"
    reader = CorpusReader(path)
    passages = list(reader)
    assert len(passages) == 10_033
    assert reader.skipped == 0
    assert len({p.id for p in passages}) == 10_033
    assert all(p.text and p.title and set(p.meta) == {"description", "topic"} for p in passages)
