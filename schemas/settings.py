"""Deployment settings: where the model, index and caches live. Loaded by `infra.settings`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.calibration import CalibrationSettings
from schemas.decoding import DecodingConfig

WeightFormat = Literal["auto", "original", "bf16", "f16", "q8_0", "q4_0"]


class ModelSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        None, description="GGUF path or http(s) URL; default: the embedded SmolLM2-135M-Instruct."
    )
    weights: WeightFormat = Field(
        "auto",
        description="Derive a faster copy of the weights once and cache it; auto picks the fastest "
        "measured format for the model's original type.",
    )
    n_ctx: int = Field(
        8192, ge=512, le=131072, description="Total KV cells shared by all sequences."
    )
    n_seq_max: int = Field(16, ge=1, le=256, description="Sequences (branches) per context.")
    n_threads: int = Field(0, ge=0, description="0: all available cores.")
    n_batch: int = Field(2048, ge=32)


class RetrievalSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    qdrant_url: str | None = Field(
        None, description="Qdrant server URL; default: embedded on disk."
    )
    qdrant_api_key: str | None = None
    collection: str = "passages"
    embedding_model: str | None = Field(
        None,
        description="sentence-transformers model folder; default: the embedded all-MiniLM-L6-v2.",
    )
    hybrid: bool = Field(
        True,
        description="Fuse dense and BM25 sparse results with RRF (hit@1 0.72 vs 0.63 dense-only "
        "on the Normans questions, bench/retrieval.py).",
    )
    passage_words: int = Field(150, ge=20, le=2000, description="Long documents are split here.")
    passage_overlap_words: int = Field(30, ge=0, le=500)


class ServeSettings(BaseModel):
    """The HTTP endpoint (`selfrag serve`, `ray_app.py`)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Bind address; loopback unless asked otherwise.")
    port: int = Field(8000, ge=1, le=65535)
    max_batch_size: int = Field(
        16,
        ge=1,
        le=256,
        description="Critique calls of concurrent requests merged into one engine call "
        "(@serve.batch); 1 turns cross-request batching off.",
    )
    batch_wait_ms: float = Field(
        5.0, ge=0.0, le=1000.0, description="How long a batch waits to fill before it runs."
    )
    max_inflight: int = Field(
        32, ge=1, le=4096, description="Answers in progress per ingress replica; beyond: 503."
    )


class Settings(BaseModel):
    """Everything a deployment configures. Defaults < TOML file < SELFRAG_* environment."""

    model_config = ConfigDict(extra="forbid")

    home: Path = Field(description="Data folder: index, derived model files, caches.")
    model: ModelSettings = Field(default_factory=ModelSettings)
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings)
    decoding: DecodingConfig = Field(default_factory=DecodingConfig)
    calibration: CalibrationSettings = Field(
        default_factory=CalibrationSettings,
        description="Logistic calibration of the likelihood critique ($SELFRAG_HOME/"
        "calibration.toml, written by `selfrag calibrate`).",
    )
    serve: ServeSettings = Field(default_factory=ServeSettings)
    redis_url: str | None = None
