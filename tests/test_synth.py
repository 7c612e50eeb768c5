"""Tests for sleuth.data.synth: the synthetic multi-hop world.

The central checks follow every gold decomposition through the documents with :func:`follow_decomposition` (a
parser of the generator's own sentence templates, which only sees the passages it is given): the supporting
documents must yield each gold intermediate answer and the gold final answer, every supporting document must be
needed, and the distractor documents alone must yield nothing.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sleuth.corpus import CorpusReader
from sleuth.data import LOADERS, load_examples
from sleuth.data.synth import (
    RELATIONS,
    SPLITS,
    SynthConfig,
    World,
    follow_decomposition,
    generate_world,
    load_synth,
    mentioned_titles,
    parse_subquestion,
    read_facts,
    synthesize,
    write_world,
)
from sleuth.records import Passage

ROOT = Path(__file__).resolve().parents[1]
SMALL = {
    "train_entities": 80,
    "dev_entities": 40,
    "test_entities": 40,
    "train_questions": 120,
    "dev_questions": 40,
    "test_questions": 40,
}


def small(**knobs: Any) -> SynthConfig:
    return SynthConfig(**{**SMALL, **knobs})


@pytest.fixture(scope="module")
def rich() -> World:
    """Paraphrase level 2 (pronouns, three templates each), contexts on."""
    return generate_world(small(seed=7, paraphrase=2, context=True, filler_sentences=3))


@pytest.fixture(scope="module")
def plain() -> World:
    """Paraphrase level 0, one-hop to four-hop bridges."""
    return generate_world(small(seed=3, paraphrase=0, min_hops=1, max_hops=4))


def examples(world: World):
    for split in SPLITS:
        yield from world.splits[split]


def docs(world: World, ids: list[str]) -> list[Passage]:
    return [world.passage(i) for i in ids]


def strip_the(text: str) -> str:
    return text[4:] if text.lower().startswith("the ") else text


def file_digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


# ---------------------------------------------------------------------------------------------------- determinism


def test_same_seed_gives_byte_identical_files(tmp_path: Path) -> None:
    config = small(seed=11, paraphrase=2)
    write_world(generate_world(config), tmp_path / "a")
    write_world(generate_world(config), tmp_path / "b")
    a, b = file_digests(tmp_path / "a"), file_digests(tmp_path / "b")
    assert sorted(a) == ["corpus.jsonl", "dev.jsonl", "test.jsonl", "train.jsonl", "world.json"]
    assert a == b
    # another process with another string-hash seed: no set or dict order leaks into the output
    code = (
        "import sys, json; from sleuth.data.synth import synthesize, SynthConfig; "
        "synthesize(sys.argv[1], SynthConfig.from_dict(json.loads(sys.argv[2])))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    args = [sys.executable, "-c", code, str(tmp_path / "c"), json.dumps(config.to_dict())]
    subprocess.run(args, check=True, env=env, timeout=60)
    assert file_digests(tmp_path / "c") == a


def test_different_seed_gives_a_different_world() -> None:
    a, b = generate_world(small(seed=1)), generate_world(small(seed=2))
    assert {p.title for p in a.corpus} != {p.title for p in b.corpus}
    assert [ex.question for ex in a.splits["train"]] != [ex.question for ex in b.splits["train"]]
    assert a.corpus[0].id == "synth-1-e0" and b.corpus[0].id == "synth-2-e0"


# ---------------------------------------------------------------------------------------------------- splits


@pytest.mark.parametrize("name", ["rich", "plain"])
def test_splits_use_disjoint_entity_sets(name: str, request: pytest.FixtureRequest) -> None:
    world: World = request.getfixturevalue(name)
    own = {split: {e.id for e in world.entities if e.split == split} for split in SPLITS}
    for x, y in itertools.combinations(SPLITS, 2):
        assert not own[x] & own[y]
    assert set().union(*own.values()) == {p.id for p in world.corpus}
    for split in SPLITS:
        used: set[str] = set()
        for ex in world.splits[split]:
            used.update(ex.supporting_ids, ex.metadata["entity_ids"], ex.metadata["distractor_ids"])
            used.update(p.id for p in ex.context)
            for step in ex.decomposition:
                used.update(step["supporting_ids"])
        assert used <= own[split], f"{split} questions use other splits' entities"
        assert len(world.splits[split]) == world.config.questions(split)


# ---------------------------------------------------------------------------------------------------- answerability


@pytest.mark.parametrize("name", ["rich", "plain"])
def test_gold_decomposition_through_supporting_documents_gives_each_gold_answer(
    name: str, request: pytest.FixtureRequest
) -> None:
    world: World = request.getfixturevalue(name)
    for ex in examples(world):
        steps = ex.decomposition
        assert steps and ex.answers
        supporting = docs(world, ex.supporting_ids)
        assert follow_decomposition(steps, supporting) in ex.answers, ex.question
        assert steps[-1]["answer"] in ex.answers
        gold: dict[int, str] = {}
        for k, step in enumerate(steps, 1):
            # the prefix of the decomposition, followed through the supporting documents, gives this step's answer
            assert strip_the(follow_decomposition(steps[:k], supporting) or "") == step["answer"], (ex.id, k)
            # and the step's own supporting document states it next to the step's subject
            question = step["question"]
            for j in sorted(gold, reverse=True):
                question = question.replace(f"#{j}", gold[j])
            if step["supporting_ids"]:
                (doc,) = docs(world, step["supporting_ids"])
                ((relation, subject),) = parse_subquestion(question)
                assert strip_the(subject) == doc.title
                assert read_facts([doc], relation, subject) == [step["answer"]]
            gold[k] = step["answer"]


@pytest.mark.parametrize("name", ["rich", "plain"])
def test_every_supporting_document_is_needed(name: str, request: pytest.FixtureRequest) -> None:
    world: World = request.getfixturevalue(name)
    for ex in examples(world):
        supporting = docs(world, ex.supporting_ids)
        assert len(supporting) == ex.metadata["hops"]
        for i in range(len(supporting)):
            rest = supporting[:i] + supporting[i + 1 :]
            assert follow_decomposition(ex.decomposition, rest) is None, (ex.id, supporting[i].id)


@pytest.mark.parametrize("name", ["rich", "plain"])
def test_questions_are_not_answerable_from_their_distractors(name: str, request: pytest.FixtureRequest) -> None:
    world: World = request.getfixturevalue(name)
    titles = [p.title for p in world.corpus]
    for ex in examples(world):
        distractors = docs(world, ex.metadata["distractor_ids"])
        assert len(distractors) == world.config.distractors
        assert not set(ex.metadata["distractor_ids"]) & set(ex.supporting_ids)
        assert follow_decomposition(ex.decomposition, distractors) is None, ex.id
        # with the supporting documents, distractors do not make any step ambiguous
        assert follow_decomposition(ex.decomposition, docs(world, ex.supporting_ids) + distractors) in ex.answers
        # no distractor names a step's subject together with that step's answer
        for step in ex.decomposition:
            if not step["supporting_ids"]:
                continue
            subject = world.passage(step["supporting_ids"][0]).title
            for d in distractors:
                named = mentioned_titles(d.text, titles) | {d.title}
                if step["answer"] in titles:
                    assert not {subject, step["answer"]} <= named, (ex.id, step, d.id)
                else:
                    assert not (subject in named and re.search(rf"\b{re.escape(step['answer'])}\b", d.text))


def test_distractors_share_surface_words_with_the_chain(rich: World) -> None:
    def stems(title: str) -> set[str]:
        return {w[:4].lower() for w in title.split() if w not in ("River",)}

    sharing = 0
    for ex in examples(rich):
        chain = set().union(*(stems(rich.passage(i).title) for i in ex.metadata["entity_ids"]))
        if any(stems(rich.passage(i).title) & chain for i in ex.metadata["distractor_ids"]):
            sharing += 1
    assert sharing >= 0.6 * sum(len(v) for v in rich.splits.values())


def test_whole_corpus_is_consistent_and_answers_the_questions(rich: World) -> None:
    """Over all documents: one reading per sentence, one object per (subject, relation), and every question holds."""
    facts: dict[tuple[str, str], set[str]] = {}
    for p in rich.corpus:
        for sentence in re.split(r"(?<=\.)\s+", p.text):
            one = Passage(id=p.id, title=p.title, text=sentence)
            readings = [r for r in RELATIONS if read_facts([one], r, p.title)]
            assert len(readings) <= 1, sentence
            for r in readings:
                facts.setdefault((p.title, r), set()).update(read_facts([one], r, p.title))
    assert facts and all(len(v) == 1 for v in facts.values())
    for split in SPLITS:
        pool = [p for p in rich.corpus if p.meta["split"] == split]
        for ex in rich.splits[split][:40]:
            assert follow_decomposition(ex.decomposition, pool) in ex.answers


# ---------------------------------------------------------------------------------------------------- questions


@pytest.mark.parametrize(("lo", "hi"), [(1, 1), (2, 3), (3, 4), (4, 4), (2, 4)])
def test_hop_counts_stay_within_the_range(lo: int, hi: int) -> None:
    comparisons = 0.3 if any(lo <= h <= hi for h in (2, 4)) else 0.0
    world = generate_world(small(seed=5, min_hops=lo, max_hops=hi, comparison_fraction=comparisons))
    hops = Counter()
    for ex in examples(world):
        n = ex.metadata["hops"]
        hops[n] += 1
        assert lo <= n <= hi
        fact_steps = [s for s in ex.decomposition if s["supporting_ids"]]
        assert len(fact_steps) == n == len(ex.supporting_ids)
        assert len(ex.decomposition) == n + (ex.metadata["type"] == "comparison")
        lines = ex.metadata["decomposition_text"].split("\n")
        assert lines == [f"### Q{k}: {s['question']}" for k, s in enumerate(ex.decomposition, 1)]
        for k, step in enumerate(ex.decomposition, 1):
            assert all(int(j) < k for j in re.findall(r"#(\d+)", step["question"]))
    assert set(hops) == set(range(lo, hi + 1))
    kinds = Counter(ex.metadata["type"] for ex in world.splits["train"])
    assert kinds["comparison"] == round(comparisons * world.config.train_questions)


def test_bridge_questions_chain_references_and_comparisons_compare(plain: World) -> None:
    for ex in examples(plain):
        steps = ex.decomposition
        if ex.metadata["type"] == "bridge":
            assert "#" not in steps[0]["question"]
            for k in range(2, len(steps) + 1):
                assert f"#{k - 1}" in steps[k - 1]["question"]
        else:
            last = steps[-1]
            assert not last["supporting_ids"] and last["answer"] in ex.answers
            hops = ex.metadata["hops"]
            assert re.findall(r"#(\d+)", last["question"]) == [str(k) for k in range(1, hops + 1)]
            if hops == 4:  # the compared entities are the bridge answers #1 and #3
                assert last["answer"] in (steps[0]["answer"], steps[2]["answer"])


def test_composed_question_is_built_from_the_chain(plain: World) -> None:
    """Each bridge question is the last relation's question about the nested phrases of the earlier ones."""
    for ex in examples(plain):
        if ex.metadata["type"] != "bridge":
            continue
        relations = ex.metadata["relations"]
        start = plain.passage(ex.supporting_ids[0]).title
        phrase = f"the {start}" if start.endswith(" River") else start
        for r in relations[:-1]:
            phrase = RELATIONS[r].phrases[0].format(x=phrase)
        expected = RELATIONS[relations[-1]].questions[0].format(x=phrase)
        assert ex.question == expected[0].upper() + expected[1:]


