"""Deployment settings: where the model, index and caches live. Loaded by
`infra.settings_loader`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Secret,
    SecretStr,
    StringConstraints,
)

from selfrag.schemas.calibration import CalibrationSettings
from selfrag.schemas.decoding import DecodingConfig

WeightFormat = Literal["auto", "original", "bf16", "f16", "q8_0", "q4_0"]
EmbeddingFormat = Literal["auto", "f32", "f16", "bf16"]
"""The converted embedding model's weights; `auto` picks by CPU (`retrieval.embedding_format`)."""
Backend = Literal["llama_cpp", "vllm"]
# The model presets (infra/models/model_presets.py holds their files, checksums and licenses).
ModelPresetName = Literal["smollm2", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
# The preset served when settings name none, chosen by measurement (notes/evaluation.md,
# "Choosing the default model"): the best held-out overall among the presets whose warm p50
# per answer stays within 3x SmolLM2's. Its weights are always installed (scripts/install.sh).
DEFAULT_PRESET: ModelPresetName = "qwen2.5-coder-0.5b"
WaitPolicy = Literal["passive", "active", "inherit"]
SupportRead = Literal["verify", "source"]
HybridFusion = Literal["rrf", "dbsf"]
"""How a hybrid search fuses its dense and BM25 hits: reciprocal rank fusion, or Qdrant's
distribution-based score fusion (each list's scores scaled by its mean and three standard
deviations, then summed)."""

MASK = "**********"
COLLECTION_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""What a collection may be called: also a folder name, so no path separators or `..`."""
DEFAULT_COLLECTION = "passages"
# Defaults of the bounds on reading one file (`infra.corpus.formats.ReadLimits`): a dense page
# of a real document is a few thousand characters, a long book's text a few megabytes, and
# pypdf reads a thousand ordinary pages in well under a minute.
MAX_DOCUMENT_BYTES = 10_000_000
MAX_PAGE_CHARS = 100_000
READ_TIMEOUT_S = 120.0
"""The collection a home uses unless told otherwise (`retrieval.collection`)."""


def mask_url(url: str) -> str:
    """`url` with its password (userinfo or `?password=`) replaced by `MASK`."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            user = parts.username or ""
            host = netloc.rpartition("@")[2]
            netloc = f"{user}:{MASK}@{host}"
        query = parts.query
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k == "password" for k, _ in pairs):
            masked = [(k, MASK if k == "password" else v) for k, v in pairs]
            query = urlencode(masked, safe="*")
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:  # not parseable as a URL: show nothing of it
        return MASK


class SecretUrl(Secret[str]):
    """A URL that may carry a password (e.g. `redis://:pw@host:6379/0`): reprs, logs and
    `model_dump(mode="json")` show it with the password masked; `get_secret_value()` is the
    URL itself."""

    def _display(self) -> str:
        # pydantic's documented hook for how a `Secret` shows (repr, str, JSON dump).
        return mask_url(self.get_secret_value())


def _blank_is_none(value: Any) -> Any:
    """An empty secret (e.g. an empty TOML string) means "not set"."""
    return None if isinstance(value, str) and not value.strip() else value


BlankIsUnset = BeforeValidator(_blank_is_none)
"""Marks an optional secret field (`Annotated[...]`) whose empty value means unset."""


class ModelSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    preset: ModelPresetName = Field(
        DEFAULT_PRESET,
        description="The model by name (`selfrag models` lists them and what is installed): "
        "smollm2 (SmolLM2-135M-Instruct Q4_1), qwen2.5-coder-0.5b or qwen2.5-coder-1.5b "
        "(Qwen2.5-Coder-0.5B/1.5B-Instruct Q4_K_M; install with "
        "`SELFRAG_MODELS=qwen2.5-coder-0.5b bash scripts/install.sh`).",
    )
    path: str | None = Field(
        None, description="Any GGUF file or http(s) URL; overrides `preset` when set."
    )
    weights: WeightFormat = Field(
        "auto",
        description="Derive a faster copy of the weights once and cache it; auto picks the fastest "
        "measured format for the model's original type.",
    )
    heads: Path | None = Field(
        None,
        description="Reflection heads file for the learned critique (`selfrag train`); default: "
        "the heads trained for the model file ($SELFRAG_HOME/heads/<sha256>.json), else those "
        "shipped for the embedded default.",
    )
    calibrate_on_first_use: bool = Field(
        True,
        description="`selfrag ask` fits the support threshold on the index once (minutes, "
        "with a progress bar) when the model file has none for the "
        "critique source in use; false: the source's constant, with a warning.",
    )
    answerability: bool = Field(
        True,
        description="Take s_sup from the answerability model fitted for the model file and "
        "critique source (`selfrag train --answerability`, or shipped), when there is one; "
        "false: the source's own s_sup.",
    )
    support_read: SupportRead = Field(
        "verify",
        description="Where s_sup comes from: verify, the model's own yes/no to whether the "
        "passage states the draft (pipeline/critics/verify.py), for every critique source; "
        "source: the critique source's own support read (heads, answerability model, tokens).",
    )
    n_ctx: int = Field(
        8192, ge=512, le=131072, description="Total KV cells shared by all sequences."
    )
    n_seq_max: int = Field(16, ge=1, le=256, description="Sequences (branches) per context.")
    n_threads: int = Field(
        0,
        ge=0,
        description="llama.cpp threads per engine process, and the embedder's while indexing; "
        "0: all available cores (os.cpu_count).",
    )
    adaptive_threads: bool = Field(
        True,
        description="Run small decode calls (generation steps) on one thread when that measures "
        "faster for calls of their size, as it does for small models with passive waiting "
        "(infra/engine/llama_threads.py); false: every call on n_threads.",
    )
    omp_wait_policy: WaitPolicy = Field(
        "passive",
        description="How llama.cpp's OpenMP threads wait (OMP_WAIT_POLICY, set in every engine "
        "process before llama.cpp loads): passive sleeps at once, so a busy process on the same "
        "cores costs the engine its share of them and no more (docs/configuration.md); active "
        "spins; inherit leaves OMP_WAIT_POLICY as the environment has it (unset: spin a while, "
        "then sleep).",
    )
    n_batch: int = Field(2048, ge=32)
    backend: Backend = Field(
        "llama_cpp",
        description="llama_cpp: load the GGUF in-process; vllm: a vLLM server's OpenAI-compatible "
        "completions API (GPU clusters).",
    )
    vllm_url: str | None = Field(
        None, description="Base URL of the vLLM server (backend = vllm), e.g. http://vllm:8000."
    )
    vllm_model: str | None = Field(
        None, description="Served model name; default: the first one /v1/models lists."
    )
    vllm_timeout_s: float = Field(120.0, gt=0.0, le=3600.0)


class RetrievalSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    qdrant_url: str | None = Field(
        None, description="Qdrant server URL; default: embedded on disk."
    )
    qdrant_api_key: Annotated[SecretStr | None, BlankIsUnset] = Field(
        None, description="Qdrant server API key; shown masked, never logged."
    )
    collection: str = Field(
        DEFAULT_COLLECTION,
        pattern=COLLECTION_NAME,
        description="The index collection (a corpus of its own: its embedded folder "
        "HOME/edge/<name>, or the server's collection); `--collection` on the commands.",
    )
    embedding_model: str | None = Field(
        None,
        description="sentence-transformers BERT model folder (safetensors), converted to GGUF "
        "once and run on llama.cpp; default: the embedded all-MiniLM-L6-v2.",
    )
    embedding_format: EmbeddingFormat = Field(
        "auto",
        description="Weights of the converted embedding model; auto: BF16 where the CPU "
        "backend multiplies BF16 natively (AVX512-BF16), else F16. The three embed alike, and "
        "an index built in one is reused in another after a sample re-embeds alike; pin one "
        "for a cluster of mixed CPUs.",
    )
    hybrid: bool = Field(
        True,
        description="Fuse dense and BM25 sparse results (a better hit@1 than dense-only on "
        "the Normans questions: docs/documents.md).",
    )
    fusion: HybridFusion = Field(
        "rrf",
        description="How hybrid search fuses its dense and BM25 results: 'dbsf' (Qdrant's "
        "distribution-based score fusion: each list's scores scaled by their own spread, "
        "then summed) or 'rrf' (reciprocal rank fusion, k=60).",
    )
    chunking: Literal["structure", "words"] = Field(
        "structure",
        description="How documents become passages: by their structure (headings, paragraphs, "
        "PDF pages; code blocks and tables kept whole) within `passage_tokens`, or the former "
        "word windows of `passage_words` (overlapping by `passage_overlap_words`).",
    )
    passage_tokens: int = Field(
        200,
        ge=16,
        le=2048,
        description="Word pieces (the embedding model's own) a passage holds at most; never "
        "more than the model reads (its max_seq_length).",
    )
    passage_words: int = Field(
        150, ge=20, le=2000, description="With chunking 'words': the window's length."
    )
    passage_overlap_words: int = Field(30, ge=0, le=500)
    max_document_bytes: int = Field(
        MAX_DOCUMENT_BYTES,
        ge=1,
        description="Indexing skips a document larger than this (UTF-8 bytes: its record or "
        "file, and the text a PDF or HTML file yields) with an error naming it; the rest of "
        "the corpus is indexed.",
    )
    max_page_chars: int = Field(
        MAX_PAGE_CHARS,
        ge=1,
        description="Indexing skips a PDF one of whose pages yields more characters of text "
        "than this (a few kilobytes of nested forms can yield megabytes) with an error naming "
        "it; the rest of the corpus is indexed.",
    )
    read_timeout_s: float = Field(
        READ_TIMEOUT_S,
        gt=0.0,
        le=86_400.0,
        description="Indexing skips a PDF or HTML file whose reading takes longer than this "
        "(seconds) with an error naming it; the rest of the corpus is indexed.",
    )


