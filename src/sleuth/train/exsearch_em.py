"""ExSearch training: generalized EM, i.e. importance-weighted self-training (Shi et al., arXiv 2505.20128, §2.2,
Algorithm 1; docs/training.md, "ExSearch EM", says what is followed and where it deviates).

Size: one module on purpose (about 1,200 lines): warm-up, E-step (sampling, best_of, weights) and M-step (the
weighted trainer) share the iteration's on-disk layout and its resumption; the plumbing shared with the other
trainers is in :mod:`sleuth.train.common`.

Warm-up, then ``iterations`` EM rounds t = 0, 1, ... with policy θ(t):

**Warm-up** (§4.5): SFT on seed trajectories in the ExSearch format, built by replaying them through the real
``exsearch`` agent (a replay LLM writes the scripted turns, a replay retriever returns the scripted documents), so a
training conversation is byte for byte the chat the agent sends at inference:

- the ReAct trajectories of ``fireact`` (``Thought / Action: search[q] / Observation / finish[a]``): sub-query =
  the search query, record = the next Thought, answer = the ``finish`` argument; only trajectories whose last
  observation says ``reward = True`` are kept (the others are counted);
- the synthetic world's gold decompositions: sub-query = the gold sub-question with ``#k`` replaced by the gold
  answers, documents = the retriever's top-K for it with the gold passage put in when it is missing, record = the
  gold passage's sentence that states the sub-answer, answer = the gold answer.

**E-step** (Alg. 1): sample ``samples`` (K = 2) trajectories per training question with θ(t) (the agent with the
rollout temperature) into a rollout store, each model call keeping the most likely of ``best_of`` (8) samples as the
reference's vLLM ``best_of`` does (:class:`BestOfLLM`; recorded in ``estep.json``); the weight of trajectory z is
``w(z) = p(y | x, z; θ(t))``, the probability of the *gold* answer y teacher-forced after the trajectory and the
finalization turn, computed with the backend's ``score`` (§4.3's recommended fix of the paper's skeleton: the answer
tokens are appended, not read off the trajectory's last positions). ``weighting``:

- ``likelihood`` (default, Algorithm 1): the raw ``w(z)``; questions whose trajectories all fail weigh ~0;
- ``self_normalized``: ``softmax_k(log w_k)`` over the K trajectories of a question (self-normalised importance
  sampling, the digest's principled alternative);
- ``em`` / ``f1``: ExSearch-Zoo's goal-oriented weights, the EM / F1 of the trajectory's own answer (App. C.3);
- ``uniform``: every weight 1, the paper's "w/o w(z)" ablation (naive self-training);
- ``reference_nll_share``: the official trainer's weights (§4.9), computed in the loss (:func:`weighted_nll`): within
  each micro-batch (``per_device_batch_size``), ``NLL_b / sum NLL`` of the per-sequence mean NLL over the model
  tokens, detached, so the worse-fitted trajectory weighs more; its ``robs`` importance ratio is computed there and
  never used. The NLL is the model's being trained (θ(t) at the M-step's first step), where the reference scores it
  with θ(t) in the E-step; records keep weight 1.

``length_normalize`` uses ``exp(mean log p)`` instead of ``exp(sum log p)``.

**M-step** (Eq. 6-7): from θ(t), minimise ``sum_z w(z) * NLL(model tokens of z, with the gold answer substituted
for the sampled one)``: sub-queries, records, the end token and the answer carry loss, the prompt, the retrieved
documents and the finalization instruction are masked (``-100``), see :func:`weighted_nll` and
:mod:`sleuth.train.tokens`. The official trainer's weighting (NLL / sum NLL within a micro-batch, which favours the
*worst* trajectories, §4.9) is the named option ``weighting: reference_nll_share``.

Sampling and evaluation run on ``engine`` (``hf``, ``vllm`` or a ``vllm:{model}?...`` template, as in
:mod:`sleuth.train.mdpo`: a vLLM server sleuth starts on θ(t), kept from θ(t)'s dev evaluation, stopped before the
M-step). Scoring (``best_of`` and the weights) can run on that server too (``score_on_engine: true``): its ``score``
formats the chat messages and tokenizes as the ``hf`` backend does and reads the completion tokens' log-probs from
``/v1/completions`` (``prompt_logprobs`` on token ids), the same values as ``hf`` (tested to float32 kernel noise,
``tests/test_vllm_server.py``); the server is then stopped after the weights. With ``score_on_engine: false`` (the
default: slower on the 2-core CPU, docs/training.md) or a server that cannot score chat prompts, scoring is on the
``hf:`` backend of θ(t) with ``llm_options`` (:class:`EngineAndScorer`): with ``best_of > 1`` both are loaded during
the E-step (on a GPU give the server room: ``gpu_memory_utilization`` in the engine spec); with ``best_of = 1`` the
server is stopped before the scorer loads. ``estep.json`` records which engine sampled and which scored.

After each M-step θ(t+1) answers the dev questions greedily (EM / F1); training stops early when dev EM has not
improved for ``patience`` iterations and ``best_model`` in the summary names the best one.

Output layout (every stage is skipped on a rerun once its result exists, so a killed run resumes)::

    OUT/config.json, OUT/index/ (BM25 of the corpus when no index is given)
    OUT/warmup/data.jsonl, data_summary.json, trainer/ (checkpoints), model/, dev.json
    OUT/iter{t}/rollouts/            E-step trajectories (rollout store)
    OUT/iter{t}/estep.json           degenerate rollouts, the best-of setting and whether it was applied, seconds
    OUT/iter{t}/weighted.jsonl       M-step records: {id, question_id, messages, weight, log_p_answer, ...}
    OUT/iter{t}/trainer/, model/     M-step checkpoints, θ(t+1)
    OUT/iter{t}/stats.json           weight distribution, trajectory length, searches, dev EM/F1, seconds
    OUT/summary.json

>>> summary = train_exsearch(load_config(EMConfig, "configs/exsearch_synth.yaml"))  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sleuth.agents import Context
from sleuth.agents.base import load_prompt
from sleuth.agents.exsearch import TAG_SETS, ExSearchConfig, transcript_messages
from sleuth.eval.metrics import exact_match, f1_score
from sleuth.llm import LLM, Generation, ReplayLLM, Request, Sampling
from sleuth.records import Example, Passage, Trace
from sleuth.retrieval import Retriever
from sleuth.train.common import (
    Engines,
    HFTrainConfig,
    WorldConfig,
    close_llm,
    default_llm_factory,
    engine_record,
    engine_spec,
    evaluate_dev,
    free_memory,
    log,
    prepare_data,
    question_block,
    questions_read,
    resolve_model,
    seed_all,
    serves,
    training_arguments,
    with_sampling,
    write_json,
)
from sleuth.train.config import load_config, to_mapping
from sleuth.train.rollouts import Rollout, RolloutStore, collect, rollout_producer
from sleuth.train.tracking import Tracker, hf_reporting

__all__ = [
    "WEIGHTINGS",
    "BestOfLLM",
    "EMConfig",
    "best_of_sampler",
    "build_weighted_records",
    "fireact_trajectories",
    "main",
    "normalize_weights",
    "replay_trajectories",
    "score_answers",
    "synth_trajectories",
    "train_exsearch",
    "train_weighted",
    "trajectory_messages",
    "weighted_nll",
]

METHOD = "exsearch"
WEIGHTINGS = ("likelihood", "self_normalized", "em", "f1", "uniform", "reference_nll_share")
Record = dict[str, Any]


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class EMConfig(HFTrainConfig, WorldConfig):
    """Options of ``sleuth train exsearch``. Defaults follow the paper (§4.3-4.6); comments name the code's value.

    Data as in :class:`~sleuth.train.common.WorldConfig`: ``data_dir`` (a synthetic world, generated from ``synth``
    when missing) or explicit ``train_file`` / ``dev_file`` / ``corpus`` / ``index``; the optimiser options are
    :class:`~sleuth.train.common.HFTrainConfig`'s (``max_steps`` > 0: optimizer steps per training stage). The
    M-step trains all weights: ``lora`` is refused.
    """

    model: str = "default"  # θ_base: a transformers directory or "default" (the embedded SmolLM2)
    output_dir: str = "runs/exsearch-em"
    train_limit: int | None = None  # E-step questions per iteration (None: all)
    # A deviation, off by default (the paper samples D every iteration): iteration t samples the t-th block of
    # train_limit questions, so a small run's later E-step does not refit the questions an earlier one trained on
    fresh_questions: bool = False
    dev_limit: int | None = 100  # dev questions for early stopping (0: none, then no early stopping)
    llm_options: str = ""  # options of the hf: backend (sampling and evaluation with engine=hf; hf scoring)
    score_on_engine: bool = False  # true: a vLLM engine also scores p(y | x, z); slower on the 2-core CPU (docs)
    agent: ExSearchConfig = field(default_factory=ExSearchConfig)  # evaluation uses it as is (greedy)
    # Warm-up [paper §4.5: 1,000 GPT-4o-written HotpotQA trajectories; here FireAct ReAct + synthetic gold]
    warmup: bool = True
    fireact: str = ""  # path of FireAct's hotpotqa ReAct jsonl ("" = none)
    fireact_limit: int | None = None
    warmup_synth: int = 300  # training questions turned into gold trajectories (0 = none)
    warmup_epochs: float = 2.0  # code README: 2
    warmup_lr: float = 2e-6
    # E-step [paper D.5: K = 2; code: T=0.8, top_p=0.95]
    samples: int = 2
    temperature: float = 0.8
    top_p: float = 0.95
    # vLLM best_of in the code (every model call of a rollout keeps the most likely of best_of samples); 1 = plain
    # sampling. Applied only when the backend can score() chat prompts, else recorded as not applied (BestOfLLM).
    best_of: int = 8
    # w(z) (module doc): the paper's p(y | x, z) by default; "reference_nll_share": the official trainer's NLL_b / sum
    # NLL per micro-batch, computed in the M-step's loss
    weighting: Literal["likelihood", "self_normalized", "em", "f1", "uniform", "reference_nll_share"] = "likelihood"
    length_normalize: bool = False
    # M-step [paper Table 6: lr 2e-6, cosine, warm-up 10%, batch 4 x 16, cutoff 8192]
    token_reduction: Literal["mean", "sum"] = "mean"  # per-trajectory NLL: mean over its model tokens, or the sum
    min_weight: float = 0.0  # records with weight <= min_weight are left out of the M-step (counted)
    learning_rate: float = 2e-6
    epochs: float = 2.0  # code README: 2
    warmup_ratio: float = 0.1
    lr_scheduler: str = "cosine"
    max_length: int | None = 8192  # tokens per trajectory; longer ones keep their end (the prompt is masked anyway)
    keep_checkpoints: bool = False
    # Iterations [paper §4.6: N = 5, early stop on validation]
    iterations: int = 5
    patience: int = 1
    seed: int = 42  # code: 42 everywhere

    def validate(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting={self.weighting!r}; expected one of {WEIGHTINGS}")
        if self.token_reduction not in ("mean", "sum"):
            raise ValueError(f"token_reduction={self.token_reduction!r}; expected 'mean' or 'sum'")
        for name in ("samples", "best_of", "iterations", "batch_size", "per_device_batch_size", "patience"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.fresh_questions and not self.train_limit:
            raise ValueError("fresh_questions needs train_limit, the number of questions per iteration")
        if self.agent.tags not in TAG_SETS:
            raise ValueError(f"agent.tags={self.agent.tags!r}; expected one of {sorted(TAG_SETS)}")
        if self.lora:
            raise ValueError("lora: the ExSearch M-step trains all weights (no LoRA); set lora: false")
        engine_spec(self, Path("MODEL"))

    def questions_to_read(self) -> int | None:
        """``train_limit``, or with ``fresh_questions`` one block of it per iteration."""
        return questions_read(self.train_limit, self.iterations, self.fresh_questions)

    def rollout_agent(self) -> ExSearchConfig:
        return with_sampling(self.agent, self.temperature, self.top_p)


# ---------------------------------------------------------------------------------------------------------------
# Warm-up trajectories: replayed through the agent
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Script:
    """A trajectory to replay: the model turns in order (``turns[-1]`` is the answer turn) and the documents each
    sub-query returns."""

    example: Example
    turns: list[str]
    documents: dict[str, list[Passage]]
    source: str


def _query_key(query: str) -> str:
    return " ".join(query.split())


def _scripted_turn(scripts: dict[str, list[str]], request: Request) -> str:
    """The scripted turn of the conversation ``request`` continues (keyed by its first user message; the turn index
    is the number of assistant messages so far)."""
    messages = request.messages or []
    turns = scripts[messages[0]["content"]]
    i = sum(m["role"] == "assistant" for m in messages)
    return turns[i] if i < len(turns) else ""


class _ReplayRetriever(Retriever):
    def __init__(self, documents: dict[str, list[Passage]]) -> None:
        self.spec = "replay"
        self.documents = documents

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        return [list(self.documents.get(_query_key(q), []))[:k] for q in queries]


def replay_trajectories(scripts: Sequence[Script], agent: ExSearchConfig) -> tuple[list[Record], Counter[str]]:
    """Run the ``exsearch`` agent on each script's example with a replay LLM and retriever; the trajectories whose
    model turns come out exactly as scripted become warm-up records ``{id, messages, weight: 1, source}``; the
    others are counted (``replay_mismatch``: the agent's parser would read the scripted text differently)."""
    from sleuth.runner import run

    skipped: Counter[str] = Counter()
    if not scripts:
        return [], skipped
    tags = TAG_SETS[agent.tags]
    prompt = load_prompt(tags.prompt)
    by_prompt: dict[str, list[str]] = {}
    documents: dict[str, list[Passage]] = {}
    for script in scripts:
        by_prompt[prompt.format(question=script.example.question)] = script.turns
        documents.update({_query_key(q): docs for q, docs in script.documents.items()})
    steps = max(len(s.turns) - 1 for s in scripts)  # no step cap inside a scripted trajectory
    config = dataclasses.replace(agent, max_steps=max(agent.max_steps, steps), select=False)
    ctx = Context(
        llm=ReplayLLM(functools.partial(_scripted_turn, by_prompt)),
        retriever=_ReplayRetriever(documents),
        config=config,
    )
    traces = run(METHOD, [s.example for s in scripts], ctx, concurrency=256, progress=False)
    records = []
    for script, trace in zip(scripts, traces, strict=True):
        segments = trace.meta.get("transcript") or []
        written = [s["text"] for s in segments if s["source"] == "model"]
        if trace.error or written != [t for t in script.turns if t]:
            skipped["replay_mismatch"] += 1
            continue
        records.append(
            {
                "id": script.example.id,
                "question_id": script.example.id,
                "messages": transcript_messages(segments),
                "weight": 1.0,
                "source": script.source,
            }
        )
    return records, skipped


_FIREACT_ACTION = re.compile(r"Action:\s*(search|finish)\[(.*)\]\s*$", re.DOTALL | re.IGNORECASE)
_FIREACT_THOUGHT = re.compile(r"Thought:\s*(.*?)\s*(?:\nAction:|$)", re.DOTALL | re.IGNORECASE)


def _fireact_script(row: Any, line: int, tags: Any) -> Script:
    """One FireAct row as a replay script; raises ValueError with the reason when it cannot be one."""
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or len(messages) < 3 or messages[0].get("role") != "user":
        raise ValueError("malformed")
    last = messages[-1]
    if last.get("role") != "user" or "reward = true" not in str(last.get("content", "")).lower():
        raise ValueError("reward_false")
    question = str(messages[0]["content"]).strip()
    steps: list[tuple[str, str, str]] = []  # (thought, action, argument)
    observations: list[str] = []
    for message in messages[1:]:
        content = str(message.get("content", ""))
        if message.get("role") == "assistant":
            action = _FIREACT_ACTION.search(content)
            if action is None:
                raise ValueError("unsupported_action")
            thought = _FIREACT_THOUGHT.search(content)
            steps.append(((thought.group(1) if thought else "").strip(), action.group(1).lower(), action.group(2)))
        else:
            observations.append(content.removeprefix("Observation:").strip())
    if not steps or steps[-1][1] != "finish" or any(a != "search" for _, a, _ in steps[:-1]):
        raise ValueError("unsupported_action")
    answer = steps[-1][2].strip()
    if not answer:
        raise ValueError("empty_answer")
    t = tags
    turns = []
    documents: dict[str, list[Passage]] = {}
    for i, (thought, _, query) in enumerate(steps):
        record = f"<{t.record}> {thought}\n" if i else ""
        if i == len(steps) - 1:
            turns.append(f"<{t.record}> {thought}\n<{t.final}>" if i else f"<{t.final}>")
        else:
            query = " ".join(query.split())
            if not query:
                raise ValueError("empty_query")
            turns.append(f"{record}<{t.think}> {query}")
            text = observations[i] if i < len(observations) else ""
            documents[query] = [Passage(id=f"fireact-{line}-{i}", title="", text=text)]
    turns.append(answer)
    example = Example(id=f"fireact-{line}", question=question, answers=[answer])
    return Script(example=example, turns=turns, documents=documents, source="fireact")


def fireact_trajectories(
    path: str | Path, agent: ExSearchConfig, limit: int | None = None
) -> tuple[list[Record], dict[str, Any]]:
    """FireAct's ReAct trajectories (``{"messages": [...]}`` per line) as ExSearch warm-up records, and a report
    counting every row not used by reason (``reward_false``, ``unsupported_action``, ``malformed`` with
    ``FILE:LINE`` listed, ``replay_mismatch``)."""
    tags = TAG_SETS[agent.tags]
    scripts: list[Script] = []
    skipped: Counter[str] = Counter()
    malformed: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(scripts) >= limit:
                break
            try:
                scripts.append(_fireact_script(json.loads(line), line_no, tags))
            except json.JSONDecodeError:
                skipped["malformed"] += 1
                malformed.append(f"{path}:{line_no}: not JSON")
            except ValueError as exc:
                skipped[str(exc)] += 1
                if str(exc) == "malformed":
                    malformed.append(f"{path}:{line_no}: not a chat of user/assistant messages")
    records, more = replay_trajectories(scripts, agent)
    skipped.update(more)
    return records, {"source": str(path), "records": len(records), "skipped": dict(skipped), "malformed": malformed}


def _evidence_sentence(passage: Passage, answer: str) -> str:
    """The sentence of ``passage`` that states ``answer`` (the record the model should write), else the answer."""
    sentences = re.split(r"(?<=[.!?])\s+", passage.text.replace("\n", " "))
    for sentence in sentences:
        if answer.casefold() in sentence.casefold():
            return sentence.strip()
    return answer


def synth_trajectories(
    examples: Iterable[Example], retriever: Retriever, corpus: dict[str, Passage], agent: ExSearchConfig
) -> tuple[list[Record], dict[str, Any]]:
    """Gold ExSearch trajectories from examples with gold decompositions (the synthetic world, MuSiQue): for each
    step the sub-question with ``#k`` resolved, the top ``agent.k`` documents the retriever returns for it (the gold
    passage replaces the last one when missing, as the paper pairs each sub-query with a retrieved document close to
    the gold one), the gold passage's sentence with the sub-answer as the record, the gold answer last."""
    from sleuth.agents.acesearcher import resolve_references

    tags = TAG_SETS[agent.tags]
    skipped: Counter[str] = Counter()
    pending: list[tuple[Example, list[tuple[str, str, Passage | None]]]] = []
    for example in examples:
        steps = example.decomposition or []
        if not steps or any(not s.get("question") or s.get("answer") is None for s in steps):
            skipped["no_gold_decomposition"] += 1
            continue
        answers: dict[int, str] = {}
        resolved = []
        for k, step in enumerate(steps, 1):
            question = resolve_references(str(step["question"]), answers)
            answers[k] = str(step["answer"])
            gold = next((corpus[i] for i in step.get("supporting_ids") or [] if i in corpus), None)
            resolved.append((_query_key(question), str(step["answer"]), gold))
        pending.append((example, resolved))
    queries = sorted({q for _, steps in pending for q, _, _ in steps})
    found = dict(zip(queries, retriever.search(queries, agent.k), strict=True)) if queries else {}
    scripts = []
    for example, steps in pending:
        turns: list[str] = []
        documents: dict[str, list[Passage]] = {}
        record = ""
        for query, answer, gold in steps:
            docs = list(found[query])
            if gold is not None and all(d.id != gold.id for d in docs):
                docs = [*docs[: max(agent.k - 1, 0)], gold]
            documents[query] = docs
            turns.append(f"{record}<{tags.think}> {query}")
            record = f"<{tags.record}> {_evidence_sentence(gold, answer) if gold else answer}\n"
        turns.append(f"{record}<{tags.final}>")
        turns.append(example.answers[0])
        scripts.append(Script(example=example, turns=turns, documents=documents, source="synth"))
    records, more = replay_trajectories(scripts, agent)
    skipped.update(more)
    return records, {"source": "synth", "records": len(records), "skipped": dict(skipped)}


# ---------------------------------------------------------------------------------------------------------------
# E-step
# ---------------------------------------------------------------------------------------------------------------


class BestOfLLM(LLM):
    """vLLM's ``best_of`` over any backend that can ``score``: each ``generate`` call samples ``best_of`` candidates
    per request and keeps the ``n`` whose text is most likely under the model, ``score(prompt, text).logprob``.

    The reference samples every model call with vLLM ``best_of=8, n=1`` (digest §2.7, ``_inference.py``), and vLLM
    applies it per ``generate()`` call, so in a multi-turn ExSearch rollout each model turn (and the selection and
    answer calls) is the best of ``best_of`` continuations of the conversation so far; a trajectory is not chosen as
    a whole. Differences from vLLM: the log-probability is the model's own (temperature 1, from ``score`` on the
    returned text) where vLLM V0, the only version with ``best_of``, summed the log-probs of its temperature-scaled
    distribution over the generated tokens; an empty candidate ranks last, since ``score`` cannot express the
    probability of ending at once. Ties keep the earlier sample. Greedy requests and ``best_of <= n`` pass through.
    """

    def __init__(self, inner: LLM, best_of: int) -> None:
        super().__init__()
        if best_of < 1:
            raise ValueError("best_of must be >= 1")
        self.inner = inner
        self.best_of = best_of
        self.spec = inner.spec
        self.stats = inner.stats
        self.counts: Counter[str] = Counter()
        self._kept_logprob = 0.0
        self._first_logprob = 0.0

    async def generate(self, requests: list[Request], sampling: Sampling) -> list[Generation]:
        if sampling.greedy or self.best_of <= sampling.n:
            return await self.inner.generate(requests, sampling)
        wide = dataclasses.replace(sampling, n=self.best_of)
        generations = await self.inner.generate(requests, wide)
        picked = await asyncio.gather(
            *(self._pick(r, g, sampling.n) for r, g in zip(requests, generations, strict=True))
        )
        return list(picked)

    async def _pick(self, request: Request, generation: Generation, n: int) -> Generation:
        prompt = request.messages if request.messages is not None else request.prompt or ""
        texts = generation.texts
        distinct = [t for t in dict.fromkeys(texts) if t]
        scores = await asyncio.gather(*(self.inner.score(prompt, t) for t in distinct))
        logprob = {t: -math.inf if math.isnan(s.logprob) else s.logprob for t, s in zip(distinct, scores, strict=True)}
        ranked = sorted(range(len(texts)), key=lambda i: -logprob.get(texts[i], -math.inf))
        keep = ranked[:n]
        self.counts["calls"] += 1
        self.counts["candidates"] += len(texts)
        self.counts["scored"] += len(distinct)
        self.counts["kept_not_first"] += keep[0] != 0
        if math.isfinite(logprob.get(texts[keep[0]], -math.inf)) and math.isfinite(logprob.get(texts[0], -math.inf)):
            self.counts["finite"] += 1
            self._kept_logprob += logprob[texts[keep[0]]]
            self._first_logprob += logprob[texts[0]]

        def take(values: list[Any] | None) -> list[Any] | None:
            return [values[i] for i in keep] if values is not None and len(values) == len(texts) else values

        return Generation(
            texts=[texts[i] for i in keep],
            prompt_tokens=generation.prompt_tokens,
            completion_tokens=take(generation.completion_tokens) or [],
            finish_reasons=take(generation.finish_reasons) or [],
            token_ids=take(generation.token_ids),
        )

    async def score(self, prompt: Any, completion: str) -> Any:
        return await self.inner.score(prompt, completion)

    def special_tokens(self) -> tuple[str, ...]:
        return self.inner.special_tokens()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "best_of": self.best_of}

    def report(self) -> dict[str, Any]:
        """What best-of did: model calls it applied to, candidates sampled and distinct ones scored, how often the
        kept candidate was not the first sample, and the mean log-probability of the kept vs the first sample."""
        finite = self.counts["finite"]
        return {
            "calls": self.counts["calls"],
            "candidates": self.counts["candidates"],
            "scored": self.counts["scored"],
            "kept_not_first": self.counts["kept_not_first"],
            "mean_logprob_kept": self._kept_logprob / finite if finite else None,
            "mean_logprob_first_sample": self._first_logprob / finite if finite else None,
        }


