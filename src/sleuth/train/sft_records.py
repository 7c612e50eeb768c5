"""The records of AceSearcher's SFT (:mod:`sleuth.train.sft`): one pure builder per record kind (``context_qa``,
``decompose``, ``final``, ``cot``, ``pot``) over benchmark examples, and the reader of the released LLaMA-Factory
records (``released``). :mod:`sleuth.train.sft` documents the kinds, mixes the records and trains on them.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import operator
import os
import random
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from sleuth.agents.acesearcher import (
    AceSearcherConfig,
    decompose_prompt,
    final_prompt,
    is_fact,
    passage_budget,
    pool_passages,
    resolve_references,
    subanswer_prompt,
)
from sleuth.agents.acesearcher_doc import AceSearcherDocConfig, prompt_fields, rank_chunks, with_table_context
from sleuth.agents.base import load_prompt
from sleuth.eval.metrics import claim_label, numbers_match
from sleuth.records import Example, Passage

__all__ = [
    "Skip",
    "breakdown_text",
    "context_qa_records",
    "cot_records",
    "decompose_records",
    "decomposition_text",
    "final_rationale",
    "final_records",
    "gold_steps",
    "make_record",
    "pot_records",
    "read_released",
    "released_record",
]

Record = dict[str, Any]


# ---------------------------------------------------------------------------------------------------------------
# Records and gold data
# ---------------------------------------------------------------------------------------------------------------


class Skip(Exception):
    """An example lacks what a record kind needs; ``reason`` is a short name counted in the data summary."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def make_record(prompt: str, completion: str, source: str, kind: str) -> Record:
    """A chat prompt-completion record (TRL's conversational prompt-completion format) with its provenance: one
    user turn and no system message, as the agent sends its prompts."""
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "completion": [{"role": "assistant", "content": completion}],
        "source": source,
        "kind": kind,
    }


def _is_document_task(example: Example) -> bool:
    """Whether the agent for ``example`` is ``acesearcher_doc`` (numeric reasoning over a document, GSM8K)."""
    return example.kind == "math" or example.metadata.get("format") in ("gsm8k", "tatqa", "docmath")


_ARROW = re.compile(r"^(.*?)\s*>>\s*(.+)$")


def _as_question(text: str) -> str:
    """A MuSiQue composition step ``"#1 >> capital"`` as a question (``"What is the capital of #1?"``); other
    steps unchanged. The relation is Wikidata's label, so the wording is templated."""
    text = " ".join(text.split())
    m = _ARROW.match(text)
    if m:
        return f"What is the {m.group(2).strip()} of {m.group(1).strip()}?"
    return text


def _socratic_steps(rationale: str) -> list[tuple[str, str]]:
    """(sub-question, worked answer) pairs of a GSM8K socratic solution (``"Q? ** A"`` lines); [] when not."""
    pairs = []
    for line in rationale.splitlines():
        question, sep, answer = line.partition(" ** ")
        if not sep:
            return []
        pairs.append((question.strip(), answer.strip()))
    return pairs


def _evidence_steps(example: Example) -> list[dict[str, Any]] | None:
    """2Wiki ``evidences`` triples ``[subject, relation, object]`` as steps ``"What is the {relation} of
    {subject}?"`` (answer: the object); a subject that is an earlier step's object becomes ``#k``. The step's
    supporting passage is the context passage titled like its subject (case-insensitive)."""
    evidences = example.metadata.get("evidences")
    if not isinstance(evidences, list) or not evidences:
        return None
    titles = {p.title.casefold(): p.id for p in example.context}
    objects: dict[str, int] = {}
    steps = []
    for k, triple in enumerate(evidences, 1):
        if not (isinstance(triple, list | tuple) and len(triple) == 3 and all(isinstance(t, str) for t in triple)):
            return None
        subject, relation, obj = (t.strip() for t in triple)
        ref = objects.get(subject.casefold())
        steps.append(
            {
                "question": f"What is the {relation} of {f'#{ref}' if ref else subject}?",
                "answer": obj,
                "supporting_ids": [titles[subject.casefold()]] if subject.casefold() in titles else [],
            }
        )
        objects.setdefault(obj.casefold(), k)
    return steps


