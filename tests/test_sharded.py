"""Sharded search: the merged top-k of shards equals the top-k of the union for score-comparable shards."""

from __future__ import annotations

import json

import pytest

from sleuth.records import Passage
from sleuth.retrieval.base import RetrievalError, Retriever
from sleuth.retrieval.remote import RemoteRetriever, load_remote
from sleuth.retrieval.sharded import ShardedRetriever


class ScoredList(Retriever):
    """A real in-memory retriever over fixed (id, score) lists: score = word overlap with the query."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        results = []
        for q in queries:
            words = set(q.split())
            scored = [
                Passage(id=i, title=i, text=t, score=float(len(words & set(t.split())))) for i, t in self.texts.items()
            ]
            scored.sort(key=lambda p: (-(p.score or 0), p.id))
            results.append(scored[:k])
        return results


TEXTS = {f"d{i}": " ".join(f"w{j}" for j in range(i % 7, i % 7 + i % 5 + 1)) for i in range(40)}


def test_merged_shards_equal_the_whole() -> None:
    whole = ScoredList(TEXTS)
    items = list(TEXTS.items())
    shards = ShardedRetriever([ScoredList(dict(items[0::2])), ScoredList(dict(items[1::2]))])
    assert len(shards) == len(whole)
    queries = ["w1 w2 w3", "w6 w7", "w0", "nothing"]
    for merged, full in zip(shards.search(queries, 5), whole.search(queries, 5), strict=True):
        assert [p.score for p in merged] == [p.score for p in full]


def test_unscored_shards_are_refused() -> None:
    class NoScores(ScoredList):
        def search(self, queries: list[str], k: int) -> list[list[Passage]]:
            return [[Passage(id="x", title="", text="")] for _ in queries]

    with pytest.raises(RetrievalError, match="without scores"):
        ShardedRetriever([NoScores({}), NoScores({})]).search(["q"], 1)
    with pytest.raises(RetrievalError, match="at least one shard"):
        ShardedRetriever([])


def test_remote_spec_with_several_urls_is_sharded() -> None:
    sharded = load_remote("127.0.0.1:9,127.0.0.1:10", {"timeout": "1"})
    assert isinstance(sharded, ShardedRetriever) and len(sharded.shards) == 2
    assert all(isinstance(s, RemoteRetriever) for s in sharded.shards)
    assert isinstance(load_remote("127.0.0.1:9", {}), RemoteRetriever)
    assert json.dumps(sharded.shards[0].describe())  # describable without contacting the server


def test_sharded_remote_over_two_real_servers() -> None:
    """Two shards behind two real servers on loopback, merged by `remote:URL1,URL2`."""
    from sleuth.retrieval import load_retriever
    from sleuth.serve import create_app
    from tests.test_serve import serving

    items = list(TEXTS.items())
    with (
        serving(create_app(ScoredList(dict(items[0::2])))) as a,
        serving(create_app(ScoredList(dict(items[1::2])))) as b,
    ):
        remote = load_retriever(f"remote:{a},{b}")
        assert isinstance(remote, ShardedRetriever)
        queries = ["w1 w2 w3", "w6 w7"]
        got = remote.search(queries, 4)
        want = ScoredList(TEXTS).search(queries, 4)
        assert [[p.score for p in r] for r in got] == [[p.score for p in r] for r in want]
        assert got[0][0].id == want[0][0].id