class EngineAndScorer(LLM):
    """Generates with ``engine`` (a vLLM server) and scores on it when ``on_engine`` and it scores chat prompts
    token-exactly (a ``score_tokenizer``: a ``vllm:`` server on a local model, the same values as ``hf``; probed
    once here, a refusal is kept in ``engine_refused``); else with an ``hf:`` backend made by ``load_scorer`` on the
    first :meth:`score` (so a run that never scores while sampling does not hold both). :meth:`stop_engine` stops
    the server once sampling (and, when it scores, the scoring) is done; :meth:`close` releases both."""

    def __init__(self, engine: LLM, load_scorer: Callable[[], LLM], on_engine: bool = True) -> None:
        super().__init__()
        self.engine: LLM | None = engine
        self.load_scorer = load_scorer
        self.scorer: LLM | None = None
        self.spec = engine.spec
        self.engine_info = engine.describe()
        tokenizer = getattr(engine, "score_tokenizer", None)
        self.scores_on_engine = on_engine and callable(tokenizer) and tokenizer() is not None
        self.engine_refused: str | None = None
        if self.scores_on_engine:
            try:
                asyncio.run(engine.score([{"role": "user", "content": "Hello"}], "Hello"))
            except Exception as exc:  # a server without prompt_logprobs: hf scores
                self.scores_on_engine = False
                self.engine_refused = f"{type(exc).__name__}: {exc}"[:300]

    async def generate(self, requests: list[Request], sampling: Sampling) -> list[Generation]:
        if self.engine is None:
            raise RuntimeError("the sampling engine was stopped")
        return await self.engine.generate(requests, sampling)

    async def score(self, prompt: Any, completion: str) -> Any:
        if self.scores_on_engine and self.engine is not None:
            return await self.engine.score(prompt, completion)
        if self.scorer is None:
            self.scorer = self.load_scorer()
        return await self.scorer.score(prompt, completion)

    def scorer_name(self) -> str:
        """Where :meth:`score` runs: ``engine`` (the server) or ``hf`` (with why the engine does not score)."""
        if self.scores_on_engine:
            return "engine"
        return f"hf (the engine cannot score: {self.engine_refused})" if self.engine_refused else "hf"

    def special_tokens(self) -> tuple[str, ...]:
        return self.engine.special_tokens() if self.engine is not None else super().special_tokens()

    def stop_engine(self) -> None:
        if self.engine is not None:
            close_llm(self.engine)
            self.engine = None

    def close(self) -> None:
        self.stop_engine()
        self.scorer = None

    def describe(self) -> dict[str, Any]:
        scorer = self.scorer.describe() if self.scorer is not None else None
        return {**self.engine_info, "scorer": "engine" if self.scores_on_engine else scorer}