def gold_steps(example: Example) -> list[dict[str, Any]] | None:
    """The gold decomposition of ``example`` as ``[{"question", "answer", "supporting_ids"}]`` (questions may
    refer to earlier answers as ``#k``), or None: ``Example.decomposition`` (MuSiQue ``>>`` steps turned into
    questions; StrategyQA, Bamboogle, the synthetic world), 2Wiki ``evidences``, GSM8K socratic sub-questions."""
    if example.decomposition:
        return [
            {
                "question": _as_question(str(s.get("question") or "")),
                "answer": None if s.get("answer") is None else str(s["answer"]).strip(),
                "supporting_ids": list(s.get("supporting_ids") or []),
            }
            for s in example.decomposition
        ]
    if example.metadata.get("evidences"):
        return _evidence_steps(example)
    pairs = _socratic_steps(str(example.metadata.get("rationale") or ""))
    if pairs:
        return [{"question": q, "answer": None, "supporting_ids": []} for q, _ in pairs]
    return None


def _checked_steps(example: Example, config: AceSearcherConfig) -> list[dict[str, Any]]:
    steps = gold_steps(example)
    if not steps:
        raise Skip("no_gold_decomposition")
    if any(not s["question"] for s in steps):
        raise Skip("empty_subquestion")
    if len(steps) > config.max_subquestions:
        raise Skip("too_many_subquestions")  # the agent would cut them (max_subquestions)
    return steps


def decomposition_text(questions: Sequence[str]) -> str:
    """The decomposer's output form the agent parses cleanly: ``### Q<k>: <question>`` lines."""
    return "\n".join(f"### Q{k}: {q}" for k, q in enumerate(questions, 1))


def _answer(example: Example, fact: bool) -> str:
    if not example.answers or not str(example.answers[0]).strip():
        raise Skip("no_answer")
    answer = str(example.answers[0]).strip()
    if fact:
        label = claim_label(answer)
        if label is None:
            raise Skip("no_yes_no_label")
        return "Yes" if label == "yes" else "No"
    return answer


def _passage_sets(example: Example, corpus: dict[str, Passage] | None) -> tuple[list[Passage], list[Passage]]:
    """(gold supporting passages, distractors) of an example: from its context, else from ``corpus`` by
    ``supporting_ids`` and ``metadata["distractor_ids"]`` (the synthetic world). With context but no supporting
    ids, every context passage counts as given context (gold)."""
    if example.context:
        wanted = set(example.supporting_ids)
        if not wanted:
            return list(example.context), []
        gold = [p for p in example.context if p.id in wanted]
        return gold, [p for p in example.context if p.id not in wanted]
    if corpus:
        gold = [corpus[i] for i in example.supporting_ids if i in corpus]
        distract = [corpus[i] for i in example.metadata.get("distractor_ids") or [] if i in corpus]
        return gold, distract
    return [], []


def _given(gold: list[Passage], distractors: list[Passage], budget: int, rng: random.Random) -> list[Passage]:
    """Gold passages first, then distractors, up to ``budget``; shuffled so the answer's position varies."""
    chosen = gold[:budget] + rng.sample(distractors, min(len(distractors), max(0, budget - len(gold))))
    rng.shuffle(chosen)
    return chosen


# ---------------------------------------------------------------------------------------------------------------
# Builders: one per record kind, pure (randomness from the rng passed in)
# ---------------------------------------------------------------------------------------------------------------


def context_qa_records(
    example: Example,
    agent: AceSearcherConfig,
    rng: random.Random,
    source: str = "",
    passages: int = 10,
    corpus: dict[str, Passage] | None = None,
    steps: bool = False,
) -> list[Record]:
    """Question + given passages -> short answer (claims: Yes/No), in the agent's sub-question answering prompt.

    ``steps``: also one record per gold sub-question that has a gold answer and a supporting passage, its ``#k``
    replaced by the gold answers (the solver's actual inputs).
    """
    fact = is_fact(example, agent)
    gold, distractors = _passage_sets(example, corpus)
    if not gold:
        raise Skip("no_passages")
    answer = _answer(example, fact)

    def prompt(question: str, shown: list[Passage]) -> str:
        return subanswer_prompt(question, shown, fact, agent.prompts, agent.passage_style, agent.passage_order)

    shown = _given(gold, distractors, passages, rng)
    records = [make_record(prompt(example.question, shown), answer, source, "context_qa")]
    if steps:
        by_id = {p.id: p for p in gold + distractors}
        answers: dict[int, str] = {}
        for k, step in enumerate(gold_steps(example) or [], 1):
            if not step["answer"]:
                break
            answers[k] = step["answer"]
            support = [by_id[i] for i in step["supporting_ids"] if i in by_id]
            if not support:
                continue
            others = [p for p in gold + distractors if p.id not in step["supporting_ids"]]
            shown = _given(support, others, passages, rng)
            resolved = resolve_references(step["question"], answers)
            step_answer = step["answer"]
            if fact:
                label = claim_label(step_answer)
                step_answer = step_answer if label is None else ("Yes" if label == "yes" else "No")
            records.append(make_record(prompt(resolved, shown), step_answer, source, "context_qa"))
    return records


