"""Tests for sleuth.data: benchmark loaders, format detection, row errors and open-mode corpora.

Real benchmark files are read from ``../shared/data`` (never copied into the repo); tests that need one skip when
it is absent. Formats without a real file there are tested on the small hand-written fixtures in
``tests/fixtures/datasets`` (invented content in the published schemas), and every loader also runs on minimal
synthetic records written to a temporary directory, so the loaders are exercised without the real data too.
"""

from __future__ import annotations

import csv
import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest

from sleuth.corpus import CorpusReader
from sleuth.data import (
    LOADERS,
    DatasetError,
    detect_format,
    iter_examples,
    load_examples,
    open_corpus,
    passage_id,
    write_open_corpus,
)
from sleuth.records import Example, Passage

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "datasets"


def real(rel: str) -> Path:
    path = DATA / rel
    if not path.exists():
        pytest.skip(f"real benchmark file {path} is absent (../shared/data is outside the repo and optional)")
    return path


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def write_json(path: Path, value: Any) -> Path:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=1), encoding="utf-8")
    return path


def by_id(example: Example) -> dict[str, Any]:
    return {p.id: p for p in example.context}


def assert_supporting_resolve(examples: list[Example]) -> None:
    """Context ids are unique and supporting ids point into the context (StrategyQA loaded without its
    paragraphs file is the one documented exception: its supporting ids are paragraph keys, the context empty)."""
    for ex in examples:
        ids = [p.id for p in ex.context]
        assert len(ids) == len(set(ids)), f"{ex.id}: duplicate passage ids in context"
        if ex.metadata.get("format") == "strategyqa" and not ex.context:
            continue
        assert set(ex.supporting_ids) <= set(ids), f"{ex.id}: supporting ids outside the context"
        for step in ex.decomposition or []:
            assert set(step["supporting_ids"]) <= set(ids), f"{ex.id}: step supporting ids outside the context"


def assert_refs_point_back(examples: list[Example]) -> None:
    """Every ``#k`` in a decomposition step i (1-based) refers to an earlier step: 1 <= k < i."""
    for ex in examples:
        for i, step in enumerate(ex.decomposition or [], start=1):
            for k in re.findall(r"#(\d+)", step["question"]):
                assert 1 <= int(k) < i, f"{ex.id}: step {i} refers to #{k}"


def read_back(path: Path) -> list[tuple[str, str, str]]:
    return [(p.id, p.title, p.text) for p in CorpusReader(path, format="searchr1", strict=True)]


# ------------------------------------------------------------------------------------------------ real files

REAL_FILES = [
    ("hotpotqa/hotpot.json", "hotpotqa", 200),
    ("hotpotqa/hotpotqa_train.json", "hotpotqa", 100),
    ("2wikimultihopqa/wikihop.json", "2wiki", 200),
    ("2wikimultihopqa/wikihop_train_preprocess.json", "2wiki", 500),
    ("musique/musique.json", "musique", 200),
    ("musique/musique_train.json", "musique", 100),
    ("musique/dev.json", "musique", 1960),
    ("strategyqa/strategy.json", "strategyqa", 229),
    ("gsm8k/test.jsonl", "gsm8k", 1319),
    ("tatqa/tatqa_dataset_dev.json", "tatqa", 1668),
    ("nq/test.jsonl", "flashrag", 1000),
    ("triviaqa/test.jsonl", "flashrag", 1000),
    ("popqa/test.jsonl", "flashrag", 1000),
    ("pubmedqa/test_set.json", "pubmedqa", 500),
    ("medqa/us_4options_test.jsonl", "medqa", 1273),
    ("fireact/hotpotqa_dev_questions.json", "hotpotqa", 7010),
]


@pytest.mark.parametrize(("rel", "fmt", "count"), REAL_FILES, ids=[r[0] for r in REAL_FILES])
def test_real_file_detects_loads_and_round_trips(rel: str, fmt: str, count: int) -> None:
    path = real(rel)
    assert detect_format(path) == fmt
    examples = load_examples(path)
    assert len(examples) == count
    assert len({e.id for e in examples}) == count, "example ids must be unique"
    assert all(e.question.strip() and e.metadata["format"] == fmt for e in examples)
    assert all(e.answers and all(isinstance(a, str) and a for a in e.answers) for e in examples)
    assert_supporting_resolve(examples)
    for ex in examples[:50]:
        assert Example.from_dict(json.loads(json.dumps(ex.to_dict()))) == ex


def test_hotpotqa_dev_real() -> None:
    examples = load_examples(real("hotpotqa/hotpot.json"))
    sizes = [len(e.context) for e in examples]
    assert sizes.count(10) >= 199 and max(sizes) == 10
    first = examples[0]
    assert first.id == "5a7f6fd75542992e7d278cfa"
    assert first.answers == ["Rush"] and first.kind == "qa" and first.decomposition is None
    assert first.metadata["type"] == "bridge" and first.metadata["level"] in ("easy", "medium", "hard")
    assert first.metadata["supporting_facts"] == [["Nobody's Hero", 0], ["Neil Peart", 1]]
    passages = by_id(first)
    assert [passages[i].title for i in first.supporting_ids] == ["Nobody's Hero", "Neil Peart"]
    porcaro = next(p for p in first.context if p.title == "Jeff Porcaro")
    assert porcaro.text.startswith("Jeffrey Thomas Porcaro (April 1, 1954")
    assert "record producer. In a career" in porcaro.text  # sentences carry their own leading space
    assert porcaro.id == passage_id("Jeff Porcaro", porcaro.text)
    for ex in examples:
        titles = {t for t, _ in ex.metadata["supporting_facts"]}
        assert {by_id(ex)[i].title for i in ex.supporting_ids} == titles