def best_of_sampler(llm: LLM, best_of: int, sampling: Sampling) -> tuple[LLM, dict[str, Any]]:
    """The LLM the E-step samples with, and the record of the best-of setting: ``llm`` wrapped in
    :class:`BestOfLLM` when ``best_of > 1``, the rollouts sample (temperature > 0; vLLM refuses best_of with
    greedy decoding) and the backend can ``score`` a chat prompt (probed once); else ``llm`` itself, with the
    reason best-of was not applied."""
    record: dict[str, Any] = {"best_of": best_of, "applied": False, "reason": None}
    if best_of <= 1:
        record["reason"] = "best_of=1"
        return llm, record
    if sampling.greedy:
        record["reason"] = "greedy rollouts (temperature 0)"
        return llm, record
    try:
        asyncio.run(llm.score([{"role": "user", "content": "Hello"}], "Hello"))
    except Exception as exc:  # any refusal means the backend cannot rank candidates
        record["reason"] = f"the backend cannot score chat prompts ({type(exc).__name__}: {exc})"[:300]
        return llm, record
    record["applied"] = True
    return BestOfLLM(llm, best_of), record


def trajectory_messages(trace: Trace, answer: str | None = None) -> list[dict[str, str]] | None:
    """The chat of an ExSearch trace (:func:`~sleuth.agents.exsearch.transcript_messages`) ending with the
    finalization turn, plus ``answer`` as the last assistant turn when given (the gold answer replaces the sampled
    one). None when the trace has no complete trajectory (failed before its answer turn)."""
    segments = trace.meta.get("transcript") or []
    if trace.error or not segments or trace.meta.get("stop") in (None, ""):
        return None
    messages = transcript_messages(segments)
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]  # the sampled answer
    if messages[-1]["role"] != "user":
        return None
    return [*messages, {"role": "assistant", "content": answer}] if answer is not None else messages


