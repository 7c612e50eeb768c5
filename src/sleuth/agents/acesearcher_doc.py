"""AceSearcher's document-level reasoning variant (DocMath-Eval, TAT-QA): decompose, then program-of-thought.

Per question (docs/methods.md, AceSearcher):

1. **Chunks.** The example's ``context`` is the document (tables as markdown passages, text paragraphs). A document
   of at most ``k`` chunks is given whole, in document order (DocMath's short subsets). A longer one is searched:
   BM25 over its own chunks with the question as the query, top ``k`` (the paper retrieves the top-10 chunks of
   long documents with an embedding model; BM25 stands in for it), recorded as a ``search`` Step. Without a
   document the run's retriever is searched instead, when there is one.
2. **Decompose** (1 LLM call): paper Fig. 11 (text chunks and tables in separate slots) or the released
   ``DECOMPOSE_PROMPT``. Sub-questions start with ``###``; they are parsed for the Trace, but the program prompt
   gets the decomposition text as it came ("a referenced breakdown"): sub-questions are *not* answered one by one.
3. **Program** (1 LLM call): paper Fig. 18 or the released ``QA_PROMPT``, "Store the final result in the variable
   ans". The program is run by :func:`sleuth.sandbox.run_program` (separate interpreter, time and memory limits,
   no network, no writes) and ``trace.answer`` is the value of ``ans`` as a string. A timeout, an exception or a
   forbidden action is recorded on the ``execute`` Step and in ``trace.meta["program"]``; the answer is then ""
   (scored wrong), never an error of the run.

``reasoning="cot"`` replaces step 3 by the chain-of-thought prompt (paper Fig. 19) and reads the last
``\\boxed{...}``. The paper reports the better of the two; PoT won at every model size (Table 8), so it is the
default. ``cot_fallback=True`` runs the CoT prompt after a failed program (digest §10 item 10; not in the paper).

Answers are scored by ``score_example``: ``kind="math"`` (TAT-QA arithmetic, DocMath) with ``docmath_accuracy``,
which reads the number in the answer string; other TAT-QA questions (spans, counts) with EM/F1. A list value
becomes its items joined with ", ", the way the TAT-QA loader joins multi-span answers.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from sleuth.agents.acesearcher import SubQuestion, extract_answer, parse_decomposition
from sleuth.agents.base import Context, format_passages, inert, load_prompt, neutralize_special_tokens, register_agent
from sleuth.llm import Sampling
from sleuth.records import Example, Passage, Step, Trace
from sleuth.sandbox import ProgramResult, arun_program, extract_program

__all__ = [
    "AceSearcherDocConfig",
    "acesearcher_doc",
    "extract_boxed",
    "format_value",
    "is_table",
    "rank_chunks",
    "render_acesearcher_doc",
]


@dataclass
class AceSearcherDocConfig:
    """Options of the ``acesearcher_doc`` agent. Defaults follow the paper; comments name the released code's choice.

    ``sampling`` is the decoding of both calls (greedy; the released ``main_reasoning.py`` uses temperature 0,
    top_k 1, top_p 0.99 and 2048 new tokens). ``decompose_max_new_tokens`` / ``answer_max_new_tokens`` override
    the budget of one call (None: ``sampling.max_new_tokens``; the CLI sets the latter).
    """

    k: int = 10  # chunks given to the model: top-10 for long documents [paper Table 4 caption, code k=10]
    sampling: Sampling = field(default_factory=lambda: Sampling(temperature=0.0, max_new_tokens=2048))
    decompose_max_new_tokens: int | None = None
    answer_max_new_tokens: int | None = None
    # "paper": Appendix E Figs. 11 and 18 verbatim; "code": main_reasoning.py's DECOMPOSE_PROMPT and QA_PROMPT.
    prompts: Literal["paper", "code"] = "paper"
    reasoning: Literal["pot", "cot"] = "pot"  # "pot": Fig. 18 + sandboxed program; "cot": Fig. 19 + \boxed{}
    passage_style: str = "text"  # format_passages style; the chunk titles (Table, Paragraph 3) are positional only
    # Order of the chunks BM25 picked from a long document: "rank" (the code's precomputed ranking) or "document".
    chunk_order: Literal["rank", "document"] = "rank"
    # The code's CompLong handling: a retrieved table chunk is prefixed with the chunk just before it.
    table_context: bool = False
    max_subquestions: int = 6  # parsed sub-questions kept for the Trace (digest §1.3)
    # "raw": the decomposition output pasted as it came (paper and code); "parsed": re-serialised "### Qk: text".
    breakdown: Literal["raw", "parsed"] = "raw"
    timeout_s: float = 3.0  # DocMath-Eval's execution timeout (digest §1.4)
    memory_mb: int = 512
    # Read when the program sets no ``ans`` (digest §10 item 10; the paper reads ``ans`` only): a variable, or a
    # function to call ("solution()", DocMath-Eval's own convention). Recorded as a fallback on the execute Step.
    answer_fallbacks: tuple[str, ...] = ("result", "solution()")
    cot_fallback: bool = False  # after a failed program, answer with the CoT prompt (not in the paper)

    @classmethod
    def official_code(cls) -> AceSearcherDocConfig:
        """The released ``main_reasoning.py``: code prompts, top_p 0.99, 2048 tokens, ranked chunks with table
        context, ``ans`` only."""
        return cls(
            sampling=Sampling(temperature=0.0, top_p=0.99, max_new_tokens=2048),
            prompts="code",
            table_context=True,
            answer_fallbacks=(),
        )

    def validate(self) -> None:
        """Raise ValueError for an option value the agent does not know (``--set`` values arrive unchecked)."""
        choices = {
            "prompts": ("paper", "code"),
            "reasoning": ("pot", "cot"),
            "chunk_order": ("rank", "document"),
            "breakdown": ("raw", "parsed"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"acesearcher_doc option {name}={getattr(self, name)!r}; expected one of {allowed}")
        for name in ("k", "max_subquestions"):
            if getattr(self, name) < 1:
                raise ValueError(f"acesearcher_doc option {name} must be >= 1")
        if self.timeout_s <= 0 or self.memory_mb < 64:
            raise ValueError("acesearcher_doc needs timeout_s > 0 and memory_mb >= 64")


def _budgeted(sampling: Sampling, max_new_tokens: int | None) -> Sampling:
    return dataclasses.replace(sampling, max_new_tokens=max_new_tokens) if max_new_tokens else sampling


def _join(*names: str | None) -> str | None:
    return "+".join(n for n in names if n) or None


# ---------------------------------------------------------------------------------------------------------------
# The document's chunks
# ---------------------------------------------------------------------------------------------------------------


def is_table(passage: Passage) -> bool:
    """A table chunk: ``meta["type"] == "table"`` (TAT-QA and DocMath loaders), or text made of ``|`` rows."""
    if passage.meta.get("type") == "table":
        return True
    lines = [line.strip() for line in passage.text.strip().splitlines() if line.strip()]
    return len(lines) >= 2 and all(line.startswith("|") for line in lines)


def rank_chunks(query: str, chunks: list[Passage], k: int) -> list[Passage]:
    """The top ``k`` of ``chunks`` for ``query`` by BM25 over the chunks alone (copies, ``score`` set, best first).

    bm25s with the project's index settings (Lucene BM25, k1=1.5, b=0.75, English stopwords, Snowball stems) over
    the chunk texts; ties keep document order.
    """
    import bm25s
    from bm25s.tokenization import Tokenized

    from sleuth.retrieval.bm25 import BM25Params, BM25Tokenizer

    params = BM25Params()
    tokenizer = BM25Tokenizer(params)
    ids = [tokenizer.document_ids(p.text) for p in chunks]
    model = bm25s.BM25(k1=params.k1, b=params.b, method=params.method)
    model.index(Tokenized(ids=ids, vocab=tokenizer.vocab), show_progress=False)
    scores = model.get_scores(tokenizer.query_tokens(query))
    order = sorted(range(len(chunks)), key=lambda i: (-float(scores[i]), i))[:k]
    return [dataclasses.replace(chunks[i], score=float(scores[i]), meta={**chunks[i].meta}) for i in order]


def with_table_context(picked: list[Passage], document: list[Passage]) -> list[Passage]:
    """Prefix each table chunk with the non-table chunk before it in the document (released code, CompLong)."""
    position = {p.id: i for i, p in enumerate(document)}
    out = []
    for p in picked:
        i = position.get(p.id, 0)
        if is_table(p) and i > 0 and not is_table(document[i - 1]):
            before = document[i - 1]
            p = dataclasses.replace(p, text=f"{before.text}\n{p.text}", meta={**p.meta, "prefixed_with": before.id})
        out.append(p)
    return out


async def select_chunks(example: Example, ctx: Context, trace: Trace, config: AceSearcherDocConfig) -> list[Passage]:
    """The chunks the prompts show: the whole document, its BM25 top-k, or (no document) the retriever's top-k."""
    document = list(example.context)
    info: dict[str, Any] = {"total": len(document)}
    if not document:
        if ctx.retriever is None:
            trace.meta["chunks"] = {**info, "source": "none", "ids": []}
            return []
        picked = await ctx.search(trace, example.question, config.k)
        trace.meta["chunks"] = {**info, "source": "retriever", "ids": [p.id for p in picked]}
        return picked
    if len(document) <= config.k:
        trace.meta["chunks"] = {**info, "source": "document", "ids": [p.id for p in document]}
        return document
    started = time.perf_counter()
    ranked = rank_chunks(example.question, document, config.k)
    trace.add(
        Step(
            kind="search",
            query=example.question,
            passages=ranked,
            seconds=time.perf_counter() - started,
            meta={"scope": "document", "chunks": len(document)},
        )
    )
    picked = ranked
    if config.chunk_order == "document":
        position = {p.id: i for i, p in enumerate(document)}
        picked = sorted(ranked, key=lambda p: position.get(p.id, 0))
    if config.table_context:
        picked = with_table_context(picked, document)
    trace.meta["chunks"] = {**info, "source": "bm25", "ids": [p.id for p in picked]}
    return picked


