"""s3 searcher warm start: gold searcher trajectories planned from gold decompositions, replayed through the real
agent, read back by the agent's own parser, with only the searcher's tokens trained; examples without a usable
decomposition are counted, never fatal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sleuth.agents.s3 import (
    S3Config,
    observation_text,
    parse_reply,
    resolve_selection,
    searcher_prompt,
    task_question,
)
from sleuth.records import Example, Passage
from sleuth.train.s3_rl import gold_reply, searcher_warmup_records, warm_start_searcher
from sleuth.train.tokens import tokenize_chat
from tests.scripted import ListRetriever, ScriptedLLM

QUESTION = "Where is the source of the river that flows through the birthplace of Tesae Togrurn"
HOP_2 = "Which river flows through Drazeibo?"
HOP_3 = "Where is the source of Nedra River?"
G1 = Passage(id="g1", title="Tesae Togrurn", text="Tesae Togrurn was born in the city of Drazeibo.")
G2 = Passage(id="g2", title="Drazeibo", text="The Nedra River flows through Drazeibo.")
G3 = Passage(id="g3", title="Nedra River", text="The Nedra River rises in Braresturova.")
NOISE = [Passage(id=f"n{i}", title=f"Noise {i}", text=f"Noise passage {i} says nothing useful.") for i in range(1, 5)]
CONFIG = S3Config(k=3, k_initial=3, max_turns=2)


def bridge(example_id: str = "s1", **changes: Any) -> Example:
    """A 3-hop bridge question in the synthetic world's format (``#k`` refers to step k's answer)."""
    fields: dict[str, Any] = {
        "id": example_id,
        "question": QUESTION,
        "answers": ["Braresturova"],
        "supporting_ids": ["g1", "g2", "g3"],
        "decomposition": [
            {"question": "Where was Tesae Togrurn born?", "answer": "Drazeibo", "supporting_ids": ["g1"]},
            {"question": "Which river flows through #1?", "answer": "Nedra River", "supporting_ids": ["g2"]},
            {"question": "Where is the source of #2?", "answer": "Braresturova", "supporting_ids": ["g3"]},
        ],
    }
    return Example(**(fields | changes))


def retrieve(query: str) -> list[Passage]:
    """The question finds hop 1's passage; each resolved sub-question finds its own at a known rank."""
    return {
        QUESTION: [NOISE[0], G1, NOISE[1]],
        HOP_2: [NOISE[2], G2, NOISE[3]],
        HOP_3: [G3, NOISE[0], NOISE[1]],
    }.get(query, NOISE[:3])