def test_hotpotqa_train_pools_into_the_hipporag_corpus() -> None:
    examples = load_examples(real("hotpotqa/hotpotqa_train.json"))
    corpus = json.loads(real("hotpotqa/hotpotqa_train_corpus.json").read_text(encoding="utf-8"))
    pooled = open_corpus(examples)
    assert len(pooled) == len(corpus) == 994
    assert {p.title: p.text for p in pooled} == {t: "".join(s).strip() for t, s in corpus.items()}
    ids = {p.id for p in pooled}
    assert all(set(e.supporting_ids) <= ids for e in examples)


def test_hotpotqa_questions_only_real() -> None:
    examples = load_examples(real("fireact/hotpotqa_dev_questions.json"))
    assert all(not e.context and not e.supporting_ids for e in examples)
    assert examples[0].answers == ["Crackle"] and examples[0].metadata["type"] == "bridge"
    assert examples[0].id == "hotpotqa_dev_questions-0"


def test_2wiki_dev_real() -> None:
    examples = load_examples(real("2wikimultihopqa/wikihop.json"))
    empty = [e for e in examples if not e.context]
    assert len(empty) == 36
    assert all(not e.supporting_ids and "qa_pairs" in e.metadata for e in empty)
    assert all(len(e.context) == 10 - e.metadata.get("duplicate_paragraphs", 0) for e in examples if e.context)
    assert sum("duplicate_paragraphs" in e.metadata for e in examples) == 6
    first = examples[0]
    assert first.id == "b088d3ca08e211ebbda4ac1f6bf848b6" and first.answers == ["Free Guy"]
    assert first.metadata["evidences"][0] == ["Forbidden Ground", "director", "Pál Gábor"]
    passages = by_id(first)
    assert {passages[i].title for i in first.supporting_ids} == {
        "Forbidden Ground",
        "Free Guy",
        "Pál Gábor",
        "Shawn Levy",
    }
    film = next(p for p in first.context if p.title == "Forbidden Ground")
    assert film.text == "Forbidden Ground is a Hungarian film directed by Pál Gábor. It was released in 1968."


def test_2wiki_open_corpus_dedups_real_and_reads_back(tmp_path: Path) -> None:
    examples = load_examples(real("2wikimultihopqa/wikihop.json"))
    pooled = open_corpus(examples)
    given = sum(len(e.context) for e in examples)
    assert len(pooled) < given  # paragraphs shared between questions are pooled once
    assert len({p.id for p in pooled}) == len(pooled) == len({(p.title, p.text) for p in pooled})
    ids = {p.id for p in pooled}
    assert all(set(e.supporting_ids) <= ids for e in examples)
    out = tmp_path / "open.jsonl"
    assert write_open_corpus(examples, out) == len(pooled)
    assert read_back(out) == [(p.id, p.title, p.text) for p in pooled]


def test_musique_dev_real() -> None:
    examples = load_examples(real("musique/musique.json"))
    assert all(len(e.context) == 20 for e in examples)
    first = examples[0]
    assert first.id == "2hop__574419_270105" and first.answers == ["Stanley"]
    assert first.metadata["answerable"] is True
    steps = first.decomposition
    assert steps is not None and [s["question"] for s in steps][1] == "#1 >> capital"
    assert [s["answer"] for s in steps] == ["Mountrail County", "Stanley"]
    passages = by_id(first)
    assert passages[steps[0]["supporting_ids"][0]].title.startswith("Van Hook Township")
    assert passages[steps[1]["supporting_ids"][0]].title == "Mountrail County Courthouse"
    for ex in examples:
        assert set(ex.supporting_ids) == {i for s in ex.decomposition or [] for i in s["supporting_ids"]}
    assert_refs_point_back(examples)
    assert any(len(e.answers) > 1 for e in examples)  # answer_aliases are kept


def test_musique_questions_with_decompositions_real() -> None:
    examples = load_examples(real("musique/dev.json"))
    first = examples[0]
    assert first.answers == ["Mr. Lawrence", "Doug Lawrence"] and not first.context
    assert first.decomposition is not None and "#1" in first.decomposition[1]["question"]
    assert all(s["supporting_ids"] == [] for e in examples for s in e.decomposition or [])
    assert all(e.decomposition for e in examples)
    assert_refs_point_back(examples)


def test_musique_train_pools_into_its_corpus() -> None:
    examples = load_examples(real("musique/musique_train.json"))
    corpus = json.loads(real("musique/musique_train_corpus.json").read_text(encoding="utf-8"))
    pooled = open_corpus(examples)
    assert len(pooled) == len(corpus) == 1890
    assert {(p.title, p.text) for p in pooled} == {(c["title"], c["text"].strip()) for c in corpus}


