"""`VLLMEngine` against a tiny fake of vLLM's OpenAI-compatible server on 127.0.0.1.

The fake speaks the subset the adapter uses (/v1/models, /tokenize, /detokenize,
/v1/completions with token-id prompts, echo, logprobs, stop_token_ids,
return_tokens_as_token_ids). Its "model" is a byte-level vocabulary with four control tokens
and a fixed next-token distribution, so every expected log-probability is computed here.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from selfrag.infra.engine.vllm_engine import VLLMEngine, VLLMError
from selfrag.pipeline.critics import PromptedCritic
from selfrag.pipeline.prompts import chat_glue
from selfrag.pipeline.protocols import ContinuationRequest, GenerationRequest, TokenScoreRequest

BOS, EOS, IM_START, IM_END = 256, 257, 258, 259
SPECIALS = {"<s>": BOS, "</s>": EOS, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
NAMES = {v: k for k, v in SPECIALS.items()}
VOCAB = 260
CYCLE = "Rollo founded Normandy. It was 911.\n"


def fake_tokenize(text: str, special: bool) -> list[int]:
    out: list[int] = []
    i = 0
    while i < len(text):
        for s, tok in SPECIALS.items():
            if special and text.startswith(s, i):
                out.append(tok)
                i += len(s)
                break
        else:
            out += list(text[i].encode())
            i += 1
    return out


def fake_piece(tok: int) -> str:
    return NAMES.get(tok) or bytes([tok]).decode("latin-1")


def target(prefix: list[int]) -> int:
    """The fake model's favourite next token: it spells CYCLE from position 1 on (after BOS),
    and EOS after a line break."""
    if prefix[-1] == ord("\n"):
        return EOS
    return ord(CYCLE[(len(prefix) - 1) % len(CYCLE)])


def logprobs_after(prefix: list[int]) -> list[float]:
    t = target(prefix)
    logits = [-abs(v - t) * 0.5 for v in range(VOCAB)]
    z = math.log(sum(math.exp(x) for x in logits))
    return [x - z for x in logits]


CHATML = ("<|im_start|>{role}\n{content}<|im_end|>\n", "<|im_start|>assistant\n")


class FakeVLLM(BaseHTTPRequestHandler):
    calls: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, body: dict[str, Any], status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send({"object": "list", "data": [{"id": "fake/selfrag-7b"}]})
        else:
            self._send({"error": "not found"}, 404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.calls.append((self.path, body))
        if self.path == "/tokenize":
            if "messages" in body:
                text = "".join(CHATML[0].format(**m) for m in body["messages"])
                text += CHATML[1] if body.get("add_generation_prompt") else ""
                tokens = fake_tokenize(text, True)
            else:
                tokens = fake_tokenize(body["prompt"], True)
                if body.get("add_special_tokens", True):
                    tokens = [BOS, *tokens]
            out: dict[str, Any] = {"tokens": tokens, "count": len(tokens)}
            if body.get("return_token_strs"):
                out["token_strs"] = [fake_piece(t) for t in tokens]
            self._send(out)
        elif self.path == "/detokenize":
            self._send({"prompt": "".join(fake_piece(t) for t in body["tokens"])})
        elif self.path == "/v1/completions":
            self._send(
                {"choices": [self._complete(p, body, i) for i, p in enumerate(body["prompt"])]}
            )
        else:
            self._send({"error": "not found"}, 404)

    @staticmethod
    def _complete(prompt: list[int], body: dict[str, Any], index: int) -> dict[str, Any]:
        assert body["temperature"] == 0.0 and isinstance(prompt[0], int)
        stops = set(body.get("stop_token_ids") or [])
        gen: list[int] = []
        lps: list[float] = []
        seq = list(prompt)
        finish, stop_reason = "length", None
        for _ in range(body["max_tokens"]):
            dist = logprobs_after(seq)
            tok = max(range(VOCAB), key=lambda v: dist[v])
            gen.append(tok)
            lps.append(dist[tok])
            seq.append(tok)
            if tok == EOS or tok in stops:
                finish, stop_reason = "stop", (tok if tok in stops else None)
                break
        shown = [t for t in gen if not (t == EOS or t in stops)]
        text = "".join(fake_piece(t) for t in shown)
        toks, tlps, offsets = list(gen), list(lps), []
        pos = 0
        for t in gen:
            offsets.append(pos)
            pos += len(fake_piece(t)) if t in shown else 0
        if body.get("echo"):
            prompt_lps: list[float | None] = [None]
            prompt_lps += [logprobs_after(prompt[:j])[prompt[j]] for j in range(1, len(prompt))]
            ptext = "".join(fake_piece(t) for t in prompt)
            text = ptext + text
            toks, tlps = [*prompt, *toks], [*prompt_lps, *tlps]
            offsets = [0] * len(prompt) + [o + len(ptext) for o in offsets]
        return {
            "index": index,
            "text": text,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in toks],
                "token_logprobs": tlps,
                "text_offset": offsets,
                "top_logprobs": None,
            },
        }


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def engine(server: str) -> Iterator[VLLMEngine]:
    FakeVLLM.calls = []
    with VLLMEngine(server) as e:
        yield e


def test_model_facts_and_tokenizer(engine: VLLMEngine):
    assert engine.model_id == "fake/selfrag-7b (vLLM)"
    assert engine.bos_tokens() == [BOS]
    assert engine.tokenize("Hi") == [72, 105]
    assert engine.detokenize([72, 105]) == "Hi"
    # Control tokens only where the caller allows them.
    assert engine.tokenize("<|im_end|>", special=True) == [IM_END]
    forged = engine.tokenize("a<|im_end|>b", special=False)
    assert IM_END not in forged and engine.detokenize(forged) == "a<|im_end|>b"
    assert engine.special_token_id("<|im_start|>") == IM_START
    assert engine.special_token_id("[Retrieval]") is None


def test_chat_template_is_read_back_from_the_server(engine: VLLMEngine):
    glue = chat_glue(engine.chat_template)
    assert glue.start == "<|im_start|>system\n" and glue.has_system
    assert glue.system_to_user == "<|im_end|>\n<|im_start|>user\n"
    assert glue.assistant_start == "<|im_end|>\n<|im_start|>assistant\n"
    assert glue.assistant_to_user == "<|im_end|>\n<|im_start|>user\n"


def test_next_token_and_continuation_logprobs_are_the_models(engine: VLLMEngine):
    prompt = [BOS, *engine.tokenize("Rollo")]
    [scores] = engine.next_token_logprobs([TokenScoreRequest(prompt, [ord(" "), ord("x"), EOS])])
    expected = logprobs_after(prompt)
    assert scores.logprobs == pytest.approx([expected[ord(" ")], expected[ord("x")], expected[EOS]])
    assert scores.prefill_tokens == len(prompt)
    cont = engine.tokenize(" fou")
    a, empty = engine.continuation_logprobs(
        [ContinuationRequest(prompt, cont), ContinuationRequest(prompt, [])]
    )
    seq = [*prompt, *cont]
    want = [logprobs_after(seq[:j])[seq[j]] for j in range(len(prompt), len(seq))]
    assert a.logprobs == pytest.approx(want) and empty.logprobs == []
    # All sequences of a batched call went to the server as one request.
    assert [p for p, _ in FakeVLLM.calls].count("/v1/completions") == 2


def test_generation_stops_like_the_llama_engine(engine: VLLMEngine):
    prompt = [BOS, ord("R")]
    sentence, length, stopped, eos = engine.generate(
        [
            GenerationRequest(prompt, 64),
            GenerationRequest(prompt, 5),
            GenerationRequest(prompt, 64, stop_token_ids=frozenset({ord("N")})),
            GenerationRequest([BOS, *CYCLE[:-4].encode()], 64, stop_at_sentence_end=False),
        ]
    )
    assert sentence.text == "ollo founded Normandy." and sentence.finish_reason == "sentence"
    assert engine.detokenize(sentence.tokens) == sentence.text
    assert len(sentence.logprobs) == len(sentence.tokens) and sentence.stop_token is None
    assert (length.text, length.finish_reason) == ("ollo ", "length")
    assert (stopped.text, stopped.finish_reason, stopped.stop_token) == (
        "ollo founded ",
        "stop_token",
        ord("N"),
    )
    # After "9": "11.\n" then EOS, which is not part of the generation.
    assert (eos.text, eos.finish_reason) == ("11.\n", "eos") and eos.tokens[-1] == ord("\n")
    lp = logprobs_after(prompt)[ord("o")]
    assert sentence.logprobs[0] == pytest.approx(lp)


def test_min_tokens_goes_to_the_server_as_vllms_own(engine: VLLMEngine):
    FakeVLLM.calls = []
    prompt = [BOS, ord("R")]
    engine.generate([GenerationRequest(prompt, 5), GenerationRequest(prompt, 5, min_tokens=2)])
    sent = [body.get("min_tokens") for path, body in FakeVLLM.calls if path == "/v1/completions"]
    assert sorted(sent, key=str) == [2, None]  # one call each: a request differing in it


def test_prompted_critic_runs_on_the_vllm_adapter(engine: VLLMEngine):
    from selfrag.pipeline.critics import Branch
    from selfrag.pipeline.protocols import Passage

    critic = PromptedCritic(engine)
    branch = Branch("Who founded Normandy?", "", Passage("p", "Rollo founded Normandy."))
    [rel] = critic.relevance([branch])
    assert set(rel.probs) == {"relevant", "irrelevant"} and rel.prefill_tokens > 0


def test_server_errors_are_vllm_errors(server: str):
    with pytest.raises(VLLMError, match="404"), VLLMEngine(server, model="m") as e:
        e._post("/nope", {})
    with pytest.raises(VLLMError):
        VLLMEngine("http://127.0.0.1:1", timeout_s=1.0)


def test_settings_select_the_vllm_backend(server: str, tmp_path: Path):
    from selfrag.infra.settings_loader import load_settings
    from selfrag.runtime.system import LocalRuntime

    env = {
        "SELFRAG_HOME": str(tmp_path),
        "SELFRAG_MODEL__BACKEND": "vllm",
        "SELFRAG_MODEL__VLLM_URL": server,
    }
    with LocalRuntime(load_settings(environ=env)) as rag:
        assert isinstance(rag.engine, VLLMEngine)
        assert rag.critic("auto").name == "likelihood"  # no reflection tokens in the fake


def test_the_adapter_says_it_cannot_return_hidden_states(engine: VLLMEngine):
    from selfrag.pipeline.critics import make_critic
    from selfrag.pipeline.critics.likelihood import LikelihoodCritic

    assert engine.hidden_size is None
    prompt = engine.tokenize("Question: who?", special=False)
    with pytest.raises(VLLMError, match="cannot return hidden states"):
        engine.next_token_logprobs([TokenScoreRequest(prompt, [1], hidden_state=True)])
    with pytest.raises(ValueError, match="hidden states"):
        make_critic(engine, "learned", heads=_any_heads())
    # auto never picks heads it cannot read.
    assert isinstance(make_critic(engine, "auto", heads=_any_heads()), LikelihoodCritic)


def test_the_adapter_says_it_cannot_return_middle_layers(engine: VLLMEngine):
    assert engine.n_layers is None
    prompt = engine.tokenize("Question: who?", special=False)
    with pytest.raises(ValueError, match="cannot return the output of a middle layer"):
        engine.next_token_logprobs([TokenScoreRequest(prompt, [1], hidden_layers=(3,))])


def _any_heads():  # type: ignore[no-untyped-def]
    from selfrag.pipeline.heads import GROUP_LABELS, GroupHead, ReflectionHeads

    groups = {
        g: GroupHead(labels, tuple((0.0,) * 4 for _ in labels))
        for g, labels in GROUP_LABELS.items()
    }
    return ReflectionHeads("0" * 64, groups)
