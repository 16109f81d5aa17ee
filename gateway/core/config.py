"""Gateway configuration.

Sources, highest precedence first:

1. ``vcache serve`` flags (passed as keyword arguments),
2. environment variables ``VCACHE_<FIELD>`` (nested with ``__``, e.g.
   ``VCACHE_ENGINE__MAX_MODEL_LEN=4096``; lists as JSON),
3. a YAML file (``--config FILE`` or ``VCACHE_CONFIG_FILE``; example in
   ``deploy/vcache.example.yaml``),
4. the defaults below.

Nested sections merge field by field across sources.
"""

from __future__ import annotations

import difflib
import os
import socket
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from engines.providers.specs import PROVIDERS
from gateway.core.engine_settings import (
    CacheSettings,
    EngineSettings,
    RemoteReplicaConfig,
    RetentionSettings,
)
from gateway.core.keys import PRIORITIES, ApiKeyConfig, KeyLimits, Priority, hash_api_key
from gateway.core.provider_settings import (
    ControlSettings,
    PriceConfig,
    ProviderConfig,
    RoutingSettings,
)

__all__ = [
    "DEMO_MODEL_NAME",
    "LOCAL_TARGET",
    "PRIORITIES",
    "ApiKeyConfig",
    "AttachmentSettings",
    "CacheSettings",
    "ControlSettings",
    "EngineSettings",
    "HttpSettings",
    "KeyLimits",
    "PriceConfig",
    "Priority",
    "ProviderConfig",
    "RemoteReplicaConfig",
    "RetentionSettings",
    "RoutingSettings",
    "SessionLogSettings",
    "Settings",
    "explain",
    "hash_api_key",
    "unknown_env",
]

DEMO_MODEL_NAME = "vcache-demo"


LOCAL_TARGET = "local"


class SessionLogSettings(BaseModel):
    """The session log: every request reconstructable from it (SQLite in WAL mode, or
    PostgreSQL shared by active-active gateways)."""

    model_config = ConfigDict(extra="forbid")

    # false: no session log (requests are not rebuildable; the Responses API answers 503)
    enabled: bool = True
    path: Path | None = None  # default: <data_dir>/sessions.db
    # postgresql://user@host/db: one log shared by every gateway (path is then unused)
    url: str | None = Field(None, pattern=r"^(postgres(ql)?|sqlite)://")
    # readiness fails once every commit has failed for this long (the store is down)
    unavailable_grace_s: float = Field(10.0, ge=0)
    # full: every commit reaches the disk; normal: a power cut may lose the last commits,
    # never corrupt the log; off: left to the OS
    fsync: Literal["full", "normal", "off"] = "normal"
    verify_reconstruction: bool = False  # rebuild each request from the log before sending
    # Whole sessions older than this, or the oldest beyond the size cap, are deleted at
    # start and every retention_interval_s; None keeps them (no default keeps them forever).
    retention_days: float | None = Field(30, gt=0)
    retention_max_bytes: int | None = Field(16 << 30, ge=1 << 20)  # size cap; None: none
    retention_interval_s: float = Field(3600, gt=0)  # how often retention runs
    cached_sessions: int = Field(4096, ge=1)  # folded session states kept in memory (LRU)

    def db_path(self, data_dir: Path) -> Path:
        return self.path or data_dir / "sessions.db"


class BatchSettings(BaseModel):
    """The batch APIs' runner (docs/batches.md): each gateway sends batch items in the
    prefix DAG's order through the service path, at the batch priority."""

    model_config = ConfigDict(extra="forbid")

    concurrency: int = Field(8, ge=1)  # items this gateway sends at once, over every batch
    # how long a claimed item is an owner's: renewed every third of it while the item runs;
    # another gateway (or this one restarted) takes the item again once it runs out
    lease_s: float = Field(60.0, gt=0)
    # how often the runner looks for work (and at once when a batch is created or cancelled)
    poll_s: float = Field(1.0, gt=0)
    # recall (M4): replay a done item's prompt chain so the items extending it read it from
    # cache, where the cost gate passes (manifest.economics.recall_pays); off: prefill fresh
    recall: bool = False
    # a batch of chat completions, Messages or Responses requests on a hosted target goes
    # to the provider's own batch API (OpenAI's, Anthropic's) where the provider plan finds
    # it cheaper than online requests in DAG order (its id kept in the batch store: a
    # restart resumes it); off: every item online (a submission kept before a restart is
    # still followed)
    provider_api: bool = False
    # between two reads of a batch running on a provider's batch API
    provider_poll_s: float = Field(30.0, gt=0)
    # the body limit of a batch's upload (POST /v1/files, POST /v1/messages/batches) in
    # place of max_request_body_bytes: Anthropic's Message Batches take 256 MB, OpenAI's
    # batch input files 200 MB
    max_upload_bytes: int = Field(256 << 20, ge=1024)