def test_strategyqa_real() -> None:
    path = real("strategyqa/strategy.json")
    bare = load_examples(path)
    assert sum(e.answers == ["yes"] for e in bare) == 107 and sum(e.answers == ["no"] for e in bare) == 122
    assert all(e.kind == "claim" and not e.context for e in bare)
    first = bare[0]
    assert first.id == "e0044a7b4d146d611e73" and first.metadata["answer"] is False
    assert first.decomposition is not None and first.decomposition[2]["question"].endswith("#1?")
    assert first.decomposition[0]["answer"] is None
    assert first.decomposition[0]["supporting_ids"] == ["Albany, Georgia-1", "Albany, Georgia-35"]
    assert_refs_point_back(bare)
    full = load_examples(path, paragraphs=real("strategyqa/strategyQA_aug_context.jsonl"))
    assert all({p.id for p in e.context} == set(e.supporting_ids) for e in full)
    assert sum(bool(e.context) for e in full) > 200
    albany = by_id(full[0])["Albany, Georgia-1"]
    assert albany.title == "Albany, Georgia" and albany.text.startswith("Albany")


def test_gsm8k_real() -> None:
    examples = load_examples(real("gsm8k/test.jsonl"))
    assert examples[0].answers == ["18"] and examples[0].kind == "math" and examples[0].id == "test-0"
    assert examples[0].metadata["rationale"].endswith("every day at the farmer’s market.")
    assert all("," not in e.answers[0] and "####" not in e.metadata["rationale"] for e in examples)
    assert any(e.answers == ["2125"] for e in examples)  # "#### 2,125"
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", e.answers[0]) for e in examples)


def test_tatqa_real() -> None:
    examples = load_examples(real("tatqa/tatqa_dataset_dev.json"))
    kinds = {e.metadata["answer_type"]: e.kind for e in examples}
    assert kinds == {"arithmetic": "math", "span": "qa", "multi-span": "qa", "count": "qa"}
    assert sum(e.kind == "math" for e in examples) == 718
    first, change, pct = examples[0], examples[4], examples[5]
    table = first.context[0]
    assert table.id == "3ffd9053-a45d-491c-957a-1b2fa0af0570" and table.meta["type"] == "table"
    assert table.text.splitlines()[0] == "|  |  | Years Ended September 30, |  |"
    assert "| Total sales | $1,496.5 | $1,202.9 | $1,107.7 |" in table.text
    assert [p.title for p in first.context[1:]] == ["Paragraph 1", "Paragraph 2"]
    assert first.supporting_ids == ["79e37805-6558-4a8c-b033-32be6bffef48"]  # rel_paragraphs ["2"], from text
    assert change.answers == ["-12.6"] and change.metadata["scale"] == "million" and change.kind == "math"
    assert pct.answers == ["-22.22"] and pct.metadata["scale"] == "percent"
    assert change.supporting_ids[0] == table.id  # answer_from "table-text"
    multi = examples[2]
    assert multi.answers == ["fixed-price type, cost-plus type, time-and-material type"]
    assert multi.metadata["answer"] == ["fixed-price type", "cost-plus type", "time-and-material type"]