def prompt_fields(
    example: Example, chunks: list[Passage], style: str, inert: Callable[[str], str] = inert
) -> dict[str, str]:
    """Every placeholder the doc prompts use: Fig. 11's separate {passages}/{tables}, and {passage} = all chunks.

    Chunk titles and texts are made inert (the agent passes :meth:`Context.inert`): tag look-alikes escaped and the
    run's special tokens broken, so a chunk cannot open a chat turn. Tables and numbers are unchanged by it (``|``
    rows, ``<0.1`` and ``a < b`` are not tag-shaped; no table or paragraph of the TAT-QA dev set changes)."""
    shown = [dataclasses.replace(p, title=inert(p.title), text=inert(p.text)) for p in chunks]
    tables = [is_table(p) for p in chunks]
    return {
        "question": example.question,
        "passage": format_passages(shown, style),
        "passages": format_passages([p for p, t in zip(shown, tables, strict=True) if not t], style),
        "tables": format_passages([p for p, t in zip(shown, tables, strict=True) if t], style),
    }


# ---------------------------------------------------------------------------------------------------------------
# Answers: the program's value, or the last \boxed{}
# ---------------------------------------------------------------------------------------------------------------


def format_value(value: Any) -> str:
    """The answer string of a program's ``ans``: numbers without float noise, lists joined with ", ". Raises
    ValueError for an int past Python's 4,300-digit str limit (the agent records it as a fallback).

    >>> format_value(3.0), format_value(0.1 + 0.2), format_value([1, 2.5]), format_value(None), format_value(True)
    ('3', '0.3', '1, 2.5', '', 'True')
    """
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value.is_integer() and abs(value) < 1e16:
            return str(int(value))
        return repr(round(value, 10)) if abs(value) >= 1e-6 else repr(value)
    if isinstance(value, list):
        return ", ".join(format_value(v) for v in value)
    return str(value)


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_LATEX_WRAPPERS = re.compile(r"\\(?:text|mathrm|textbf|mathbf|operatorname)\s*\{([^{}]*)\}")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