def _doc_fields(example: Example, doc: AceSearcherDocConfig) -> dict[str, str]:
    """The document variant's prompt fields for ``example``, chunks chosen as ``acesearcher_doc`` chooses them
    without a retriever: the whole document up to ``k`` chunks, else its BM25 top-k (GSM8K: no chunks)."""
    document = list(example.context)
    picked = document
    if len(document) > doc.k:
        picked = rank_chunks(example.question, document, doc.k)
        if doc.chunk_order == "document":
            position = {p.id: i for i, p in enumerate(document)}
            picked = sorted(picked, key=lambda p: position.get(p.id, 0))
        if doc.table_context:
            picked = with_table_context(picked, document)
    return prompt_fields(example, picked, doc.passage_style)


def _doc_template(stage: str, doc: AceSearcherDocConfig) -> str:
    if stage == "cot":  # the released code has no CoT prompt: both settings use Fig. 19
        return load_prompt("acesearcher_doc_cot")
    return load_prompt(f"acesearcher_doc_{'code_' if doc.prompts == 'code' else ''}{stage}")


def decompose_records(
    example: Example, agent: AceSearcherConfig, doc: AceSearcherDocConfig, source: str = ""
) -> list[Record]:
    """Question -> ``### Q<k>:`` lines of its gold decomposition, in the decomposition prompt the agent sends
    (QA or claim variant; the document variant's prompt for numeric-reasoning examples)."""
    steps = _checked_steps(example, agent)
    target = decomposition_text([s["question"] for s in steps])
    if _is_document_task(example):
        prompt = _doc_template("decompose", doc).format(**_doc_fields(example, doc)).strip()
    else:
        prompt = decompose_prompt(example.question, is_fact(example, agent), agent.prompts)
    return [make_record(prompt, target, source, "decompose")]


def final_rationale(items: Sequence[tuple[int, str, str]], answer: str, fact: bool) -> str:
    """The templated rationale of a final-answer target: each resolved sub-question and its gold answer, then
    the conclusion and ``<answer>answer</answer>``.

    >>> print(final_rationale([(1, "Who founded Velmo Guild?", "Ann Dask")], "Ann Dask", False))
    Who founded Velmo Guild? Ann Dask. So the answer is Ann Dask.
    <answer>Ann Dask</answer>
    """
    chain = " ".join(f"{q} {a.rstrip('.')}." for _, q, a in items)
    if fact:
        conclusion = "So the claim is supported." if answer == "Yes" else "So the claim is not supported."
    else:
        conclusion = f"So the answer is {answer}."
    return f"{chain} {conclusion}\n<answer>{answer}</answer>".strip()


def final_records(
    example: Example,
    agent: AceSearcherConfig,
    rng: random.Random,
    source: str = "",
    corpus: dict[str, Passage] | None = None,
) -> list[Record]:
    """Question + gold sub-questions/answers + pooled passages -> templated rationale + ``<answer>``.

    The passages of sub-question k are its supporting passages plus distractors, shuffled, ``budget`` of them
    (the agent's ``passage_budget``), pooled with the agent's ``pool_passages``. Claims get no passages (Fig. 17).
    """
    steps = _checked_steps(example, agent)
    if any(not s["answer"] for s in steps):
        raise Skip("no_gold_subanswers")
    fact = is_fact(example, agent)
    answer = _answer(example, fact)
    answers: dict[int, str] = {}
    items: list[tuple[int, str, str]] = []
    for k, step in enumerate(steps, 1):
        items.append((k, resolve_references(step["question"], answers), step["answer"]))
        answers[k] = step["answer"]
    pool: list[Passage] = []
    if not fact:
        gold, distractors = _passage_sets(example, corpus)
        by_id = {p.id: p for p in gold + distractors}
        if not by_id:
            raise Skip("no_passages")
        budget = passage_budget(len(steps), agent.total_passages, agent.budget_rule)
        per_step = []
        for step in steps:
            support = [by_id[i] for i in step["supporting_ids"] if i in by_id]
            others = [p for p in gold + distractors if p.id not in step["supporting_ids"]]
            per_step.append(_given(support, others, budget, rng))
        pool = pool_passages(per_step, budget)
    prompt = final_prompt(example.question, items, pool, fact, agent.prompts, agent.passage_style)
    return [make_record(prompt, final_rationale(items, answer, fact), source, "final")]