@pytest.mark.parametrize("name", ["nq", "triviaqa", "popqa"])
def test_flashrag_real(name: str) -> None:
    examples = load_examples(real(f"{name}/test.jsonl"))
    first = examples[0]
    raw = json.loads(real(f"{name}/test.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert first.id == raw["id"] and first.answers == raw["golden_answers"] and first.question == raw["question"]
    if name == "popqa":
        assert first.metadata["s_wiki_title"] == raw["metadata"]["s_wiki_title"]


def test_pubmedqa_real() -> None:
    examples = load_examples(real("pubmedqa/test_set.json"))
    first = examples[0]
    assert first.id == "12377809" and first.kind == "mcq"
    assert first.answers == ["yes", "A"] and first.metadata["answer_idx"] == "A"
    assert first.metadata["options"] == {"A": "yes", "B": "no", "C": "maybe"}
    assert [p.title for p in first.context] == ["AIMS", "METHODS", "RESULTS"]
    assert first.supporting_ids == [p.id for p in first.context]
    decisions = [e.answers[0] for e in examples]
    assert (decisions.count("yes"), decisions.count("no"), decisions.count("maybe")) == (276, 169, 55)
    assert "LONG_ANSWER" in first.metadata and "QUESTION" not in first.metadata


def test_medqa_real() -> None:
    examples = load_examples(real("medqa/us_4options_test.jsonl"))
    first = examples[0]
    assert first.kind == "mcq" and first.answers == [
        "Tell the attending that he cannot fail to disclose this mistake",
        "B",
    ]
    assert first.metadata["answer_idx"] == "B" and set(first.metadata["options"]) == {"A", "B", "C", "D"}
    assert all(e.metadata["options"][e.metadata["answer_idx"]] == e.answers[0] for e in examples)


def to_flashrag_hotpot(row: dict[str, Any]) -> dict[str, Any]:
    """HotpotQA original -> FlashRAG jsonl with HF-style columnar context, as FlashRAG ships it."""
    return {
        "id": row["_id"],
        "question": row["question"],
        "golden_answers": [row["answer"]],
        "metadata": {
            "type": row["type"],
            "level": row["level"],
            "supporting_facts": {
                "title": [t for t, _ in row["supporting_facts"]],
                "sent_id": [i for _, i in row["supporting_facts"]],
            },
            "context": {"title": [t for t, _ in row["context"]], "sentences": [s for _, s in row["context"]]},
        },
    }


def test_flashrag_forms_give_the_original_passage_ids(tmp_path: Path) -> None:
    hotpot = real("hotpotqa/hotpot.json")
    rows = [json.loads(line) for line in hotpot.read_text(encoding="utf-8").splitlines()[:20]]
    flash = write_jsonl(tmp_path / "hotpotqa_dev.jsonl", [to_flashrag_hotpot(r) for r in rows])
    original = load_examples(hotpot, limit=20)
    converted = load_examples(flash)
    assert detect_format(flash) == "flashrag"
    for a, b in zip(original, converted, strict=True):
        assert (a.id, a.answers, a.supporting_ids) == (b.id, b.answers, b.supporting_ids)
        assert [(p.id, p.text) for p in a.context] == [(p.id, p.text) for p in b.context]
        assert "context" not in b.metadata and b.metadata["type"] == a.metadata["type"]
    musique = real("musique/musique.json")
    mrows = [json.loads(line) for line in musique.read_text(encoding="utf-8").splitlines()[:5]]
    mflash = [
        {
            "id": r["id"],
            "question": r["question"],
            "golden_answers": [r["answer"], *r["answer_aliases"]],
            "metadata": {k: r[k] for k in ("paragraphs", "question_decomposition", "answerable")},
        }
        for r in mrows
    ]
    for a, b in zip(
        load_examples(musique, limit=5), load_examples(write_jsonl(tmp_path / "m.jsonl", mflash)), strict=True
    ):
        assert (a.supporting_ids, a.decomposition) == (b.supporting_ids, b.decomposition)
        assert [p.id for p in a.context] == [p.id for p in b.context]


# -------------------------------------------------------------------------------------------------- fixtures

FIXTURE_FORMATS = [
    ("bamboogle.csv", "bamboogle", 3),
    ("bamboogle.json", "bamboogle", 2),
    ("hover_dev.json", "hover", 3),
    ("fever_dev.jsonl", "fever", 3),
    ("exfever_test.csv", "fever", 3),
    ("docmath_testmini.json", "docmath", 2),
    ("docmath_tables.jsonl", "docmath", 2),
    ("flashrag_hotpotqa.jsonl", "flashrag", 2),
    ("flashrag_musique.jsonl", "flashrag", 1),
    ("flashrag_mmlu.jsonl", "flashrag", 2),
    ("ircot_test_subsampled.jsonl", "ircot", 2),
    ("pubmedqa_hf.jsonl", "pubmedqa", 2),
]


@pytest.mark.parametrize(("name", "fmt", "count"), FIXTURE_FORMATS, ids=[f[0] for f in FIXTURE_FORMATS])
def test_fixture_detects_and_loads(name: str, fmt: str, count: int) -> None:
    path = FIXTURES / name
    assert detect_format(path) == fmt
    examples = load_examples(path)
    assert len(examples) == count and len({e.id for e in examples}) == count
    assert all(e.metadata["format"] == fmt for e in examples)
    assert_supporting_resolve(examples)
    for ex in examples:
        assert Example.from_dict(json.loads(json.dumps(ex.to_dict()))) == ex


def test_bamboogle_csv_and_json() -> None:
    rows = load_examples(FIXTURES / "bamboogle.csv")
    assert [e.answers for e in rows] == [["Bill Clinton"], ["Paris"], ["Steve Jobs"]]
    assert rows[1].question.startswith("What is the capital of the country where the Eiffel Tower stands, in")
    assert [e.id for e in rows] == ["bamboogle-0", "bamboogle-1", "bamboogle-2"]
    assert all(e.decomposition is None and e.kind == "qa" for e in rows)
    first, second = load_examples(FIXTURES / "bamboogle.json")
    assert first.decomposition == [
        {
            "question": "In what year was the first Harry Potter novel published?",
            "answer": "1997",
            "supporting_ids": [],
        },
        {"question": "Who was president of the United States in #1?", "answer": "Bill Clinton", "supporting_ids": []},
    ]
    assert second.decomposition is not None and len(second.decomposition) == 2  # empty Q3/A3 ignored
    assert "Q1" not in first.metadata and "Question" not in first.metadata
    assert_refs_point_back([first, second])


def test_hover_labels_and_titles(tmp_path: Path) -> None:
    examples = load_examples(FIXTURES / "hover_dev.json")
    assert [e.answers for e in examples] == [["yes"], ["no"], ["yes"]]
    assert all(e.kind == "claim" and e.question == e.question.strip() for e in examples)
    assert examples[0].id == "hover-fixture-0001" and examples[0].metadata["num_hops"] == 2
    assert examples[1].metadata["supporting_titles"] == ["Paris", "Seine"]
    assert examples[1].metadata["label"] == "NOT_SUPPORTED"
    # Hugging Face class labels: 0 NOT_SUPPORTED, 1 SUPPORTED
    hf = write_jsonl(tmp_path / "hover_hf.jsonl", [{"uid": "a", "claim": "x", "label": 1, "num_hops": 2}])
    hf0 = write_jsonl(tmp_path / "hover_hf0.jsonl", [{"uid": "b", "claim": "y", "label": 0, "num_hops": 3}])
    assert load_examples(hf)[0].answers == ["yes"] and load_examples(hf0)[0].answers == ["no"]


def test_fever_and_exfever_map_not_enough_info_to_no() -> None:
    fever = load_examples(FIXTURES / "fever_dev.jsonl")
    assert [e.answers for e in fever] == [["yes"], ["no"], ["no"]]
    assert [e.id for e in fever] == ["900001", "900002", "900003"]
    assert fever[1].metadata["supporting_titles"] == ["Mount Everest", "Himalayas (mountain range)"]
    assert fever[2].metadata["label"] == "NOT ENOUGH INFO" and fever[2].metadata["supporting_titles"] == []
    ex = load_examples(FIXTURES / "exfever_test.csv")
    assert [e.answers for e in ex] == [["yes"], ["no"], ["no"]]
    assert [e.metadata["label"] for e in ex] == ["SUPPORT", "REFUTE", "NOT ENOUGH INFO"]
    assert ex[1].metadata["supporting_titles"] == ["Dracula", "Bram Stoker"]
    assert ex[1].metadata["explanation"].startswith("Dracula was written by Bram Stoker.")
    assert ex[0].id == "exfever_test-0"


def test_docmath_official_form() -> None:
    first, second = load_examples(FIXTURES / "docmath_testmini.json")
    assert first.kind == "math" and first.answers == ["20"] and second.answers == ["20"]
    assert len(first.context) == 3  # the empty fourth paragraph is skipped
    assert [p.meta["type"] for p in first.context] == ["paragraph", "table", "paragraph"]
    table, intro = first.context[1], first.context[0]
    assert first.supporting_ids == [table.id, intro.id]  # table evidence first
    assert second.supporting_ids == [table.id]
    assert {p.id for p in first.context} == {p.id for p in second.context}  # same document, same passages
    assert first.metadata["python_solution"].startswith("def solution():")
    assert "paragraphs" not in first.metadata and first.metadata["table_evidence"] == [1]
    assert len(open_corpus([first, second])) == 3


def test_docmath_separate_tables_form() -> None:
    first, second = load_examples(FIXTURES / "docmath_tables.jsonl")
    assert first.answers == ["165"] and second.answers == []  # ground_truth hidden
    assert [p.meta["type"] for p in first.context] == ["paragraph", "paragraph", "table"]
    assert first.supporting_ids == [first.context[2].id, first.context[1].id]


def test_flashrag_fixtures_build_context_and_mcq() -> None:
    hp1, hp2 = load_examples(FIXTURES / "flashrag_hotpotqa.jsonl")
    seine = by_id(hp1)[hp1.supporting_ids[0]]
    assert seine.title == "Seine" and seine.text == "The Seine is a river in northern France. It rises near Dijon."
    assert [by_id(hp2)[i].title for i in hp2.supporting_ids] == ["Seine", "Loire"]
    assert hp1.metadata["supporting_facts"] == {"title": ["Seine", "France"], "sent_id": [0, 1]}
    assert len(open_corpus([hp1, hp2])) == 3  # Seine and Loire are shared
    (mu,) = load_examples(FIXTURES / "flashrag_musique.jsonl")
    assert mu.answers == ["Paris", "City of Light"] and mu.metadata["answerable"] is True
    assert mu.decomposition is not None and mu.decomposition[1]["question"] == "#1 >> capital"
    assert [by_id(mu)[s["supporting_ids"][0]].title for s in mu.decomposition] == ["Loire", "France"]
    m1, m2 = load_examples(FIXTURES / "flashrag_mmlu.jsonl")
    assert (m1.kind, m1.answers, m1.metadata["answer_idx"]) == ("mcq", ["Mercury", "A"], "A")
    assert (m2.answers, m2.metadata["options"]["C"], m2.metadata["subject"]) == (
        ["5", "C"],
        "5",
        "elementary_mathematics",
    )


def test_ircot_fixture() -> None:
    plain, full = load_examples(FIXTURES / "ircot_test_subsampled.jsonl")
    assert plain.id == "test_0" and plain.answers == ["Bill Clinton"] and not plain.context
    assert plain.metadata["dataset"] == "bamboogle"
    assert full.answers == ["52 BC", "52"]  # date, span (deduplicated) and number
    assert [by_id(full)[i].title for i in full.supporting_ids] == ["Seine"]


def test_pubmedqa_hf_fixture() -> None:
    yes, maybe = load_examples(FIXTURES / "pubmedqa_hf.jsonl")
    assert yes.id == "90000001" and yes.answers == ["yes", "A"] and maybe.answers == ["maybe", "C"]
    assert [p.title for p in yes.context] == ["METHODS", "RESULTS"]
    assert yes.metadata["long_answer"].startswith("Regular walking")


# ------------------------------------------------------------------------- synthetic records, one per format


def hotpot_row(qid: str, answer: str, context: list[tuple[str, list[str]]], facts: list[str]) -> dict[str, Any]:
    return {
        "_id": qid,
        "question": f"Question {qid}?",
        "answer": answer,
        "type": "bridge",
        "level": "easy",
        "supporting_facts": [[t, 0] for t in facts],
        "context": [[t, s] for t, s in context],
    }


SEINE = ("Seine", ["The Seine is a river.", " It flows through Paris."])
LOIRE = ("Loire", ["The Loire is the longest river in France."])
DANUBE = ("Danube", ["The Danube flows through Vienna."])

SYNTHETIC: dict[str, tuple[str, list[dict[str, Any]], list[str]]] = {
    "hotpotqa": ("h.jsonl", [hotpot_row("h1", "Paris", [SEINE, LOIRE], ["Seine"])], ["Paris"]),
    "2wiki": (
        "w.json",
        [{**hotpot_row("w1", "Vienna", [DANUBE], ["Danube"]), "evidences": [["Danube", "flows", "Vienna"]]}],
        ["Vienna"],
    ),
    "musique": (
        "m.jsonl",
        [
            {
                "id": "2hop__1_2",
                "question": "Where does the river of Paris flow?",
                "answer": "Le Havre",
                "answer_aliases": ["Havre"],
                "answerable": True,
                "paragraphs": [
                    {
                        "idx": 0,
                        "title": "Seine",
                        "paragraph_text": "The Seine flows to Le Havre.",
                        "is_supporting": True,
                    }
                ],
                "question_decomposition": [
                    {"id": 1, "question": "Paris >> river", "answer": "Seine", "paragraph_support_idx": 0},
                    {"id": 2, "question": "#1 >> mouth", "answer": "Le Havre", "paragraph_support_idx": 0},
                ],
            }
        ],
        ["Le Havre", "Havre"],
    ),
    "strategyqa": (
        "s.jsonl",
        [
            {
                "qid": "q1",
                "term": "Seine",
                "description": "river",
                "question": "Is the Seine longer than the Loire?",
                "answer": False,
                "facts": ["The Loire is longer."],
                "decomposition": ["How long is the Seine?", "How long is the Loire?", "Is #1 longer than #2?"],
                "evidence": [[[["Seine-1"]], [["Loire-0"]], ["operation"]]],
            }
        ],
        ["no"],
    ),
    "gsm8k": ("g.jsonl", [{"question": "What is 1000 + 234?", "answer": "1000 + 234 = 1234\n#### 1,234"}], ["1234"]),
    "tatqa": (
        "t.json",
        [
            {
                "table": {"uid": "tab-1", "table": [["", "2019"], ["Sales", "10"]]},
                "paragraphs": [{"uid": "par-1", "order": 1, "text": "Sales are in millions."}],
                "questions": [
                    {
                        "uid": "q-1",
                        "order": 1,
                        "question": "What were sales in 2019?",
                        "answer": 10,
                        "derivation": "",
                        "answer_type": "arithmetic",
                        "answer_from": "table-text",
                        "rel_paragraphs": ["1"],
                        "req_comparison": False,
                        "scale": "million",
                    }
                ],
            }
        ],
        ["10"],
    ),
    "pubmedqa": (
        "p.json",
        [
            {
                "123": {
                    "QUESTION": "Does it work?",
                    "CONTEXTS": ["It worked."],
                    "LABELS": ["RESULTS"],
                    "final_decision": "no",
                }
            }
        ],
        ["no", "B"],
    ),
    "medqa": (
        "md.jsonl",
        [{"question": "Pick B.", "answer": "second", "options": {"A": "first", "B": "second"}, "answer_idx": "B"}],
        ["second", "B"],
    ),
}


def write_synthetic(tmp_path: Path, fmt: str) -> Path:
    name, rows, _ = SYNTHETIC[fmt]
    path = tmp_path / name
    if fmt == "pubmedqa":
        return write_json(path, rows[0])
    return write_json(path, rows) if name.endswith(".json") else write_jsonl(path, rows)


@pytest.mark.parametrize("fmt", sorted(SYNTHETIC))
def test_synthetic_record_per_format(tmp_path: Path, fmt: str) -> None:
    path = write_synthetic(tmp_path, fmt)
    assert detect_format(path) == fmt
    (example,) = load_examples(path)
    assert example.answers == SYNTHETIC[fmt][2]
    assert_supporting_resolve([example])
    assert_refs_point_back([example])


def test_gzip_files_load(tmp_path: Path) -> None:
    rows = SYNTHETIC["musique"][1]
    path = tmp_path / "musique.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode("utf-8")))
    assert detect_format(path) == "musique"
    (example,) = load_examples(path)
    assert example.answers == ["Le Havre", "Havre"] and example.id == "2hop__1_2"


def test_synthetic_details(tmp_path: Path) -> None:
    (hp,) = load_examples(write_synthetic(tmp_path, "hotpotqa"))
    assert by_id(hp)[hp.supporting_ids[0]].text == "The Seine is a river. It flows through Paris."
    (mu,) = load_examples(write_synthetic(tmp_path, "musique"))
    assert mu.decomposition is not None and mu.decomposition[1]["supporting_ids"] == mu.supporting_ids
    (sq,) = load_examples(write_synthetic(tmp_path, "strategyqa"))
    assert sq.kind == "claim" and sq.supporting_ids == ["Seine-1", "Loire-0"]
    assert sq.decomposition is not None and [s["supporting_ids"] for s in sq.decomposition] == [
        ["Seine-1"],
        ["Loire-0"],
        [],
    ]
    (tq,) = load_examples(write_synthetic(tmp_path, "tatqa"))
    assert (
        tq.kind == "math" and tq.supporting_ids == ["tab-1", "par-1"] and tq.context[0].text.startswith("|  | 2019 |")
    )
    (pm,) = load_examples(write_synthetic(tmp_path, "pubmedqa"))
    assert pm.id == "123" and pm.context[0].title == "RESULTS"


# --------------------------------------------------------------------------------- detection and the override


def test_format_override(tmp_path: Path) -> None:
    wiki = write_synthetic(tmp_path, "2wiki")
    (as_hotpot,) = load_examples(wiki, format="hotpotqa")  # same schema: the override is obeyed
    assert as_hotpot.metadata["format"] == "hotpotqa" and as_hotpot.answers == ["Vienna"]
    gsm = write_synthetic(tmp_path, "gsm8k")
    with pytest.raises(DatasetError, match=re.escape(f"{gsm}:1: missing key 'options'")):
        load_examples(gsm, format="medqa")
    with pytest.raises(DatasetError, match="unknown dataset format 'nope'; known: hotpotqa, 2wiki, musique"):
        iter_examples(gsm, format="nope")


def test_detection_failure_lists_known_formats(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "odd.jsonl", [{"prompt": "x", "completion": "y"}])
    with pytest.raises(DatasetError) as err:
        detect_format(path)
    message = str(err.value)
    assert str(path) in message and "['completion', 'prompt']" in message
    assert all(name in message for name in LOADERS)
    with pytest.raises(DatasetError, match="no records"):
        detect_format(write_jsonl(tmp_path / "empty.jsonl", []))
    with pytest.raises(FileNotFoundError):
        detect_format(tmp_path / "missing.jsonl")


def test_detection_reads_only_the_first_array_element(tmp_path: Path) -> None:
    good = json.dumps(hotpot_row("h1", "Paris", [SEINE], ["Seine"]))
    path = tmp_path / "truncated.json"
    path.write_text(f"[\n{good},\n{good[:40]}", encoding="utf-8")
    assert detect_format(path) == "hotpotqa"
    with pytest.raises(DatasetError, match=re.escape(f"{path}:3: invalid JSON")):
        load_examples(path)


# -------------------------------------------------------------------------------------------- malformed rows


def test_missing_key_names_file_line_and_key(tmp_path: Path) -> None:
    row = SYNTHETIC["musique"][1][0]
    broken = {k: v for k, v in row.items() if k != "paragraphs"}
    path = write_jsonl(tmp_path / "musique.json", [row, {**row, "id": "b"}, broken])
    with pytest.raises(DatasetError) as err:
        load_examples(path)
    assert str(err.value) == f"{path}:3: missing key 'paragraphs'"
    assert (err.value.path, err.value.row, err.value.key) == (str(path), 3, "paragraphs")
    assert len(load_examples(path, limit=2)) == 2  # rows before the bad one load


def test_array_rows_are_named_by_index(tmp_path: Path) -> None:
    good = hotpot_row("h1", "Paris", [SEINE], ["Seine"])
    bad = {k: v for k, v in good.items() if k != "answer"}
    path = write_json(tmp_path / "hotpot.json", [good, bad])
    with pytest.raises(DatasetError, match=re.escape(f"{path}[1]: missing key 'answer'")):
        load_examples(path)


MALFORMED: list[tuple[str, str, Any, str]] = [
    ("bad_json.jsonl", "hotpotqa", '{"_id": "a",}\n{"_id": "b"}\n', r":1: invalid JSON"),
    (
        "wrong_type.jsonl",
        "musique",
        [{**SYNTHETIC["musique"][1][0], "paragraphs": [{"idx": 0, "title": "T", "paragraph_text": 7}]}],
        r":1: paragraphs\[0\]: key 'paragraph_text' should be str, got int",
    ),
    (
        "bad_support.jsonl",
        "musique",
        [
            {
                **SYNTHETIC["musique"][1][0],
                "question_decomposition": [{"id": 1, "question": "q", "answer": "a", "paragraph_support_idx": 9}],
            }
        ],
        r":1: question_decomposition\[0\]: paragraph_support_idx 9 names no paragraph",
    ),
    (
        "tatqa.json",
        "tatqa",
        [{**SYNTHETIC["tatqa"][1][0], "questions": [{"uid": "q", "question": "x?", "answer_type": "span"}]}],
        r"\[0\]: questions\[0\]: missing key 'answer'",
    ),
    ("fever.jsonl", "fever", [{"id": 1, "claim": "c", "label": "MAYBE"}], r":1: unknown label 'MAYBE'"),
    ("gsm.jsonl", "gsm8k", [{"question": "q", "answer": "no final line"}], r":1: key 'answer' has no '#### '"),
    ("hotpot_ctx.jsonl", "hotpotqa", [{"_id": "a", "question": "q", "answer": "a", "context": [["T"]]}], r"item 0"),
    ("medqa.jsonl", "medqa", [{"question": "q", "options": {"A": "x"}, "answer_idx": "C"}], r"answer_idx 'C'"),
    ("pub.json", "pubmedqa", {"42": {"QUESTION": "q", "CONTEXTS": ["c"]}}, r"\['42'\]: missing key 'final_decision'"),
    (
        "strat.jsonl",
        "strategyqa",
        [{"qid": "q", "question": "q?", "answer": "yes"}],
        r"'answer' should be bool, got str",
    ),
    (
        "empty_q.jsonl",
        "flashrag",
        [{"id": "1", "question": "  ", "golden_answers": ["a"]}],
        r":1: key 'question' is empty",
    ),
]


@pytest.mark.parametrize(("name", "fmt", "content", "pattern"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_rows_raise_dataset_error(tmp_path: Path, name: str, fmt: str, content: Any, pattern: str) -> None:
    path = tmp_path / name
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    elif name.endswith(".json"):
        write_json(path, content)
    else:
        write_jsonl(path, content)
    with pytest.raises(DatasetError, match=re.escape(str(path)) + ".*" + pattern):
        load_examples(path, format=fmt)


def test_csv_missing_column(tmp_path: Path) -> None:
    path = tmp_path / "bamboogle.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["Question", "Notes"], ["Who?", "n"]])
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: missing key 'Answer'")):
        load_examples(path, format="bamboogle")


def test_iter_examples_streams_jsonl(tmp_path: Path) -> None:
    rows = [hotpot_row(f"h{i}", "Paris", [SEINE], ["Seine"]) for i in range(5)]
    path = tmp_path / "h.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n", encoding="utf-8")
    it = iter_examples(path, limit=5)
    assert not isinstance(it, list)
    assert [e.id for e in it] == [f"h{i}" for i in range(5)]
    with pytest.raises(DatasetError, match=re.escape(f"{path}:6: invalid JSON")):
        load_examples(path)
    with pytest.raises(ValueError, match="limit"):
        iter_examples(path, limit=-1)


# ------------------------------------------------------------------------------------------------ open mode


def test_open_corpus_dedups_shared_paragraphs(tmp_path: Path) -> None:
    quoted = ('"Weird Al" Yankovic', ["Alfred Yankovic is a singer.", " He plays the accordion."])
    rows = [
        hotpot_row("q1", "Paris", [SEINE, LOIRE], ["Seine"]),
        hotpot_row("q2", "Loire", [LOIRE, SEINE, quoted], ["Loire", '"Weird Al" Yankovic']),
    ]
    examples = load_examples(write_jsonl(tmp_path / "h.jsonl", rows))
    assert examples[0].context[0].id == examples[1].context[1].id  # the same paragraph, the same id
    pooled = open_corpus(examples)
    assert [p.title for p in pooled] == ["Seine", "Loire", '"Weird Al" Yankovic']
    ids = {p.id for p in pooled}
    assert all(set(e.supporting_ids) <= ids for e in examples)
    out = tmp_path / "corpus" / "open.jsonl"
    assert write_open_corpus(examples, out) == 3
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert (
        set(lines[0]) == {"id", "contents"}
        and lines[0]["contents"] == '"Seine"\nThe Seine is a river. It flows through Paris.'
    )
    assert read_back(out) == [(p.id, p.title, p.text) for p in pooled]
    again = load_examples(write_jsonl(tmp_path / "again.jsonl", rows[::-1]))
    assert {p.id for p in open_corpus(again)} == ids  # stable across files and runs


def test_open_corpus_rejects_one_id_for_two_passages() -> None:
    a = Example(id="a", question="q", context=[Passage("x", "T", "one")])
    b = Example(id="b", question="q", context=[Passage("x", "T", "two")])
    with pytest.raises(DatasetError, match="passage id 'x' names two different passages"):
        open_corpus([a, b])


def test_passage_ids_are_stable_and_content_derived() -> None:
    assert passage_id("Paris", "Paris is the capital of France.") == "Paris#cedecad809"
    assert passage_id("Paris", "Paris is in France.") != passage_id("Paris", "Paris is the capital of France.")
    assert passage_id("Lyon", "x") != passage_id("Paris", "x")
    assert passage_id("", "x") == "11f6ad8ec5"


# ------------------------------------------------------------------------------------------------------ encodings

HOTPOT_ROW = {"_id": "h1", "question": "Où coule la Seine?", "answer": "Paris", "supporting_facts": [], "context": []}


def _raises_naming(path: Path, text: str, **kwargs: Any) -> str:
    with pytest.raises(DatasetError) as info:
        load_examples(path, **kwargs)
    message = str(info.value)
    assert message.startswith(text), message
    return message


@pytest.mark.parametrize("given", [None, "hotpotqa"])
def test_a_utf16_json_dataset_names_the_encoding_and_the_file(tmp_path: Path, given: str | None) -> None:
    # The reproduction: a UTF-16-LE JSON dataset said "invalid JSON (Expecting value at column 2)".
    bare = tmp_path / "hotpot16.json"
    bare.write_bytes(json.dumps([HOTPOT_ROW], ensure_ascii=False).encode("utf-16-le"))
    message = _raises_naming(bare, f"{bare}: not UTF-8 (looks like UTF-16-LE without a byte-order mark", format=given)
    assert "convert it with iconv -f UTF-16LE -t UTF-8" in message and "invalid JSON" not in message
    bom = tmp_path / "hotpot16bom.jsonl"
    bom.write_bytes(json.dumps(HOTPOT_ROW, ensure_ascii=False).encode("utf-16"))  # Python writes the BOM, LE
    message = _raises_naming(bom, f"{bom}: not UTF-8 (looks like UTF-16-LE: it has a byte-order mark)", format=given)
    assert "convert it with iconv -f UTF-16 -t UTF-8" in message
    csv_be = tmp_path / "bamboogle16.csv"
    csv_be.write_bytes("\ufeffQuestion,Answer\nOù?,Paris\n".encode("utf-16-be"))
    _raises_naming(csv_be, f"{csv_be}: not UTF-8 (looks like UTF-16-BE: it has a byte-order mark)")


def test_a_latin1_dataset_names_the_line_and_a_utf8_bom_is_accepted(tmp_path: Path) -> None:
    latin = tmp_path / "hotpot-latin1.jsonl"
    latin.write_bytes(json.dumps(HOTPOT_ROW, ensure_ascii=False).encode("latin-1") + b"\n")
    message = _raises_naming(latin, f"{latin}:1: not UTF-8 text (byte 0xf9 at column ")
    assert "iconv -f latin1 -t utf-8" in message
    bom = tmp_path / "hotpot-bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(HOTPOT_ROW, ensure_ascii=False).encode("utf-8") + b"\n")
    assert [e.question for e in load_examples(bom)] == ["Où coule la Seine?"]
