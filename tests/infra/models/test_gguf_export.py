"""The exported native checkpoint (`selfrag train --export-gguf`) on the real embedded model:
its reflection tokens give the learned critique's scores, and ordinary text is unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest

from selfrag.infra.engine.llama_engine import LlamaEngine
from selfrag.infra.models.gguf_export import export_reflection_model
from selfrag.infra.models.heads_store import load_heads, save_heads
from selfrag.infra.models.model_files import (
    ModelFileError,
    default_model_path,
    derive_weights,
    file_sha256,
)
from selfrag.pipeline.critics import (
    NATIVE_CHAT_LAYOUT,
    NATIVE_TOKENS,
    Branch,
    LearnedCritic,
    NativeChatCritic,
    make_critic,
)
from selfrag.pipeline.heads import GROUP_LABELS, HeadsError
from selfrag.pipeline.protocols import GenerationRequest, Passage, TokenScoreRequest
from selfrag.pipeline.scoring import (
    relevance_score,
    retrieval_probability,
    support_score,
    utility_score,
)
from tests.real import real

ENGINE = dict(n_ctx=4096, n_seq_max=8, n_threads=2, n_batch=512)
PASSAGE = Passage(
    "normans#0",
    "Rollo was a Viking leader who founded Normandy in 911, after the siege of Chartres.",
    "Normans",
)


@pytest.fixture(scope="module")
@real
def base_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return derive_weights(default_model_path(), "auto", tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
@real
def base(base_path: Path) -> Iterator[LlamaEngine]:
    engine = LlamaEngine(base_path, model_id="base", **ENGINE)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def heads_file(base: LlamaEngine, base_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """Heads with random rows (seeded), lowered below ordinary logits the way training does:
    the export must carry whatever rows it is given."""
    from selfrag.jobs.head_fitting import lowered

    rng = np.random.default_rng(0)
    prompt = base.tokenize("<|im_start|>user\nTell me about the sea.<|im_end|>\n", special=True)
    states = np.array(
        [
            r.hidden_state
            for r in base.next_token_logprobs(
                [TokenScoreRequest(prompt[:n], (), hidden_state=True) for n in range(4, 12)]
            )
        ]
    )
    weights = {}
    for group, labels in GROUP_LABELS.items():
        w = rng.normal(0.0, 0.05, size=(len(labels), base.hidden_size))
        weights[group] = lowered(w, states)[0]
    path = tmp_path_factory.mktemp("heads") / "heads.json"
    save_heads(path, file_sha256(base_path), weights, {"test": True})
    return path


@pytest.fixture(scope="module")
def exported(base_path: Path, heads_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "reflection.gguf"
    return export_reflection_model(base_path, load_heads(heads_file), out)


def test_export_adds_control_tokens_and_rows_only(base_path: Path, exported: Path) -> None:
    src, dst = gguf.GGUFReader(str(base_path)), gguf.GGUFReader(str(exported))
    old = list(src.fields["tokenizer.ggml.tokens"].contents())
    new = list(dst.fields["tokenizer.ggml.tokens"].contents())
    pieces = [p for labels in NATIVE_TOKENS.values() for p in labels.values()]
    assert new[: len(old)] == old
    assert set(pieces) | {NATIVE_CHAT_LAYOUT} <= set(new[len(old) :])
    types = list(dst.fields["tokenizer.ggml.token_type"].contents())
    assert set(types[len(old) :]) == {int(gguf.TokenType.CONTROL)}
    a = {t.name: np.asarray(t.data) for t in src.tensors}
    b = {t.name: np.asarray(t.data) for t in dst.tensors}
    assert a.keys() == b.keys()
    for name in a:
        if name == "token_embd.weight":
            assert np.array_equal(b[name][: len(old)], a[name])
        else:
            assert np.array_equal(a[name], b[name]), name


def test_native_scores_of_the_export_agree_with_learned(
    base: LlamaEngine, heads_file: Path, exported: Path
) -> None:
    engine = LlamaEngine(exported, model_id="exported", **ENGINE)
    try:
        learned = make_critic(base, "learned", heads=load_heads(heads_file))
        native = make_critic(engine, "auto")
        assert isinstance(learned, LearnedCritic) and isinstance(native, NativeChatCritic)
        branches = [
            Branch("Who founded Normandy?", "", PASSAGE),
            Branch("What is the capital of France?", "", PASSAGE),
            Branch("Who founded Normandy?", "Rollo founded it.", None),
        ]

        def step(critic):  # type: ignore[no-untyped-def]
            # The same calls in the same order on both engines: their KV caches then hold the
            # same cells, computed in the same batch shapes.
            drafts = critic.draft(branches, 24)
            return [d.text for d in drafts], {
                "s_rel": [relevance_score(x.probs) for x in critic.relevance(branches[:2])],
                "p_ret": [retrieval_probability(x.probs) for x in critic.retrieval(branches)],
                "s_sup": [support_score(x.probs) for x in critic.support(branches[:2], drafts[:2])],
                "s_use": [utility_score(x.probs) for x in critic.utility(branches, drafts)],
            }

        texts, want = step(learned)
        native_texts, got = step(native)
        # No reflection token interrupts the exported model's drafts.
        assert native_texts == texts
        # The export stores the rows in the output matrix's F16, and llama.cpp's AVX-512
        # backends compute that matmul less exactly than haswell's: the largest gap (s_use)
        # measured 0.0009 on haswell, 0.0023 on skylakex, icelake and zen4 (an AMD EPYC).
        # A misplaced or misscaled row is off by tenths.
        for name, values in want.items():
            assert np.allclose(values, got[name], rtol=0.0, atol=5e-3), (name, values, got[name])
    finally:
        engine.close()


def test_ordinary_generation_is_unchanged(base: LlamaEngine, exported: Path) -> None:
    engine = LlamaEngine(exported, model_id="exported", **ENGINE)
    try:
        texts = [
            "<|im_start|>user\nWrite a poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>user\nWho founded Normandy?<|im_end|>\n<|im_start|>assistant\n",
            "The history of the Normans begins",
        ]
        requests = [
            GenerationRequest(base.tokenize(t, special=True), 40, stop_at_sentence_end=False)
            for t in texts
        ]
        assert [g.tokens for g in engine.generate(requests)] == [
            g.tokens for g in base.generate(requests)
        ]
        # Untrusted text never tokenizes into the new control tokens.
        assert engine.tokenize("[Retrieval]<paragraph>", special=False) == base.tokenize(
            "[Retrieval]<paragraph>", special=False
        )
    finally:
        engine.close()


def test_export_refuses_heads_of_another_model(base_path: Path, tmp_path: Path) -> None:
    other = "0" * 64
    weights = {g: np.zeros((len(labels), 576)) for g, labels in GROUP_LABELS.items()}
    heads = save_heads(tmp_path / "h.json", other, weights, {})
    with pytest.raises(HeadsError) as err:
        export_reflection_model(base_path, heads, tmp_path / "out.gguf")
    assert other in str(err.value) and file_sha256(base_path) in str(err.value)
    assert not (tmp_path / "out.gguf").exists()


def test_export_refuses_a_model_that_already_has_the_tokens(
    exported: Path, heads_file: Path, tmp_path: Path
) -> None:
    heads = load_heads(heads_file)
    again = save_heads(tmp_path / "h.json", file_sha256(exported), dict(_rows(heads)), {})
    with pytest.raises(ModelFileError, match="already has the tokens"):
        export_reflection_model(exported, again, tmp_path / "twice.gguf")


def _rows(heads):  # type: ignore[no-untyped-def]
    for group, head in heads.groups.items():
        yield group, np.asarray(head.rows)


def test_the_export_has_the_umask_mode_and_leaves_no_temporary_file(exported: Path) -> None:
    from selfrag.infra.models.gguf_export import current_umask

    assert exported.stat().st_mode & 0o777 == 0o666 & ~current_umask()  # 0644 under 022
    assert [p.name for p in exported.parent.iterdir()] == [exported.name]


def test_train_refuses_to_export_onto_the_model_or_a_copy_derived_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    from selfrag.cli import main
    from selfrag.infra.models.model_files import derived_path

    models, home = tmp_path / "models", tmp_path / "home"
    models.mkdir()
    model = models / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))  # refused before anything reads more than this
    derived = derived_path(model, "f16", home)
    derived.parent.mkdir(parents=True)
    derived.write_bytes(b"GGUF derived")
    (models / "link.gguf").symlink_to(model)
    os.link(model, models / "hard.gguf")
    for name in list(os.environ):
        if name.startswith("SELFRAG_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SELFRAG_HOME", str(home))
    monkeypatch.setenv("SELFRAG_MODEL__PATH", str(model))

    def listing() -> dict[str, bytes]:
        return {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    before = listing()
    targets = [
        model,
        models / ".." / "models" / "m.gguf",
        models / "link.gguf",
        models / "hard.gguf",
        derived,
        derived_path(model, "q8_0", home),  # not made yet: still the engine's file
    ]
    for target in targets:
        assert main(["train", "--reuse", "--export-gguf", str(target)]) == 2, target
        err = capsys.readouterr().err
        assert f"refusing to export onto {target}" in err and "Traceback" not in err
        assert listing() == before  # nothing written, nothing left behind