def model_replies(record: dict[str, Any]) -> list[str]:
    return [s["text"] for s in record["messages"][1]["segments"] if s["source"] == "model"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# ------------------------------------------------------------------------------------------------ the transcript


def test_gold_transcript_parses_back_to_the_gold_queries_and_doc_numbers() -> None:
    retriever = ListRetriever(retrieve)
    records, summary = searcher_warmup_records([bridge()], retriever, CONFIG)
    assert summary["records"] == 1 and summary["skipped"] == {}
    record = records[0]
    # hop 1 is in the initial documents: the searcher queries hops 2 and 3 with the gold answers substituted
    assert record["queries"] == [HOP_2, HOP_3] and record["selected_ids"] == [["g2"], ["g3"]]
    assert record["weight"] == 1.0 and record["source"] == "s3-gold" and record["id"] == "s1"

    turns = [parse_reply(text, query_open=False) for text in model_replies(record)]
    assert [t.query for t in turns] == [HOP_2, HOP_3, None]
    assert [t.complete for t in turns] == [False, False, True]
    assert [t.selection for t in turns] == [None, [2], [1]]  # the initial block is kept whole (no tag)
    assert all(t.fallbacks == [] for t in turns)
    assert [resolve_selection(t.selection, 3, CONFIG.max_selected)[0] for t in turns[1:]] == [[2], [1]]

    # the conversation is the agent's own: its prompt, and the observations it inserts for those queries
    user, assistant = record["messages"]
    initial = retrieve(QUESTION)
    assert user["content"] == searcher_prompt(task_question(bridge(), CONFIG), initial, CONFIG)
    observations = [s["text"] for s in assistant["segments"] if s["source"] == "observation"]
    assert observations == [observation_text(retrieve(HOP_2), CONFIG), observation_text(retrieve(HOP_3), CONFIG)]
    assert [s["source"] for s in assistant["segments"]] == ["model", "observation"] * 2 + ["model"]
    assert retriever.queries.count(HOP_2) == 2  # planned, then replayed through the agent with the real retriever
    assert summary["hops"] == {
        "hops": 3,
        "hops_in_initial": 1,
        "hops_queried": 2,
        "gold_retrieved": 2,
        "hops_beyond_max_turns": 0,
    }
    assert summary["searches_per_record"] == {"2": 1}


def test_initial_gold_selects_the_initial_blocks_gold_documents_and_replays_exactly() -> None:
    """``initial="gold"`` (the warm start's deviation): the first reply tags the initial block's gold document (Doc 2,
    G1) beside the first query, the replay through the real agent matches the plan, and the agent serves the
    generator the gold documents only, naive RAG's two noise documents dropped; with none of the initial documents
    gold the tag is ``[]``."""
    from sleuth.agents import Context
    from sleuth.runner import run
    from sleuth.train.s3_rl import gold_searches

    retriever = ListRetriever(retrieve)
    records, summary = searcher_warmup_records([bridge()], retriever, CONFIG, initial="gold")
    assert summary["records"] == 1 and summary["skipped"] == {}
    turns = [parse_reply(text, query_open=False) for text in model_replies(records[0])]
    assert [t.selection for t in turns] == [[2], [2], [1]] and [t.query for t in turns] == [HOP_2, HOP_3, None]
    assert [t.complete for t in turns] == [False, False, True] and all(t.fallbacks == [] for t in turns)
    # the same replies through the agent: the generator reads G1, G2, G3 and nothing else
    searcher = ScriptedLLM(model_replies(records[0]))
    ctx = Context(llm=searcher, retriever=retriever, config=CONFIG, roles={"generator": ScriptedLLM(["Braresturova"])})
    trace = run("s3", [bridge()], ctx, progress=False)[0]
    assert trace.meta["selected_ids"] == ["g1", "g2", "g3"] and trace.meta["naive_rag_ids"] == ["n1", "g1", "n2"]

    elsewhere = bridge("s2", question="Where was Tesae Togrurn born, and which river?")  # initial: noise only
    searches, _ = gold_searches([elsewhere], retriever, CONFIG, initial="gold")
    assert searches[0].initial_selection == [] and searches[0].replies[0].startswith("<important_info>\n[]\n")
    with pytest.raises(ValueError, match="initial"):
        gold_searches([bridge()], retriever, CONFIG, initial="some")


def test_reply_layout_is_the_prompts_json_and_tags() -> None:
    # the first reply that searches is the query alone (the prompt's "not enough" example)
    assert gold_reply(None, 'Who is "Ann"?') == '<query>\n{\n    "query": "Who is \\"Ann\\"?"\n}\n</query>'
    assert gold_reply(None, None) == "<search_complete>\nTrue\n</search_complete>"
    later = "<important_info>\n[2]\n</important_info>\n<search_complete>\nFalse\n</search_complete>\n<query>"
    assert gold_reply([2], "Who?").startswith(later)
    stop = "<important_info>\n[]\n</important_info>\n<search_complete>\nTrue\n</search_complete>"
    assert gold_reply([], None) == stop
    assert parse_reply(gold_reply([1, 3], "Zoë?"), query_open=False).query == "Zoë?"


def test_a_gold_passage_not_retrieved_selects_nothing_and_the_turn_limit_is_kept() -> None:
    """Hop 1 is not in the initial documents and its query misses it: ``[]`` (keep none of that block); the next
    query still names the gold answer; with one search allowed, the hops left are counted."""
    initial_noise = ListRetriever(lambda q: NOISE[:3])
    config = S3Config(k=3, k_initial=3, max_turns=1)
    records, summary = searcher_warmup_records([bridge()], initial_noise, config)
    assert records[0]["queries"] == ["Where was Tesae Togrurn born?"] and records[0]["selected_ids"] == [[]]
    turns = [parse_reply(text, query_open=False) for text in model_replies(records[0])]
    assert [t.selection for t in turns] == [None, []] and turns[-1].complete
    assert summary["hops"]["gold_retrieved"] == 0 and summary["hops"]["hops_beyond_max_turns"] == 2

    # every gold passage in the initial documents: one reply, search complete
    everything = ListRetriever(lambda q: [G1, G2, G3])
    records, summary = searcher_warmup_records([bridge()], everything, CONFIG)
    assert model_replies(records[0]) == ["<search_complete>\nTrue\n</search_complete>"]
    assert records[0]["queries"] == [] and summary["searches_per_record"] == {"0": 1}


def test_examples_without_a_usable_decomposition_are_skipped_and_counted() -> None:
    steps = bridge().decomposition or []
    examples = [
        bridge("none", decomposition=None),
        bridge("empty", decomposition=[]),
        bridge("no-answer", decomposition=[steps[0], {"question": "Which river flows through #1?", "answer": None}]),
        bridge("no-passages", decomposition=[{**s, "supporting_ids": []} for s in steps]),
        bridge("dangling", decomposition=[steps[0], {**steps[1], "question": "Which river flows through #4?"}]),
        bridge("ok"),
        bridge("twin"),  # the same question again: the prompt names one trajectory per question
    ]
    records, summary = searcher_warmup_records(examples, ListRetriever(retrieve), CONFIG)
    assert [r["id"] for r in records] == ["ok"]
    assert summary["questions"] == 7 and summary["records"] == 1
    assert summary["skipped"] == {
        "duplicate_question": 1,
        "incomplete_decomposition": 1,
        "no_gold_decomposition": 2,
        "no_supporting_passages": 1,
        "unresolved_reference": 1,
    }
    assert searcher_warmup_records([], ListRetriever(retrieve), CONFIG)[1]["records"] == 0


def test_searching_only_skips_the_questions_the_initial_documents_answer() -> None:
    def easy(query: str) -> list[Passage]:  # the question alone finds every gold passage: nothing to search
        return [G1, G2, G3] if query == QUESTION else retrieve(query)

    records, summary = searcher_warmup_records([bridge("easy")], ListRetriever(easy), CONFIG)
    assert summary["searches_per_record"] == {"0": 1} and len(records) == 1
    records, summary = searcher_warmup_records([bridge("easy")], ListRetriever(easy), CONFIG, searching_only=True)
    assert records == [] and summary["skipped"] == {"needs_no_search": 1}
    records, _ = searcher_warmup_records([bridge("hard")], ListRetriever(retrieve), CONFIG, searching_only=True)
    assert [len(r["queries"]) for r in records] == [2]


# ------------------------------------------------------------------------------------------------ training data


def test_only_the_searchers_own_tokens_are_labelled(tokenizer: Any) -> None:
    records, _ = searcher_warmup_records([bridge()], ListRetriever(retrieve), CONFIG, tokenizer=tokenizer)
    chat = tokenize_chat(tokenizer, records[0]["messages"])
    labelled = tokenizer.decode([t for t, m in zip(chat.input_ids, chat.model_mask, strict=True) if m])
    for reply in model_replies(records[0]):
        assert reply in labelled
    assert labelled.endswith(tokenizer.eos_token)  # the searcher learns to stop after its last reply
    for passage in [*NOISE, G1, G2, G3]:  # neither the initial documents nor any observation carries loss
        assert passage.text not in labelled
    assert "search copilot" not in labelled and "<information>" not in labelled
    assert not any(o and m for o, m in zip(chat.observation_mask, chat.model_mask, strict=True))
    observed = sum(chat.observation_mask)
    assert observed > 0 and chat.model_tokens > 0


def test_warm_start_on_a_synthetic_world_replays_every_plan_and_trains(
    tmp_path: Path, tiny_model_dir: Path, tokenizer: Any
) -> None:
    """BM25 over a tiny synthetic world, the tiny model's tokenizer (chat-template continuation, observation cap):
    every planned trajectory replays as planned, and a few optimizer steps write a model."""
    from sleuth.data.synth import load_synth, synthesize
    from sleuth.retrieval import load_retriever
    from sleuth.retrieval.bm25 import build_bm25_index

    sizes = {"train_entities": 40, "dev_entities": 20, "test_entities": 20}
    world = tmp_path / "world"
    synthesize(world, seed=0, train_questions=8, dev_questions=1, test_questions=1, min_hops=2, max_hops=3, **sizes)
    build_bm25_index(world / "corpus.jsonl", world / "index")
    examples = list(load_synth(world / "train.jsonl"))
    records, summary = searcher_warmup_records(examples, load_retriever(str(world / "index")), CONFIG, tokenizer)
    assert summary["records"] == len(records) > 0
    assert sum(summary["skipped"].values()) + len(records) == len(examples)
    assert "replay_mismatch" not in summary["skipped"] and "replay_error" not in summary["skipped"]
    for record in records:
        turns = [parse_reply(text, query_open=False) for text in model_replies(record)]
        assert [t.query for t in turns[:-1]] == record["queries"] and turns[-1].complete
        assert len(turns) <= CONFIG.max_turns + 1

    stats = warm_start_searcher(records[:2], tiny_model_dir, tmp_path / "warm", learning_rate=1e-3, epochs=1.0)
    assert stats["trained"] == 2 and stats["steps"] >= 1
    assert (tmp_path / "warm" / "model" / "config.json").exists()