def _frac(m: re.Match[str]) -> str:
    try:
        return format_value(float(m.group(1).replace(",", "")) / float(m.group(2).replace(",", "")))
    except (ValueError, ZeroDivisionError):
        return f"({m.group(1)})/({m.group(2)})"


def clean_latex(text: str) -> str:
    r"""Plain text of a boxed answer: ``\text{}`` unwrapped, numeric ``\frac{a}{b}`` evaluated, ``\%`` -> ``%``.

    >>> clean_latex(r"\$1{,}234.5"), clean_latex(r"12.5\%"), clean_latex(r"\frac{1}{4}"), clean_latex(r"5\text{ mn}")
    ('$1,234.5', '12.5%', '0.25', '5 mn')
    """
    text = _LATEX_WRAPPERS.sub(r"\1", text)
    text = _FRAC.sub(_frac, text)
    for old, new in (("\\%", "%"), ("\\$", "$"), ("{,}", ","), ("\\,", ""), ("\\!", ""), ("\\ ", " ")):
        text = text.replace(old, new)
    text = " ".join(text.replace("\\left", "").replace("\\right", "").split())
    if len(text) > 1 and text.startswith("$") and text.endswith("$"):
        text = text[1:-1].strip()
    return text


def extract_boxed(text: str) -> tuple[str, str | None]:
    r"""The content of the last ``\boxed{...}`` (nested braces matched, LaTeX cleaned) and the fallback taken.

    Fallbacks: an unclosed last ``\boxed{`` -> the rest of its line (``"unclosed_boxed"``); no ``\boxed`` -> the
    AceSearcher final-answer rules (``<answer>`` tags, "answer is", the last line), named ``"no_boxed+<rule>"``.

    >>> extract_boxed(r"So 3 + 4 = 7, i.e. \boxed{7}. Check: \boxed{\frac{7}{2}}")
    ('3.5', None)
    >>> extract_boxed("The change is 12.5%.")
    ('The change is 12.5%.', 'no_boxed+whole_text')
    """
    text = text or ""
    last = deque(_BOXED.finditer(text), maxlen=1)  # only the last match counts; no list of every match is kept
    if last:
        begin = last[0].end()
        depth = 1
        for i in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                answer = clean_latex(text[begin:i])
                return answer, None if answer else "empty_boxed"
        return clean_latex(text[begin:].split("\n")[0]), "unclosed_boxed"
    answer, fallback = extract_answer(text)
    return clean_latex(answer), _join("no_boxed", fallback)


