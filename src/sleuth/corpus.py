"""Streaming corpus readers that turn passage files into :class:`~sleuth.records.Passage` objects.

A 21M-passage file is never held in memory: line-based formats are read one line at a time. Formats (the names are
the CLI's ``--format`` values), with one example line each:

``searchr1``
    Search-R1 / FlashRAG jsonl: ``{"id": "0", "contents": "\\"Aaron\\"\\nAaron is a prophet ..."}``. The first line
    of ``contents`` is the title (one pair of surrounding double quotes removed), the rest is the text.
``jsonl``
    ``{"id": "0", "title": "Aaron", "text": "Aaron is a prophet ..."}`` (``title`` optional).
``tsv``
    DPR ``psgs_w100.tsv``: ``1<TAB>"Aaron Aaron ( or ; ""Ahärôn"") is ..."<TAB>Aaron``, columns id, text, title;
    an ``id<TAB>text<TAB>title`` header line is skipped. Quoted fields must not span lines.
``wiki-summaries``
    The bundled Wikipedia summaries JSON, one object:
    ``{"Paris": {"title": "Paris", "extract": "Paris is ...", "description": "...", "topic": "..."}}``.

Files ending in ``.gz`` are decompressed on the fly. Keys other than the ones above go into ``Passage.meta``.
Duplicate ids are not checked here.

>>> for p in read_corpus("wiki.jsonl"):  # doctest: +SKIP
...     index.add(p)
"""

from __future__ import annotations

import csv
import gzip
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterator
from typing import IO, Any

from sleuth.records import Passage, encodable

__all__ = ["FORMATS", "CorpusError", "CorpusReader", "detect_format", "encoding_error", "read_corpus"]

FORMATS: tuple[str, ...] = ("searchr1", "jsonl", "tsv", "wiki-summaries")
MAX_ERRORS = 20
_BUFFER = 1 << 20
_SNIFF_LINES = 1000
_SNIFF_BYTES = 1 << 18

logger = logging.getLogger("sleuth.corpus")

PathLike = str | os.PathLike[str]


class CorpusError(ValueError):
    """A corpus file that cannot be read: unknown format, or a malformed line in strict mode."""


class _Malformed(Exception):
    """Raised by the line parsers; carries the reason only (the reader adds file and line)."""


def _is_gz(path: PathLike) -> bool:
    return os.fspath(path).lower().endswith(".gz")


def _open_binary(path: PathLike) -> tuple[IO[bytes], IO[bytes]]:
    """Return (stream to read lines from, raw file whose tell() is the position in the file on disk)."""
    raw = open(path, "rb", buffering=_BUFFER)  # noqa: SIM115 - closed by the caller
    if _is_gz(path):
        try:
            return gzip.GzipFile(fileobj=raw, mode="rb"), raw
        except BaseException:
            raw.close()
            raise
    return raw, raw


# --------------------------------------------------------------------------------------------------------- encoding

# Byte-order marks of the encodings a text file is most often saved in instead of UTF-8 (UTF-32-LE's starts with
# UTF-16-LE's, so it comes first), with the name iconv reads such a file by. A UTF-8 BOM is accepted everywhere.
_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32-LE", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32-BE", "UTF-32"),
    (b"\xff\xfe", "UTF-16-LE", "UTF-16"),
    (b"\xfe\xff", "UTF-16-BE", "UTF-16"),
)
_ENCODING_HEAD = 1 << 12


def _nul_pattern(head: bytes) -> str | None:
    """The UTF-16/32 variant whose NUL bytes sit where ``head``'s do (ASCII text saved without a BOM), or None."""
    n = len(head) - len(head) % 4
    if n < 4:
        return None
    per = n // 4
    nuls = [head[r:n:4].count(0) for r in range(4)]
    if min(nuls[1:]) >= 0.9 * per and nuls[0] < 0.5 * per:
        return "UTF-32-LE"
    if min(nuls[:3]) >= 0.9 * per and nuls[3] < 0.5 * per:
        return "UTF-32-BE"
    even, odd = nuls[0] + nuls[2], nuls[1] + nuls[3]
    if odd >= 0.6 * 2 * per and even < 0.2 * 2 * per:
        return "UTF-16-LE"
    if even >= 0.6 * 2 * per and odd < 0.2 * 2 * per:
        return "UTF-16-BE"
    return None