def test_answers_and_bridge_entities_are_not_spelled_in_the_question(rich: World) -> None:
    for ex in examples(rich):
        hidden = ex.metadata["entity_ids"][1:]
        if ex.metadata["type"] == "comparison":
            if ex.metadata["hops"] == 2:
                continue  # "Which is older, A or B?" names its candidates
            hidden = [i for i in ex.metadata["entity_ids"] if i not in ex.supporting_ids[::2]]
        for pid in hidden:
            assert not re.search(rf"\b{re.escape(rich.passage(pid).title)}\b", ex.question), (ex.question, pid)
        if ex.metadata["type"] == "bridge":
            assert not any(re.search(rf"\b{re.escape(a)}\b", ex.question) for a in ex.answers)


def test_names_are_unique_and_ids_readable(rich: World) -> None:
    titles = [p.title for p in rich.corpus]
    assert len(set(titles)) == len(titles)
    assert [p.id for p in rich.corpus] == [f"synth-7-e{i}" for i in range(len(rich.corpus))]
    assert [e.name for e in rich.entities] == titles
    assert {e.type for e in rich.entities} == {"person", "city", "country", "organisation", "river"}
    assert rich.splits["dev"][3].id == "synth-7-dev-3"


def test_context_option_holds_supporting_and_distractor_documents(rich: World, plain: World) -> None:
    for ex in examples(rich):
        ids = [p.id for p in ex.context]
        assert sorted(ids) == sorted(ex.supporting_ids + ex.metadata["distractor_ids"])
        assert all(p.text == rich.passage(p.id).text for p in ex.context)
    assert all(ex.context == [] for ex in examples(plain))