# ---------------------------------------------------------------------------------------------------------------
# The agent
# ---------------------------------------------------------------------------------------------------------------


async def decompose_document(
    example: Example, fields: dict[str, str], ctx: Context, trace: Trace, config: AceSearcherDocConfig
) -> str:
    """The decomposition call; returns the breakdown text the answer prompt gets and records the parse."""
    template = load_prompt(
        "acesearcher_doc_code_decompose" if config.prompts == "code" else "acesearcher_doc_decompose"
    )
    sampling = _budgeted(config.sampling, config.decompose_max_new_tokens)
    step = await ctx.chat(trace, "decompose", template.format(**fields).strip(), sampling)
    raw = (step.output or "").strip()
    subs, fallback = parse_decomposition(raw, config.max_subquestions)
    if config.breakdown == "parsed" or not raw:
        items = subs or [SubQuestion(1, example.question, [])]
        breakdown = "\n".join(f"### Q{s.index}: {s.text}" for s in items)
        if not subs:
            fallback = _join(fallback, "question_as_subquestion")
    else:
        breakdown = raw  # the paper and the code paste the decomposition output verbatim
    # model text (which may copy a chunk) goes into the next prompt: no chat-control token may survive in it
    breakdown = neutralize_special_tokens(breakdown, ctx.special_tokens())
    step.parsed = [dataclasses.asdict(s) for s in subs]
    step.fallback = fallback
    step.meta["breakdown"] = breakdown
    trace.meta["decomposition"] = [{"index": s.index, "text": s.text} for s in subs]
    trace.meta["breakdown"] = breakdown
    return breakdown


# An echo shorter than this is no echo: a reply may start with the prompt's first words by chance.
_MIN_ECHO = 40