def wrong_encoding(head: bytes) -> str | None:
    """Why a file starting with ``head`` is not UTF-8 text as a whole, or None: a UTF-16/32 byte-order mark, NUL
    bytes where UTF-16/32 puts them (the same without a BOM), or any other NUL byte (binary data). A UTF-8 BOM
    is fine. Invalid UTF-8 sequences are left to the line readers, which name the line and byte.

    >>> wrong_encoding("{}".encode("utf-16"))
    'not UTF-8 (looks like UTF-16-LE: it has a byte-order mark); convert it with iconv -f UTF-16 -t UTF-8'
    >>> wrong_encoding(b"\\xef\\xbb\\xbf{}") is None
    True
    """
    for bom, name, iconv in _BOMS:
        if head.startswith(bom):
            return (
                f"not UTF-8 (looks like {name}: it has a byte-order mark); convert it with iconv -f {iconv} -t UTF-8"
            )
    if b"\x00" not in head:
        return None
    guess = _nul_pattern(head)
    if guess is None:
        return "not UTF-8 text (it holds NUL bytes: a binary file, or UTF-16/32 text that is not plain ASCII?)"
    return (
        f"not UTF-8 (looks like {guess} without a byte-order mark: NUL bytes sit between the characters); "
        f"convert it with iconv -f {guess.replace('-LE', 'LE').replace('-BE', 'BE')} -t UTF-8"
    )


def encoding_error(path: PathLike) -> str | None:
    """``"PATH: <why>"`` when the file is not UTF-8 text as a whole (see :func:`wrong_encoding`; ``.gz`` files are
    looked at decompressed), None when it looks like UTF-8 or cannot be read (its reader reports that)."""
    try:
        stream, raw = _open_binary(path)
    except OSError:
        return None
    try:
        head = stream.read(_ENCODING_HEAD)
    except (OSError, EOFError, zlib.error):
        return None
    finally:
        stream.close()
        raw.close()
    problem = wrong_encoding(head)
    return None if problem is None else f"{os.fspath(path)}: {problem}"


def _invalid_utf8(path: PathLike, line: int, data: bytes, exc: UnicodeDecodeError) -> str:
    """``PATH:LINE: invalid UTF-8 at byte N ...`` for ``exc`` raised decoding ``data``; N counts from 0 at the
    start of the line (``data`` may be the line or the whole file)."""
    line_start = data.rfind(b"\n", 0, exc.start) + 1
    return (
        f"{os.fspath(path)}:{line}: invalid UTF-8 at byte {exc.start - line_start} (0x{data[exc.start]:02x}: "
        f"{exc.reason}); the file is not UTF-8 (Latin-1 or Windows-1252?): convert it with iconv -f LATIN1 -t UTF-8"
    )


# ---------------------------------------------------------------------------------------------------------- parsers


def _check_id(pid: Any) -> str:
    if type(pid) is str:
        if pid:
            return pid
        raise _Malformed("empty id")
    if pid is None:
        raise _Malformed("missing id")
    if isinstance(pid, int) and not isinstance(pid, bool):
        return str(pid)
    raise _Malformed(f"id must be a string or integer, got {type(pid).__name__}")