def score_answers(
    llm: LLM, items: Sequence[tuple[list[dict[str, str]], str]], concurrency: int = 64
) -> list[tuple[float, int]]:
    """``(log p(answer | context), answer tokens)`` for each ``(context messages, answer)``, teacher-forced with the
    backend's ``score`` (the context ends with the finalization user turn; the generation prompt is added)."""

    async def all_scores() -> list[tuple[float, int]]:
        gate = asyncio.Semaphore(concurrency)

        async def one(messages: list[dict[str, str]], answer: str) -> tuple[float, int]:
            async with gate:
                score = await llm.score(messages, answer)
            return score.logprob, len(score.token_logprobs)

        return list(await asyncio.gather(*(one(m, a) for m, a in items)))

    return asyncio.run(all_scores())


def normalize_weights(
    log_p: Sequence[float],
    groups: Sequence[str],
    weighting: str = "likelihood",
    lengths: Sequence[int] | None = None,
    metrics: Sequence[float] | None = None,
    length_normalize: bool = False,
) -> list[float]:
    """Importance weights of trajectories from ``log_p`` = log p(y | x, z) (module doc, ``weighting``).

    ``groups``: each trajectory's question (for ``self_normalized``); ``lengths``: answer tokens (for
    ``length_normalize``); ``metrics``: the trajectory's own EM or F1 (for ``em`` / ``f1``)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {weighting!r}")
    n = len(log_p)
    if weighting in ("uniform", "reference_nll_share"):  # the latter is weighted in the loss (weighted_nll)
        return [1.0] * n
    if weighting in ("em", "f1"):
        if metrics is None or len(metrics) != n:
            raise ValueError(f"weighting={weighting!r} needs one metric value per trajectory")
        return [float(m) for m in metrics]
    values = list(log_p)
    if length_normalize:
        if lengths is None:
            raise ValueError("length_normalize needs the answer lengths")
        values = [v / max(t, 1) for v, t in zip(values, lengths, strict=True)]
    if weighting == "likelihood":
        return [math.exp(v) for v in values]
    by_group: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    weights = [0.0] * n
    for members in by_group.values():
        top = max(values[i] for i in members)
        exps = [math.exp(values[i] - top) for i in members]
        total = sum(exps)
        for i, e in zip(members, exps, strict=True):
            weights[i] = e / total
    return weights


def build_weighted_records(
    rollouts: Iterable[Rollout], llm: LLM | None, config: EMConfig
) -> tuple[list[Record], dict[str, Any]]:
    """M-step records from E-step rollouts: the trajectory with the gold answer substituted, its log p(y | x, z)
    under θ(t) and its weight; degenerate rollouts (failed, no finalization turn, no gold answer) are counted."""
    degenerate: Counter[str] = Counter()
    items = []
    for rollout in rollouts:
        trace = rollout.trace
        gold = next((a for a in trace.example.answers if a.strip()), None)  # the primary gold answer (§4.3)
        if gold is None:
            degenerate["no_gold_answer"] += 1
            continue
        context = trajectory_messages(trace)
        if context is None:
            degenerate["error" if trace.error else "incomplete"] += 1
            continue
        items.append((rollout, context, gold))
    needs_score = config.weighting in ("likelihood", "self_normalized") or llm is not None
    scores = score_answers(llm, [(c, g) for _, c, g in items], config.concurrency) if needs_score and llm else []
    if not scores:
        scores = [(0.0, 0)] * len(items)
    own = [
        # SQuAD normalisation, as ExSearch's evaluation (and every paper's table) uses
        (exact_match if config.weighting == "em" else f1_score)(r.trace.answer or "", r.trace.example.answers, "squad")
        for r, _, _ in items
    ]
    weights = normalize_weights(
        [s for s, _ in scores],
        [r.group for r, _, _ in items],
        config.weighting,
        lengths=[t for _, t in scores],
        metrics=own,
        length_normalize=config.length_normalize,
    )
    records = []
    for (rollout, context, gold), (log_p, tokens), weight in zip(items, scores, weights, strict=True):
        trace = rollout.trace
        records.append(
            {
                "id": rollout.key,
                "question_id": rollout.group,
                "messages": [*context, {"role": "assistant", "content": gold}],
                "weight": weight,
                "log_p_answer": log_p,
                "answer_tokens": tokens,
                "sampled_answer": trace.answer,
                "em": exact_match(trace.answer or "", trace.example.answers, "squad"),
                "searches": len(trace.meta.get("iterations") or []),
                "stop": trace.meta.get("stop"),
                "fallbacks": trace.fallbacks,
            }
        )
    return records, {"degenerate": dict(degenerate)}


def weight_stats(records: Sequence[Record]) -> dict[str, Any]:
    """The weight distribution and the trajectories' shape, for the iteration stats."""
    import numpy as np

    if not records:
        return {"n": 0}
    w = np.asarray([r["weight"] for r in records], dtype=float)
    searches = np.asarray([r.get("searches", 0) for r in records], dtype=float)
    lengths = np.asarray([sum(len(m["content"]) for m in r["messages"] if m["role"] == "assistant") for r in records])
    return {
        "n": len(records),
        "weight": {
            "mean": float(w.mean()),
            "median": float(np.median(w)),
            "p10": float(np.quantile(w, 0.1)),
            "p90": float(np.quantile(w, 0.9)),
            "max": float(w.max()),
            "zero": int((w <= 0).sum()),
            "above_0.5": int((w > 0.5).sum()),
            "ess": float(w.sum() ** 2 / (w**2).sum()) if (w > 0).any() else 0.0,  # effective sample size
        },
        "searches_per_trajectory": float(searches.mean()),
        "model_chars_per_trajectory": float(lengths.mean()),
        "sampled_em": float(np.mean([r.get("em", 0.0) for r in records])),
        "stops": dict(Counter(str(r.get("stop")) for r in records)),
    }