# ---------------------------------------------------------------------------------------------------- files


def test_written_world_reads_back(tmp_path: Path) -> None:
    world = generate_world(small(seed=4))
    info = write_world(world, tmp_path)
    reader = CorpusReader(tmp_path / "corpus.jsonl", strict=True)
    assert reader.format == "searchr1"
    passages = list(reader)
    ids = [p.id for p in passages]
    assert len(ids) == len(set(ids)) == len(world.corpus)
    assert [(p.id, p.title, p.text) for p in passages] == [(p.id, p.title, p.text) for p in world.corpus]
    for split in SPLITS:
        loaded = load_examples(tmp_path / f"{split}.jsonl", format="synth")
        assert loaded == world.splits[split]
        assert all(set(ex.supporting_ids) <= set(ids) for ex in loaded)
    assert LOADERS["synth"] is load_synth
    saved = json.loads((tmp_path / "world.json").read_text())
    assert saved == json.loads(json.dumps(info))
    assert SynthConfig.from_dict(saved["config"]) == world.config
    assert saved["counts"]["documents"] == len(world.corpus)
    assert saved["counts"]["questions"]["dev"]["total"] == SMALL["dev_questions"]


def test_synthesize_applies_knobs(tmp_path: Path) -> None:
    info = synthesize(tmp_path, small(), seed=9, max_hops=3, comparison_fraction=0.0)
    assert info["config"]["seed"] == 9 and info["config"]["max_hops"] == 3
    assert set(info["counts"]["questions"]["train"]["hops"]) == {"2", "3"}
    assert info["counts"]["questions"]["train"]["comparison"] == 0
    first = json.loads((tmp_path / "corpus.jsonl").read_text().splitlines()[0])
    assert first["id"] == "synth-9-e0" and first["contents"].startswith('"')


