"""Reading benchmark files record by record, and the helpers every dataset loader shares.

Containers (chosen by content, never by the file name, except ``.csv``):

- JSON lines: one object per line, read lazily; a row is named ``PATH:LINE`` (1-based line number).
- a JSON array of objects, loaded whole; a row is named ``PATH[INDEX]`` (0-based).
- one JSON object whose values are all objects, keyed by an id (PubMedQA's ``{pmid: {...}}``); a row is named
  ``PATH['KEY']`` and :attr:`Row.key` holds the key.
- one JSON object of any other shape: a single record, ``PATH[0]``.
- ``.csv`` with a header line (Bamboogle, EX-FEVER); a row is named ``PATH:LINE``.

``.gz`` files are decompressed on the fly; a UTF-8 byte-order mark is ignored. Every problem raises
:class:`DatasetError` whose message starts with the row's name, e.g. ``musique.json:17: missing key 'paragraphs'``;
a file that is not UTF-8 or a broken ``.gz`` names the first line it cannot read (``data.jsonl:3: not UTF-8 ...``).
Strings that JSON escapes spell as lone surrogates (``"\\ud800"``) are replaced by U+FFFD, so every row can be
written back as UTF-8.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

from sleuth.records import Passage, encodable, encodable_json

PathLike = str | os.PathLike[str]

_HEAD_BYTES = 1 << 16
# A JSON escape of a UTF-16 surrogate (\ud800-\udfff); only text holding one can decode to a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# What reading a file that is not UTF-8 text, or a broken .gz, raises.
_UNREADABLE = (UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error)


class DatasetError(ValueError):
    """A dataset file that does not fit its format: the message names the file, the row and the key.

    ``path``, ``row`` (line number, array index or mapping key) and ``key`` (the missing or malformed key) are
    also attributes, None where they do not apply.
    """

    def __init__(
        self, message: str, *, path: str | None = None, row: int | str | None = None, key: str | None = None
    ) -> None:
        super().__init__(message)
        self.path = path
        self.row = row
        self.key = key


_TYPE_NAMES: dict[type, str] = {dict: "object", list: "list", str: "str", bool: "bool", int: "int", float: "float"}


def _type_name(value: Any) -> str:
    """The JSON-ish name of a value's type, for error messages."""
    return "null" if value is None else _TYPE_NAMES.get(type(value), type(value).__name__)


@dataclass
class Row:
    """One record of a dataset file (or a nested object inside one) and where it came from.

    ``where`` names it in error messages (``musique.json:17``, ``tatqa.json[3]: questions[2]``); ``row`` is the
    line number, array index or mapping key; ``index`` counts the file's records from 0 (for fallback ids).
    """

    data: dict[str, Any]
    path: str
    where: str
    row: int | str
    index: int
    key: str | None = None

    def error(self, message: str, key: str | None = None) -> DatasetError:
        return DatasetError(f"{self.where}: {message}", path=self.path, row=self.row, key=key)

    def child(self, value: Any, label: str) -> Row:
        """A nested object as a Row, so its errors read ``FILE:ROW: label: ...``; raises unless it is an object."""
        if not isinstance(value, dict):
            raise self.error(f"{label} should be an object, got {_type_name(value)}")
        return Row(value, self.path, f"{self.where}: {label}", self.row, self.index, self.key)

    def need(self, key: str, *types: type) -> Any:
        """The value of a required key, optionally checked against ``types``; raises :class:`DatasetError`."""
        if key not in self.data:
            raise self.error(f"missing key {key!r}", key)
        return self._check(key, self.data[key], types)

    def get(self, key: str, default: Any = None, *types: type) -> Any:
        """The value of an optional key (``default`` when absent or null), checked against ``types`` if given."""
        value = self.data.get(key)
        if value is None:
            return default
        return self._check(key, value, types)

    def _check(self, key: str, value: Any, types: tuple[type, ...]) -> Any:
        if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            expected = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)
            raise self.error(f"key {key!r} should be {expected}, got {_type_name(value)}", key)
        return value

    def strings(self, key: str, *, required: bool = True) -> list[str]:
        """A list of strings (numbers are turned into strings); an absent optional key gives ``[]``."""
        value = self.need(key, list) if required else self.get(key, [], list)
        out = []
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, str | int | float):
                raise self.error(f"{key}[{i}] should be a string, got {_type_name(item)}", key)
            out.append(item if isinstance(item, str) else format_number(item))
        return out

    def id(self, *keys: str) -> str:
        """The first of ``keys`` that the record has (as a string), else the fallback ``"{file stem}-{index}"``."""
        for key in keys:
            value = self.data.get(key)
            if value is not None and value != "":
                if isinstance(value, bool) or not isinstance(value, str | int):
                    raise self.error(f"key {key!r} should be a string id, got {_type_name(value)}", key)
                return str(value)
        return f"{file_stem(self.path)}-{self.index}"