def _echo_end(reply: str, prompt: str) -> int:
    """Where the model's own text starts in ``reply`` when it begins by echoing ``prompt``: after the last
    occurrence of the whole prompt, else after a common prefix of at least ``_MIN_ECHO`` characters (leading
    whitespace ignored); 0 when there is no echo."""
    prompt = prompt.strip()
    end = 0
    while prompt and (at := reply.find(prompt, end)) >= 0:  # forward find is linear; rfind can be quadratic
        end = at + len(prompt)
    if end:
        return end
    start = len(reply) - len(reply.lstrip())
    shared = 0
    for a, b in zip(reply[start : start + len(prompt)], prompt, strict=False):
        if a != b:
            break
        shared += 1
    return start + shared if shared >= min(_MIN_ECHO, len(prompt)) and shared else 0


def authored_program(reply: str, prompt: str, documents: Iterable[str]) -> tuple[str, str | None]:
    """The program to run from a model reply, taken only from text the model authored, and the fallback taken.

    A document can plant code (a fenced ```python block setting ``ans``) that a model echoing its prompt would
    copy into its reply. So: an echoed prompt at the start of the reply is cut off (``"echoed_prompt"``), the
    program is extracted from the rest (:func:`sleuth.sandbox.extract_program`, its fallback kept), and a program
    that occurs verbatim in a document (as the prompt showed it, or raw) is refused: ``("", "planted_program")``.
    Linear in the reply, the prompt and the documents."""
    cut = _echo_end(reply, prompt)
    code, fallback = extract_program(reply[cut:])
    fallbacks = ["echoed_prompt" if cut else None, fallback]
    body = code.strip()
    if body and any(body in document for document in documents):
        return "", _join(*fallbacks, "planted_program")
    return code, _join(*fallbacks)


def _read_value(result: ProgramResult) -> tuple[str | None, str | None]:
    """The answer string of a program run and the fallback taken (None, None when the run failed)."""
    if not result.ok:
        return None, None
    try:
        answer = format_value(result.value)
    except ValueError:  # an int past Python's str limit: no answer can be printed from it
        return None, "unprintable_value"
    return answer, f"read_{result.variable}" if result.variable != "ans" else None


async def program_of_thought(
    fields: dict[str, str],
    breakdown: str,
    ctx: Context,
    trace: Trace,
    config: AceSearcherDocConfig,
    chunks: Iterable[Passage] = (),
) -> str | None:
    """Ask for the program, run it in the sandbox; the answer string, or None when the program failed.

    Only a program the model authored runs (:func:`authored_program`): never one echoed from the prompt or copied
    verbatim from a chunk (``chunks``: their raw texts, next to the ones the prompt showed)."""
    template = load_prompt("acesearcher_doc_code_pot" if config.prompts == "code" else "acesearcher_doc_pot")
    prompt = template.format(**fields, decomposition=breakdown, decompose=breakdown).strip()
    sampling = _budgeted(config.sampling, config.answer_max_new_tokens)
    step = await ctx.chat(trace, "program", prompt, sampling)
    documents = [fields["passage"], *(p.text for p in chunks)]
    code, fallback = authored_program(step.output or "", prompt, documents)
    planted = "planted_program" in (fallback or "")
    step.parsed = code
    step.fallback = _join(fallback, None if code.strip() or planted else "empty_program")
    if code.strip():
        result = await arun_program(
            code,
            timeout_s=config.timeout_s,
            memory_mb=config.memory_mb,
            result_var="ans",
            fallback_vars=tuple(config.answer_fallbacks),
        )
    else:
        result = ProgramResult(
            ok=False, error="refused: program copied from a document" if planted else "empty program"
        )
    answer, read = _read_value(result)
    value = result.value if read != "unprintable_value" else None
    run = Step(
        kind="execute",
        parsed=value,
        error=result.error,
        seconds=result.seconds,
        fallback=read,
        meta={"ok": result.ok, "variable": result.variable, "stdout": result.stdout, "answer": answer},
    )
    trace.add(run)
    trace.meta["program"] = {
        "code": code,
        "ok": result.ok and answer is not None,
        "value": value,
        "error": result.error,
        "variable": result.variable,
        "stdout": result.stdout,
        "seconds": result.seconds,
    }
    return answer


