"""A llama.cpp model's vocabulary: tokenize, detokenize, the special tokens, and the checks
that request token ids lie in it."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cached_property

import llama_cpp

from selfrag.infra.engine.llama_batch import EngineError


class LlamaVocab:
    """The tokenizer of a loaded model (the model must outlive it)."""

    def __init__(self, vocab: llama_cpp.llama_vocab_p) -> None:
        self._vocab = vocab
        self.n_tokens = int(llama_cpp.llama_vocab_n_tokens(vocab))

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """Tokenize without adding BOS. With `special=False` no control token can appear."""
        data = text.encode("utf-8")
        if not data:
            return []
        size = len(data) + 8
        while True:
            buf = (llama_cpp.llama_token * size)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, size, False, special)
            if n >= 0:
                return list(buf[:n])
            if -n <= size:
                raise EngineError(f"llama.cpp could not tokenize a text of {len(data)} bytes")
            size = -n

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of `tokens` (ids already checked), special tokens written out as text."""
        if not tokens:
            return ""
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        size = 8 * len(tokens) + 16
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_detokenize(self._vocab, arr, len(tokens), buf, size, False, True)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = -n + 1

    def special_token_id(self, piece: str) -> int | None:
        """The id of `piece` when the vocabulary holds it as one control/user-defined token."""
        tokens = self.tokenize(piece, special=True)
        if len(tokens) != 1:
            return None
        attr = int(llama_cpp.llama_vocab_get_attr(self._vocab, tokens[0]))
        special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
        return tokens[0] if attr & special else None

    def bos_tokens(self) -> list[int]:
        """[BOS] when the vocabulary asks for it at the start of a prompt, else []."""
        bos = int(llama_cpp.llama_vocab_bos(self._vocab))
        if bos >= 0 and llama_cpp.llama_vocab_get_add_bos(self._vocab):
            return [bos]
        return []

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, end-of-turn, ...)."""
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    @cached_property
    def eog_tokens(self) -> list[int]:
        """Every end-of-generation token id (read once: one call per vocabulary entry)."""
        return [t for t in range(self.n_tokens) if self.is_eog(t)]

    def check_tokens(self, tokens: Sequence[int], what: str) -> list[int]:
        """`tokens` as ints; a ValueError naming `what` for one outside the vocabulary."""
        try:
            out = [int(t) for t in tokens]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{what}: token ids must be integers ({exc})") from exc
        for t in out:
            if not 0 <= t < self.n_tokens:
                raise ValueError(
                    f"{what}: token id {t} is outside the vocabulary (0..{self.n_tokens - 1})"
                )
        return out

    def check_prompt(self, prompt: Sequence[int], what: str) -> list[int]:
        """`check_tokens`, and a prompt must have at least one token."""
        tokens = self.check_tokens(prompt, what)
        if not tokens:
            raise ValueError(f"{what} is empty: at least one token (e.g. BOS) is needed")
        return tokens
