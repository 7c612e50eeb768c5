"""Chat conversations as token ids with a mask of the model-written tokens.

Every trainer that learns from a multi-turn trajectory (ExSearch's EM, the RL trainers) needs the same thing: the
ids the chat template produces for the whole conversation, and for each id whether the model wrote it (loss, KL and
advantages cover those) or whether it was inserted (the prompt, retrieved documents, the finalization instruction:
masked). Tokenizing each message separately and concatenating would not give the ids the model sees (merges across
the boundaries, special tokens), so the mask is computed on the *rendered* conversation instead:

1. render the whole chat with the tokenizer's template, and each prefix of it, to find the character span of every
   message's text inside the full rendering (a template that is not prefix-stable is refused with an error);
2. tokenize the full rendering once with character offsets;
3. a token is a model token when its characters overlap a model span. A model span is an assistant message's
   content plus the template's end-of-turn text after it (``<|im_end|>``), so the model learns to stop; the
   newline after it and the next role header stay masked.

The ids are exactly ``tokenizer.apply_chat_template(messages, tokenize=True)``, and the masked-in tokens decode to
the assistant contents with their end-of-turn tokens, which the tests check on a template with special tokens.

Inserted text from outside (retrieved documents, given references) can be marked as ``observation`` segments of any
message; its tokens are then known too (``observation_mask``), and :func:`fit_to_length` can shorten an episode
that is over a token limit by cutting observation tokens only, never the instruction or a model token.

**Sampled ids (token-in, token-out).** Re-tokenizing the text is a fallback: the ids it gives are not always those
the model sampled (a BPE merge across a turn boundary, a stop string cut mid-token, a template that rewrites earlier
turns). :func:`sampled_chat` builds the same :class:`TokenizedChat` from ids recorded during the rollout instead:
the prompt's ids as the engine received them, then each model turn's sampled ids (mask 1, with the end-of-turn id
when the model sampled one) and each inserted observation's ids, tokenized once when it was inserted (mask 0).
:func:`prompt_observations` marks the observations inside the prompt so that :func:`fit_to_length` works the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

IGNORE_INDEX = -100

__all__ = [
    "IGNORE_INDEX",
    "TokenizedChat",
    "TokenizationError",
    "fit_to_length",
    "observation_segments",
    "prompt_observations",
    "sampled_chat",
    "tokenize_chat",
]

KEEP_TAIL = 8  # tokens kept at the end of a cut observation: its closing tag and layout (``</information>\n\n``)


class TokenizationError(ValueError):
    """A conversation cannot be tokenized with a reliable mask (template not prefix-stable, no fast tokenizer)."""


@dataclass
class TokenizedChat:
    """``input_ids`` of the rendered conversation; ``model_mask[i]`` is 1 where the model wrote token i;
    ``labels`` is ``input_ids`` with every other position set to ``IGNORE_INDEX`` (the usual causal-LM shift is the
    model's job); ``spans`` are the character spans ``(start, end, message_index)`` of the model-written text.
    ``observation_mask[i]`` is 1 where token i lies wholly inside an ``observation`` segment (and is no model
    token). ``text`` and ``spans`` describe the full rendering even after a cut; ``truncated`` says a cut happened,
    ``cut_tokens`` / ``cut_observations`` how many observation tokens it removed from how many observations."""

    input_ids: list[int]
    model_mask: list[int]
    text: str
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    truncated: bool = False
    observation_mask: list[int] = field(default_factory=list)
    cut_tokens: int = 0
    cut_observations: int = 0

    @property
    def labels(self) -> list[int]:
        return [t if m else IGNORE_INDEX for t, m in zip(self.input_ids, self.model_mask, strict=True)]

    @property
    def model_tokens(self) -> int:
        return sum(self.model_mask)

    def __len__(self) -> int:
        return len(self.input_ids)


def _render(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False)


def _end_of_turn(segment: str, content_end: int, eos: str | None) -> int:
    """Where the model's part of an assistant segment ends: after the end-of-turn token that follows the content
    (the tokenizer's EOS text when the template writes it), else at the content's end."""
    if eos:
        at = segment.find(eos, content_end)
        if at >= 0 and not segment[content_end:at].strip():
            return at + len(eos)
    return content_end


def tokenize_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    model_roles: Sequence[str] = ("assistant",),
    max_length: int | None = None,
) -> TokenizedChat:
    """Tokenize ``messages`` with the chat template; mark the tokens of ``model_roles`` messages (module doc).

    A message may carry ``segments`` (``[{"source": "model" | "observation" | ..., "text"}]``, its content being
    their concatenation): then only its ``model`` segments are model tokens, e.g. an s3 reply that the searcher
    keeps continuing around inserted search results. The end-of-turn token counts as the model's only when the
    last segment is the model's.

    Segments whose source is ``observation`` (in any message, e.g. the documents inside a user prompt) are
    recorded in ``observation_mask``, which :func:`fit_to_length` cuts from.

    ``max_length``: keep the last ``max_length`` tokens (the start of a long trajectory is the prompt, whose tokens
    carry no loss; ``truncated`` records it). This loses the instruction at the start; the RL trainers use
    :func:`fit_to_length` instead. Needs a fast tokenizer (character offsets).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizationError("tokenize_chat needs a fast tokenizer (character offsets)")
    segments: list[list[tuple[str, str]] | None] = []
    plain = []
    for i, message in enumerate(messages):
        parts = message.get("segments")
        if parts is not None:
            parts = [(str(p["source"]), str(p["text"])) for p in parts]
            if "".join(t for _, t in parts) != message.get("content", "".join(t for _, t in parts)):
                raise TokenizationError(f"message {i}: its segments do not add up to its content")
        segments.append(parts)
        content = "".join(t for _, t in parts) if parts is not None else message["content"]
        plain.append({"role": message["role"], "content": content})
    messages = plain
    text = _render(tokenizer, messages)
    eos = tokenizer.eos_token if isinstance(tokenizer.eos_token, str) else None
    spans: list[tuple[int, int, int]] = []
    observed: list[tuple[int, int]] = []
    previous_end = 0
    for i, message in enumerate(messages):
        prefix = _render(tokenizer, messages[: i + 1])
        if not text.startswith(prefix):
            raise TokenizationError(
                f"the chat template is not prefix-stable at message {i} (role {message['role']!r}): the rendering "
                "of the first messages is not a prefix of the whole conversation's, so model tokens cannot be found"
            )
        is_model = message["role"] in model_roles
        if message["content"] and (is_model or segments[i] is not None):
            start = prefix.rfind(message["content"], previous_end)
            if start < 0:
                raise TokenizationError(f"message {i}'s content is not in its rendering (the template alters it)")
            content_end = start + len(message["content"])
            if segments[i] is None:
                spans.append((start, _end_of_turn(prefix, content_end, eos), i))
            else:  # model text and inserted observations in one message (s3's growing reply, a prompt's documents)
                at = start
                for j, (source, piece) in enumerate(segments[i]):
                    if is_model and source == "model" and piece:
                        last = j == len(segments[i]) - 1
                        end = _end_of_turn(prefix, at + len(piece), eos) if last else at + len(piece)
                        spans.append((at, end, i))
                    elif source == "observation" and piece:
                        observed.append((at, at + len(piece)))
                    at += len(piece)
        previous_end = len(prefix)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(encoded["input_ids"])
    mask = [0] * len(ids)
    inside = [0] * len(ids)
    j = k = 0
    for t, (s, e) in enumerate(encoded["offset_mapping"]):
        while j < len(spans) and spans[j][1] <= s:
            j += 1
        if j < len(spans) and e > spans[j][0] and s < spans[j][1] and e > s:
            mask[t] = 1
        while k < len(observed) and observed[k][1] <= s:
            k += 1
        if not mask[t] and k < len(observed) and observed[k][0] <= s and e <= observed[k][1] and e > s:
            inside[t] = k + 1  # which observation (1-based), so that neighbouring observations stay apart
    truncated = False
    if max_length is not None and len(ids) > max_length:
        ids, mask, inside, truncated = ids[-max_length:], mask[-max_length:], inside[-max_length:], True
    return TokenizedChat(
        input_ids=ids, model_mask=mask, text=text, spans=spans, truncated=truncated, observation_mask=inside
    )


def observation_segments(content: str, pieces: Sequence[str]) -> list[dict[str, str]] | None:
    """``content`` split into ``prompt`` and ``observation`` segments, each of ``pieces`` (in order, e.g. the
    documents placed in a prompt) marked where it occurs after the previous one; a piece not found is left as
    prompt text. None when no piece is found (the message then needs no segments)."""
    out: list[dict[str, str]] = []
    at = 0
    for piece in pieces:
        if not piece:
            continue
        start = content.find(piece, at)
        if start < 0:
            continue
        if start > at:
            out.append({"source": "prompt", "text": content[at:start]})
        out.append({"source": "observation", "text": piece})
        at = start + len(piece)
    if not any(s["source"] == "observation" for s in out):
        return None
    if at < len(content):
        out.append({"source": "prompt", "text": content[at:]})
    return out


def _level_cuts(lengths: Sequence[int], excess: int) -> list[int]:
    """Tokens to cut from each observation so that ``excess`` go in all, taken from the longest first: every
    observation longer than some level is brought down to it (ties broken by position)."""
    low, high = 0, max(lengths)
    while low < high:  # the highest level at which cutting down to it removes at least `excess`
        level = (low + high + 1) // 2
        if sum(max(0, n - level) for n in lengths) >= excess:
            low = level
        else:
            high = level - 1
    cuts = [max(0, n - (low + 1)) for n in lengths]
    remaining = excess - sum(cuts)
    for i, n in enumerate(lengths):
        if remaining and n > low:
            cuts[i] += 1
            remaining -= 1
    return cuts


def fit_to_length(chat: TokenizedChat, max_tokens: int | None, keep_tail: int = KEEP_TAIL) -> TokenizedChat | None:
    """``chat`` within ``max_tokens`` tokens by cutting observation tokens only, or None when even removing every
    observation token would not fit (the caller drops the episode and counts it).

    The longest observations are shortened first, down to a common length; each loses the end of its body but
    keeps its first tokens and its last ``keep_tail`` (the closing tag), so the instruction, the template and every
    model-written token keep their ids and their order. ``None`` limit, or a chat already within it: unchanged."""
    if max_tokens is None or len(chat) <= max_tokens:
        return chat
    excess = len(chat) - max_tokens
    runs: dict[int, list[int]] = {}
    for t, which in enumerate(chat.observation_mask):
        if which:
            runs.setdefault(which, []).append(t)
    observations = list(runs.values())
    if sum(len(r) for r in observations) < excess:
        return None
    drop: set[int] = set()
    cut_observations = 0
    for run, cut in zip(observations, _level_cuts([len(r) for r in observations], excess), strict=True):
        if not cut:
            continue
        keep = len(run) - cut
        tail = min(keep_tail, keep // 2)
        drop.update(run[keep - tail : len(run) - tail])
        cut_observations += 1
    kept = [t for t in range(len(chat)) if t not in drop]
    return TokenizedChat(
        input_ids=[chat.input_ids[t] for t in kept],
        model_mask=[chat.model_mask[t] for t in kept],
        text=chat.text,
        spans=chat.spans,
        truncated=True,
        observation_mask=[chat.observation_mask[t] for t in kept],
        cut_tokens=chat.cut_tokens + len(drop),
        cut_observations=cut_observations,
    )


def prompt_observations(tokenizer: Any, messages: Sequence[dict[str, Any]], prompt_ids: Sequence[int]) -> list[int]:
    """``observation_mask`` of a prompt given as ids (the ids an engine was sent, which end with the generation
    prompt): the observations marked in ``messages`` (``segments``, as :func:`tokenize_chat` reads them), when the
    rendering of ``messages`` tokenizes to a prefix of ``prompt_ids`` (after a leading BOS); all 0 otherwise (the
    prompt then has nothing :func:`fit_to_length` may cut)."""
    none = [0] * len(prompt_ids)
    if not messages:
        return none
    try:
        chat = tokenize_chat(tokenizer, messages, model_roles=())
    except TokenizationError:
        return none
    ids = list(prompt_ids)
    for skip in (0, 1):
        if ids[skip : skip + len(chat)] == chat.input_ids:
            return [0] * skip + chat.observation_mask + [0] * (len(ids) - skip - len(chat))
    return none


def sampled_chat(
    prompt_ids: Sequence[int], pieces: Sequence[dict[str, Any]], prompt_observation_mask: Sequence[int] | None = None
) -> tuple[TokenizedChat, list[float] | None]:
    """An episode from the ids of its rollout: ``prompt_ids`` then ``pieces`` in order, each ``{"source", "ids"}``
    with source ``model`` (sampled: mask 1; ``logprobs``, the sampler's, one per id), ``observation`` (inserted
    evidence: mask 0, cuttable by :func:`fit_to_length`) or anything else (inserted text that stays: mask 0).

    Returns the chat (``text`` empty: the Trace holds the text) and the sampler's log-prob of every model token in
    order, or None when a model piece has none."""
    ids = list(prompt_ids)
    mask = [0] * len(ids)
    observed = list(prompt_observation_mask) if prompt_observation_mask is not None else [0] * len(ids)
    if len(observed) != len(ids):
        raise ValueError("prompt_observation_mask must have one entry per prompt id")
    which = max(observed, default=0)
    logprobs: list[float] | None = []
    for piece in pieces:
        piece_ids = [int(t) for t in piece.get("ids") or []]
        source = piece.get("source")
        if source == "model":
            values = piece.get("logprobs")
            if logprobs is not None and values is not None and len(values) == len(piece_ids):
                logprobs.extend(float(v) for v in values)
            else:
                logprobs = None
            mask += [1] * len(piece_ids)
            observed += [0] * len(piece_ids)
        elif source == "observation":
            which += 1
            mask += [0] * len(piece_ids)
            observed += [which] * len(piece_ids)
        else:
            mask += [0] * len(piece_ids)
            observed += [0] * len(piece_ids)
        ids += piece_ids
    return TokenizedChat(input_ids=ids, model_mask=mask, text="", observation_mask=observed), logprobs