def text_field(row: Row, key: str) -> str:
    """A required, non-empty string field of a row, stripped."""
    value = row.need(key, str).strip()
    if not value:
        raise row.error(f"key {key!r} is empty", key)
    return value


def file_stem(path: PathLike) -> str:
    """The file name without directories and extensions (``.gz`` too): ``data/test.jsonl.gz`` -> ``test``."""
    name = os.path.basename(os.fspath(path))
    if name.lower().endswith(".gz"):
        name = name[:-3]
    return os.path.splitext(name)[0]


def is_csv(path: PathLike) -> bool:
    name = os.fspath(path).lower()
    return name.endswith(".csv") or name.endswith(".csv.gz")


def _open_text(path: str) -> IO[str]:
    if path.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")  # noqa: SIM115 - closed by the caller


def _is_keyed(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, dict) for v in obj.values())


def _json_error(path: str, line: int, e: json.JSONDecodeError) -> DatasetError:
    return DatasetError(f"{path}:{line}: invalid JSON ({e.msg} at column {e.colno})", path=path, row=line)


def _object_rows(path: str, obj: Any) -> Iterator[Row]:
    """Rows of a whole-file JSON value: an array, a keyed mapping or one record."""
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            if not isinstance(item, dict):
                raise DatasetError(f"{path}[{i}]: expected a JSON object, got {_type_name(item)}", path=path, row=i)
            yield Row(item, path, f"{path}[{i}]", i, i)
    elif _is_keyed(obj):
        for i, (key, item) in enumerate(obj.items()):
            yield Row(item, path, f"{path}[{key!r}]", key, i, key=key)
    elif isinstance(obj, dict):
        yield Row(obj, path, f"{path}[0]", 0, 0)
    else:
        raise DatasetError(f"{path}: expected JSON objects, got {_type_name(obj)}", path=path)