# ---------------------------------------------------------------------------------------------------- knobs


def _template_shapes(world: World) -> set[str]:
    """Sentences with names and numbers blanked: the distinct sentence templates a world uses."""
    names = sorted((p.title for p in world.corpus), key=len, reverse=True)
    pattern = re.compile("|".join(re.escape(n) for n in names))
    shapes = set()
    for p in world.corpus:
        for sentence in re.split(r"(?<=\.)\s+", p.text)[1:]:  # skip the lead sentence
            shapes.add(re.sub(r"[\d,]+\d", "N", pattern.sub("E", sentence)))
    return shapes


def _question_shapes(world: World) -> set[str]:
    names = sorted((p.title for p in world.corpus), key=len, reverse=True)
    pattern = re.compile("|".join(re.escape(n) for n in names))
    return {pattern.sub("E", s["question"]) for ex in examples(world) for s in ex.decomposition}


def test_paraphrase_level_adds_templates() -> None:
    worlds = [generate_world(small(seed=2, paraphrase=level, filler_sentences=0)) for level in (0, 1, 2)]
    facts = [len(_template_shapes(w)) for w in worlds]
    questions = [len(_question_shapes(w)) for w in worlds]
    composed = [len({ex.question for ex in examples(w)}) for w in worlds]
    assert facts[0] < facts[1] < facts[2], facts
    assert questions[0] < questions[1] < questions[2], questions
    assert facts[0] == len(RELATIONS)  # one template per relation (founding years of cities and organisations alike)
    assert composed[0] == composed[2] == sum(SMALL[f"{s}_questions"] for s in SPLITS)

    # level 2 uses pronouns for the subject, levels 0 and 1 never do
    def pronouns(w: World) -> int:
        return sum(bool(re.search(r"(?:^|\. )(?:He|She|It) ", p.text)) for p in w.corpus)

    assert pronouns(worlds[0]) == pronouns(worlds[1]) == 0 < pronouns(worlds[2])