def breakdown_text(example: Example) -> str:
    """The breakdown pasted into the CoT/PoT prompts: the gold sub-questions, else the question as Q1."""
    steps = gold_steps(example)
    questions = [s["question"] for s in steps] if steps else [example.question]
    return decomposition_text(questions)


_CALC = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


def _strip_calculator(text: str) -> str:
    return _CALC.sub("", text)


def cot_records(
    example: Example, doc: AceSearcherDocConfig, source: str = "", answer_format: str = "boxed"
) -> list[Record]:
    """Chain-of-thought target in the document variant's CoT prompt (Fig. 19): the GSM8K rationale (worked
    answers of socratic lines; calculator annotations removed) or the TAT-QA derivation, then the answer in
    ``\\boxed{}`` (``answer_format="answer_tag"``: ``<answer>...</answer>``)."""
    answer = _answer(example, False)
    rationale = str(example.metadata.get("rationale") or "").strip()
    if rationale:
        pairs = _socratic_steps(rationale)
        lines = [a for _, a in pairs] if pairs else rationale.splitlines()
        reasoning = "\n".join(_strip_calculator(line).strip() for line in lines if line.strip())
    elif str(example.metadata.get("derivation") or "").strip():
        scale = str(example.metadata.get("scale") or "").strip()
        reasoning = f"{str(example.metadata['derivation']).strip()} = {answer}{f' ({scale})' if scale else ''}"
    else:
        raise Skip("no_rationale")
    mark = f"<answer>{answer}</answer>" if answer_format == "answer_tag" else f"\\boxed{{{answer}}}"
    breakdown = breakdown_text(example)
    fields = _doc_fields(example, doc)
    prompt = _doc_template("cot", doc).format(**fields, decomposition=breakdown, decompose=breakdown).strip()
    return [make_record(prompt, f"{reasoning}\nThe final answer is {mark}.", source, "cot")]


_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _arith(expr: str) -> float | None:
    """The value of a plain arithmetic expression (numbers, + - * / // % **, parentheses), or None."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(value(node.right)) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")

    try:
        result = value(tree.body)
    except (ValueError, ZeroDivisionError, OverflowError, TypeError):
        return None
    return float(result) if math.isfinite(result) else None


def _python_number(expr: str, percent: bool = True) -> str:
    """A derivation / calculator expression as Python: thousands separators and ``$`` dropped, ``[]`` -> ``()``,
    ``×`` -> ``*``, ``÷`` -> ``/``, and ``x%`` -> ``(x / 100)`` (``percent=False``: the ``%`` sign dropped)."""
    expr = expr.replace("[", "(").replace("]", ")").replace("$", "").replace("×", "*").replace("÷", "/")
    expr = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", expr)
    expr = re.sub(r"(\d+(?:\.\d+)?)\s*%", r"(\1 / 100)" if percent else r"\1", expr)
    return " ".join(expr.split())


def _decimals(text: str) -> int | None:
    m = re.fullmatch(r"\s*-?\d+(?:\.(\d+))?\s*", text)
    return None if m is None else len(m.group(1) or "")


def _program_block(lines: Sequence[str]) -> str:
    return "```python\n" + "\n".join(lines) + "\n```"


def _gsm8k_program(example: Example, answer: str) -> list[str] | None:
    """Assignments from GSM8K's calculator annotations ``<<48/2=24>>``, one per step, ``ans`` the last one;
    None unless every expression evaluates to its stated result and the last one to the gold answer."""
    rationale = str(example.metadata.get("rationale") or "")
    calls = _CALC.findall(rationale)
    if not calls:
        return None
    pairs = _socratic_steps(rationale)
    lines: list[str] = []
    for k, (expr, result) in enumerate(calls, 1):
        code = _python_number(expr)
        got = _arith(code)
        if got is None or not numbers_match(got, result, docmath_rules=False):
            return None
        if len(pairs) == len(calls):
            lines.append(f"# Q{k}: {pairs[k - 1][0]}")
        lines.append(f"step{k} = {code}")
    lines.append(f"ans = step{len(calls)}")
    last = _arith(_python_number(calls[-1][0]))
    return lines if last is not None and numbers_match(last, answer, docmath_rules=False) else None


def _matches(value: float, answer: str, decimals: int | None) -> bool:
    """``value`` is the gold ``answer``: within DocMath's tolerance, or equal once rounded like the gold."""
    if numbers_match(value, answer, docmath_rules=False):
        return True
    return decimals is not None and round(value, decimals) == round(float(answer), decimals)