class AttachmentSettings(BaseModel):
    """Images and documents in requests (OpenAI's image_url and file parts; the Messages
    and Responses APIs' images arrive in those shapes): what intake takes, each refused
    by name (400 or 413) beyond these bounds; stored by digest beside the session log."""

    model_config = ConfigDict(extra="forbid")

    # hosts an http(s) image URL may be fetched from (exact names, or host:port); none:
    # URLs are refused, data URLs only
    fetch_hosts: list[str] = Field(default_factory=list)
    fetch_timeout_s: float = Field(10.0, gt=0)  # the whole fetch of one URL, else a 400
    max_bytes: int = Field(20 << 20, ge=1024)  # one image's or document's bytes, else 413
    max_count: int = Field(100, ge=1)  # images and documents in one request, else 400
    max_total_bytes: int = Field(64 << 20, ge=1024)  # all of a request's, else 413
    # decoded pixels (width * height) of one image, checked before it is decoded
    # (decompression bombs), else 400
    max_pixels: int = Field(8000 * 8000, ge=1)


class StateSettings(BaseModel):
    """Soft state shared by active-active gateways (gateway/state/): in-process by default;
    ``url: redis://host:6379/0`` shares provider belief, anchors, headroom and roles."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(None, pattern=r"^rediss?://")  # redis://host:port/db; None: in-process
    prefix: str = Field("vcache:", min_length=1, max_length=64)  # every key starts with it
    role_ttl_s: float = Field(10.0, gt=0)  # a dead holder's role passes on after this
    unavailable_grace_s: float = Field(30.0, ge=0)  # readiness fails past it


class HttpSettings(BaseModel):
    """Limits of the HTTP server (see gateway/http/server.py)."""

    model_config = ConfigDict(extra="forbid")

    max_header_bytes: int = Field(64 * 1024, ge=1024)  # request line + headers, else 431
    header_timeout_s: float = Field(10.0, gt=0)  # the whole head must arrive in time, else 408
    body_timeout_s: float = Field(30.0, gt=0)  # longest wait for the next body chunk, else 408
    keep_alive_s: float = Field(5.0, gt=0)  # idle kept-alive connections close after this
    max_connections: int = Field(2048, ge=1)  # served at once; beyond, 503
    # a kept-alive connection's last request (then connection: close; 0: no limit), so
    # clients that reconnect spread again over the --workers of one port
    max_requests_per_connection: int = Field(100, ge=0)


def _default_data_dir() -> Path:
    """`$XDG_CACHE_HOME/vcache`, else `~/.cache/vcache`"""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vcache"


def _default_instance_id() -> str:
    """`<hostname>-<pid>-<8 random hex digits>`"""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="VCACHE_", env_nested_delimiter="__", extra="forbid"
    )

    config_file: Path | None = None  # the YAML file beneath environment and flags
    model: str | None = None  # local path or hub id; None builds the demo model
    # the name clients send as `model`; None: `model` itself (vcache-demo for the demo model)
    served_model_name: str | None = None
    # the HTTP and gRPC bind address; one other than loopback needs api_keys or
    # allow_anonymous (`vcache serve` refuses it otherwise)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)  # HTTP (0: a free port)
    grpc_port: int | None = Field(50051, ge=0, le=65535)  # gRPC; None: no gRPC server
    # the demo model, the session log's SQLite file and provider calibrations
    data_dir: Path = Field(default_factory=_default_data_dir)
    # this gateway among several in front of the same replicas and stores (the engines'
    # pin holds, the shared state's leader); unique per process by default
    instance_id: str = Field(default_factory=_default_instance_id, min_length=1, max_length=128)
    # gateway processes on this host, one port (SO_REUSEPORT); embedded replicas' engine
    # cores run in their parent, each worker a client of them: see gateway/workers.py
    workers: int = Field(1, ge=1, le=64)
    worker_index: int = Field(0, ge=0)  # set by the parent of --workers for each worker
    engine: EngineSettings = Field(default_factory=EngineSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    control: ControlSettings = Field(default_factory=ControlSettings)
    # `vllm serve` replicas with the vcache plugins, beside or instead of embedded ones
    remote_replicas: list[RemoteReplicaConfig] = Field(default_factory=list)
    # accepted keys; none: every caller is the anonymous tenant "default", never an admin
    api_keys: list[ApiKeyConfig] = Field(default_factory=list)
    # serve a host other than loopback with no api_keys (`vcache serve` refuses it otherwise)
    allow_anonymous: bool = False
    # hosted providers by name (anthropic, openai, gemini, deepseek)
    providers: dict[str, ProviderConfig] = Field(default_factory=dict)
    # model alias → ordered targets: "local" (the vLLM replicas) or "provider/model"
    aliases: dict[str, list[str]] = Field(default_factory=dict)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    # hosted providers' system prompts: canonical moves the lines the prefix lint flags (a
    # timestamp, an id) after the stable part, so the anchor stays byte-stable;
    # passthrough sends them where they are
    prompt_layout: Literal["canonical", "passthrough"] = "canonical"
    session_log: SessionLogSettings = Field(default_factory=SessionLogSettings)
    attachments: AttachmentSettings = Field(default_factory=AttachmentSettings)
    batches: BatchSettings = Field(default_factory=BatchSettings)
    state: StateSettings = Field(default_factory=StateSettings)
    max_request_body_bytes: int = Field(4 << 20, ge=1024)  # a larger body is a 413
    http: HttpSettings = Field(default_factory=HttpSettings)
    log_level: str = "info"  # debug, info, warning or error
    log_format: Literal["text", "json"] = "text"  # json: one object per line
    otlp_endpoint: str | None = None  # OTLP/HTTP traces, e.g. http://collector:4318/v1/traces

    @property
    def has_local(self) -> bool:
        return self.engine.replicas > 0 or bool(self.remote_replicas)

    @field_validator("providers")
    @classmethod
    def _known_providers(cls, v: dict[str, ProviderConfig]) -> dict[str, ProviderConfig]:
        unknown = sorted(set(v) - set(PROVIDERS))
        if unknown:
            raise ValueError(f"unknown provider {unknown[0]!r}; one of {', '.join(PROVIDERS)}")
        return v

    @model_validator(mode="after")
    def _some_target(self) -> Settings:
        if not self.has_local and not self.providers:
            raise ValueError(
                "configure at least one replica (engine.replicas or remote_replicas) or a provider"
            )
        return self

    @model_validator(mode="after")
    def _workers_share_a_port(self) -> Settings:
        if self.workers > 1 and self.port == 0:
            raise ValueError("workers > 1 share one port: give it (port 0 picks one each)")
        return self

    @model_validator(mode="after")
    def _targets_exist(self) -> Settings:
        for alias, targets in self.aliases.items():
            if not targets:
                raise ValueError(f"alias {alias!r} needs at least one target")
            for t in targets:
                if t == LOCAL_TARGET and not self.has_local:
                    raise ValueError(f"alias {alias!r}: 'local' needs a local replica")
                provider, sep, model = t.partition("/")
                if t != LOCAL_TARGET and (not sep or not model or provider not in self.providers):
                    raise ValueError(
                        f"alias {alias!r}: target {t!r} is neither 'local' nor "
                        "'provider/model' with a configured provider"
                    )
        return self

    @field_validator("log_level")
    @classmethod
    def _lower(cls, v: str) -> str:
        return v.lower()

    @property
    def model_name(self) -> str:
        """The name clients put in ``model``."""
        if self.served_model_name:
            return self.served_model_name
        return self.model or DEMO_MODEL_NAME

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlFileSource(settings_cls, init_settings))


class _YamlFileSource(PydanticBaseSettingsSource):
    """Reads the YAML file named by the ``config_file`` flag or ``VCACHE_CONFIG_FILE``."""

    def __init__(self, settings_cls: type[BaseSettings], init: PydanticBaseSettingsSource):
        super().__init__(settings_cls)
        self._init = init

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ is overridden; never used

    def __call__(self) -> dict[str, Any]:
        path: Any = None
        if isinstance(self._init, InitSettingsSource):
            path = self._init.init_kwargs.get("config_file")
        path = path or os.environ.get("VCACHE_CONFIG_FILE")
        if not path:
            return {}
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: top level must be a mapping")
        return data


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The settings model that holds the field at ``loc`` (None past a dict or a list)."""
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def explain(exc: ValidationError) -> list[str]:
    """A configuration error as one line per problem, naming the key (a typo gets the
    nearest valid names)."""
    lines = []
    for e in exc.errors():
        loc = tuple(e.get("loc", ()))
        key = ".".join(str(p) for p in loc) or "(top level)"
        if e.get("type") == "extra_forbidden":
            parent = _model_at(Settings, loc[:-1])
            known = list(parent.model_fields) if parent is not None else []
            near = difflib.get_close_matches(str(loc[-1]), known, n=2)
            prefix = "".join(f"{p}." for p in loc[:-1])
            hint = " or ".join(f"'{prefix}{n}'" for n in near)
            lines.append(f"unknown setting '{key}'" + (f" (did you mean {hint}?)" if near else ""))
        else:
            msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
            lines.append(f"setting '{key}': {msg}")
    return lines


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """``VCACHE_<SECTION>__<KEY>`` variables naming a key their section does not have (a
    typo would otherwise be ignored silently)."""
    out = []
    for name in sorted(environ):
        section, sep, rest = name.removeprefix("VCACHE_").partition("__")
        if not name.startswith("VCACHE_") or not sep:
            continue
        model = _model_at(Settings, (section.lower(),))
        if model is None:
            continue  # a dict or list section (providers, aliases): free-form keys
        key = rest.split("__")[0].lower()
        if key not in model.model_fields:
            near = difflib.get_close_matches(key, list(model.model_fields), n=1)
            hint = f" (did you mean VCACHE_{section}__{near[0].upper()}?)" if near else ""
            out.append(f"unknown setting {name}{hint}")
    return out