def test_more_distractors_and_fillers_mean_more_documents_and_sentences() -> None:
    few = generate_world(small(seed=6, distractors=2, filler_sentences=0))
    many = generate_world(small(seed=6, distractors=10, filler_sentences=4))
    count = lambda w: [len(ex.metadata["distractor_ids"]) for ex in examples(w)]  # noqa: E731
    assert set(count(few)) == {2} and set(count(many)) == {10}
    assert many.counts()["sentences"] == few.counts()["sentences"] + 4 * len(few.corpus)
    none = generate_world(small(seed=6, distractors=0))
    assert all(ex.metadata["distractor_ids"] == [] for ex in examples(none))


def test_lookalike_rate_controls_shared_name_stems() -> None:
    def shared(world: World) -> float:
        words = Counter(w[:4] for p in world.corpus for w in p.title.split() if w != "River")
        return sum(n for n in words.values() if n > 1) / sum(words.values())

    low = shared(generate_world(small(seed=8, lookalike_rate=0.0)))
    high = shared(generate_world(small(seed=8, lookalike_rate=0.9)))
    assert high > low + 0.3, (low, high)


def test_numeric_and_comparison_fractions() -> None:
    world = generate_world(small(seed=1, numeric_fraction=1.0, comparison_fraction=0.0))
    assert all(ex.metadata["answer_type"] == "number" for ex in examples(world))
    assert all(re.fullmatch(r"[\d,]+", ex.decomposition[-1]["answer"]) for ex in examples(world))
    world = generate_world(small(seed=1, numeric_fraction=0.0, comparison_fraction=1.0))
    assert all(ex.metadata["type"] == "comparison" for ex in examples(world))


@pytest.mark.parametrize(
    "knobs",
    [
        {"min_hops": 0},
        {"min_hops": 3, "max_hops": 2},
        {"max_hops": 5},
        {"min_hops": 3, "max_hops": 3},  # comparisons have 2 or 4 hops
        {"paraphrase": 3},
        {"comparison_fraction": 1.5},
        {"distractors": -1},
        {"train_entities": 10},
        {"filler_sentences": 99},
    ],
)
def test_bad_configs_are_rejected(knobs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        small(**knobs)


def test_too_few_entities_for_the_questions_is_an_error() -> None:
    with pytest.raises(ValueError, match="raise dev_entities"):
        generate_world(small(dev_entities=20, dev_questions=5000, min_hops=1, max_hops=1, comparison_fraction=0))


def test_default_counts_match_the_documentation() -> None:
    doc = (ROOT / "docs" / "synthetic-world.md").read_text()
    counts = generate_world(SynthConfig()).counts()
    assert f"| documents | {counts['documents']:,} |" in doc
    for split in SPLITS:
        q = counts["questions"][split]
        hops = " | ".join(f"{q['hops'].get(str(h), 0):,}" for h in range(1, 5))
        row = f"| {split} | {sum(counts['entities'][split].values()):,} | {q['total']:,} | {q['bridge']:,} | "
        row += f"{q['comparison']:,} | {q['numeric_answers']:,} | {hops} |"
        assert row in doc, row
