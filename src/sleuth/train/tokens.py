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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "TokenizedChat", "TokenizationError", "tokenize_chat"]


class TokenizationError(ValueError):
    """A conversation cannot be tokenized with a reliable mask (template not prefix-stable, no fast tokenizer)."""


@dataclass
class TokenizedChat:
    """``input_ids`` of the rendered conversation; ``model_mask[i]`` is 1 where the model wrote token i;
    ``labels`` is ``input_ids`` with every other position set to ``IGNORE_INDEX`` (the usual causal-LM shift is the
    model's job); ``spans`` are the character spans ``(start, end, message_index)`` of the model-written text."""

    input_ids: list[int]
    model_mask: list[int]
    text: str
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    truncated: bool = False

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

    ``max_length``: keep the last ``max_length`` tokens (the start of a long trajectory is the prompt, whose tokens
    carry no loss; ``truncated`` records it). Needs a fast tokenizer (character offsets).
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
    previous_end = 0
    for i, message in enumerate(messages):
        prefix = _render(tokenizer, messages[: i + 1])
        if not text.startswith(prefix):
            raise TokenizationError(
                f"the chat template is not prefix-stable at message {i} (role {message['role']!r}): the rendering "
                "of the first messages is not a prefix of the whole conversation's, so model tokens cannot be found"
            )
        if message["role"] in model_roles and message["content"]:
            start = prefix.rfind(message["content"], previous_end)
            if start < 0:
                raise TokenizationError(f"message {i}'s content is not in its rendering (the template alters it)")
            content_end = start + len(message["content"])
            if segments[i] is None:
                spans.append((start, _end_of_turn(prefix, content_end, eos), i))
            else:  # one assistant message holding model text and inserted observations (s3's growing reply)
                at = start
                for j, (source, piece) in enumerate(segments[i]):
                    if source == "model" and piece:
                        last = j == len(segments[i]) - 1
                        end = _end_of_turn(prefix, at + len(piece), eos) if last else at + len(piece)
                        spans.append((at, end, i))
                    at += len(piece)
        previous_end = len(prefix)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(encoded["input_ids"])
    mask = [0] * len(ids)
    j = 0
    for t, (s, e) in enumerate(encoded["offset_mapping"]):
        while j < len(spans) and spans[j][1] <= s:
            j += 1
        if j < len(spans) and e > spans[j][0] and s < spans[j][1] and e > s:
            mask[t] = 1
    truncated = False
    if max_length is not None and len(ids) > max_length:
        ids, mask, truncated = ids[-max_length:], mask[-max_length:], True
    return TokenizedChat(input_ids=ids, model_mask=mask, text=text, spans=spans, truncated=truncated)