def _csv_rows(path: str) -> Iterator[Row]:
    with _open_text(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return
        names = [h.strip() for h in header]
        index = 0
        for cells in reader:
            if not any(c.strip() for c in cells):
                continue
            line = reader.line_num
            if len(cells) > len(names):
                raise DatasetError(
                    f"{path}:{line}: {len(cells)} fields but the header has {len(names)}", path=path, row=line
                )
            data = dict(zip(names, cells, strict=False))
            yield Row(data, path, f"{path}:{line}", line, index)
            index += 1


def _clean(obj: Any, text: str) -> Any:
    """``obj`` (decoded from ``text``) with lone surrogates replaced; a scan of ``text`` skips the walk when the
    text holds no surrogate escape, which is almost always."""
    if _SURROGATE_ESCAPE.search(text) is None:
        return obj
    try:
        return encodable_json(obj)
    except RecursionError:  # nested past the recursion limit: left to the loader's own checks
        return obj


def _unreadable(path: str, exc: BaseException) -> DatasetError:
    """A :class:`DatasetError` naming the first line of ``path`` that cannot be read, and why.

    Text decoding happens a buffer at a time, ahead of the line being parsed, so the file is scanned again
    line by line (only when reading failed) to find the line that holds the bad byte or where the .gz breaks.
    """
    line = 0
    reason = f"cannot read ({type(exc).__name__}: {exc})"
    try:
        opener = gzip.open if path.lower().endswith(".gz") else open
        with opener(path, "rb") as f:
            for line, raw in enumerate(f, 1):  # noqa: B007 - the line reached is reported
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    byte = raw[e.start]
                    reason = (
                        f"not UTF-8 text (byte 0x{byte:02x} at column {e.start + 1}); re-save the file as UTF-8 "
                        "(e.g. iconv -f latin1 -t utf-8)"
                    )
                    break
            else:
                line = 0
    except (EOFError, OSError, zlib.error) as e:  # a broken .gz: the line being read when it broke
        line += 1
        reason = f"cannot read, the .gz file is damaged ({type(e).__name__}: {e})"
    where = f"{path}:{line}" if line else path
    return DatasetError(f"{where}: {reason}", path=path, row=line or None)


def read_records(path: PathLike) -> Iterator[Row]:
    """Yield the records of a dataset file as :class:`Row` objects (see the module docstring for containers).

    JSON lines are read one line at a time, so stopping early reads only the start of the file.
    """
    name = os.fspath(path)
    try:
        yield from _read_records(name)
    except _UNREADABLE as exc:
        raise _unreadable(name, exc) from None
    except RecursionError:
        raise DatasetError(f"{name}: JSON nested too deeply", path=name) from None


def _read_records(name: str) -> Iterator[Row]:
    if is_csv(name):
        yield from _csv_rows(name)
        return
    with _open_text(name) as f:
        lineno = 0
        first = ""
        for line in f:
            lineno += 1
            if line.strip():
                first = line
                break
        if not first:
            return
        if first.lstrip().startswith("{"):
            try:
                obj = json.loads(first)
            except (json.JSONDecodeError, RecursionError):
                obj = None  # a pretty-printed object spanning lines: parse the whole file below
            if obj is not None:
                obj = _clean(obj, first)
                if _is_keyed(obj) and not any(rest.strip() for rest in f):
                    yield from _object_rows(name, obj)
                    return
                yield from _jsonl_rows(name, f, obj, lineno)
                return
        text = first + f.read()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as e:
        if first.rstrip().endswith("}"):  # a one-line object that does not parse: a broken JSON line
            try:
                json.loads(first)
            except json.JSONDecodeError as line_error:
                raise _json_error(name, lineno, line_error) from None
        raise _json_error(name, e.lineno + lineno - 1, e) from None
    yield from _object_rows(name, _clean(whole, text))


def _jsonl_rows(path: str, f: IO[str], first: Any, lineno: int) -> Iterator[Row]:
    index = 0
    obj = first
    while True:
        if not isinstance(obj, dict):
            message = f"{path}:{lineno}: expected a JSON object, got {_type_name(obj)}"
            raise DatasetError(message, path=path, row=lineno)
        yield Row(obj, path, f"{path}:{lineno}", lineno, index)
        index += 1
        for line in f:
            lineno += 1
            if line.strip():
                try:
                    obj = _clean(json.loads(line), line)
                except json.JSONDecodeError as e:
                    raise _json_error(path, lineno, e) from None
                except RecursionError:
                    raise DatasetError(f"{path}:{lineno}: JSON nested too deeply", path=path, row=lineno) from None
                break
        else:
            return


def first_record(path: PathLike) -> dict[str, Any] | None:
    """The first record of a file (None when it has none), reading as little as the container allows.

    A JSON array is decoded only up to its first element, so detecting the format of a large array is cheap.
    """
    name = os.fspath(path)
    try:
        return _first_record(name)
    except _UNREADABLE as exc:
        raise _unreadable(name, exc) from None
    except RecursionError:
        raise DatasetError(f"{name}: JSON nested too deeply", path=name) from None


def _first_record(name: str) -> dict[str, Any] | None:
    if not is_csv(name):
        with _open_text(name) as f:
            head = f.read(_HEAD_BYTES)
            start = len(head) - len(head.lstrip())
            if head[start : start + 1] == "[":
                decoder = json.JSONDecoder()
                while True:
                    body = head[start + 1 :].lstrip()
                    offset = len(head) - len(body)
                    if body.startswith("]"):
                        return None
                    try:
                        obj, _ = decoder.raw_decode(head, offset)
                    except json.JSONDecodeError:
                        more = f.read(max(len(head), _HEAD_BYTES))
                        if not more:
                            break  # let read_records report the error with its line
                        head += more
                        continue
                    if not isinstance(obj, dict):
                        message = f"{name}[0]: expected a JSON object, got {_type_name(obj)}"
                        raise DatasetError(message, path=name, row=0)
                    return _clean(obj, head)
    for row in _read_records(name):
        return row.data
    return None


# ------------------------------------------------------------------------------------------------------- helpers


def clean_title(title: Any) -> str:
    """A title on one line, without surrounding whitespace (the Search-R1 ``contents`` form needs one line)."""
    return " ".join(str(title).splitlines()).strip()


def passage_id(title: str, text: str) -> str:
    """A stable id for a paragraph: its title, ``#``, and the first 10 hex digits of the SHA-1 of its text.

    The same paragraph (same title and text) gets the same id in every question, file and run, so a corpus
    pooled from many questions stays deduplicated and every question's ``supporting_ids`` stay valid. A paragraph
    without a title is named by the hash alone.

    >>> passage_id("Paris", "Paris is the capital of France.")
    'Paris#cedecad809'
    """
    digest = hashlib.sha1(text.encode("utf-8")).hexdigest()[:10]
    return f"{title}#{digest}" if title else digest


def make_passage(title: Any, text: str, pid: str | None = None, **meta: Any) -> Passage:
    """A :class:`Passage` with a cleaned title, stripped text and (unless given) the :func:`passage_id`."""
    title = encodable(clean_title(title))
    text = encodable(text.strip())
    return Passage(id=pid if pid is not None else passage_id(title, text), title=title, text=text, meta=meta)


def join_sentences(sentences: Sequence[str], sep: str) -> str:
    return sep.join(sentences).strip()


def dedupe_passages(passages: Sequence[Passage]) -> tuple[list[Passage], int]:
    """Drop repeated passages (same id) within one question's context, keeping the first; returns the count dropped.

    2WikiMultiHopQA, for one, sometimes lists the very same paragraph twice among a question's ten.
    """
    out: dict[str, Passage] = {}
    for p in passages:
        out.setdefault(p.id, p)
    return list(out.values()), len(passages) - len(out)


def format_number(value: int | float) -> str:
    """A number as an answer string: ints as they are, integral floats without ``.0``, others in shortest form.

    >>> format_number(18), format_number(3.0), format_number(-22.22), format_number(1e-7)
    ('18', '3', '-22.22', '1e-07')
    """
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def markdown_table(rows: Sequence[Sequence[Any]]) -> str:
    """Render a table (rows of cells) as a GitHub markdown table; the first row is the header.

    >>> print(markdown_table([["", "2019"], ["Sales", "1|2"]]))
    |  | 2019 |
    | --- | --- |
    | Sales | 1\\|2 |
    """
    if not rows:
        return ""
    width = max(len(r) for r in rows) or 1

    def cell(value: Any) -> str:
        text = "" if value is None else str(value)
        return " ".join(text.split()).replace("|", "\\|")

    lines = ["| " + " | ".join([cell(c) for c in r] + [""] * (width - len(r))) + " |" for r in rows]
    lines.insert(1, "| " + " | ".join(["---"] * width) + " |")
    return "\n".join(lines)


def extras(data: dict[str, Any], used: Iterable[str]) -> dict[str, Any]:
    """The keys of a record that a loader did not turn into Example fields: they go into ``metadata``."""
    skip = set(used)
    return {k: v for k, v in data.items() if k not in skip}


def unique(items: Iterable[str]) -> list[str]:
    """Items without repeats, in first-seen order."""
    return list(dict.fromkeys(items))