class ServeSettings(BaseModel):
    """The HTTP endpoint (`selfrag serve`, `ray_app.py`)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Bind address; loopback unless asked otherwise.")
    port: int = Field(8000, ge=1, le=65535)
    allowed_hosts: list[
        Annotated[str, StringConstraints(pattern=r"^(\*|[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])$")]
    ] = Field(
        default_factory=list,
        max_length=64,
        description="Host names (no port) a server bound to a loopback address answers besides "
        "localhost, 127.0.0.1, [::1] and its bind address; other Host headers get 421, which "
        "stops DNS rebinding. Add the name a local reverse proxy sends; '*' turns the check off.",
    )
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
    max_queued_requests: int = Field(
        64,
        ge=-1,
        le=100_000,
        description="Calls waiting for a busy replica, per deployment handle, before Serve "
        "rejects new ones (503 with Retry-After); -1: unbounded.",
    )
    max_timeout_s: float = Field(
        300.0,
        gt=0.0,
        le=3600.0,
        description="Largest timeout_s a request may ask for (the default is decoding.timeout_s); "
        "above it: 422.",
    )
    retry_after_s: int = Field(
        2, ge=1, le=3600, description="Retry-After (seconds) sent with every 503."
    )
    drain_s: float = Field(
        6.0,
        ge=0.0,
        le=3600.0,
        description="At a stop (SIGTERM, Ctrl-C), how long `selfrag serve` waits for the answers "
        "in progress (new ones get 503 meanwhile) before it stops them: below the supervisor's "
        "grace period (8 s is a common one: Kubernetes gives 30 s by default).",
    )
    model_name: str = Field(
        "selfrag",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
        description="The model id the OpenAI-compatible API serves (`GET /v1/models`); "
        "requests naming another model get 404.",
    )
    pool_replicas: int = Field(
        1,
        ge=1,
        le=64,
        description="BranchPool replicas `selfrag serve` starts (deploy/serve.yaml autoscales).",
    )
    affinity: bool = Field(
        True,
        description="Route every call of one answer to the same pool and decider replica "
        "(consistent hashing on a per-answer session id), where its KV slots are.",
    )
    index_version_ttl_s: float = Field(
        1.0,
        ge=0.0,
        le=3600.0,
        description="How long the ingress reuses the passage index's version (part of the query "
        "cache key) before asking the Retriever again; a re-index is seen within this time. "
        "0: ask on every request.",
    )
    ray_access_log: bool = Field(
        False,
        description="Ray Serve's own access log line per request in the proxy and every "
        "replica. selfrag logs each answer itself; Ray's lines add measurably to a cache "
        "hit's latency (docs/http.md).",
    )
    log_questions: bool = Field(
        False,
        description="Log each question's text at INFO; off by default so user text stays out of "
        "logs (the access line then shows its length and a short hash).",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        "INFO",
        description="Level of Ray Serve's logs and of selfrag's own in every replica (Serve's "
        "LoggingConfig.log_level).",
    )
    log_encoding: Literal["TEXT", "JSON"] = Field(
        "TEXT",
        description="Format of the Serve replica log files, selfrag's records included: TEXT, "
        "or JSON (one object per line, with the request id) for a log pipeline.",
    )


class CacheSettings(BaseModel):
    """The query cache and the passage KV-state cache. Redis (`redis_url`) is an optional
    second tier behind an in-process LRU; when it is down or slow it is bypassed."""

    model_config = ConfigDict(extra="forbid")

    query: bool = Field(True, description="Answer a repeated query from the cache.")
    query_memory_entries: int = Field(1024, ge=1, description="In-process LRU entries.")
    query_ttl_s: int = Field(86400, ge=1, description="Redis TTL of a cached answer.")
    query_redis_mb: int = Field(256, ge=1, description="Redis size cap of cached answers.")
    passage_kv: bool = Field(
        True,
        description="Restore the saved KV state of a prompt's template + passage prefix instead "
        "of recomputing it (llama.cpp backend).",
    )
    kv_memory_mb: int = Field(512, ge=0, description="In-process LRU of KV states; 0: none.")
    kv_disk_mb: int = Field(
        4096,
        ge=0,
        description="Node-local disk tier of KV states under HOME/kv (shared by the node's "
        "engine processes, kept across restarts); least recently used go past the cap; 0: none.",
    )
    kv_ttl_s: int = Field(86400, ge=1, description="Redis TTL of a KV state.")
    kv_redis_mb: int = Field(2048, ge=1, description="Redis size cap of KV states.")
    kv_min_tokens: int = Field(
        32, ge=1, description="Shorter reusable prefixes are recomputed, not cached."
    )
    redis_timeout_ms: float = Field(
        250.0, gt=0.0, le=10000.0, description="Socket timeout; slower Redis calls are bypassed."
    )
    redis_retry_s: float = Field(
        5.0, ge=0.0, le=3600.0, description="After a Redis failure, bypass it this long."
    )


class Settings(BaseModel):
    """Everything a deployment configures: `infra.settings_loader.load_settings` fills it (with
    pydantic-settings) from defaults < HOME/calibration.toml < a TOML file < SELFRAG_*
    environment < overrides. A plain model: constructing one reads no environment."""

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
    cache: CacheSettings = Field(default_factory=CacheSettings)
    redis_url: Annotated[SecretUrl | None, BlankIsUnset] = Field(
        None,
        description="redis://[:password@]host:port/db: the shared cache tier; default: "
        "in-process only. Shown with the password masked.",
    )