def _derivation_program(example: Example, answer: str) -> list[str] | None:
    """``ans = <TAT-QA derivation>`` (``%`` read as a unit or as /100, x100 for a percentage the derivation gives
    as a fraction; rounded like the gold answer), or None when no reading evaluates to the gold answer."""
    derivation = str(example.metadata.get("derivation") or "").strip()
    if not derivation:
        return None
    decimals = _decimals(answer)
    scales = (1, 100) if example.metadata.get("scale") == "percent" else (1,)
    for code in dict.fromkeys((_python_number(derivation, percent=False), _python_number(derivation))):
        got = _arith(code)
        if got is None:
            continue
        for scale in scales:
            if _matches(got * scale, answer, decimals):
                expr = code if scale == 1 else f"({code}) * {scale}"
                return [f"ans = round({expr}, {decimals})" if decimals else f"ans = {expr}"]
    return None


def pot_records(example: Example, doc: AceSearcherDocConfig, source: str = "") -> list[Record]:
    """Program-of-thought target in the document variant's PoT prompt (Fig. 18): a fenced Python program that
    stores the answer in ``ans``, from GSM8K calculator annotations or a TAT-QA derivation when they reproduce the
    gold answer, else ``ans = <the answer>`` (a number when it parses as one)."""
    answer = _answer(example, False)
    lines = _gsm8k_program(example, answer) or _derivation_program(example, answer)
    if lines is None:
        decimals = _decimals(answer)
        literal = repr(answer) if decimals is None else str(int(answer)) if decimals == 0 else repr(float(answer))
        lines = [f"ans = {literal}"]
    breakdown = breakdown_text(example)
    fields = _doc_fields(example, doc)
    prompt = _doc_template("pot", doc).format(**fields, decomposition=breakdown, decompose=breakdown).strip()
    return [make_record(prompt, _program_block(lines), source, "pot")]


# ---------------------------------------------------------------------------------------------------------------
# Released AceSearcher SFT data (LLaMA-Factory records)
# ---------------------------------------------------------------------------------------------------------------

_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
}


class _Malformed(ValueError):
    pass


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _Malformed(f"{what} should be a string, got {type(value).__name__}")
    return value