# ---------------------------------------------------------------------------------------------------------------
# M-step
# ---------------------------------------------------------------------------------------------------------------


def weighted_nll(
    logits: Any, labels: Any, weights: Any, reduction: str = "mean", weighting: str = "likelihood"
) -> Any:
    """The M-step loss (paper Eq. 6-7): ``(1/B) sum_b w_b * l_b`` with ``l_b`` the NLL of example b's labelled
    tokens (``labels != -100``; ``logits[:, t]`` predicts ``labels[:, t + 1]``, the causal shift is done here),
    summed over its tokens (``reduction="sum"``, the paper's ``log p(z | x) + log p(y | x, z)``) or averaged
    (``"mean"``, the official trainer's per-sample CE). An example without labelled tokens contributes 0.

    ``weighting="reference_nll_share"`` ignores ``weights`` and returns the official trainer's ``sum_b w_b * l_b``
    with ``w_b = m_b / sum_c m_c``, ``m_b`` example b's mean NLL over its labelled tokens, detached (no 1/B: the
    weights sum to 1 over the micro-batch)."""
    import torch
    import torch.nn.functional as F

    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    mask = shift_labels != -100
    token_nll = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.clamp(min=0).reshape(-1),
        reduction="none",
    ).view(shift_labels.shape)
    token_nll = token_nll * mask
    per_example = token_nll.sum(dim=1)
    if reduction == "mean":
        per_example = per_example / mask.sum(dim=1).clamp(min=1)
    elif reduction != "sum":
        raise ValueError(f"reduction={reduction!r}; expected 'mean' or 'sum'")
    if weighting == "reference_nll_share":
        mean_nll = (token_nll.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).detach()
        share = mean_nll / mean_nll.sum().clamp(min=torch.finfo(mean_nll.dtype).tiny)
        return (share * per_example).sum()
    weights = torch.as_tensor(weights, dtype=per_example.dtype, device=per_example.device)
    return (weights * per_example).sum() / max(per_example.shape[0], 1)


