"""`LanguageModel` on a vLLM server's OpenAI-compatible API, for GPU clusters.

Endpoints used: `GET /v1/models`, `POST /tokenize`, `POST /detokenize` and
`POST /v1/completions` with token-id prompts (a batch is one request with a list of prompts,
which vLLM schedules together and whose common prefixes its prefix cache shares):

* generation: `temperature=0` (or a request's `Sampling`: temperature, top_p, seed),
  `logprobs=0` (the chosen token's log-probability), `return_tokens_as_token_ids`,
  `stop_token_ids`; sentence ends are cut client-side from the tokens' `text_offset`, so the
  result equals stopping there (a prefix does not depend on what follows it);
* scoring: `echo=true` with `logprobs=0` returns the log-probability of every prompt token, so
  a continuation (or a candidate next token) is scored by appending it to the prompt.

`prefill_tokens` reports the prompt length sent; what vLLM's prefix cache saved is not visible.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import httpx

from selfrag.infra.lifecycle import Closeable
from selfrag.pipeline.prompts import split_on
from selfrag.pipeline.protocols import (
    ContinuationRequest,
    ContinuationScores,
    FinishReason,
    Generation,
    GenerationRequest,
    Sampling,
    TokenScoreRequest,
    TokenScores,
)
from selfrag.pipeline.segmenting import ends_sentence

# A single token spelling chat or reflection markup (<|im_start|>, </s>, [Retrieval], ...).
_MARKUP_TOKEN = re.compile(r"^(?:<\|?/?[A-Za-z_][\w:\-]{0,40}\|?>|\[[^\[\]\n]{1,40}\])$")
# Sentinels for reading the server's chat template back: plain text that survives
# tokenize/detokenize unchanged.
_SENTINELS = [f"SENTINEL{i}ZQX" for i in range(4)]


class VLLMError(RuntimeError):
    """The vLLM server failed, or answered something this adapter cannot use."""


class VLLMEngine(Closeable):
    """A model served by vLLM. Thread-safe (one pooled HTTP client)."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        timeout_s: float = 120.0,
        api_key: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers)
        self._model = model or self._first_model()
        self._template_override = chat_template
        self._lock = threading.Lock()
        self._special: dict[str, int | None] = {}

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        self._http.close()

    # ----------------------------------------------------------------- HTTP

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            r = self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise VLLMError(f"vLLM {path}: {type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            raise VLLMError(f"vLLM {path} answered {r.status_code}: {r.text[:500]}")
        return r.json()  # type: ignore[no-any-return]

    def _first_model(self) -> str:
        try:
            r = self._http.get("/v1/models")
            r.raise_for_status()
            models = r.json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise VLLMError(f"vLLM /v1/models: {exc}") from exc
        if not models:
            raise VLLMError("vLLM serves no model")
        return str(models[0]["id"])

    # ----------------------------------------------------------------- model facts

    @property
    def model_id(self) -> str:
        return f"{self._model} (vLLM)"

    @cached_property
    def chat_template(self) -> str | None:
        """The server's chat template, read back by rendering sentinel messages through
        `/tokenize` and rebuilt as an equivalent Jinja template (pipeline.prompts.chat_glue
        splits it the same way); None when the server has no chat template."""
        if self._template_override is not None:
            return self._template_override
        bos = self.detokenize(self.bos_tokens()) if self.bos_tokens() else ""
        for roles in (["system", "user", "assistant", "user"], ["user", "assistant", "user"]):
            contents = _SENTINELS[4 - len(roles) :]
            messages = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
            try:
                out = self._post(
                    "/tokenize",
                    {
                        "model": self._model,
                        "messages": messages,
                        "add_generation_prompt": True,
                        "add_special_tokens": False,
                    },
                )
            except VLLMError:
                continue
            text = self.detokenize(out["tokens"])
            if not all(c in text for c in contents):
                continue
            pieces = split_on(text, contents)
            if bos and pieces[0].startswith(bos):
                # The prompt builder adds BOS itself (bos_tokens); the template must not.
                pieces[0] = pieces[0][len(bos) :]
            return _glue_template(pieces, has_system=len(roles) == 4)
        return None

    def bos_tokens(self) -> list[int]:
        """The tokens the server's tokenizer adds in front of a prompt."""
        return list(self._bos)

    @cached_property
    def _bos(self) -> tuple[int, ...]:
        plain = self._tokenize("a", add_special=False)
        added = self._tokenize("a", add_special=True)
        n = len(added) - len(plain)
        # Only leading additions are a BOS; an appended EOS is not part of a prompt.
        return tuple(added[:n]) if n > 0 and added[n:] == plain else ()

    # ----------------------------------------------------------------- tokenizer

    def _tokenize(self, text: str, *, add_special: bool) -> list[int]:
        body = {"model": self._model, "prompt": text, "add_special_tokens": add_special}
        return [int(t) for t in self._post("/tokenize", body)["tokens"]]

    def _tokenize_strs(self, text: str) -> tuple[list[int], list[str]]:
        body = {
            "model": self._model,
            "prompt": text,
            "add_special_tokens": False,
            "return_token_strs": True,
        }
        out = self._post("/tokenize", body)
        return [int(t) for t in out["tokens"]], [str(x) for x in out.get("token_strs") or []]

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """Tokenize without BOS. With `special=False`, a markup-shaped text that the server
        reads as one token (a control token) is split after its first character, so no
        control token can come out of untrusted text."""
        if not text:
            return []
        if special:
            return self._tokenize(text, add_special=False)
        ids, strs = self._tokenize_strs(text)
        if not any(_MARKUP_TOKEN.match(s) for s in strs):
            return ids
        out: list[int] = []
        rest = text
        for s in strs:
            if _MARKUP_TOKEN.match(s) and s in rest:
                before, _, rest = rest.partition(s)
                if before:
                    out += self._tokenize(before, add_special=False)
                out += self._tokenize(s[0], add_special=False)
                out += self.tokenize(s[1:], special=False)
        if rest:
            out += self._tokenize(rest, add_special=False)
        return out

    def detokenize(self, tokens: Sequence[int]) -> str:
        if not tokens:
            return ""
        out = self._post("/detokenize", {"model": self._model, "tokens": [int(t) for t in tokens]})
        return str(out["prompt"])

    def special_token_id(self, piece: str) -> int | None:
        """The id of a markup-shaped `piece` the vocabulary holds as one token, else None."""
        with self._lock:
            if piece in self._special:
                return self._special[piece]
        ids = self._tokenize(piece, add_special=False)
        found = int(ids[0]) if len(ids) == 1 and _MARKUP_TOKEN.match(piece) else None
        with self._lock:
            self._special[piece] = found
        return found

    # ----------------------------------------------------------------- batched calls

    def _completions(self, prompts: list[list[int]], **params: Any) -> list[dict[str, Any]]:
        body = {"model": self._model, "prompt": prompts, "temperature": 0.0, **params}
        choices = self._post("/v1/completions", body).get("choices") or []
        if len(choices) != len(prompts):
            raise VLLMError(f"vLLM returned {len(choices)} choices for {len(prompts)} prompts")
        return sorted(choices, key=lambda c: int(c["index"]))

    def _prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token_i | tokens before it) for i ≥ 1 of every sequence (echo)."""
        if not sequences:
            return []
        choices = self._completions(
            sequences, max_tokens=1, echo=True, logprobs=0, return_tokens_as_token_ids=True
        )
        out = []
        for seq, choice in zip(sequences, choices, strict=True):
            lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
            if len(lps) < len(seq):
                raise VLLMError("vLLM echoed fewer prompt log-probabilities than prompt tokens")
            # The first prompt token has no log-probability (None); -inf arrives as a number.
            out.append([float(x) if x is not None else 0.0 for x in lps[1 : len(seq)]])
        return out

    @property
    def hidden_size(self) -> None:
        """None: vLLM's completions API returns no hidden states (no `learned` critique)."""
        return None

    @property
    def n_layers(self) -> None:
        """None: vLLM's completions API returns no layer outputs either."""
        return None

    def next_token_logprobs(self, requests: Sequence[TokenScoreRequest]) -> list[TokenScores]:
        """Each candidate scored as the last token of `prompt + [candidate]`."""
        sequences: list[list[int]] = []
        for i, req in enumerate(requests):
            if req.hidden_layers:
                raise ValueError(
                    f"requests[{i}].hidden_layers: the vLLM adapter cannot return the output of "
                    "a middle layer (vLLM's OpenAI-compatible API has no such output)"
                )
            if req.hidden_state:
                raise VLLMError(
                    "the vLLM adapter cannot return hidden states: vLLM's OpenAI-compatible "
                    "API has no such output. Serve a model exported with "
                    "`selfrag train --export-gguf` (critique 'native') instead"
                )
            prompt = _prompt(req.prompt, f"requests[{i}].prompt")
            sequences += [[*prompt, int(c)] for c in req.candidates]
        scored = iter(self._prompt_logprobs(sequences))
        return [
            TokenScores([next(scored)[-1] for _ in req.candidates], len(req.prompt))
            for req in requests
        ]

    def continuation_logprobs(
        self, requests: Sequence[ContinuationRequest]
    ) -> list[ContinuationScores]:
        sequences = []
        for i, req in enumerate(requests):
            prompt = _prompt(req.prompt, f"requests[{i}].prompt")
            if req.continuation:
                sequences.append([*prompt, *(int(t) for t in req.continuation)])
        scored = iter(self._prompt_logprobs(sequences))
        out = []
        for req in requests:
            if not req.continuation:
                out.append(ContinuationScores([], 0))
                continue
            lps = next(scored)
            out.append(ContinuationScores(lps[len(req.prompt) - 1 :], len(req.prompt)))
        return out

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Continuations (greedy, or sampled as a request says); requests with the same stop
        tokens, budget, sampling and `min_tokens` share a call."""
        outputs: list[Generation | None] = [None] * len(requests)
        groups: dict[tuple[frozenset[int], int, Sampling | None, int], list[int]] = {}
        for i, req in enumerate(requests):
            _prompt(req.prompt, f"requests[{i}].prompt")
            if req.max_tokens < 0:
                raise ValueError(f"requests[{i}].max_tokens must not be negative")
            if req.max_tokens == 0:
                outputs[i] = Generation([], "", [], "length", 0)
            else:
                sampling = req.sampling if req.sampling and req.sampling.temperature > 0 else None
                key = (req.stop_token_ids, req.max_tokens, sampling, req.min_tokens)
                groups.setdefault(key, []).append(i)
        for (stops, max_tokens, sampling, min_tokens), members in groups.items():
            drawn: dict[str, Any] = {"min_tokens": min_tokens} if min_tokens else {}
            if sampling is not None:
                drawn |= {"temperature": sampling.temperature, "top_p": sampling.top_p}
                if sampling.seed is not None:
                    drawn["seed"] = sampling.seed
            choices = self._completions(
                [[int(t) for t in requests[i].prompt] for i in members],
                max_tokens=max_tokens,
                logprobs=0,
                return_tokens_as_token_ids=True,
                stop_token_ids=sorted(stops),
                skip_special_tokens=True,
                **drawn,
            )
            for i, choice in zip(members, choices, strict=True):
                outputs[i] = _generation(requests[i], choice)
        return [g for g in outputs if g is not None]


def _prompt(prompt: Sequence[int], what: str) -> list[int]:
    if not prompt:
        raise ValueError(f"{what} is empty: at least one token (e.g. BOS) is needed")
    return [int(t) for t in prompt]


def _token_id(s: str) -> int:
    # return_tokens_as_token_ids spells each token "token_id:<id>".
    if not s.startswith("token_id:"):
        raise VLLMError(f"expected a 'token_id:<id>' token, got {s!r}")
    return int(s[len("token_id:") :])


def _generation(req: GenerationRequest, choice: dict[str, Any]) -> Generation:
    """One completion choice as a `Generation`, cut at the first sentence end if asked."""
    lp = choice.get("logprobs") or {}
    tokens = [_token_id(s) for s in lp.get("tokens") or []]
    logprobs = [float(x) if x is not None else 0.0 for x in lp.get("token_logprobs") or []]
    offsets = [int(x) for x in lp.get("text_offset") or []]
    text = str(choice.get("text") or "")
    if offsets:
        # Offsets count from the completion's own text start.
        base = offsets[0]
        offsets = [o - base for o in offsets]
    ends = [*offsets[1:], len(text)]
    reason = choice.get("finish_reason")
    stop = choice.get("stop_reason")
    finish: FinishReason = "length"
    stop_token: int | None = None
    if reason == "stop":
        if isinstance(stop, int) and stop in req.stop_token_ids:
            finish, stop_token = "stop_token", stop
        else:
            finish = "eos"
        # vLLM lists the stop or end-of-generation token last; like the llama.cpp engine,
        # it is not part of the generation. An EOS adds no text (skip_special_tokens).
        start = ends[-2] if len(ends) > 1 else 0
        if tokens and (tokens[-1] == stop_token or (finish == "eos" and ends[-1] == start)):
            tokens, logprobs, ends = tokens[:-1], logprobs[:-1], ends[:-1]
    if req.stop_at_sentence_end:
        # The llama.cpp engine checks after each token: a sentence end wins over what follows.
        for n in range(1, len(tokens) + 1):
            if ends_sentence(text[: ends[n - 1]]):
                finish, stop_token = "sentence", None
                tokens, logprobs, ends = tokens[:n], logprobs[:n], ends[:n]
                break
    cut = ends[-1] if ends else 0
    return Generation(
        tokens=tokens,
        text=text[:cut],
        logprobs=logprobs[: len(tokens)],
        finish_reason=finish,
        prefill_tokens=len(req.prompt),
        stop_token=stop_token,
    )


def _glue_template(pieces: list[str], *, has_system: bool) -> str:
    """A Jinja chat template that renders [system?, user, assistant, user, ...] with the
    literal glue `pieces` read from the server (see pipeline.prompts.ChatGlue)."""

    def lit(s: str) -> str:
        return "{{ " + json.dumps(s) + " }}"

    if has_system:
        start, sys_to_user, a_start, a_to_user, _ = pieces
    else:
        start, a_start, a_to_user, _ = pieces
        sys_to_user = ""
    return (
        lit(start)
        + "{% for m in messages %}"
        + "{% if not loop.first %}"
        + "{% if m.role == 'assistant' %}" + lit(a_start)
        + "{% elif messages[loop.index0 - 1].role == 'system' %}" + lit(sys_to_user)
        + "{% else %}" + lit(a_to_user) + "{% endif %}"
        + "{% endif %}"
        + "{{ m.content }}"
        + "{% endfor %}"
        + "{% if add_generation_prompt %}" + lit(a_start) + "{% endif %}"
    )  # fmt: skip
