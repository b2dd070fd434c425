"""`selfrag train --export-gguf`: a copy of a model with the reflection tokens in its vocabulary.

The paper's reflection tokens (`[Retrieval]` … `[Utility:5]`), the `<paragraph>` markup and the
chat-layout marker `NATIVE_CHAT_LAYOUT` are appended to the vocabulary as control tokens (so no
text, trusted or not, tokenizes into them), and each reflection token's output row is the
learned head row of its label. The `native` critique then reads them through the model's own
softmax at the chat-layout positions; since the heads have no bias, the within-group
probabilities equal the `learned` critique's. Every other tensor and row is copied unchanged, so
ordinary text generation is unchanged too.

With tied embeddings (no `output.weight`, as in SmolLM2) a row is both the output row and the
token's input embedding: reflection tokens never appear as input in the chat layout. The
markup rows are zero. Only float token matrices (F32, F16, BF16) can be extended: export from an
F16 copy of a quantised model (`model.weights = "f16"`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import get_args

import gguf
import numpy as np

from selfrag.infra.file_lock import atomic_output
from selfrag.infra.models.heads_store import heads_matrix
from selfrag.infra.models.model_files import (
    DerivedFormat,
    ModelFileError,
    derived_path,
    file_sha256,
)
from selfrag.infra.models.model_presets import resolve_model
from selfrag.pipeline.critics import NATIVE_CHAT_LAYOUT, NATIVE_MARKUP, NATIVE_TOKENS
from selfrag.pipeline.heads import ReflectionHeads
from selfrag.schemas.settings import ModelSettings

CONTROL = int(gguf.TokenType.CONTROL)
_FLOAT_TYPES = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
}


def reflection_rows(heads: ReflectionHeads) -> list[tuple[str, np.ndarray | None]]:
    """The appended tokens in order, each with its output row (None: a zero row)."""
    rows: list[tuple[str, np.ndarray | None]] = []
    for group, pieces in NATIVE_TOKENS.items():
        w = heads_matrix(heads, group)
        labels = heads.groups[group].labels
        for label, piece in pieces.items():
            rows.append((piece, w[labels.index(label)]))
    rows += [(piece, None) for piece in (*NATIVE_MARKUP, NATIVE_CHAT_LAYOUT)]
    return rows


def engine_model_files(settings: ModelSettings, home: Path) -> list[Path]:
    """The model file `settings` names and every copy the engine derives from it (one per
    weight format, whether made yet or not): files an export must never replace."""
    source = resolve_model(settings, home)
    return [source, *(derived_path(source, fmt, home) for fmt in get_args(DerivedFormat))]


def check_export_target(target: Path, protected: Iterable[Path]) -> None:
    """ModelFileError when `target` is one of the `protected` files: the same path once links
    and `..` are resolved, or the same file under another name (a hard link, a bind mount)."""
    resolved = target.resolve()
    for path in protected:
        same = resolved == path.resolve()
        if not same and resolved.exists() and path.exists():
            same = os.path.samefile(resolved, path)
        if same:
            raise ModelFileError(
                f"refusing to export onto {target}: it is the model file {path} (or a copy "
                "the engine derives from it), which the export reads; choose another path"
            )


def _check_token_matrix(
    source: Path, name: str, t: gguf.ReaderTensor, n_vocab: int, hidden: int
) -> None:
    """Refuse a token matrix that cannot take new rows: not F32/F16, or of another shape."""
    if t.tensor_type not in _FLOAT_TYPES:
        raise ModelFileError(
            f"{source}: {name} is {t.tensor_type.name}; only F32/F16 token matrices can take "
            "new rows — export from an F16 copy (model.weights = 'f16')"
        )
    if int(t.shape[1]) != n_vocab or int(t.shape[0]) != hidden:
        raise ModelFileError(f"{source}: {name} has shape {list(t.shape)}")


def _with_rows(
    t: gguf.ReaderTensor,
    n_vocab: int,
    hidden: int,
    added: list[tuple[str, np.ndarray | None]],
    learned: bool,
) -> np.ndarray:
    """Token matrix `t` with one row per added token: its learned row when `learned` and it
    has one, else zeros."""
    base = np.asarray(t.data).reshape(n_vocab, hidden)
    extra = np.zeros((len(added), hidden), dtype=base.dtype)
    if learned:
        for i, (_, row) in enumerate(added):
            if row is not None:
                extra[i] = row.astype(base.dtype)
    return np.concatenate([base, extra])


def export_reflection_model(
    source: Path, heads: ReflectionHeads, target: Path, protected: Iterable[Path] = ()
) -> Path:
    """Write `target`: `source` with the reflection tokens and learned rows. Returns `target`.
    Refused before anything is written when `target` is `source` or one of `protected`
    (`engine_model_files`). The file appears whole or not at all, durably (fsynced, then
    renamed, then its folder fsynced), with the mode a new file gets under the umask."""
    check_export_target(target, [source, *protected])
    sha = file_sha256(source)
    heads.check_model(sha, None)
    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    added = reflection_rows(heads)
    clash = sorted({piece for piece, _ in added} & set(tokens))
    if clash:
        raise ModelFileError(f"{source} already has the tokens {clash}: export from the base model")
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors["token_embd.weight"]
    tied = "output.weight" not in tensors
    n_vocab = len(tokens)
    for name in ("token_embd.weight", *(() if tied else ("output.weight",))):
        _check_token_matrix(source, name, tensors[name], n_vocab, heads.hidden_size)

    def extended(name: str, learned: bool) -> np.ndarray:
        return _with_rows(tensors[name], n_vocab, heads.hidden_size, added, learned)

    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(target, mode=0o666 & ~current_umask()) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch=arch)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            value = field.contents()
            if key == "tokenizer.ggml.tokens":
                value = tokens + [piece for piece, _ in added]
            elif key == "tokenizer.ggml.token_type":
                value = types + [CONTROL] * len(added)
            elif key == f"{arch}.vocab_size":
                value = n_vocab + len(added)
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, field.types[0], sub_type=sub)
        writer.add_string("selfrag.reflection.base_sha256", sha)
        writer.add_string("selfrag.reflection.layout", "chat")
        for t in reader.tensors:
            if t.name == "token_embd.weight":
                data = extended(t.name, learned=tied)
            elif t.name == "output.weight":
                data = extended(t.name, learned=True)
            else:
                writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
                continue
            writer.add_tensor(t.name, data, raw_dtype=embd.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return target


def current_umask() -> int:
    """This process's umask, read without changing it where Linux shows it (/proc), since
    os.umask can only read it by setting it, a race with other threads creating files."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