def _collate(pad_id: int) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    import torch

    def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            labels[i, :n] = torch.tensor(r["labels"])
            attention[i, :n] = 1
        weights = torch.tensor([float(r["weight"]) for r in rows])
        return {"input_ids": ids, "labels": labels, "attention_mask": attention, "weights": weights}

    return collate


def _trainer_class(reduction: str, weighting: str = "likelihood") -> Any:
    from transformers import Trainer

    class WeightedTrainer(Trainer):
        """A transformers Trainer whose loss is :func:`weighted_nll` (per-example weights from the batch)."""

        def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, **_: Any) -> Any:
            weights = inputs.pop("weights")
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = weighted_nll(outputs.logits, labels, weights, reduction, weighting)
            return (loss, outputs) if return_outputs else loss

    return WeightedTrainer


def tokenize_records(records: Sequence[Record], tokenizer: Any, max_length: int | None) -> tuple[list[dict], Counter]:
    """Token ids, labels (model tokens only) and weights of M-step records; records with no model token left after
    truncation are counted, not trained on."""
    from sleuth.train.tokens import tokenize_chat

    rows, dropped = [], Counter()
    for record in records:
        chat = tokenize_chat(tokenizer, record["messages"], max_length=max_length)
        if not chat.model_tokens:
            dropped["no_model_tokens"] += 1
            continue
        dropped["truncated"] += int(chat.truncated)
        rows.append({"input_ids": chat.input_ids, "labels": chat.labels, "weight": float(record["weight"])})
    return rows, dropped


