"""Convert a sentence-transformers BERT folder (safetensors weights, WordPiece vocabulary) into a
GGUF file that llama.cpp runs as an embedding model, without torch.

What the folder computes is read from its own files: `config.json` (the BERT shape),
`1_Pooling/config.json` (mean or CLS pooling), `sentence_bert_config.json` (the longest input in
word pieces), `tokenizer_config.json` (lower-casing, accent stripping) and `vocab.txt`.
`BertFolder` describes it; `convert_bert` writes the GGUF file. Tensor names come from the
`gguf` package's own map of Hugging Face names to llama.cpp's (`gguf.TensorNameMap`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from selfrag.infra.corpus.bounded_reads import load_json
from selfrag.infra.models.model_files import (
    FTYPE_ALL_F32,
    FTYPE_MOSTLY_BF16,
    FTYPE_MOSTLY_F16,
    ModelFileError,
)

BertFormat = Literal["f32", "f16", "bf16"]
BERT_FORMATS: tuple[BertFormat, ...] = get_args(BertFormat)
CONVERTER_VERSION = 2
"""Part of the converted file's name: a change to what `convert_bert` writes converts again."""

_FTYPES: dict[BertFormat, int] = {
    "f32": FTYPE_ALL_F32,
    "f16": FTYPE_MOSTLY_F16,
    "bf16": FTYPE_MOSTLY_BF16,
}
# Hugging Face tensors llama.cpp does not use for embeddings (position ids are implicit; the
# pooler is a CLS-classification head sentence-transformers does not apply).
_UNUSED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")
_SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
)
_F32_ALWAYS = ("token_types.weight", "position_embd.weight")
_POOLING = {"pooling_mode_mean_tokens": 1, "pooling_mode_cls_token": 2}  # gguf.PoolingType
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64}
# The safetensors format's own bound on its JSON header.
MAX_SAFETENSORS_HEADER = 100_000_000
# The same leaf files the folder's identity hashes (`infra.embeddings.embedder`), besides the
# weights.
TOKENIZER_FILES = ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class BertFolder:
    """A sentence-transformers folder holding a BERT model, as far as embedding needs."""

    path: Path
    config: dict[str, Any]
    pooling: int
    """llama.cpp's pooling type: 1 mean, 2 CLS."""
    max_seq_length: int
    """The longest input in word pieces, [CLS] and [SEP] included (longer ones are cut)."""
    lowercase: bool
    strip_accents: bool
    normalize: bool
    """Whether the folder's pipeline ends with a Normalize module (unit-length vectors)."""

    @property
    def dim(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def weights(self) -> Path:
        return self.path / "model.safetensors"

    @classmethod
    def read(cls, path: Path) -> BertFolder:
        """Describe `path`; ModelFileError when it is not a BERT sentence-transformers folder
        this converter can read (it names the file and what is missing)."""
        config = _json(path / "config.json")
        if config.get("model_type") != "bert":
            raise ModelFileError(
                f"{path / 'config.json'}: model_type {config.get('model_type')!r}; only BERT "
                "sentence-transformers models can be converted for llama.cpp"
            )
        missing = [k for k in _SHAPE_KEYS if not isinstance(config.get(k), int)]
        if missing:
            raise ModelFileError(f"{path / 'config.json'} lacks the BERT sizes {missing}")
        if not (path / "model.safetensors").is_file():
            raise ModelFileError(f"{path} has no model.safetensors (the weights to convert)")
        if not (path / "vocab.txt").is_file():
            raise ModelFileError(f"{path} has no vocab.txt (the WordPiece vocabulary)")
        modules = _json(path / "modules.json") if (path / "modules.json").is_file() else []
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        unknown = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
        if unknown:
            raise ModelFileError(f"{path}: modules {unknown} cannot be run by llama.cpp")
        pooling_file = path / "1_Pooling" / "config.json"
        pooling_config = _json(pooling_file) if pooling_file.is_file() else {}
        chosen = [p for key, p in _POOLING.items() if pooling_config.get(key)]
        others = [k for k, v in pooling_config.items() if k.startswith("pooling_mode") and v]
        if len(others) > 1 or (others and not chosen):
            raise ModelFileError(f"{pooling_file}: pooling {others} is not mean or CLS alone")
        st_config = path / "sentence_bert_config.json"
        max_seq = int(_json(st_config).get("max_seq_length", 0)) if st_config.is_file() else 0
        max_seq = min(max_seq or 512, int(config.get("max_position_embeddings", 512)))
        tok_file = path / "tokenizer_config.json"
        tok = _json(tok_file) if tok_file.is_file() else {}
        lowercase = bool(tok.get("do_lower_case", True))
        # Hugging Face's BERT tokenizer strips accents when asked, or by default when it
        # lower-cases (strip_accents None).
        strip = tok.get("strip_accents")
        return cls(
            path=path,
            config=config,
            pooling=chosen[0] if chosen else 1,
            max_seq_length=max_seq,
            lowercase=lowercase,
            strip_accents=lowercase if strip is None else bool(strip),
            normalize="Normalize" in kinds,
        )

    def vocabulary(self) -> list[str]:
        return (self.path / "vocab.txt").read_text(encoding="utf-8").splitlines()

    def special_tokens(self) -> dict[str, str]:
        """{"cls": "[CLS]", "sep": …, "unk": …, "pad": …, "mask": …} as the folder names them."""
        names = {"cls": "[CLS]", "sep": "[SEP]", "unk": "[UNK]", "pad": "[PAD]", "mask": "[MASK]"}
        mapping = self.path / "special_tokens_map.json"
        if mapping.is_file():
            for kind, value in _json(mapping).items():
                token = value.get("content") if isinstance(value, dict) else value
                if kind.endswith("_token") and isinstance(token, str):
                    names[kind.removesuffix("_token")] = token
        return names


def convert_bert(folder: BertFolder, target: Path, fmt: BertFormat) -> None:
    """Write `folder`'s model to `target` as a GGUF file of llama.cpp's `bert` architecture:
    weight matrices in `fmt`; biases, norms, position and token-type rows in F32; the
    WordPiece vocabulary in llama.cpp's form (a word-initial piece is prefixed with U+2581, a
    `##` continuation loses its `##`)."""
    import gguf

    c = folder.config
    n_layers = int(c["num_hidden_layers"])
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.BERT, n_layers)
    tensors = read_safetensors(folder.weights)
    writer = gguf.GGUFWriter(str(target), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT])
    writer.add_name(folder.path.parent.name if folder.path.name == "model" else folder.path.name)
    writer.add_file_type(_FTYPES[fmt])
    writer.add_context_length(int(c["max_position_embeddings"]))
    writer.add_embedding_length(folder.dim)
    writer.add_feed_forward_length(int(c["intermediate_size"]))
    writer.add_block_count(n_layers)
    writer.add_head_count(int(c["num_attention_heads"]))
    writer.add_layer_norm_eps(float(c.get("layer_norm_eps", 1e-12)))
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(folder.pooling))
    _add_vocabulary(writer, folder)
    for name, array in tensors.items():
        name = name.removeprefix("bert.")
        if name in _UNUSED:
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ModelFileError(f"{folder.weights}: no llama.cpp tensor for {name!r}")
        data = array.astype(np.float32)
        # Only the matrices that are multiplied or looked up: llama.cpp adds the token-type
        # row to the embeddings as it is, and ggml cannot add F16 to F32.
        if data.ndim != 2 or gguf_name in _F32_ALWAYS or fmt == "f32":
            writer.add_tensor(gguf_name, data)
        elif fmt == "f16":
            writer.add_tensor(gguf_name, data.astype(np.float16))
        else:
            bf16 = gguf.GGMLQuantizationType.BF16
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, bf16), raw_dtype=bf16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_vocabulary(writer: Any, folder: BertFolder) -> None:
    import gguf

    vocab = folder.vocabulary()
    if len(vocab) != int(folder.config.get("vocab_size", len(vocab))):
        raise ModelFileError(
            f"{folder.path / 'vocab.txt'} has {len(vocab)} pieces, config.json says "
            f"{folder.config.get('vocab_size')}"
        )
    special = folder.special_tokens()
    ids = {piece: i for i, piece in enumerate(vocab)}
    missing = [t for t in special.values() if t not in ids]
    if missing:
        raise ModelFileError(f"{folder.path / 'vocab.txt'} lacks the special pieces {missing}")
    control = set(special.values())
    pieces, types = [], []
    for piece in vocab:
        if piece in control:
            pieces.append(piece)
            types.append(gguf.TokenType.CONTROL)
            continue
        pieces.append(piece[2:] if piece.startswith("##") else "\u2581" + piece)
        types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(pieces)
    writer.add_token_types(types)
    writer.add_token_type_count(int(folder.config.get("type_vocab_size", 1)))
    # [CLS] text [SEP]: llama.cpp's `bert` vocabulary adds the BOS and the SEP token.
    writer.add_bos_token_id(ids[special["cls"]])
    writer.add_sep_token_id(ids[special["sep"]])
    writer.add_unk_token_id(ids[special["unk"]])
    writer.add_pad_token_id(ids[special["pad"]])
    writer.add_mask_token_id(ids[special["mask"]])
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)
    writer.add_add_eos_token(False)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a `.safetensors` file as numpy arrays (memory-mapped, read-only).

    The format: an 8-byte little-endian header length, a JSON header naming each tensor's
    dtype, shape and byte range in the data that follows. A header that does not describe
    tensors lying within the file is a `ModelFileError` naming the file.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > min(size - 8, MAX_SAFETENSORS_HEADER):
                raise ModelFileError(
                    f"unreadable safetensors file {path}: a header of {length} bytes in a file "
                    f"of {size}"
                )
            header = load_json(fh.read(length).decode("utf-8"), max_depth=8)
        if not isinstance(header, dict):
            raise ModelFileError(f"unreadable safetensors file {path}: the header is not an object")
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + length)
    except ModelFileError:
        raise
    except (OSError, ValueError, struct.error) as exc:
        raise ModelFileError(f"unreadable safetensors file {path}: {exc}") from exc
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name != "__metadata__":
            out[name] = _tensor(path, name, info, data)
    return out


