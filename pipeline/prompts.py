"""Prompt assembly as token sequences, keeping untrusted text away from control tokens.

A prompt is a list of parts. Trusted parts (our templates) are tokenized with special tokens
enabled; untrusted parts (questions, passages, drafted text) are first neutralised and then
tokenized with special tokens disabled, so neither a document nor a user can forge a
reflection token, a `<paragraph>` marker or a chat turn.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from selfrag.pipeline.protocols import Passage

# Chat control markup such as <|im_start|>, <|eot_id|>, <start_of_turn> and <paragraph>.
_ANGLE_MARKUP = re.compile(r"<\|?/?[A-Za-z_][A-Za-z0-9_:\-]{0,40}\|?>")
_BRACKET_MARKUP = re.compile(
    r"\[(?:Retrieval|No Retrieval|Continue to Use Evidence|Relevant|Irrelevant|Fully supported|"
    r"Partially supported|No support / Contradictory|Utility:\s*\d)\]",
    re.IGNORECASE,
)


def neutralise(text: str, reserved: Iterable[str] = ()) -> str:
    """Defuse markup that could be read as a control or reflection token.

    The first character of each match is swapped for a look-alike ('[' → '［', '<' → '‹'),
    so the text stays readable but no longer spells the reserved token.
    """

    def swap(match: re.Match[str]) -> str:
        s = match.group(0)
        first = {"[": "［", "<": "‹"}.get(s[0], s[0] + "\u2060")
        return first + s[1:]

    text = _ANGLE_MARKUP.sub(swap, text)
    text = _BRACKET_MARKUP.sub(swap, text)
    for piece in reserved:
        if piece and piece in text:
            text = text.replace(
                piece, {"[": "［", "<": "‹"}.get(piece[0], piece[0] + "\u2060") + piece[1:]
            )
    return text


class Tokenizer(Protocol):
    def tokenize(self, text: str, *, special: bool = False) -> list[int]: ...

    def bos_tokens(self) -> list[int]: ...


@dataclass(frozen=True)
class Trusted:
    text: str


@dataclass(frozen=True)
class Untrusted:
    text: str


@dataclass(frozen=True)
class Evidence(Untrusted):
    """A retrieved passage: untrusted, and cut to its share of the context (`PromptBuilder`)
    when it would not fit; `of`: how many passages share the prompt."""

    of: int = 1


@dataclass(frozen=True)
class Tokens:
    """Already-tokenized model output (a drafted segment), appended as is."""

    ids: tuple[int, ...]


Part = Trusted | Untrusted | Tokens


# The share of the context (`n_ctx` of the tokenizer's engine) the passages of one prompt may
# take together: the rest holds the template, the question, the drafts and the generation.
EVIDENCE_SHARE = 4


class PromptBuilder:
    """Turns parts into token ids, caching the tokens of trusted template pieces. A passage
    (`Evidence`) longer than its share of the engine's context (`n_ctx` / `EVIDENCE_SHARE`,
    divided among the prompt's passages) is cut to it: one passage too long for the context
    (an index of unbounded passages) costs its tail, not the answer."""

    def __init__(self, tokenizer: Tokenizer, reserved: Iterable[str] = ()) -> None:
        self._tok = tokenizer
        self._reserved = tuple(reserved)
        self._trusted_cache: dict[str, list[int]] = {}
        n_ctx = getattr(tokenizer, "n_ctx", None)
        self._evidence_tokens = n_ctx // EVIDENCE_SHARE if isinstance(n_ctx, int) else None

    def build(self, parts: Sequence[Part], *, bos: bool = True) -> list[int]:
        ids: list[int] = list(self._tok.bos_tokens()) if bos else []
        for part in parts:
            if isinstance(part, Trusted):
                cached = self._trusted_cache.get(part.text)
                if cached is None:
                    cached = self._tok.tokenize(part.text, special=True)
                    self._trusted_cache[part.text] = cached
                ids.extend(cached)
            elif isinstance(part, Untrusted):
                tokens = self._tok.tokenize(neutralise(part.text, self._reserved), special=False)
                if isinstance(part, Evidence) and self._evidence_tokens is not None:
                    tokens = tokens[: max(1, self._evidence_tokens // part.of)]
                ids.extend(tokens)
            else:
                ids.extend(part.ids)
        return ids

    def build_split(
        self, parts: Sequence[Part], split: int, *, bos: bool = True
    ) -> tuple[list[int], int]:
        """`build(parts)` and the number of its tokens that come from `parts[:split]`.

        Parts are tokenized one by one, so those tokens are exactly `build(parts[:split])`.
        """
        head = self.build(parts[:split], bos=bos)
        return head + self.build(parts[split:], bos=False), len(head)


# --- chat templates ---------------------------------------------------------------------------

_SENTINEL = "\x00{}\x00"


@dataclass(frozen=True)
class ChatGlue:
    """The literal template text around message contents, found by rendering sentinels.

    Rendering [system, user, assistant, user] gives
    `start · S · before_user · U · assistant_start · A · assistant_end_user_start · U ·
    assistant_start`, which lets prompts be assembled part by part (untrusted contents
    tokenized separately) while matching the model's own template exactly.
    """

    start: str
    system_to_user: str
    assistant_start: str
    assistant_to_user: str
    has_system: bool


def chat_glue(template: str | None, bos_token: str = "", eos_token: str = "") -> ChatGlue:
    """Derive the glue of a Jinja chat template; a plain-text layout when there is none."""
    if not template:
        return ChatGlue(
            start="",
            system_to_user="\n\n",
            assistant_start="\nAnswer: ",
            assistant_to_user="\n\n",
            has_system=True,
        )
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    s = [_SENTINEL.format(i) for i in range(4)]
    for with_system in (True, False):
        roles = (
            ["system", "user", "assistant", "user"]
            if with_system
            else ["user", "assistant", "user"]
        )
        contents = s if with_system else s[1:]
        messages = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
        try:
            rendered = compiled.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=bos_token,
                eos_token=eos_token,
            )
        except Exception:
            continue
        if not all(c in rendered for c in contents):
            continue
        pieces = split_on(rendered, contents)
        if with_system:
            start, sys_to_user, a_start, a_to_u, a_start2 = pieces
        else:
            start, a_start, a_to_u, a_start2 = pieces
            sys_to_user = ""
        if a_start != a_start2:
            # Templates that render the last generation prompt differently are rare; the
            # trailing form is the one the model sees when asked to answer.
            a_start = a_start2
        return ChatGlue(start, sys_to_user, a_start, a_to_u, with_system)
    raise ValueError("the model's chat template could not be rendered with plain messages")


def split_on(rendered: str, sentinels: Sequence[str]) -> list[str]:
    """`rendered` cut at each sentinel in turn: the text before each, then the rest."""
    pieces: list[str] = []
    rest = rendered
    for sentinel in sentinels:
        before, _, rest = rest.partition(sentinel)
        pieces.append(before)
    pieces.append(rest)
    return pieces


# --- the prompt head shared by the critique sources and the baselines ---------------------------

SYSTEM_PROMPT = (
    "You answer questions accurately and briefly, using the given evidence when there is some."
)


def passage_text(p: Passage) -> str:
    """A passage as prompts show it: its title on the first line, when it has one."""
    return f"{p.title}\n{p.text}" if p.title else p.text


def system_head(glue: ChatGlue) -> list[Part]:
    """The start of every prompt: the template's opening and the system message."""
    parts: list[Part] = [Trusted(glue.start)]
    if glue.has_system:
        parts += [Trusted(SYSTEM_PROMPT), Trusted(glue.system_to_user)]
    return parts


def passage_part(p: Passage, label: str = "Passage", of: int = 1) -> list[Part]:
    """`label: <passage>` and a blank line; the passage is untrusted evidence, one of `of`
    in the prompt."""
    return [Trusted(f"{label}: "), Evidence(passage_text(p), of), Trusted("\n\n")]


def evidence_head(glue: ChatGlue, passage: Passage | None) -> list[Part]:
    """System and passage: the same for any question, so its KV state is a reusable prefix."""
    return system_head(glue) + (passage_part(passage) if passage is not None else [])
