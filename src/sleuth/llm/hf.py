"""Local transformers backend: ``hf:PATH_OR_NAME?device=cpu&dtype=float32&max_batch=32&threads=2``.

Concurrent ``generate`` calls (from many agents driven by the runner) are micro-batched into one left-padded
``model.generate`` call per group of equal sampling settings (seeds aside: :func:`bucket_seed`); ``score`` calls are
batched into one forward pass, and the completions of one prompt (best-of-n candidates) share one pass over that
prompt.
Stop strings are honoured per row: a row stops as soon as its own text contains one, and the returned text is cut
before it (OpenAI semantics). Greedy decoding gives the same text batched or alone (tested).

Options: ``device`` (``cpu``, ``cuda``, ``cuda:1``; default cuda when available), ``dtype`` (``float32``,
``bfloat16``, ``float16``; default bfloat16 on a GPU that supports it, else float32), ``max_batch`` (rows per
batch, default 32), ``threads`` (torch CPU threads, on a CPU device only; unset, torch's default uses every core;
ignored on a GPU, where fewer CPU threads would only slow the rest of the process), ``max_padding`` (split a batch
into length groups whose padded size is at most this multiple of their real tokens; default 1.25 on CPU, 0 = never
split, on GPU).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading
from dataclasses import dataclass
from typing import Any

from sleuth.batching import MicroBatcher
from sleuth.llm.base import (
    LLM,
    Generation,
    LLMError,
    Messages,
    Request,
    Sampling,
    Score,
    encode_prompt,
    register_backend,
    truncate_at_stop,
)
from sleuth.records import encodable

SCORE_LOGITS_BYTES = 1 << 30  # per forward pass of score(): see HFLLM._score_rows


@dataclass(frozen=True)
class _Row:
    prompt_ids: tuple[int, ...]
    sampling: Sampling


@dataclass
class _RowResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    sampled_ids: list[int]
    logprobs: list[float]


class HFLLM(LLM):
    """A transformers causal LM on this machine.

    >>> llm = HFLLM("HuggingFaceTB/SmolLM2-135M-Instruct")  # doctest: +SKIP
    >>> asyncio.run(llm.generate([Request.chat("Capital of France?")], Sampling(max_new_tokens=8)))  # doctest: +SKIP
    """

    def __init__(
        self,
        path: str,
        device: str | None = None,
        dtype: str | None = None,
        max_batch: int = 32,
        threads: int | None = None,
        max_padding: float | None = None,
    ) -> None:
        super().__init__()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the "Loading weights" bar would interleave with sleuth's own output
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if (count := cpu_threads(self.device.type, threads)) is not None:
            torch.set_num_threads(count)
        if dtype is None:
            use_bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
            torch_dtype = torch.bfloat16 if use_bf16 else torch.float32
        else:
            torch_dtype = getattr(torch, dtype, None)
            if not isinstance(torch_dtype, torch.dtype):
                raise LLMError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
        self.autocast_dtype: Any = None
        _check_model_dir(path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(self.device).eval()
        except (OSError, ValueError, KeyError, TypeError) as exc:  # transformers' ways of saying "not a model here"
            raise LLMError(f"hf:{path}: no model found ({_first_line(exc)})") from exc
        self._setup(model, tokenizer, path, max_batch, max_padding)

    @classmethod
    def from_model(
        cls,
        model: Any,
        tokenizer: Any,
        max_batch: int = 32,
        max_padding: float | None = None,
        autocast: Any = None,
    ) -> HFLLM:
        """A backend over an already loaded model, sharing its weights (an RL trainer samples rollouts from the
        policy it is training: every update is visible to the next generation). The caller owns train/eval mode;
        generation runs under ``torch.inference_mode`` (and ``torch.autocast`` to ``autocast``, a torch dtype, when
        given: the trainer's compute dtype over fp32 master weights)."""
        llm = cls.__new__(cls)
        LLM.__init__(llm)
        llm.device = next(model.parameters()).device
        llm.autocast_dtype = autocast
        llm._setup(model, tokenizer, getattr(model, "name_or_path", "in-memory"), max_batch, max_padding)
        return llm

    def _setup(self, model: Any, tokenizer: Any, path: str, max_batch: int, max_padding: float | None) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.path = path
        # On CPU a padded, masked prefill costs far more than the same rows unpadded (measured in
        # docs/results/bench_runner.md), so rows are grouped by length; on a GPU one big batch wins.
        self.max_padding = max_padding if max_padding is not None else (1.25 if self.device.type == "cpu" else 0.0)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.eos_ids = self._eos_ids()
        self._lock = threading.Lock()  # one model, one forward pass at a time
        self._generate_batcher: MicroBatcher[_Row, _RowResult] = MicroBatcher(
            # seeds differ per call (sleuth.agents.base.call_seed): rows batch together whatever their seeds
            self._generate_rows,
            max_batch=max_batch,
            key=lambda row: dataclasses.replace(row.sampling, seed=None),
        )
        self._score_batcher: MicroBatcher[tuple[list[int], list[int]], Score] = MicroBatcher(
            self._score_rows, max_batch=max_batch
        )

    def _eos_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id
        eos = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return eos

    def special_tokens(self) -> tuple[str, ...]:
        """Every string this tokenizer encodes as one special token (declared specials and special added tokens)."""
        declared = set(getattr(self.tokenizer, "all_special_tokens", []) or [])
        for token in (getattr(self.tokenizer, "added_tokens_decoder", None) or {}).values():
            if getattr(token, "special", False):
                declared.add(str(token))
        return tuple(sorted(t for t in declared if t and t.strip()))

    # ----------------------------------------------------------------------------------------------- prompts
    def encode_prompt(self, prompt: Messages | str) -> list[int]:
        """Token ids of a prompt: chat messages get the chat template and the generation prompt."""
        return encode_prompt(self.tokenizer, prompt, self.path)

    # ----------------------------------------------------------------------------------------------- generate
    async def generate(self, requests: list[Request], sampling: Sampling) -> list[Generation]:
        self.stats.requests += len(requests)
        encoded = [
            list(r.prompt_ids)
            if r.prompt_ids is not None
            else self.encode_prompt(r.messages if r.messages is not None else r.prompt or "")
            for r in requests
        ]
        # Greedy decoding gives n identical samples: compute one and repeat it.
        copies = 1 if sampling.greedy else sampling.n
        futures = [self._generate_batcher.submit(_Row(tuple(ids), sampling)) for ids in encoded for _ in range(copies)]
        rows = await asyncio.gather(*futures)
        generations = []
        for i, ids in enumerate(encoded):
            mine = rows[i * copies : (i + 1) * copies] * (sampling.n if sampling.greedy else 1)
            generation = Generation(
                texts=[r.text for r in mine],
                prompt_tokens=len(ids),
                completion_tokens=[len(r.token_ids) for r in mine],
                finish_reasons=[r.finish_reason for r in mine],
                token_ids=[r.token_ids for r in mine],
                prompt_ids=list(ids),
                sampled_ids=[r.sampled_ids for r in mine],
                logprobs=[r.logprobs for r in mine],
            )
            self.stats.prompt_tokens += generation.prompt_tokens
            self.stats.completion_tokens += sum(generation.completion_tokens)
            generations.append(generation)
        return generations

    def _generate_rows(self, rows: list[_Row]) -> list[_RowResult]:
        results: list[_RowResult | None] = [None] * len(rows)
        for bucket in length_buckets([len(r.prompt_ids) for r in rows], self.max_padding):
            for i, result in zip(bucket, self._generate_bucket([rows[i] for i in bucket]), strict=True):
                results[i] = result
        return results  # type: ignore[return-value]

    def _generate_bucket(self, rows: list[_Row]) -> list[_RowResult]:
        import torch

        sampling = rows[0].sampling
        pad = self.tokenizer.pad_token_id
        width = max(len(r.prompt_ids) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids)
            attention[i, width - len(row.prompt_ids) :] = 1
        kwargs: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens,
            "pad_token_id": pad,
            "eos_token_id": sorted(self.eos_ids),
            "repetition_penalty": sampling.repetition_penalty,
        }
        if sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        if sampling.stop:
            kwargs["stopping_criteria"] = [_StopOnStrings(self.tokenizer, sampling.stop, width)]
        recorder = _SampledLogprobs(1.0 if sampling.greedy else sampling.temperature)
        kwargs["logits_processor"] = [recorder]
        seed = bucket_seed([r.sampling.seed for r in rows])
        with self._lock, torch.inference_mode(), self._autocast():
            if seed is not None:
                torch.manual_seed(seed)
            self.stats.calls += 1
            output = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device), **kwargs
            )
        logprobs = recorder.finish(output[:, -1])
        results = []
        for i, generated in enumerate(output[:, width:].tolist()):
            cut = next((j for j, t in enumerate(generated) if t in self.eos_ids or t == pad), None)
            ids = generated if cut is None else generated[:cut]
            # what was sampled: the text's ids and the end-of-sequence id that ended the row (a pad id after the
            # row finished on a stop string was not sampled)
            sampled = ids + [generated[cut]] if cut is not None and generated[cut] in self.eos_ids else ids
            text = encodable(self.tokenizer.decode(ids, skip_special_tokens=True))
            text, stopped = truncate_at_stop(text, sampling.stop)
            finished = stopped or cut is not None or len(ids) < sampling.max_new_tokens
            results.append(
                _RowResult(
                    text=text,
                    token_ids=ids,
                    finish_reason="stop" if finished else "length",
                    sampled_ids=sampled,
                    logprobs=logprobs[i][: len(sampled)],
                )
            )
        return results

    def _autocast(self) -> Any:
        """Generation under the trainer's autocast (``from_model(..., autocast=dtype)``: fp32 master weights, bf16
        compute), else nothing."""
        import contextlib

        import torch

        dtype = getattr(self, "autocast_dtype", None)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    # ----------------------------------------------------------------------------------------------- score
    async def score(self, prompt: Messages | str, completion: str) -> Score:
        """Log-probability of ``completion`` after ``prompt``.

        The prompt and the completion are tokenized separately and concatenated, so the completion's tokens are
        exactly ``tokenizer(completion)`` (no special tokens added).
        """
        self.stats.requests += 1
        prompt_ids = self.encode_prompt(prompt)
        completion_ids = self.tokenizer(completion, add_special_tokens=False)["input_ids"]
        if not completion_ids:
            return Score(logprob=0.0, token_logprobs=[], tokens=[])
        return await self._score_batcher.submit((prompt_ids, completion_ids))

    def _score_rows(self, rows: list[tuple[list[int], list[int]]]) -> list[Score]:
        # Rows that share their prompt (best-of-n candidates of one request, samples of one question) are scored
        # from one pass over the prompt (_score_shared): the prompt is most of the tokens.
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for i, (prompt_ids, _) in enumerate(rows):
            by_prompt.setdefault(tuple(prompt_ids), []).append(i)
        out: dict[int, Score] = {}
        alone: list[int] = []
        for prompt, members in by_prompt.items():
            if len(members) > 1 and prompt:
                shared = self._score_shared(list(prompt), [rows[i][1] for i in members])
                out.update(zip(members, shared, strict=True))
            else:
                alone.extend(members)
        if alone:
            out.update(zip(alone, self._score_separately([rows[i] for i in alone]), strict=True))
        return [out[i] for i in range(len(rows))]

    def _score_separately(self, rows: list[tuple[list[int], list[int]]]) -> list[Score]:
        # full-vocabulary logits cost rows x width x vocab floats (32 rows of 1,500 tokens over SmolLM2's 49k
        # vocabulary: 9 GB), so rows are scored in length-sorted chunks whose logits stay under SCORE_LOGITS_BYTES
        vocab = self._vocab_size()
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
        out: dict[int, Score] = {}
        chunk: list[int] = []
        for index in [*order, -1]:
            width = len(rows[index][0]) + len(rows[index][1]) if index >= 0 else 0
            if chunk and (index < 0 or (len(chunk) + 1) * width * vocab * 4 > SCORE_LOGITS_BYTES):
                out.update(zip(chunk, self._score_chunk([rows[i] for i in chunk]), strict=True))
                chunk = []
            if index >= 0:
                chunk.append(index)
        return [out[i] for i in range(len(rows))]

    def _vocab_size(self) -> int:
        return int(getattr(self.model.config, "vocab_size", 0) or 50_000)

    def _score_shared(self, prompt_ids: list[int], completions: list[list[int]]) -> list[Score]:
        """Score several completions of one prompt: one pass over the prompt keeps its key/value cache and the
        logits of its last position (each completion's first token); the completions then run on copies of that
        cache, right-padded, in chunks whose logits stay under SCORE_LOGITS_BYTES. Same values as scoring each
        row whole (tested), for 1 prompt pass instead of one per row."""
        import torch

        pad = self.tokenizer.pad_token_id
        vocab = self._vocab_size()
        scores: list[Score | None] = [None] * len(completions)
        with self._lock, torch.inference_mode():
            self.stats.calls += 1
            prefix = self.model(
                input_ids=torch.tensor([prompt_ids], device=self.device), use_cache=True, logits_to_keep=1
            )
            first = torch.log_softmax(prefix.logits[0, -1].float(), dim=-1)
            cache = prefix.past_key_values
            order = sorted(range(len(completions)), key=lambda i: len(completions[i]))
            chunk: list[int] = []
            for index in [*order, -1]:
                width = len(completions[index]) if index >= 0 else 0
                if chunk and (index < 0 or (len(chunk) + 1) * width * vocab * 4 > SCORE_LOGITS_BYTES):
                    rows = [completions[i] for i in chunk]
                    for i, score in zip(chunk, self._continue(prompt_ids, rows, first, cache, pad), strict=True):
                        scores[i] = score
                    chunk = []
                if index >= 0:
                    chunk.append(index)
        return scores  # type: ignore[return-value]

    def _continue(self, prompt_ids: list[int], rows: list[list[int]], first: Any, cache: Any, pad: int) -> list[Score]:
        """Log-probabilities of ``rows`` (completions of one prompt) from the prompt's cache and last logits."""
        import copy

        import torch

        values = [[float(first[row[0]])] for row in rows]
        rest = [row[:-1] for row in rows]  # the tokens whose logits predict each row's 2nd token on
        width = max(len(r) for r in rest)
        if width:
            self.stats.calls += 1
            input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
            attention = torch.zeros((len(rows), len(prompt_ids) + width), dtype=torch.long)
            attention[:, : len(prompt_ids)] = 1
            for i, tokens in enumerate(rest):
                input_ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
                attention[i, len(prompt_ids) : len(prompt_ids) + len(tokens)] = 1
            past = copy.deepcopy(cache)
            past.batch_repeat_interleave(len(rows))
            logits = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                past_key_values=past,
                use_cache=True,
            ).logits
            for i, row in enumerate(rows):
                if len(row) > 1:
                    logprobs = torch.log_softmax(logits[i, : len(row) - 1].float(), dim=-1)
                    targets = torch.tensor(row[1:], device=logits.device)
                    values[i] += logprobs[torch.arange(len(row) - 1, device=logits.device), targets].cpu().tolist()
        return [
            Score(logprob=float(sum(v)), token_logprobs=v, tokens=self.tokenizer.convert_ids_to_tokens(row))
            for v, row in zip(values, rows, strict=True)
        ]

    def _score_chunk(self, rows: list[tuple[list[int], list[int]]]) -> list[Score]:
        import torch

        pad = self.tokenizer.pad_token_id
        sequences = [p + c for p, c in rows]
        width = max(len(s) for s in sequences)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, seq in enumerate(sequences):  # right padding: positions start at 0 for every row
            input_ids[i, : len(seq)] = torch.tensor(seq)
            attention[i, : len(seq)] = 1
        scores = []
        with self._lock, torch.inference_mode():
            self.stats.calls += 1
            logits = self.model(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device)).logits
            for i, (prompt_ids, completion_ids) in enumerate(rows):
                start = len(prompt_ids)
                positions = torch.arange(start - 1, start - 1 + len(completion_ids), device=logits.device)
                logprobs = torch.log_softmax(logits[i, positions].float(), dim=-1)  # the completion's rows only
                targets = torch.tensor(completion_ids, device=logits.device)
                values = logprobs[torch.arange(len(completion_ids), device=logits.device), targets].cpu().tolist()
                scores.append(
                    Score(
                        logprob=float(sum(values)),
                        token_logprobs=values,
                        tokens=self.tokenizer.convert_ids_to_tokens(completion_ids),
                    )
                )
        return scores

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": self.path, "device": str(self.device), "dtype": str(self.model.dtype)}


