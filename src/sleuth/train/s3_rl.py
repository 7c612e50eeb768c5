"""s3 training: RL of the searcher on Gain Beyond RAG while the generator stays frozen (Jiang et al., arXiv
2505.14146, §3; docs/training.md, "s3 RL").

``sleuth train s3 --config configs/s3_ppo.yaml``. Only the searcher learns; the generator is any backend spec
(another local model, a vLLM or hosted endpoint) and is never updated. Before training, the naive-RAG accuracy
of every training question (the generator answering from the top-3 documents for the question) is computed once
into ``OUT/naive_rag_cache.jsonl`` (keyed by a fingerprint of the generator and retrieval settings: a different
generator recomputes), and the training questions are filtered as the paper does: yes/no/true/false answers and
questions naive RAG already answers are dropped, with counts in ``OUT/data_summary.json``.

Each step the ``s3`` agent runs on the step's questions with the live searcher sampling at T = 0.6, top-p 0.95 and
the frozen generator answering from the documents it kept; the reward is
``GBR = Acc(G(Q, D_s3), A) - Acc(G(Q, D_RAG), A)`` (``reward: code`` adds the official code's ``+ Acc``), with Acc
the normalised span match (``metric: judge`` and a ``judge`` spec switch to the LLM judge). The searcher's whole
trajectory is one assistant message in which retrieved ``<information>`` blocks are inserted: they are masked out
of the policy loss, the KL and the value loss (the initial documents in the prompt are marked as observations too,
so an episode over ``max_episode_tokens`` loses document text, never the instruction). Algorithms: **PPO** (the
paper's, with the reference's veRL settings: a separate critic initialised from the base model, critic lr 1e-5 with
a 15-step linear warm-up, actor lr 1e-6 constant, no critic-only warm-up steps, GAE with gamma = lambda = 1, KL to
the initial searcher in the reward with coefficient 0.001, clip 0.2, value clip 0.5, entropy 0.001, 120 questions
per step in 4 mini-batches; ``critic: shared_head`` is the memory-saving deviation) or **GRPO**
(``algorithm: grpo``, ``group_size`` rollouts per question, group-normalised GBR). The loop, its log, checkpoints
and resume: :mod:`sleuth.train.online_rl`.

**Searcher warm start** (a deviation from the paper, which starts RL from the base searcher; off unless a caller
asks for it): :func:`searcher_warmup_records` turns questions with a gold decomposition (the synthetic world, MuSiQue,
2Wiki evidences) into gold searcher trajectories replayed through the real ``s3`` agent, to fine-tune the searcher on
before RL with :func:`~sleuth.train.exsearch_em.train_weighted` (observations masked). See its docstring.

>>> summary = train_s3(load_config(S3RLConfig, "configs/s3_ppo.yaml"))  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sleuth.agents import Context
from sleuth.agents.base import escape_observation
from sleuth.agents.s3 import S3Config, task_question
from sleuth.llm import LLM, ReplayLLM, Request
from sleuth.records import Example, Passage, Trace
from sleuth.retrieval import Retriever
from sleuth.train.common import DataConfig, prepare_data, with_sampling
from sleuth.train.config import load_config, to_mapping
from sleuth.train.online_rl import DataParallel, Episode, RLConfig, Task, train_online
from sleuth.train.tokens import observation_segments

__all__ = [
    "GoldSearch",
    "S3RLConfig",
    "S3Task",
    "gold_reply",
    "gold_searches",
    "main",
    "prepare_s3_data",
    "searcher_warmup_records",
    "train_s3",
    "trajectory_messages",
    "warm_start_searcher",
]

Record = dict[str, Any]


@dataclass
class S3RLConfig(RLConfig, DataConfig):
    """Options of ``sleuth train s3`` (defaults: the paper and its training script; docs/training.md, "s3 RL")."""

    output_dir: str = "runs/s3-rl"
    algorithm: Literal["grpo", "ppo"] = "ppo"
    group_size: int = 1  # PPO: one rollout per question (n_agent = 1)
    prompts_per_step: int = 120
    steps: int = 20  # the paper evaluates the step-20 checkpoint
    mini_batches: int = 4  # ppo_mini_batch_size 30 of 120
    learning_rate: float = 1e-6
    critic_learning_rate: float = 1e-5
    # veRL's critic lr_warmup_steps_ratio 0.01 x the script's total_training_steps 1500 (veRL starts that ramp at 0,
    # sleuth at lr / 15); trainer.critic_warmup = 0 in s3's scripts: the actor learns from the first step
    critic_lr_warmup_steps: int = 15
    kl_coef: float = 0.001
    kl: str = "k1"
    entropy_coef: float = 0.001
    value_clip: float = 0.5
    # veRL (dp_actor / dp_critic): each micro-batch's token mean divided by the accumulation steps
    micro_batch_aggregation: Literal["mini_batch_mean", "micro_batch_mean"] = "micro_batch_mean"
    weight_decay: float = 0.01  # veRL's AdamW default (optim.weight_decay 1e-2), actor and critic
    temperature: float = 0.6
    top_p: float = 0.95
    seed: int = 42
    # data (DataConfig): a synthetic world (data_dir, generated from `synth` when missing) or explicit files;
    # llm_options: hf: options of the searcher's sampling model
    generator: str = "default"  # the frozen generator: any backend spec ("default": the embedded SmolLM2)
    agent: S3Config = field(default_factory=S3Config)
    reward: Literal["paper", "code"] = "paper"  # GBR, or the official code's GBR + Acc
    metric: Literal["genacc", "span", "judge"] = "genacc"
    # LLM judge spec for metric genacc/judge. "" = span match only: a deviation (the reference always falls back to
    # its LLM judge, for the s3 answer and the naive-RAG score), kept as the default so a CPU run needs no judge model
    judge: str = ""
    filter: bool = True  # the paper's training-data filter

    def validate(self) -> None:
        super().validate()
        if self.reward not in ("paper", "code"):
            raise ValueError(f"reward={self.reward!r}; expected 'paper' or 'code'")


def trajectory_messages(trace: Trace) -> list[dict[str, Any]] | None:
    """The searcher's conversation: the prompt (its initial documents' texts marked as observations), then ONE
    assistant message made of model segments and inserted observations (``trace.meta["transcript"]``). None when
    the searcher never wrote anything."""
    prompt = trace.meta.get("searcher_prompt")
    segments = [s for s in trace.meta.get("transcript") or [] if s.get("text")]
    if not prompt or not any(s["source"] == "model" for s in segments):
        return None
    user: dict[str, Any] = {"role": "user", "content": prompt}
    documents = [escape_observation(str(p.get("text") or "")) for p in trace.meta.get("naive_rag_passages") or []]
    marked = observation_segments(prompt, documents)  # the initial documents: cut before the instruction
    if marked is not None:
        user["segments"] = marked
    return [user, {"role": "assistant", "segments": segments}]


def trajectory_pieces(trace: Trace) -> tuple[list[int], list[dict[str, Any]]] | None:
    """The searcher's trajectory as ids (token-in, token-out rollouts): the first prompt's ids as the engine got them
    and the pieces that followed, for :func:`sleuth.train.tokens.sampled_chat`: each kept reply's sampled ids
    (``model``, with the sampler's log-probs; the last one with its end-of-turn id when one was sampled), each
    observation's ids (``observation``) and text the agent put back after a reply (``inserted``). None when the
    rollout recorded no ids, or not for every segment (the trainer then re-tokenizes the text)."""
    head = trace.meta.get("searcher_prompt_ids")
    segments = [s for s in trace.meta.get("transcript") or [] if s.get("text")]
    if not head or trace.meta.get("tokens_off") or not segments or any("ids" not in s for s in segments):
        return None
    pieces: list[dict[str, Any]] = []
    for i, segment in enumerate(segments):
        if segment["source"] != "model":
            pieces.append({"source": segment["source"], "ids": list(segment["ids"])})
            continue
        ids, logprobs = list(segment["ids"]), segment.get("logprobs")
        logprobs = list(logprobs) if logprobs is not None else None
        last = i == len(segments) - 1 and not segment.get("inserted")
        if last and segment.get("eos") is not None:  # the reply that ended the message: its end-of-turn id learns
            ids.append(int(segment["eos"]))
            logprobs = (
                [*logprobs, segment["eos_logprob"]] if logprobs and segment.get("eos_logprob") is not None else None
            )
        pieces.append({"source": "model", "ids": ids, "logprobs": logprobs})
        if segment.get("inserted"):
            pieces.append({"source": "inserted", "ids": list(segment["inserted"])})
    return list(head), pieces


class S3Task(Task):
    method = "s3"

    def __init__(self, config: S3RLConfig, retriever: Retriever, generator: LLM, cache: Any, judge: Any) -> None:
        self.config = config
        self.retriever = retriever
        self.generator = generator
        self.cache = cache
        self.judge = judge

    def agent_config(self, config: RLConfig) -> Any:
        return with_sampling(self.config.agent, config.temperature, config.top_p)

    def context(self, llm: Any, agent_config: Any) -> Context:
        return Context(llm=llm, retriever=self.retriever, config=agent_config, roles={"generator": self.generator})

    def episodes(self, traces: list[Trace]) -> list[Episode]:
        from sleuth.train.rewards import s3_reward

        async def rewards() -> list[dict[str, Any] | None]:
            async def one(trace: Trace) -> dict[str, Any] | None:
                if trace.error:
                    return None
                return await s3_reward(
                    trace,
                    self.generator,
                    self.cache,
                    self.config.reward,
                    self.judge,
                    config=self.config.agent,
                    metric=self.config.metric,
                )

            return list(await asyncio.gather(*(one(t) for t in traces)))

        out = []
        for trace, scores in zip(traces, asyncio.run(rewards()), strict=True):
            group = trace.example.metadata["rl"]["group"]
            messages = trajectory_messages(trace) if scores is not None else None
            searches = max(len(trace.meta.get("rounds") or []) - 1, 0)
            if scores is None or messages is None:
                out.append(Episode(group=group, messages=None, reward=0.0, components={}, searches=searches))
                continue
            components = {
                "acc_s3": float(scores["acc_s3"]),
                "acc_naive": float(scores["acc_naive"]),
                "selected": float(len(trace.meta.get("selected_ids") or [])),
            }
            episode = Episode(
                group=group,
                messages=messages,
                reward=float(scores["reward"]),
                components=components,
                searches=searches,
            )
            if (tokens := trajectory_pieces(trace)) is not None:
                episode.prompt_ids, episode.pieces = tokens
            out.append(episode)
        return out


def prepare_s3_data(config: S3RLConfig) -> tuple[list[Example], str]:
    """Training questions and the retriever spec (generating the synthetic world / BM25 index when needed)."""
    train, _, index = prepare_data(config, config.output_dir, config.progress)
    return train, index


def train_s3(config: S3RLConfig, generator: LLM | None = None, retriever: Retriever | None = None) -> dict[str, Any]:
    """Cache the naive-RAG baseline, filter, then RL (module doc). ``generator`` / ``retriever`` replace the
    ones the config names (tests pass scripted ones)."""
    from sleuth.llm import load_llm
    from sleuth.retrieval import load_retriever
    from sleuth.train.rewards import NaiveRagCache, filter_training_examples, precompute_naive_rag

    config.validate()
    out = Path(config.output_dir)
    processes = DataParallel()
    with processes.main_first():  # several processes: process 0 builds the data and the baseline cache
        out.mkdir(parents=True, exist_ok=True)
        train, index = prepare_s3_data(config)
        if retriever is None:  # not `or`: a Retriever defines __len__ (0 for in-memory ones)
            retriever = load_retriever(index)
        if generator is None:
            generator = load_llm(None if config.generator == "default" else config.generator)
        judge = load_llm(config.judge) if config.judge else None
        cache = NaiveRagCache.for_s3(
            out / "naive_rag_cache.jsonl",
            generator,
            config.agent,
            retriever=index or retriever.spec,
            judge=judge,
            metric=config.metric,
        )
        naive = asyncio.run(
            precompute_naive_rag(
                train, retriever, generator, cache, config.agent, judge, config.metric, config.concurrency
            )
        )
        kept, dropped = filter_training_examples(train, naive) if config.filter else (train, {})
        summary = {
            "questions": len(train),
            "kept": len(kept),
            "dropped": dict(dropped),
            "naive_rag_accuracy": sum(naive.values()) / max(len(naive), 1),
            "cache": {"hits": cache.hits, "misses": cache.misses},
        }
        if processes.main:
            (out / "config.json").write_text(json.dumps(to_mapping(config), indent=2, default=str) + "\n")
            (out / "data_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not kept:
        raise ValueError(f"no training questions left after filtering: {summary}")
    result = train_online(config, S3Task(config, retriever, generator, cache, judge), kept, log_name="s3")
    result["data"] = summary
    return result


# ---------------------------------------------------------------------------------------------------------------
# Searcher warm start: gold trajectories replayed through the agent (a deviation: the paper starts from the base)
# ---------------------------------------------------------------------------------------------------------------

WARMUP_SOURCE = "s3-gold"
# The agent's searcher prompt (s3_searcher.txt) names the question after this line; a trajectory is found by it.
_PROMPT_QUESTION = re.compile(
    re.escape("Now, start the loop with the following question and initial searched results:")
    + r"\s*<question>\n(.*?)\n</question>",
    re.S,
)
# Every gold reply but the last is followed by one retrieval block, and retrieved text is inert (it cannot contain
# the tag): the number of blocks closed after the prompt's question, less the initial one, is the number of replies
# written so far.
_BLOCK_END = "</information>"
_UNRESOLVED = re.compile(r"#\d+")


@dataclass
class GoldSearch:
    """One gold searcher trajectory before its replay: the example, the replies in order (the last one stops), the
    query of each search, and per searched block the doc numbers its ``<important_info>`` selects and the passage
    ids they are. ``counts``: how the example's retrieval hops were covered (:func:`gold_searches`)."""

    example: Example
    replies: list[str]
    queries: list[str]
    selections: list[list[int]]
    selected_ids: list[list[str]]
    counts: Counter[str] = field(default_factory=Counter)
    initial_selection: list[int] | None = None  # the first reply's tag on the initial block (None: kept whole)


def gold_reply(selection: list[int] | None, query: str | None) -> str:
    """One searcher reply in the layout of the searcher prompt's own example (``s3_searcher.txt``): the
    ``<important_info>`` of the most recent ``<information>`` block (``None``: no tag, so a block is kept whole, as
    the initial one), ``<search_complete>`` (``True`` exactly when there is no query) and the query as the prompt's
    JSON (``{"query": ...}`` indented by 4, non-ASCII kept). The first reply (``selection`` None) that searches is
    the query alone, as the prompt's "If the initial searched results are not enough ..., you should output:
    <query>..." example: the base model finds that opening as likely as ``<search_complete>True``, while
    ``<search_complete>False`` first is 2 nats less likely (``benchmarks/s3_warmup_probe.py``, SmolLM2-135M)."""
    parts = [] if selection is None else [f"<important_info>\n{list(selection)}\n</important_info>"]
    if selection is not None or query is None:
        parts.append(f"<search_complete>\n{query is None}\n</search_complete>")
    if query is not None:
        parts.append("<query>\n" + json.dumps({"query": query}, indent=4, ensure_ascii=False) + "\n</query>")
    return "\n".join(parts)


def _retrieval_hops(example: Example) -> tuple[list[tuple[str, list[str]]], str | None]:
    """The gold hops to search for: per decomposition step that has supporting passages (a comparison step has
    none: it is reasoning, not search), its sub-question with each ``#k`` replaced by step k's gold answer
    (whitespace collapsed) and its passage ids; or why there are none (``no_gold_decomposition``,
    ``incomplete_decomposition``: a step without a question or an answer, ``unresolved_reference``,
    ``no_supporting_passages``). The decompositions are :func:`sleuth.train.sft.gold_steps`'s."""
    from sleuth.agents.acesearcher import resolve_references
    from sleuth.train.sft import gold_steps

    steps = gold_steps(example)
    if not steps:
        return [], "no_gold_decomposition"
    if any(not s["question"] or not s["answer"] for s in steps):
        return [], "incomplete_decomposition"
    answers: dict[int, str] = {}
    hops: list[tuple[str, list[str]]] = []
    for k, step in enumerate(steps, 1):
        query = " ".join(resolve_references(step["question"], answers).split())
        answers[k] = step["answer"]
        if step["supporting_ids"]:
            if _UNRESOLVED.search(query):
                return [], "unresolved_reference"
            hops.append((query, list(step["supporting_ids"])))
    return hops, (None if hops else "no_supporting_passages")


def gold_searches(
    examples: Iterable[Example], retriever: Retriever, config: S3Config, initial: str = "whole"
) -> tuple[list[GoldSearch], Counter[str]]:
    """Plan each example's gold searcher trajectory with the real retriever (one batched search per round), and
    count the examples that have none by reason.

    The searcher starts from the naive-RAG documents (top ``k_initial`` for the question, in the prompt). Each round
    queries the first hop not searched yet whose gold passages have not all been shown (in the initial documents or
    an earlier observation), with its resolved gold sub-question; its observation is the top ``k`` for that query.
    At most ``max_turns`` queries: hops left uncovered then are counted (``hops_beyond_max_turns``). With
    ``initial="whole"`` the initial block gets no ``<important_info>`` (kept whole, as the prompt's example and the
    code's searchers do); ``initial="gold"`` (a deviation of the warm start: it teaches the searcher to drop naive
    RAG's documents that are not gold, the documents a question kept by s3's filter was missed with) tags it in the
    first reply with its gold numbers like any other block (``[]``: none kept); every
    searched block selects the numbers of the example's gold passages it shows (possibly none: ``[]`` keeps none of
    it), ascending, at most ``max_selected``; the last reply says ``<search_complete>True``.

    Counts per example: ``hops``, ``hops_in_initial``, ``hops_queried``, ``gold_retrieved`` (queried hops whose gold
    passages their own query found; the next query still names the gold answer when it did not) and
    ``hops_beyond_max_turns``; hops in none of these were shown by another hop's query."""
    if initial not in ("whole", "gold"):
        raise ValueError(f"initial must be 'whole' or 'gold', not {initial!r}")
    skipped: Counter[str] = Counter()
    plans: list[tuple[Example, list[tuple[str, list[str]]]]] = []
    for example in examples:
        hops, reason = _retrieval_hops(example)
        if reason:
            skipped[reason] += 1
        else:
            plans.append((example, hops))
    if not plans:
        return [], skipped
    initial_docs = retriever.search([e.question.strip() for e, _ in plans], config.k_initial)  # the agent's q0
    shown = [{p.id for p in docs} for docs in initial_docs]
    blocks: list[list[list[Passage]]] = [[] for _ in plans]
    queries: list[list[str]] = [[] for _ in plans]
    counts = [Counter({"hops": len(hops)}) for _, hops in plans]
    for i, (_, hops) in enumerate(plans):
        counts[i]["hops_in_initial"] = sum(set(ids) <= shown[i] for _, ids in hops)
    position = [0] * len(plans)  # per example, the next hop that may be queried

    def next_hop(i: int) -> tuple[str, list[str]] | None:
        hops = plans[i][1]
        while position[i] < len(hops) and set(hops[position[i]][1]) <= shown[i]:
            position[i] += 1
        return hops[position[i]] if position[i] < len(hops) else None

    for _ in range(config.max_turns):
        asking = [(i, hop) for i in range(len(plans)) if (hop := next_hop(i)) is not None]
        if not asking:
            break
        found = retriever.search([query for _, (query, _) in asking], config.k)
        for (i, (query, ids)), docs in zip(asking, found, strict=True):
            position[i] += 1
            blocks[i].append(list(docs))
            queries[i].append(query)
            counts[i]["hops_queried"] += 1
            counts[i]["gold_retrieved"] += set(ids) <= {p.id for p in docs}
            shown[i].update(p.id for p in docs)
    searches = []
    for i, (example, hops) in enumerate(plans):
        counts[i]["hops_beyond_max_turns"] = sum(not set(ids) <= shown[i] for _, ids in hops[position[i] :])
        gold = set(example.supporting_ids).union(*(ids for _, ids in hops))
        selections = []
        for docs in blocks[i]:
            numbers = [n for n, p in enumerate(docs, 1) if p.id in gold]
            selections.append(numbers[: config.max_selected] if config.max_selected else numbers)
        first = None
        if initial == "gold":
            numbers = [n for n, p in enumerate(initial_docs[i], 1) if p.id in gold]
            first = numbers[: config.max_selected] if config.max_selected else numbers
        replies = [gold_reply(first, queries[i][0] if queries[i] else None)]
        for j, selection in enumerate(selections):
            replies.append(gold_reply(selection, queries[i][j + 1] if j + 1 < len(queries[i]) else None))
        searches.append(
            GoldSearch(
                example=example,
                replies=replies,
                queries=queries[i],
                selections=selections,
                selected_ids=[[docs[n - 1].id for n in sel] for docs, sel in zip(blocks[i], selections, strict=True)],
                counts=counts[i],
                initial_selection=first,
            )
        )
    return searches, skipped


def _gold_reply(replies: dict[str, list[str]], request: Request) -> str:
    """The planned reply of the searcher prompt ``request`` continues: the question the prompt names picks the
    trajectory, the number of replies already written its turn (stateless, so it works in both of
    :func:`~sleuth.agents.s3.searcher_request`'s modes). Any other request (the generator's) gets an empty reply."""
    if request.prompt is not None:
        text = request.prompt
    else:
        text = "".join(str(m.get("content") or "") for m in request.messages or [])
    match = _PROMPT_QUESTION.search(text)
    planned = replies.get(match.group(1)) if match else None
    if planned is None:
        return ""
    turn = max(text.count(_BLOCK_END, match.end()) - 1, 0)
    return planned[turn] if turn < len(planned) else ""


def _replay_problem(search: GoldSearch, trace: Trace) -> str | None:
    """Why a replayed trace is not the planned trajectory (None: it is, reply for reply)."""
    if trace.error:
        return "replay_error"
    if (trace.meta.get("observation_cap") or {}).get("truncated"):
        return "observation_capped"  # the searcher would see fewer documents than planned
    written = [s["text"] for s in trace.meta.get("transcript") or [] if s["source"] == "model"]
    rounds = trace.meta.get("rounds") or []
    searched = rounds[1:]
    if (
        written != search.replies
        or (rounds[0]["important_info"] if rounds else None) != search.initial_selection
        or [r["query"] for r in searched] != search.queries
        or [r["important_info"] for r in searched] != search.selections
        or [r["selected_ids"] for r in searched] != search.selected_ids
        or not trace.meta.get("search_complete")
        or any(s.fallback for s in trace.steps if s.kind == "searcher")
    ):
        return "replay_mismatch"
    return None


def searcher_warmup_records(
    examples: Iterable[Example],
    retriever: Retriever,
    config: S3Config,
    tokenizer: Any = None,
    searching_only: bool = False,
    initial: str = "whole",
) -> tuple[list[Record], dict[str, Any]]:
    """Gold s3 searcher trajectories as SFT records, and a summary (questions, records, skipped by reason, hop
    counts, searches per record).

    Each example with a gold decomposition is planned by :func:`gold_searches` (the gold sub-questions as queries,
    the gold passages shown as selections), then replayed through the real ``s3`` agent, as the ExSearch warm-up
    replays its trajectories (:func:`sleuth.train.exsearch_em.replay_trajectories`): a replay LLM writes the
    planned replies, the real retriever answers, so the prompt, the ``<information>`` observations and the
    trajectory are byte for byte what the agent builds at inference (``tokenizer``: the searcher's, for the
    observation cap and the chat-template continuation; without it observations are not capped). A replay that
    differs from its plan (another parse, other documents, a capped observation) is skipped and counted, as is an
    example without a usable decomposition or a second example with the same question; nothing raises.
    ``searching_only``: skip (and count, ``needs_no_search``) the questions whose gold passages are all in the initial
    documents, so every transcript searches at least once. ``initial``: :func:`gold_searches`'s (``"gold"``: the
    first reply also selects the initial block's gold documents).

    A record is ``{id, question_id, messages, weight: 1.0, source: "s3-gold", queries, selected_ids}`` with
    ``messages`` = :func:`trajectory_messages` of the replayed trace: the searcher prompt (its initial documents
    marked as observations) and ONE assistant message of ``model`` and ``observation`` segments, the format of
    :func:`~sleuth.train.exsearch_em.train_weighted`, whose :func:`~sleuth.train.tokens.tokenize_chat` labels the
    model segments (and the end-of-turn token after the last one) only: prompts and observations carry no loss."""
    from sleuth.runner import run

    examples = list(examples)
    searches, skipped = gold_searches(examples, retriever, config, initial)
    replies: dict[str, list[str]] = {}
    unique = []
    for search in searches:
        if searching_only and not search.queries:
            skipped["needs_no_search"] += 1
            continue
        question = task_question(search.example, config)  # as the searcher prompt names it
        if question in replies:
            skipped["duplicate_question"] += 1
            continue
        replies[question] = search.replies
        unique.append(search)
    records: list[Record] = []
    counts: Counter[str] = Counter()
    searches_per_record: Counter[int] = Counter()
    if unique:
        # the agent ends with a generator call: answered empty, unused. The searcher's tokenizer: the agent caps
        # observations (max_obs_tokens) and continues the chat-template prompt exactly as at inference.
        roles = {"generator": ReplayLLM(lambda request: "", "gold-replay")}
        llm = ReplayLLM(functools.partial(_gold_reply, replies), "gold-replay", tokenizer)
        ctx = Context(llm=llm, retriever=retriever, config=config, roles=roles)
        traces = run("s3", [s.example for s in unique], ctx, concurrency=256, progress=False)
        for search, trace in zip(unique, traces, strict=True):
            problem = _replay_problem(search, trace)
            messages = trajectory_messages(trace) if problem is None else None
            if messages is None:
                skipped[problem or "no_model_text"] += 1
                continue
            counts.update(search.counts)
            searches_per_record[len(search.queries)] += 1
            records.append(
                {
                    "id": search.example.id,
                    "question_id": search.example.id,
                    "messages": messages,
                    "weight": 1.0,
                    "source": WARMUP_SOURCE,
                    "queries": search.queries,
                    "selected_ids": search.selected_ids,
                }
            )
    summary = {
        "questions": len(examples),
        "records": len(records),
        "skipped": dict(sorted(skipped.items())),
        "hops": {key: counts[key] for key in ("hops", "hops_in_initial", "hops_queried", "gold_retrieved")}
        | {"hops_beyond_max_turns": counts["hops_beyond_max_turns"]},
        "searches_per_record": {str(n): searches_per_record[n] for n in sorted(searches_per_record)},
    }
    return records, summary


def warm_start_searcher(
    records: Sequence[Record],
    model: str | Path,
    out: str | Path,
    learning_rate: float,
    epochs: float = 2.0,
    batch_size: int = 8,
    per_device_batch_size: int = 2,
    seed: int = 0,
    max_length: int | None = 8192,
    token_reduction: str = "sum",
) -> dict[str, Any]:
    """Fine-tune the searcher ``model`` on warm-start records (:func:`searcher_warmup_records`) into
    ``out/model`` with :func:`~sleuth.train.exsearch_em.train_weighted` (weights 1: plain SFT on the searcher's own
    tokens, cosine schedule with 10% warm-up; checkpoints in ``out/trainer`` resume a killed run, a finished one is
    not redone). Returns its training stats.

    ``token_reduction="sum"`` (default): every searcher token weighs the same. With ``"mean"`` (the NLL averaged per
    transcript) a transcript that stops at once (~12 tokens) gives its one search-or-stop token ~8x the weight of a
    searching transcript's (~100 tokens): measured on 64 transcripts of which 40 search, the searcher came out
    opening with ``<search_complete>`` at p ~0.87 on every prompt, the searching ones included, and never searched."""
    from sleuth.train.exsearch_em import EMConfig, train_weighted

    config = EMConfig(
        model=str(model),
        output_dir=str(out),
        learning_rate=learning_rate,
        epochs=epochs,
        batch_size=batch_size,
        per_device_batch_size=per_device_batch_size,
        weighting="uniform",
        token_reduction=token_reduction,
        max_length=max_length,
        seed=seed,
    )
    return train_weighted(records, model, out, config, learning_rate, epochs)


def main(config_path: str | Path | None, overrides: dict[str, Any] | Sequence[str] | None = None) -> dict[str, Any]:
    """``sleuth train s3 --config cfg.yaml [--set key=value]``."""
    return train_s3(load_config(S3RLConfig, config_path, overrides))