def _load_object(line: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except UnicodeDecodeError as e:
        raise _Malformed(f"invalid UTF-8 ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise _Malformed(f"invalid JSON ({e})") from None
    except RecursionError:
        raise _Malformed("invalid JSON (nested too deeply)") from None
    if type(obj) is not dict:
        raise _Malformed(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def split_contents(contents: str) -> tuple[str, str]:
    """Split Search-R1 ``contents`` into (title, text).

    >>> split_contents('"Paris"\\nParis is the capital of France.')
    ('Paris', 'Paris is the capital of France.')
    >>> split_contents("no title here")
    ('', 'no title here')
    """
    nl = contents.find("\n")
    if nl < 0:
        return "", contents.strip()
    title = contents[:nl].strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return title, contents[nl + 1 :].strip()


def _object_and_id(line: bytes) -> tuple[dict[str, Any], Any]:
    """A jsonl line's object and its ``id`` (checked: a non-empty string, or a number :func:`_check_id` takes)."""
    obj = _load_object(line)
    pid = obj.get("id")
    if type(pid) is not str or not pid:
        pid = _check_id(pid)
    return obj, pid


def _parse_searchr1(line: bytes) -> Passage:
    obj, pid = _object_and_id(line)
    contents = obj.get("contents")
    if type(contents) is not str:
        raise _Malformed("missing contents" if contents is None else "contents is not a string")
    title, text = split_contents(encodable(contents))
    if not text:
        raise _Malformed("empty text")
    pid = encodable(pid)
    if len(obj) == 2:
        return Passage(pid, title, text)
    return Passage(pid, title, text, meta={k: v for k, v in obj.items() if k != "id" and k != "contents"})


_JSONL_KEYS = frozenset(("id", "title", "text", "meta", "score"))


def _parse_jsonl(line: bytes) -> Passage:
    obj, pid = _object_and_id(line)
    text = obj.get("text")
    if type(text) is not str:
        raise _Malformed("missing text" if text is None else "text is not a string")
    if not text or text.isspace():
        raise _Malformed("empty text")
    title = obj.get("title")
    if type(title) is not str:
        if title is not None:
            raise _Malformed("title is not a string")
        title = ""
    # JSON escapes can spell lone surrogates, which no UTF-8 writer accepts.
    pid, title, text = encodable(pid), encodable(title), encodable(text)
    if len(obj) <= 3 and ("title" in obj or len(obj) == 2):
        return Passage(pid, title, text)
    # A line written by Passage.to_dict(): its meta dict is taken over, a null score dropped.
    meta = obj.get("meta")
    meta = dict(meta) if isinstance(meta, dict) else ({} if "meta" not in obj else {"meta": meta})
    if obj.get("score") is not None:
        meta["score"] = obj["score"]
    meta.update((k, v) for k, v in obj.items() if k not in _JSONL_KEYS)
    return Passage(pid, title, text, meta=meta)


def _parse_tsv_fields(fields: list[str]) -> Passage:
    if len(fields) != 3:
        raise _Malformed(f"expected 3 tab-separated columns (id, text, title), got {len(fields)}")
    pid, text, title = fields
    if not pid:
        raise _Malformed("empty id")
    if not text or text.isspace():
        raise _Malformed("empty text")
    return Passage(pid, title, text)


def _parse_tsv(line: bytes) -> Passage:
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Malformed(f"invalid UTF-8 ({e.reason} at byte {e.start})") from None
    s = s.rstrip("\r\n")
    if '"' not in s:
        return _parse_tsv_fields(s.split("\t"))
    try:
        fields = next(csv.reader((s,), delimiter="\t", strict=True))
    except csv.Error as e:
        raise _Malformed(f"bad quoting ({e})") from None
    return _parse_tsv_fields(fields)


_LINE_PARSERS: dict[str, Callable[[bytes], Passage]] = {
    "searchr1": _parse_searchr1,
    "jsonl": _parse_jsonl,
    "tsv": _parse_tsv,
}

_TSV_HEADER = ("id", "text", "title")


# -------------------------------------------------------------------------------------------------------- detection


def _looks_like_summaries(head: str) -> bool:
    """True when ``head`` (the start of a JSON file) opens an object whose first value is an object with "extract"."""
    s = head.lstrip("\ufeff \t\r\n")
    if not s.startswith("{"):
        return False
    dec = json.JSONDecoder()
    try:
        i = len(s) - len(s[1:].lstrip())
        key, i = dec.raw_decode(s, i)
        rest = s[i:].lstrip()
        if not isinstance(key, str) or not rest.startswith(":"):
            return False
        rest = rest[1:].lstrip()
        value, _ = dec.raw_decode(rest)
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict) and "extract" in value


def _unreadable(path: PathLike, line: int | None, exc: BaseException) -> CorpusError:
    """``PATH[:LINE]: cannot read (...)`` for a broken .gz (bad header, cut short, corrupt data) or an I/O error."""
    where = f"{os.fspath(path)}:{line}" if line else os.fspath(path)
    what = "the .gz file is damaged" if _is_gz(path) else "I/O error"
    return CorpusError(f"{where}: cannot read, {what} ({type(exc).__name__}: {exc})")


def _sniff_lines(path: PathLike) -> tuple[str | None, str | None]:
    """Format of the first non-empty line that parses as a JSON object (or None), and the message for the first
    line that is not UTF-8 before it (or None)."""
    stream, raw = _open_binary(path)
    n = 0
    bad_utf8: str | None = None
    try:
        for n, line in enumerate(stream):  # noqa: B007 - n names the line a broken .gz stops at
            if n >= _SNIFF_LINES:
                break
            if line.isspace():
                continue
            try:
                obj = json.loads(line)
            except UnicodeDecodeError as e:
                bad_utf8 = bad_utf8 or _invalid_utf8(path, n + 1, line, e)
                continue
            except (ValueError, RecursionError):
                continue
            if isinstance(obj, dict):
                if "contents" in obj:
                    return "searchr1", bad_utf8
                if "text" in obj:
                    return "jsonl", bad_utf8
                return None, bad_utf8
    except (OSError, EOFError, zlib.error) as e:
        raise _unreadable(path, n + 1, e) from None
    finally:
        stream.close()
        raw.close()
    return None, bad_utf8


def detect_format(path: PathLike) -> str:
    """Guess a corpus file's format from its extension (``.gz`` stripped) and its first entry.

    ``.tsv`` is ``tsv``; a ``.json`` file holding one object of objects with an ``extract`` key is
    ``wiki-summaries``; otherwise the first non-empty line that parses as JSON decides: a ``contents`` key means
    ``searchr1``, a ``text`` key ``jsonl``. Raises :class:`CorpusError` when it cannot tell, naming the encoding
    when the file is not UTF-8 (:func:`encoding_error`, or the first line that is not).
    """
    name = os.fspath(path).lower()
    if name.endswith(".gz"):
        name = name[:-3]
    ext = os.path.splitext(name)[1]
    if ext == ".tsv":
        return "tsv"
    if not os.path.exists(path):
        raise FileNotFoundError(f"corpus file not found: {os.fspath(path)}")
    if (problem := encoding_error(path)) is not None:
        raise CorpusError(problem)
    if ext == ".json":
        stream, raw = _open_binary(path)
        try:
            head = stream.read(_SNIFF_BYTES).decode("utf-8", errors="replace")
        except (OSError, EOFError, zlib.error) as e:
            raise _unreadable(path, None, e) from None
        finally:
            stream.close()
            raw.close()
        if _looks_like_summaries(head):
            return "wiki-summaries"
    found, bad_utf8 = _sniff_lines(path)
    if found is not None:
        return found
    if bad_utf8 is not None:
        raise CorpusError(bad_utf8)
    raise CorpusError(
        f"{os.fspath(path)}: cannot tell the corpus format (expected .tsv, a Wikipedia summaries .json, or JSON "
        f"lines with a 'contents' or 'text' key); pass --format ({', '.join(FORMATS)})"
    )


# ----------------------------------------------------------------------------------------------------------- reader


class CorpusReader:
    """Iterate over a corpus file's passages, one at a time.

    Each ``iter()`` starts a new pass and resets the counters. A malformed line (invalid JSON, not an object, a
    missing or empty id, missing ``contents``/``text``, a wrong number of tsv columns, empty text) raises
    :class:`CorpusError` ``"PATH:LINE: reason"`` in strict mode; otherwise it is skipped and counted in ``skipped``,
    the first 20 messages are kept in ``errors``, and one warning with :meth:`summary` is logged (logger
    ``sleuth.corpus``) at the end of a pass that skipped lines. Blank lines are ignored. ``bytes_read`` and
    ``total_bytes`` are positions in the file on disk (compressed for ``.gz``), for progress bars.
    """

    def __init__(self, path: PathLike, format: str | None = None, strict: bool = False) -> None:
        self.path: str = os.fspath(path)
        if format is None:
            format = detect_format(path)
        elif format not in FORMATS:
            raise CorpusError(f"unknown corpus format {format!r}; known: {', '.join(FORMATS)}")
        if (problem := encoding_error(path)) is not None:  # UTF-16/32: every line would be skipped as malformed
            raise CorpusError(problem)
        self.format: str = format
        self.strict: bool = strict
        self.read: int = 0
        self.skipped: int = 0
        self.errors: list[str] = []
        self.total_bytes: int | None = os.path.getsize(self.path) if os.path.exists(self.path) else None
        self._raw: IO[bytes] | None = None
        self._final_bytes: int | None = 0

    def __repr__(self) -> str:
        return f"CorpusReader({self.path!r}, format={self.format!r}, strict={self.strict})"

    @property
    def bytes_read(self) -> int | None:
        """Bytes of the file on disk consumed so far (compressed bytes for ``.gz``; None if unknown)."""
        raw = self._raw
        if raw is not None and not raw.closed:
            try:
                return raw.tell()
            except (OSError, ValueError):
                return None
        return self._final_bytes

    def summary(self) -> str:
        """One line: how many passages were read and how many lines were skipped, with the first error."""
        out = f"read {self.read:,} passages from {self.path}"
        if self.skipped:
            if self.format == "wiki-summaries":
                unit = "entry" if self.skipped == 1 else "entries"
            else:
                unit = "line" if self.skipped == 1 else "lines"
            out += f"; skipped {self.skipped:,} malformed {unit} (first: {self.errors[0]})"
        return out

    def _bad(self, where: str, reason: str) -> None:
        message = f"{self.path}:{where}: {reason}"
        if self.strict:
            raise CorpusError(message)
        self.skipped += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(message)

    def __iter__(self) -> Iterator[Passage]:
        self.read = 0
        self.skipped = 0
        self.errors = []
        self._final_bytes = 0
        if self.format == "wiki-summaries":
            yield from self._iter_summaries()
        else:
            yield from self._iter_lines()
        if self.skipped:
            logger.warning(self.summary())

    def _open(self) -> IO[bytes]:
        stream, raw = _open_binary(self.path)
        self._raw = raw
        return stream

    def _close(self, stream: IO[bytes]) -> None:
        raw = self._raw
        try:
            self._final_bytes = raw.tell() if raw is not None and not raw.closed else None
        except (OSError, ValueError):
            self._final_bytes = None
        stream.close()
        if raw is not None:
            raw.close()
        self._raw = None

    def _iter_lines(self) -> Iterator[Passage]:
        parse = _LINE_PARSERS[self.format]
        stream = self._open()
        try:
            lineno = 0
            for lineno, line in enumerate(stream, 1):  # noqa: B007 - lineno is used after the loop too
                if line.isspace():
                    continue
                if lineno == 1:
                    if line.startswith(b"\xef\xbb\xbf"):
                        line = line[3:]
                    if self.format == "tsv" and tuple(line.decode("utf-8", "replace").rstrip("\r\n").split("\t")) == (
                        _TSV_HEADER
                    ):
                        continue
                try:
                    passage = parse(line)
                except _Malformed as e:
                    self._bad(str(lineno), str(e))
                    continue
                self.read += 1
                yield passage
        except (OSError, EOFError, zlib.error) as e:
            raise _unreadable(self.path, lineno + 1, e) from None
        finally:
            self._close(stream)

    def _iter_summaries(self) -> Iterator[Passage]:
        stream = self._open()
        try:
            try:
                content = stream.read()
                data = json.loads(content)
            except (OSError, EOFError, zlib.error) as e:
                raise _unreadable(self.path, None, e) from None
            except UnicodeDecodeError as e:
                line = content.count(b"\n", 0, e.start) + 1
                raise CorpusError(_invalid_utf8(self.path, line, content, e)) from None
            except (ValueError, RecursionError) as e:
                raise CorpusError(f"{self.path}: not a valid wiki-summaries JSON file ({e})") from None
        finally:
            self._close(stream)
        if not isinstance(data, dict):
            raise CorpusError(f"{self.path}: wiki-summaries file must hold one JSON object, got {type(data).__name__}")
        for key, entry in data.items():
            if not isinstance(entry, dict):
                self._bad(f"entry {key!r}", f"expected an object, got {type(entry).__name__}")
                continue
            extract = entry.get("extract")
            if not isinstance(extract, str) or not extract.strip():
                self._bad(f"entry {key!r}", "missing or empty extract")
                continue
            if not key:
                self._bad(f"entry {key!r}", "empty title")
                continue
            title = entry.get("title")
            meta = {"description": entry.get("description", ""), "topic": entry.get("topic", "")}
            self.read += 1
            title = title if isinstance(title, str) else key
            yield Passage(encodable(key), encodable(title), encodable(extract), meta=meta)


def read_corpus(path: PathLike, format: str | None = None, strict: bool = False) -> Iterator[Passage]:
    """Yield the passages of a corpus file; see :class:`CorpusReader` for formats and error handling."""
    return iter(CorpusReader(path, format=format, strict=strict))
