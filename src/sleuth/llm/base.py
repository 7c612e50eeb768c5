"""The one interface every LLM backend speaks, and the spec-string registry that picks a backend.

A request is either chat ``messages`` or a raw ``prompt``. ``generate`` returns one :class:`Generation` per request
with ``n`` sampled texts; ``score`` returns the log-probability of a given completion after a prompt.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import parse_qsl


class LLMError(RuntimeError):
    """A backend failed in a way retrying will not fix (bad request, bad spec, exhausted retries)."""


Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Sampling:
    """Decoding settings. ``temperature == 0`` means greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    n: int = 1
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str | list):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if self.n < 1:
            raise ValueError("Sampling.n must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError("Sampling.max_new_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("Sampling.temperature must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Request:
    """One prompt: chat ``messages`` or a raw ``prompt`` (exactly one of them).

    ``prompt_ids`` (optional, token-in): the exact token ids to continue, for a backend that takes ids (``hf``; the
    ``openai`` backend sends them to ``/completions``, which vLLM accepts). ``messages`` / ``prompt`` then stay the
    human-readable form of the same context (recorded in the Trace); a backend that cannot take ids uses them."""

    messages: Messages | None = None
    prompt: str | None = None
    prompt_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("a Request needs exactly one of `messages` or `prompt`")
        if self.prompt_ids is not None and not self.prompt_ids:
            raise ValueError("Request.prompt_ids must hold at least one id (or be None)")

    @classmethod
    def chat(cls, user: str, system: str | None = None) -> Request:
        messages = [{"role": "system", "content": system}] if system else []
        return cls(messages=[*messages, {"role": "user", "content": user}])


@dataclass
class Generation:
    """The ``n`` completions of one request. ``finish_reasons`` are "stop" (EOS or a stop string) or "length".

    Token-out (backends that know their ids; None otherwise): ``token_ids`` are each text's ids (without the
    end-of-sequence token); ``prompt_ids`` the ids the request was given to the model as; ``sampled_ids`` every id
    sampled for each completion, in order, including the end-of-sequence id that ended it and any tokens past a
    stop string; ``logprobs`` the sampler's log-probability of each of ``sampled_ids`` (at the sampling
    temperature, before top-p), when the backend reports them."""

    texts: list[str]
    prompt_tokens: int = 0
    completion_tokens: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    token_ids: list[list[int]] | None = None
    prompt_ids: list[int] | None = None
    sampled_ids: list[list[int]] | None = None
    logprobs: list[list[float]] | None = None

    @property
    def text(self) -> str:
        return self.texts[0]


@dataclass
class Score:
    """Log-probability of a completion given a prompt: the sum and the per-token values, with the tokens."""

    logprob: float
    token_logprobs: list[float]
    tokens: list[str]


@dataclass
class LLMStats:
    """Counters a backend keeps: requests asked for, and calls actually made to the model or the server."""

    requests: int = 0
    calls: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


#: Control strings of the common chat templates (ChatML/Qwen/SmolLM, Llama 2/3, Mistral, Gemma, Phi, GPT-2), used
#: where a backend cannot read its tokenizer's own list.
COMMON_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "[INST]",
    "[/INST]",
    "<<SYS>>",
    "<</SYS>>",
    "<s>",
    "</s>",
    "<unk>",
    "<pad>",
)


class LLM(abc.ABC):
    """Base class of the backends. Subclasses implement :meth:`generate` and :meth:`score`."""

    spec: str = ""

    def __init__(self) -> None:
        self.stats = LLMStats()

    @abc.abstractmethod
    async def generate(self, requests: list[Request], sampling: Sampling) -> list[Generation]:
        """Complete each request; the result is in request order."""

    @abc.abstractmethod
    async def score(self, prompt: Messages | str, completion: str) -> Score:
        """Log-probability of ``completion`` following ``prompt`` (chat messages get the generation prompt)."""

    def special_tokens(self) -> tuple[str, ...]:
        """The control strings this model's tokenizer turns into special tokens (``<|im_end|>``, ``</s>``, ...).

        Text from outside (passages, tool output) that contains one of them would become a real turn boundary once
        the prompt is tokenized, so agents neutralise them (:meth:`sleuth.agents.base.Context.inert`). A backend that
        cannot see its tokenizer (a remote server) returns :data:`COMMON_SPECIAL_TOKENS`.
        """
        return COMMON_SPECIAL_TOKENS

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release connections or threads; the default has nothing to release."""

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec, "backend": type(self).__name__}


class ReplayLLM(LLM):
    """An LLM that writes planned text: ``reply(request)`` for each request, the same for all ``n`` samples. The
    warm starts use it to run a real agent through gold trajectories, so that prompts, observations and parsing are
    exactly the inference ones; ``reply`` finds the trajectory and the turn from the request. ``tokenizer``: the
    trained model's, for agents that count or template tokens. Scoring is not available."""

    def __init__(self, reply: Callable[[Request], str], spec: str = "replay", tokenizer: Any = None) -> None:
        super().__init__()
        self.spec = spec
        self.reply = reply
        if tokenizer is not None:
            self.tokenizer = tokenizer

    async def generate(self, requests: list[Request], sampling: Sampling) -> list[Generation]:
        n = sampling.n
        return [
            Generation(texts=[self.reply(r)] * n, completion_tokens=[0] * n, finish_reasons=["stop"] * n)
            for r in requests
        ]

    async def score(self, prompt: Messages | str, completion: str) -> Score:
        raise LLMError(f"{self.spec} replays planned text and cannot score")


_BACKENDS: dict[str, Callable[[str, dict[str, str]], LLM]] = {}


def register_backend(
    prefix: str,
) -> Callable[[Callable[[str, dict[str, str]], LLM]], Callable[[str, dict[str, str]], LLM]]:
    """Register a factory ``(target, options) -> LLM`` for specs of the form ``prefix:target?key=value``."""

    def decorate(factory: Callable[[str, dict[str, str]], LLM]) -> Callable[[str, dict[str, str]], LLM]:
        _BACKENDS[prefix] = factory
        return factory

    return decorate


def parse_spec(spec: str) -> tuple[str, str, dict[str, str]]:
    """Split ``prefix:target?k=v&k2=v2`` into its parts.

    >>> parse_spec("hf:/models/smol?device=cpu&max_batch=8")
    ('hf', '/models/smol', {'device': 'cpu', 'max_batch': '8'})
    """
    prefix, sep, rest = spec.partition(":")
    if not sep or not prefix:
        raise LLMError(f"LLM spec {spec!r} has no backend prefix; expected one of {sorted(_BACKENDS)} like 'hf:PATH'")
    target, _, query = rest.partition("?")
    return prefix, target, dict(parse_qsl(query, keep_blank_values=True))


def load_llm(spec: str | None = None) -> LLM:
    """Build a backend from a spec string.

    ``None`` or ``"default"`` is the embedded SmolLM2 model (fetched by ``sleuth assets fetch``);
    ``hf:PATH_OR_NAME`` a local transformers model; ``openai:MODEL@BASE_URL`` any OpenAI-compatible server;
    ``vllm:PATH_OR_NAME`` a vLLM server that sleuth starts and stops (:mod:`sleuth.llm.vllm_server`).
    """
    from sleuth.llm import hf, openai_compat, vllm_server  # noqa: F401 - imported for their registrations

    if spec in (None, "", "default"):
        from sleuth.assets import default_model_dir

        spec = f"hf:{default_model_dir()}"
    prefix, target, options = parse_spec(spec)
    if prefix not in _BACKENDS:
        raise LLMError(f"unknown LLM backend {prefix!r} in spec {spec!r}; known: {sorted(_BACKENDS)}")
    llm = _BACKENDS[prefix](target, options)
    llm.spec = spec
    return llm


def encode_prompt(tokenizer: Any, prompt: Messages | str, name: str = "the model") -> list[int]:
    """Token ids of a prompt with a transformers ``tokenizer``: a string is tokenized as is (with the tokenizer's
    own special tokens); chat messages get the chat template and the generation prompt, or continue a final
    assistant turn in place. The ``hf`` backend and the ``openai``/``vllm`` backends' token-exact :meth:`LLM.score`
    both use it, so a score means the same on either."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if not tokenizer.chat_template:
        raise LLMError(f"{name} has no chat template; send raw prompts (Request(prompt=...)) instead")
    if prompt and prompt[-1]["role"] == "assistant":  # a prefilled assistant turn is continued in place
        text = tokenizer.apply_chat_template(prompt, tokenize=False, continue_final_message=True)
    else:
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def truncate_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """Cut ``text`` before the earliest stop string; return the text and whether a stop string was found."""
    cut = min((i for s in stop if s and (i := text.find(s)) >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
