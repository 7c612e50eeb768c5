"""The records that cross module boundaries: Passage, Example, Step, Trace.

They are plain dataclasses with a lossless JSON round trip (``from_dict(x.to_dict()) == x``). Everything an agent
does is written into a Trace, so evaluation, training data, debugging views and benchmarks all read one structure.

>>> p = Passage(id="7", title="Paris", text="Paris is the capital of France.")
>>> Passage.from_dict(p.to_dict()) == p
True
>>> p.contents
'"Paris"\\nParis is the capital of France.'
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def encodable(text: str) -> str:
    """``text`` made encodable as UTF-8: each lone surrogate becomes U+FFFD, a surrogate pair its character.

    Model replies (the OpenAI client decodes a JSON ``"\\ud800"`` escape to a lone surrogate), passages and
    dataset rows can carry code points that no UTF-8 writer accepts; they are replaced where text enters sleuth.
    Text without surrogates is returned as it is (one scan, no copy).

    >>> encodable("ANS-7 \\ud800")
    'ANS-7 \\ufffd'
    >>> encodable("\\ud83d\\ude00") == "\\U0001f600"
    True
    """
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def encodable_json(value: Any) -> Any:
    """A JSON-like value (dicts, lists, strings) with every string, keys included, made :func:`encodable`."""
    if isinstance(value, str):
        return encodable(value)
    if isinstance(value, list):
        return [encodable_json(v) for v in value]
    if isinstance(value, dict):
        return {encodable(k) if isinstance(k, str) else k: encodable_json(v) for k, v in value.items()}
    return value


def _check_keys(cls: type, data: dict[str, Any]) -> None:
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")


@dataclass
class Passage:
    """A retrievable unit of text. ``score`` is set by the retriever that returned it."""

    id: str
    title: str
    text: str
    score: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def contents(self) -> str:
        """The Search-R1 ``contents`` form: the title in double quotes, a newline, then the text."""
        return f'"{self.title}"\n{self.text}'

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Passage:
        _check_keys(cls, data)
        return cls(**data)


@dataclass
class Example:
    """One question (or claim, multiple-choice item, math problem) with its gold data.

    ``answers`` holds every accepted alias. ``context`` holds passages given with the question (HotpotQA's
    distractor paragraphs, a TAT-QA document); ``supporting_ids`` are the ids of the passages that support the
    answer, used as retrieval ground truth. ``decomposition`` is a gold decomposition when the dataset has one:
    a list of ``{"question", "answer", "supporting_ids"}`` dicts, questions possibly referring to ``#k``.
    """

    id: str
    question: str
    answers: list[str] = field(default_factory=list)
    kind: str = "qa"  # qa | claim | mcq | math
    context: list[Passage] = field(default_factory=list)
    supporting_ids: list[str] = field(default_factory=list)
    decomposition: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Example:
        _check_keys(cls, data)
        data = dict(data)
        data["context"] = [Passage.from_dict(p) for p in data.get("context", [])]
        return cls(**data)


@dataclass
class Step:
    """One thing an agent did: an LLM call, a search, a parse, a program run.

    For LLM steps ``messages`` (chat) or ``prompt`` (raw text) is what was sent, ``output`` the raw text that came
    back, ``parsed`` the value the agent took from it. ``fallback`` names the lenient rule used when the output did
    not follow the expected format (``None`` when it did); ``error`` holds an exception that the agent survived.
    For search steps ``query`` is what was searched and ``passages`` what came back.
    """

    kind: str
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    output: str | None = None
    parsed: Any = None
    query: str | None = None
    passages: list[Passage] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    fallback: str | None = None
    error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Step:
        _check_keys(cls, data)
        data = dict(data)
        data["passages"] = [Passage.from_dict(p) for p in data.get("passages", [])]
        return cls(**data)


@dataclass
class Trace:
    """Everything one agent run did for one example, in order, and what it answered.

    ``error`` is set when the agent raised: the example is kept (never dropped) and scored as unanswered.
    """

    example: Example
    method: str
    steps: list[Step] = field(default_factory=list)
    answer: str | None = None
    error: str | None = None
    seconds: float = 0.0
    started_at: float = field(default_factory=time.time)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, step: Step) -> Step:
        self.steps.append(step)
        return step

    @property
    def fallbacks(self) -> list[str]:
        return [s.fallback for s in self.steps if s.fallback]

    @property
    def llm_calls(self) -> int:
        return sum(1 for s in self.steps if s.messages is not None or s.prompt is not None)

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.steps)

    @property
    def completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        _check_keys(cls, data)
        data = dict(data)
        data["example"] = Example.from_dict(data["example"])
        data["steps"] = [Step.from_dict(s) for s in data.get("steps", [])]
        return cls(**data)

    def to_json(self) -> str:
        """One line of JSON that always encodes as UTF-8: lone surrogates are replaced (:func:`encodable`) and a
        value JSON cannot hold (a set, a numpy number, an exception in ``meta``) is written as its ``repr``."""
        return encodable(json.dumps(self.to_dict(), ensure_ascii=False, default=repr))

    @classmethod
    def from_json(cls, line: str) -> Trace:
        return cls.from_dict(json.loads(line))