def cpu_threads(device_type: str, threads: int | None) -> int | None:
    """The torch thread count to set for a model on ``device_type``: ``threads`` on ``cpu``, else None (leave
    torch's default, every core). A benchmark's ``threads=2``, sized for a 2-core CPU, must not throttle a GPU host.

    >>> cpu_threads("cpu", 2), cpu_threads("cuda", 2), cpu_threads("cpu", None)
    (2, None, None)
    """
    return threads if device_type == "cpu" and threads else None


def bucket_seed(seeds: list[int | None]) -> int | None:
    """The torch seed of one batched generation from its rows' seeds: the seed when they share one (or only some
    rows carry one), a hash of them all in order when they differ, None when no row is seeded. A row's draw then
    depends on its batch, as it always has on this backend."""
    given = [s for s in seeds if s is not None]
    if not given:
        return None
    if len(set(given)) == 1:
        return given[0]
    digest = hashlib.blake2b(",".join(map(str, seeds)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") >> 1


def length_buckets(lengths: list[int], max_padding: float) -> list[list[int]]:
    """Group row indices by length so each group's padded size stays within ``max_padding`` x its real tokens.

    Rows are sorted by length and a new group starts when adding the next (longer) row would make
    ``len(group) * longest > max_padding * sum(lengths of group)``. ``max_padding <= 0`` keeps one group.

    >>> length_buckets([100, 900, 110, 880], 1.25)
    [[0, 2], [3, 1]]
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if max_padding <= 0:
        return [order]
    buckets: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in order:
        if current and (len(current) + 1) * lengths[i] > max_padding * (real + lengths[i]):
            buckets.append(current)
            current, real = [], 0
        current.append(i)
        real += lengths[i]
    return [*buckets, current] if current else buckets


class _SampledLogprobs:
    """A logits processor that records the log-probability of each sampled token at ``temperature`` (the sampling
    distribution before top-p, as the trainer computes it). transformers runs custom processors before its
    temperature and top-p warpers, so the scores it sees are the model's (after the repetition penalty); it keeps
    one step's log-softmax and reads the token sampled from it at the next call (``finish``: the last one), so no
    more than one ``(rows, vocab)`` tensor is held."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature if temperature > 0 else 1.0
        self.previous: Any = None
        self.values: list[Any] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        self._read(input_ids[:, -1])
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _read(self, sampled: Any) -> None:
        if self.previous is not None:
            self.values.append(self.previous.gather(-1, sampled[:, None].to(self.previous.device))[:, 0])
            self.previous = None

    def finish(self, last: Any) -> list[list[float]]:
        """Per row, the log-prob of every generated position (``last``: the ids of the final position)."""
        import torch

        self._read(last)
        if not self.values:
            return [[] for _ in range(last.shape[0])]
        return torch.stack(self.values, dim=1).cpu().tolist()


class _StopOnStrings:
    """Per-row stopping criterion: a row is done once its generated text contains a stop string."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], prompt_width: int) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.prompt_width = prompt_width
        # Every token decodes to at least one character, so the last len(stop)+2 tokens cover any new match.
        self.window = max((len(s) for s in self.stop), default=1) + 2

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        done = []
        for row in input_ids[:, self.prompt_width :].tolist():
            tail = self.tokenizer.decode(row[-self.window :], skip_special_tokens=True)
            done.append(any(s in tail for s in self.stop))
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _check_model_dir(path: str) -> None:
    """A local directory must hold a transformers model: a ``config.json`` mapping that names its ``model_type``;
    a local-looking path must exist (``org/name`` hub names are left to transformers)."""
    import json
    from pathlib import Path

    folder = Path(path).expanduser()
    if not folder.exists() and (path.startswith(("/", ".", "~")) or path.count("/") > 1):
        raise LLMError(f"hf:{path}: no model found (no such directory)")
    if not folder.is_dir() or (folder / "adapter_config.json").is_file():  # a PEFT adapter: transformers reads it
        return
    config = folder / "config.json"
    if not config.is_file():
        raise LLMError(f"hf:{path}: no model found (no config.json in the directory)")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LLMError(f"hf:{path}: no model found (config.json is not readable JSON: {_first_line(exc)})") from None
    if not isinstance(data, dict) or not data.get("model_type"):
        raise LLMError(f"hf:{path}: no model found (config.json names no model_type)")


@register_backend("hf")
def _make_hf(target: str, options: dict[str, str]) -> HFLLM:
    known = {"device", "dtype", "max_batch", "threads", "max_padding"}
    if unknown := set(options) - known:
        raise LLMError(f"unknown hf option(s) {sorted(unknown)}; known: {sorted(known)}")
    return HFLLM(
        target,
        device=options.get("device") or None,
        dtype=options.get("dtype") or None,
        max_batch=int(options.get("max_batch", 32)),
        threads=int(options["threads"]) if options.get("threads") else None,
        max_padding=float(options["max_padding"]) if options.get("max_padding") else None,
    )