def train_weighted(
    records: Sequence[Record],
    model_path: str | Path,
    out: str | Path,
    config: EMConfig,
    learning_rate: float | None = None,
    epochs: float | None = None,
    callbacks: Sequence[Any] = (),
) -> dict[str, Any]:
    """Fine-tune ``model_path`` on weighted chat records (the M-step; the warm-up with weights 1) and save the
    model to ``out/model``; checkpoints in ``out/trainer`` resume a killed run. Returns training stats."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

    from sleuth.train.sft import last_checkpoint

    out = Path(out)
    done = out / "train_stats.json"
    if done.exists() and (out / "model" / "config.json").exists():
        return json.loads(done.read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kept = [r for r in records if float(r["weight"]) > config.min_weight]
    rows, dropped = tokenize_records(kept, tokenizer, config.max_length)
    stats: dict[str, Any] = {
        "records": len(records),
        "below_min_weight": len(records) - len(kept),
        "trained": len(rows),
        "dropped": dict(dropped),
    }
    if not rows:
        raise ValueError(f"no M-step records to train on ({stats}); nothing was learned")
    accumulation = max(1, math.ceil(config.batch_size / config.per_device_batch_size))
    bf16 = (
        config.bf16 if config.bf16 is not None else bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    )
    report_to, reporting = hf_reporting(config.report_to, out.parent, out.name)  # curves: RUN/tb/{warmup,iterN}
    args = TrainingArguments(
        **training_arguments(
            config,
            out / "trainer",
            num_train_epochs=epochs if epochs is not None else config.epochs,
            learning_rate=learning_rate if learning_rate is not None else config.learning_rate,
            gradient_accumulation_steps=accumulation,
            bf16=bf16,
            remove_unused_columns=False,
            dataloader_pin_memory=torch.cuda.is_available(),
            report_to=report_to,
            disable_tqdm=not config.progress,
            **({"gradient_checkpointing": True} if config.gradient_checkpointing else {}),
        )
    )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32 if not bf16 else torch.bfloat16)
    trainer_class = _trainer_class(config.token_reduction, config.weighting)
    if config.length_sorted and config.weighting != "reference_nll_share":  # that one is per micro-batch
        from sleuth.train.packing import length_sorted_trainer

        trainer_class = length_sorted_trainer(trainer_class)
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        data_collator=_collate(tokenizer.pad_token_id),
        callbacks=[*reporting, *callbacks],
    )
    started = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=last_checkpoint(out / "trainer"))
    model_dir = out / "model"
    trainer.save_model(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    stats.update(
        steps=trainer.state.global_step,
        train_loss=result.training_loss,
        first_loss=losses[0] if losses else None,
        last_loss=losses[-1] if losses else None,
        seconds=time.perf_counter() - started,
        step_seconds=(time.perf_counter() - started) / max(trainer.state.global_step, 1),
    )
    write_json(done, stats)  # before the checkpoints go: a rerun from here finds the model and these stats
    if not config.keep_checkpoints:
        import shutil

        shutil.rmtree(out / "trainer", ignore_errors=True)
    return stats


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------


def _write_jsonl(path: Path, rows: Iterable[Record]) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    partial.replace(path)


def _read_jsonl(path: Path) -> list[Record]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _log(config: EMConfig, message: str) -> None:
    log(config.progress, message, "exsearch-em")


def evaluate(
    examples: list[Example], llm: LLM, retriever: Retriever, agent: ExSearchConfig, out: Path, concurrency: int
) -> dict[str, Any]:
    """Greedy ExSearch on ``examples``: EM, F1, searches per question; traces written to ``out``."""
    result = evaluate_dev(examples, llm, retriever, agent, out, concurrency, method=METHOD)
    traces = [Trace.from_json(line) for line in out.read_text().splitlines()] if out.exists() else []
    result["searches"] = sum(len(t.meta.get("iterations") or []) for t in traces) / max(len(traces), 1)
    return result


def _corpus(config: EMConfig) -> dict[str, Passage]:
    from sleuth.corpus import read_corpus

    path = config.corpus or (str(Path(config.data_dir) / "corpus.jsonl") if config.data_dir else "")
    return {p.id: p for p in read_corpus(path)} if path else {}


def warmup_records(config: EMConfig, train: list[Example], retriever: Retriever) -> tuple[list[Record], dict]:
    records: list[Record] = []
    reports = []
    if config.fireact:
        found, report = fireact_trajectories(config.fireact, config.agent, config.fireact_limit)
        records += found
        reports.append(report)
    if config.warmup_synth:
        found, report = synth_trajectories(train[: config.warmup_synth], retriever, _corpus(config), config.agent)
        records += found
        reports.append(report)
    return records, {"sources": reports, "records": len(records)}


def train_exsearch(
    config: EMConfig,
    llm_factory: Callable[[Path], LLM] | None = None,
    retriever: Retriever | None = None,
) -> dict[str, Any]:
    """Warm-up then EM iterations (module doc); returns the summary also written to ``OUT/summary.json``."""
    from sleuth.llm import load_llm
    from sleuth.retrieval import load_retriever

    config.validate()
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", to_mapping(config))
    train, dev, index = prepare_data(config, config.output_dir, config.progress, need_index=retriever is None)
    if retriever is None:
        retriever = load_retriever(index)
    factory = llm_factory or default_llm_factory(config)
    policy = resolve_model(config.model)
    history: list[dict[str, Any]] = []
    split = serves(config) and llm_factory is None  # sample on the engine's server, score on hf
    # a server on a model just evaluated samples the E-step that follows on the same model
    engines = Engines(factory, keep=split)

    def dev_eval(model_dir: Path, path: Path, keep: bool) -> dict[str, Any]:
        if path.exists():
            return json.loads(path.read_text())
        if not dev:
            return {"n": 0, "em": None}
        llm = engines.open(model_dir)
        result = evaluate(dev, llm, retriever, config.agent, path.with_suffix(".traces.jsonl"), config.concurrency)
        result["engine"] = engine_record(llm)
        engines.release(model_dir, llm, keep)
        del llm
        result = {k: v for k, v in result.items() if k != "per_example_em"}
        write_json(path, result)
        return result

    def scorer_for(model_dir: Path) -> Callable[[], LLM]:
        return lambda: load_llm(f"hf:{model_dir}" + (f"?{config.llm_options}" if config.llm_options else ""))

    try:
        return _em(config, train, dev, retriever, policy, history, engines, dev_eval, scorer_for, split)
    finally:
        engines.close()


def _em(
    config: EMConfig,
    train: list[Example],
    dev: list[Example],
    retriever: Retriever,
    policy: Path,
    history: list[dict[str, Any]],
    engines: Any,
    dev_eval: Callable[[Path, Path, bool], dict[str, Any]],
    scorer_for: Callable[[Path], Callable[[], LLM]],
    split: bool,
) -> dict[str, Any]:
    out = Path(config.output_dir)
    # every iteration's questions, checked before anything is evaluated or sampled
    blocks = [question_block(train, config.train_limit, t, config.fresh_questions) for t in range(config.iterations)]
    tracker = Tracker(config.report_to, out, out.name, to_mapping(config))  # iteration statistics in OUT/tb
    base_dev = dev_eval(policy, out / "dev_base.json", not config.warmup and config.iterations > 0)
    summary: dict[str, Any] = {"base": {"model": str(policy), "dev": base_dev}}
    if config.warmup:
        stage = out / "warmup"
        stage.mkdir(exist_ok=True)
        if not (stage / "model" / "config.json").exists():
            data = stage / "data.jsonl"
            if not data.exists():
                records, report = warmup_records(config, train, retriever)
                write_json(stage / "data_summary.json", report)
                _write_jsonl(data, records)
            records = _read_jsonl(data)
            _log(config, f"warm-up: SFT on {len(records)} seed trajectories from {policy}")
            seed_all(config.seed)
            train_weighted(records, policy, stage, config, config.warmup_lr, config.warmup_epochs)
        policy = stage / "model"
        summary["warmup"] = {"model": str(policy), "dev": dev_eval(policy, stage / "dev.json", config.iterations > 0)}
    best = {"model": str(policy), "em": (summary.get("warmup") or summary["base"])["dev"].get("em")}
    stale = 0
    for t in range(config.iterations):
        it = out / f"iter{t}"
        it.mkdir(exist_ok=True)
        model_dir, stats_path = it / "model", it / "stats.json"
        if stats_path.exists() and (model_dir / "config.json").exists():
            stats = json.loads(stats_path.read_text())
        else:
            seconds: dict[str, float] = {}
            weighted = it / "weighted.jsonl"
            if not weighted.exists():
                started = time.perf_counter()
                rollout_agent = config.rollout_agent()
                engine = engines.open(policy)
                sampling_engine = engine_record(engine)
                llm = EngineAndScorer(engine, scorer_for(policy), config.score_on_engine) if split else engine
                scorer = llm.scorer_name() if isinstance(llm, EngineAndScorer) else "engine"
                sampler, best_of = best_of_sampler(llm, config.best_of, rollout_agent.sampling)
                producer = rollout_producer(METHOD, rollout_agent, policy, t, samples=config.samples)
                if best_of["applied"]:  # absent when not applied: stores sampled before the option still resume
                    producer["best_of"] = config.best_of
                store = RolloutStore(it / "rollouts", producer=producer)
                seed_all(config.seed * 1000 + t)
                how = f"best of {config.best_of} per model call" if best_of["applied"] else "plain sampling"
                if config.best_of > 1 and not best_of["applied"]:
                    how += f", best_of not applied: {best_of['reason']}"
                questions = f"{config.samples} trajectories x {len(blocks[t])} questions"
                _log(config, f"iteration {t}: E-step, {questions} ({how})")
                ctx = Context(llm=sampler, retriever=retriever, config=rollout_agent)
                collect(METHOD, blocks[t], ctx, store, config.samples, config.concurrency, config.progress)
                if isinstance(sampler, BestOfLLM):
                    best_of.update(sampler.report())
                seconds["sampling"] = time.perf_counter() - started
                if isinstance(llm, EngineAndScorer) and not llm.scores_on_engine:
                    llm.stop_engine()  # before the scorer loads (when best_of did not load it already)
                started = time.perf_counter()
                records, info = build_weighted_records(store, llm, config)
                seconds["weights"] = time.perf_counter() - started
                close_llm(llm)
                del llm, engine, ctx, sampler
                free_memory()
                _write_jsonl(weighted, records)
                estep = {**info, "best_of": best_of, "sampling_engine": sampling_engine, "scorer": scorer}
                estep["seconds"] = seconds
                write_json(it / "estep.json", estep)
            records = _read_jsonl(weighted)
            info = json.loads((it / "estep.json").read_text())
            seconds = dict(info.get("seconds", {}))  # a run killed during the M-step keeps its E-step timings
            _log(config, f"iteration {t}: M-step on {len(records)} weighted trajectories ({config.weighting})")
            seed_all(config.seed + t)
            engines.close()  # no server holds memory or cores while the M-step trains
            train_stats = train_weighted(records, policy, it, config)
            seconds["training"] = train_stats["seconds"]
            stats = {
                "iteration": t,
                "policy": str(policy),
                "model": str(model_dir),
                "weighting": config.weighting,
                "best_of": info.get("best_of"),
                "sampling_engine": info.get("sampling_engine"),
                "trajectories": weight_stats(records),
                "degenerate": info.get("degenerate", {}),
                "m_step": train_stats,
                "seconds": seconds,
            }
            write_json(stats_path, stats)
        stats["dev"] = dev_eval(model_dir, it / "dev.json", t + 1 < config.iterations)
        write_json(stats_path, stats)
        history.append(stats)
        tracker.log(t, stats)  # trajectories/weight/* (ESS), degenerate/*, m_step/*, dev/*, seconds/*
        policy = model_dir
        em = stats["dev"].get("em")
        _log(config, f"iteration {t}: dev EM {em}")
        if em is not None and (best["em"] is None or em > best["em"]):
            best, stale = {"model": str(model_dir), "em": em}, 0
        elif em is not None:
            stale += 1
            if stale >= config.patience:
                _log(config, f"early stop: no dev EM improvement for {stale} iteration(s)")
                summary["early_stopped_after"] = t
                break
    summary.update(
        iterations=[
            {
                "iteration": s["iteration"],
                "dev": s.get("dev"),
                "weight": (s.get("trajectories") or {}).get("weight"),
                "searches": (s.get("trajectories") or {}).get("searches_per_trajectory"),
                "sampled_em": (s.get("trajectories") or {}).get("sampled_em"),
                "best_of": {k: (s.get("best_of") or {}).get(k) for k in ("best_of", "applied")},
            }
            for s in history
        ],
        best_model=best["model"],
        best_dev_em=best["em"],
        final_model=str(policy),
    )
    tracker.close()
    write_json(out / "summary.json", summary)
    return summary


def main(config_path: str | Path | None, overrides: dict[str, Any] | Sequence[str] | None = None) -> dict[str, Any]:
    """``sleuth train exsearch --config cfg.yaml [--set key=value]``: load the config, run :func:`train_exsearch`."""
    return train_exsearch(load_config(EMConfig, config_path, overrides))