def _tensor(path: Path, name: str, info: object, data: np.ndarray) -> np.ndarray:
    """One tensor of a safetensors header, checked against the data it points into."""
    if not isinstance(info, dict):
        raise ModelFileError(f"{path}: tensor {name} is described by {type(info).__name__}")
    dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise ModelFileError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
    offsets, shape = info.get("data_offsets"), info.get("shape")
    if not _ints(offsets, 2) or not _ints(shape):
        raise ModelFileError(
            f"{path}: tensor {name} needs data_offsets [start, end] and a shape of "
            f"non-negative integers, got {offsets!r} and {shape!r}"
        )
    start, end = offsets
    count = int(np.prod(shape, dtype=object))
    if not start <= end <= len(data) or end - start != count * np.dtype(dtype).itemsize:
        raise ModelFileError(
            f"{path}: tensor {name} of shape {tuple(shape)} ({info['dtype']}) at bytes "
            f"{start}..{end} does not fit the {len(data)} bytes of data"
        )
    return data[start:end].view(dtype).reshape(shape)


def _ints(value: object, length: int | None = None) -> bool:
    """Whether `value` is a list of non-negative ints (of `length` items, when given)."""
    return (
        isinstance(value, list)
        and (length is None or len(value) == length)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    )


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelFileError(f"{path} is missing") from exc
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"unreadable {path}: {exc}") from exc