async def chain_of_thought(
    fields: dict[str, str],
    breakdown: str,
    ctx: Context,
    trace: Trace,
    config: AceSearcherDocConfig,
    after_failure: bool = False,
) -> str:
    """Fig. 19: step-by-step reasoning, the answer read from the last ``\\boxed{}``."""
    prompt = load_prompt("acesearcher_doc_cot").format(**fields, decomposition=breakdown, decompose=breakdown)
    sampling = _budgeted(config.sampling, config.answer_max_new_tokens)
    step = await ctx.chat(trace, "answer", prompt.strip(), sampling)
    answer, fallback = extract_boxed(step.output or "")
    step.parsed = answer
    step.fallback = _join("cot_after_failed_program" if after_failure else None, fallback)
    return answer


def render_acesearcher_doc(trace: Trace) -> Any:
    """The chunks used, the decomposition, the program (syntax-highlighted) with its result or error, the answer."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.syntax import Syntax
    from rich.text import Text
    from rich.tree import Tree

    parts: list[Any] = [Text(trace.example.question, style="bold")]
    chunks = trace.meta.get("chunks") or {}
    if chunks:
        how = {"document": "the whole document", "bm25": "BM25 top-k of the document", "retriever": "the retriever"}
        parts.append(
            Text(
                f"context: {len(chunks.get('ids', []))} of {chunks.get('total', 0)} chunk(s), "
                f"{how.get(chunks.get('source'), 'none')}",
                style="dim",
            )
        )
    tree = Tree(Text("decomposition", style="bold"), guide_style="dim")
    subs = trace.meta.get("decomposition") or []
    for sub in subs:
        tree.add(Text.assemble((f"Q{sub['index']}", "bold cyan"), f": {sub['text']}"))
    if not subs:
        breakdown = trace.meta.get("breakdown")
        tree.add(Text(f"(unparsed) {breakdown}" if breakdown else "(none recorded)", style="dim"))
    parts.append(tree)
    program = trace.meta.get("program")
    if program is not None:
        parts.append(
            Panel(
                Syntax(program.get("code") or "", "python", line_numbers=True, word_wrap=True),
                title="program",
                title_align="left",
            )
        )
        if program.get("ok"):
            name = program.get("variable") or "ans"
            parts.append(Text.assemble((f"{name} = ", "bold"), (repr(program.get("value")), "green")))
        else:
            parts.append(Text.assemble(("program failed: ", "bold red"), (str(program.get("error")), "red")))
        if program.get("stdout"):
            parts.append(Text(f"stdout: {program['stdout'].strip()[:500]}", style="dim"))
    answer_style = "bold green" if trace.answer else "bold red"
    parts.append(Text.assemble(("final answer: ", "bold"), (trace.answer or "(no answer)", answer_style)))
    return Group(*parts)


@register_agent(
    "acesearcher_doc",
    config=AceSearcherDocConfig,
    needs_retriever=False,
    wants_retriever=True,
    render=render_acesearcher_doc,
)
async def acesearcher_doc(example: Example, ctx: Context, trace: Trace) -> Trace:
    """AceSearcher on a document (DocMath, TAT-QA): decompose, write a program that sets ``ans``, run it."""
    config: AceSearcherDocConfig = ctx.config if ctx.config is not None else AceSearcherDocConfig()
    trace.answer = ""
    config.validate()
    trace.meta["reasoning"] = config.reasoning
    chunks = await select_chunks(example, ctx, trace, config)
    fields = prompt_fields(example, chunks, config.passage_style, ctx.inert)
    breakdown = await decompose_document(example, fields, ctx, trace, config)
    if config.reasoning == "cot":
        trace.answer = await chain_of_thought(fields, breakdown, ctx, trace, config)
        return trace
    answer = await program_of_thought(fields, breakdown, ctx, trace, config, chunks)
    if answer is None and config.cot_fallback:
        trace.meta["cot_fallback"] = True
        answer = await chain_of_thought(fields, breakdown, ctx, trace, config, after_failure=True)
    trace.answer = answer or ""
    return trace