def _message(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or value.get("role") not in ("system", "user", "assistant"):
        raise _Malformed(f"{what} should be a {{role, content}} message with a system/user/assistant role")
    return {"role": value["role"], "content": _text(value.get("content"), f"{what} content")}


def released_record(data: Any, source: str) -> Record:
    """One released SFT record as a prompt-completion record; raises ValueError naming what is wrong.

    Alpaca (LLaMA-Factory): the user turn is ``instruction`` and ``input`` joined by a newline, the completion
    ``output``; ``system`` and ``history`` (``[[user, assistant], ...]``) become earlier messages. ShareGPT
    ``conversations`` (``from``: human/gpt/system) and ``messages`` (``role``/``content``): the last message must be
    the assistant's and is the completion; earlier messages are the prompt (not trained on). A record already in
    ``prompt``/``completion`` form is taken as it is.
    """
    if not isinstance(data, dict):
        raise _Malformed(f"expected a JSON object, got {type(data).__name__}")
    if "conversations" in data or "messages" in data:
        key = "conversations" if "conversations" in data else "messages"
        turns = data[key]
        if not isinstance(turns, list) or not turns:
            raise _Malformed(f"{key} should be a non-empty list")
        messages = []
        if data.get("system"):
            messages.append({"role": "system", "content": _text(data["system"], "system")})
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise _Malformed(f"{key}[{i}] should be an object")
            role = turn.get("from", turn.get("role"))
            content = turn.get("value", turn.get("content"))
            if role not in _ROLES:
                raise _Malformed(f"{key}[{i}]: unsupported role {role!r}")
            messages.append({"role": _ROLES[role], "content": _text(content, f"{key}[{i}] content")})
        if messages[-1]["role"] != "assistant":
            raise _Malformed(f"{key}: the last message is not the assistant's")
        if not messages[-1]["content"].strip():
            raise _Malformed(f"{key}: the assistant's reply is empty")
        if not any(m["role"] == "user" for m in messages[:-1]):
            raise _Malformed(f"{key}: no user message before the reply")
        return {"prompt": messages[:-1], "completion": [messages[-1]], "source": source, "kind": "released"}
    if "instruction" in data or "output" in data:
        instruction = _text(data.get("instruction", ""), "instruction")
        extra = _text(data.get("input") or "", "input")
        output = _text(data.get("output"), "output")
        user = "\n".join(part for part in (instruction, extra) if part)
        if not user.strip():
            raise _Malformed("instruction and input are empty")
        if not output.strip():
            raise _Malformed("output is empty")
        messages = []
        if data.get("system"):
            messages.append({"role": "system", "content": _text(data["system"], "system")})
        for i, pair in enumerate(data.get("history") or []):
            if not (isinstance(pair, list | tuple) and len(pair) == 2):
                raise _Malformed(f"history[{i}] should be a [user, assistant] pair")
            messages.append({"role": "user", "content": _text(pair[0], f"history[{i}][0]")})
            messages.append({"role": "assistant", "content": _text(pair[1], f"history[{i}][1]")})
        messages.append({"role": "user", "content": user})
        completion = [{"role": "assistant", "content": output}]
        return {"prompt": messages, "completion": completion, "source": source, "kind": "released"}
    if "prompt" in data and "completion" in data:
        prompt, completion = data["prompt"], data["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return make_record(prompt, completion, source, "released")
        if isinstance(prompt, list) and isinstance(completion, list) and completion:
            return {
                "prompt": [_message(m, f"prompt[{i}]") for i, m in enumerate(prompt)],
                "completion": [_message(m, f"completion[{i}]") for i, m in enumerate(completion)],
                "source": source,
                "kind": "released",
            }
        raise _Malformed("prompt/completion should be strings or message lists")
    raise _Malformed(f"unknown record shape (keys {sorted(data)[:8]}); expected alpaca, sharegpt or messages")


def _released_rows(path: str, split: str) -> Iterator[tuple[str, Any]]:
    """(where, raw record) of a local file (a JSON array: ``FILE[INDEX]``; else JSON lines: ``FILE:LINE``, a line
    that does not parse yields a :class:`_Malformed`) or of a hub dataset (``NAME[SPLIT][INDEX]``)."""
    if os.path.exists(path):
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
        if text.lstrip().startswith("["):
            with contextlib.suppress(json.JSONDecodeError):
                rows = json.loads(text)
                if isinstance(rows, list):
                    for i, row in enumerate(rows):
                        yield f"{path}[{i}]", row
                    return
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as exc:
                yield f"{path}:{lineno}", _Malformed(f"invalid JSON ({exc.msg} at column {exc.colno})")
        return
    if path.endswith((".json", ".jsonl", ".gz")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        raise FileNotFoundError(f"released SFT data not found: {path} (neither a file nor a hub name like 'org/name')")
    import datasets

    for i, row in enumerate(datasets.load_dataset(path, split=split)):
        yield f"{path}[{split}][{i}]", row


def read_released(
    path: str, split: str = "train", limit: int | None = None, source: str | None = None
) -> tuple[list[Record], list[str], int]:
    """Records of released SFT data, the malformed ones as ``"FILE:LINE: reason"``, and the number read.

    ``path`` is a local ``.json`` (array) / ``.jsonl`` file; when it does not exist and looks like a hub name
    (``AceSearcher/Search-SFT``) the ``split`` is loaded with ``datasets.load_dataset``. ``limit`` counts records
    read, malformed ones included.
    """
    records: list[Record] = []
    malformed: list[str] = []
    read = 0
    label = source or f"{Path(path).stem}:released"
    for where, row in _released_rows(path, split):
        if limit is not None and read >= limit:
            break
        read += 1
        try:
            if isinstance(row, _Malformed):
                raise row
            records.append(released_record(row, label))
        except _Malformed as exc:
            malformed.append(f"{where}: {exc}")
    return records, malformed, read
