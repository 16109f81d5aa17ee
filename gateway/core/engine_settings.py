"""The local engines' settings: the embedded vLLM replicas, remote replicas, and the
exact KV spans over them (events, routing, pins, retention across tool pauses)."""

from __future__ import annotations

import math
import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from gateway.core.keys import PRIORITIES, Priority

_SHARES: dict[Priority, float] = {"batch": 0.5, "default": 1.0, "interactive": 1.1}


_ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices


class LoraSettings(BaseModel):
    """LoRA adapters on the local replicas, each served as a model of its own
    (docs/local_kv.md#lora-adapters)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False  # the engines run with LoRA (vLLM's --enable-lora)
    max_loras: int = Field(2, ge=1)  # adapters in one batch (vLLM's --max-loras)
    max_lora_rank: int = 16  # the highest rank an adapter may have (vLLM's --max-lora-rank)
    # adapters kept in each engine's CPU memory (vLLM's --max-cpu-loras); None: max_loras
    max_cpu_loras: int | None = Field(None, ge=1)
    # loaded on every replica at start (and again after a restart): name -> adapter
    # directory (PEFT's adapter_config.json and weights), vLLM's --lora-modules
    adapters: dict[Annotated[str, Field(pattern=_ADAPTER_NAME)], str] = Field(default_factory=dict)
    # a request naming an adapter no replica has is served from <resolver_dir>/<name>
    # when that holds an adapter_config.json (as vLLM's lora_filesystem_resolver does)
    resolver_dir: str | None = None
    # serving the demo model: also build and load its two demo adapters (demo-lora-a,
    # demo-lora-b: random weights, engines/vllm/demo_lora.py)
    demo_adapters: bool = False

    @field_validator("max_lora_rank")
    @classmethod
    def _rank(cls, v: int) -> int:
        if v not in LORA_RANKS:
            raise ValueError(f"max_lora_rank is one of {', '.join(map(str, LORA_RANKS))}")
        return v

    @model_validator(mode="after")
    def _cpu_loras(self) -> LoraSettings:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("lora.max_cpu_loras is at least lora.max_loras")
        return self


class EngineSettings(BaseModel):
    """The embedded vLLM replicas: the engine each runs (context, KV cache, devices), their
    restarts, and how requests of different priorities share them (docs/agents.md)."""

    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=0, le=64)  # embedded vLLM engines, one per GPU / TP group
    max_model_len: int = Field(2048, ge=16)  # context length, prompt and answer
    # the most tokens one answer may generate; a request asking for more, or for no limit,
    # gets this many and says so (x-vcache-max-tokens-clamped; finish_reason length).
    # Unset: what the context leaves
    max_output_tokens: int | None = Field(None, ge=1)
    # how an answer the ceiling (not the client's own limit) cut ends: "length" (it says
    # it was cut: finish_reason length, stop_reason max_tokens, an incomplete response) or
    # "stop" (as the model's own end, for clients that take a cut answer as a failed turn,
    # as Claude Code and Codex do when run non-interactively); the header says it either way
    max_output_tokens_finish: Literal["length", "stop"] = "length"
    block_size: int | None = Field(None, ge=1)  # KV block tokens; None: vLLM's (128 on CPU)
    # each replica's KV cache; None: gpu_memory_utilization on a GPU, 1 GiB on CPU
    kv_cache_bytes: int | None = Field(None, ge=1 << 20)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)  # share of GPU memory vLLM takes
    enforce_eager: bool = False  # no CUDA graphs or compilation (faster start)
    hash_seed: str = "0"  # the engines' PYTHONHASHSEED: block hashes depend on it
    # requests admitted at once (then 503 with Retry-After): see admission_shares
    max_queued_requests: int = Field(256, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)  # GPUs per replica
    # where each embedded replica computes (engines/vllm/placement.py): "auto" gives
    # each its own devices (CUDA_VISIBLE_DEVICES) or CPU cores (VLLM_CPU_OMP_THREADS_BIND)
    # where there are enough, "none" leaves it to vLLM, a list names each replica's own
    # (["0", "1"] GPUs; ["0-7", "8-15"] CPU cores)
    placement: Literal["auto", "none"] | list[str] = "auto"
    dtype: str = "auto"  # vLLM's dtype of the weights (auto, float16, bfloat16, ...)
    # the engine processes' CPU niceness above the gateway's own (0-19, as `nice -n`):
    # where the gateway shares cores with its engines, its own work for a request goes
    # first (engines/vllm/niceness.py). None: 10 on a CPU host, where the engines
    # compute on the gateway's cores; 0 elsewhere
    nice: int | None = Field(None, ge=0, le=19)
    watch_interval_s: float = Field(1.0, gt=0)  # how often replicas are checked for death
    restart_backoff_s: float = Field(1.0, ge=0)  # first restart delay of a dead replica
    restart_backoff_cap_s: float = Field(60.0, ge=0)  # doubling up to this
    # vLLM's tool-call parser for the model's chat template (hermes, llama3_json, mistral,
    # qwen3_coder, ...): reads tool calls out of answers to `tool_choice: auto`
    tool_parser: str = "hermes"
    # a streamed answer's outputs are read from an embedded engine at most once per this
    # many milliseconds: the tokens it made meanwhile (vLLM merges them) go out as one
    # piece, one SSE event.  Below what a reader sees; the gateway's work per token falls
    # with the tokens an event carries (docs/benchmarks.md).  Where the serving replicas
    # make 2 or more tokens a request in it, vLLM is asked for one output every that many
    # tokens (its stream_interval; the first at once): its output processor, in the
    # gateway's process, builds one an interval, not one a step, and under vcache's
    # scheduler class (the default) the engine core sends only those
    # (engines/vllm/core_coalesce.py).  0: each step's output as it comes, none
    # coalesced.  Answers sent whole are coalesced by the engine whatever this is
    output_interval_ms: float = Field(20.0, ge=0, le=1000)
    # vLLM's --trust-request-chat-template: a request may bring its own chat_template
    trust_request_chat_template: bool = False
    # a chat or text prompt renders on the event loop, not the render thread, when the
    # characters it may tokenize afresh (its text, once a render its memories do not
    # answer) are at most this many and the thread is idle; a template of the request's
    # own or an image's expansion always on the thread.  0 (the default): every render on
    # the thread, as inline renders cost 5-10% more CPU a request in three bench runs for
    # no TTFT difference a run resolved; 4,096 is ~1.3 ms of work, half what the hop to
    # the thread costs at the median (docs/benchmarks.md)
    render_inline_chars: int = Field(0, ge=0)
    # requests in each replica's engine at once (vLLM's max_num_seqs); the rest wait in
    # the gateway and go in fair order across tenants (gateway/local/fairness.py).
    # None: vLLM's default, no gateway queue.
    max_num_seqs: int | None = Field(None, ge=1)
    # vLLM's long_prefill_token_threshold: a prompt's prefill computes at most this many
    # tokens a step, so a long prompt shares each step with others' first tokens in
    # small pieces (None: vLLM's default, the whole step's budget)
    long_prefill_token_threshold: int | None = Field(None, ge=1)
    # the prompt of a request whose priority is above every other request's on its
    # replica computes whole, past long_prefill_token_threshold.  This or
    # top_prefill_alone on: the embedded engines run vLLM's scheduler_cls
    # engines.vllm.top_first_scheduler.TopFirstScheduler (engines/vllm/top_prefill.py; a
    # remote replica takes it with --scheduler-cls, docs/local_kv.md), which also takes
    # the holds carried in requests (else holds are awaited in routing).  Measured:
    # [notebook](notebook_agents.md#where-a-first-token-waits-2026-12-03)
    top_prefill_whole: bool = True
    # while a prompt of the highest priority on a replica is in its prefill, the prompts
    # of lower priorities there compute nothing (their decodes go on); held in vLLM's
    # scheduler at the step boundary (the scheduler class of top_prefill_whole).  Measured:
    # [notebook](notebook_agents.md#lower-prefills-held-in-the-engine-2026-12-03)
    top_prefill_alone: bool = True
    # with top_prefill_alone, the lower priorities' decodes skip those steps too: the top
    # prefill's steps compute it alone; each lower answer pauses for that prefill.  Off:
    # not shown to help, run fair2 (fair8 further on):
    # [notebook](notebook_agents.md#the-hold-for-a-leased-turn-and-three-rounds-a-run-2026-12-04)
    top_prefill_decodes: bool = False
    # vLLM's scheduler: "priority" serves x-vcache-priority's order (interactive first),
    # "fcfs" arrival order whatever the priority
    scheduling_policy: Literal["priority", "fcfs"] = "priority"
    # while a request waits for its first token on a replica, no request of a lower
    # priority starts there (it would share the prefill's steps); gateway/local/fairness.py
    first_token_guard: bool = True
    # and (with the guard) a prompt of a lower priority still in prefill there is stopped
    # (aborted in the engine, its computed blocks kept in the prefix cache) and starts
    # again after that first token
    preempt_prefills: bool = True
    # where the guard and its stops act: "replica", on the replica of the waiting request;
    # "host", on every embedded replica (their engines share the host's cores: a lower
    # prefill on one slows the steps of another). None: "host" on a CPU host, else "replica"
    guard_scope: Literal["replica", "host"] | None = None
    # at most this many requests of a priority prefilling at once on a replica (e.g.
    # {default: 1, batch: 1}); absent: no cap
    prefill_slots: dict[Priority, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    # how much of max_queued_requests each priority may fill (interactive a reserve beyond
    # it): when the queue fills, batch is refused first and interactive last
    admission_shares: dict[Priority, float] = Field(default_factory=lambda: dict(_SHARES))
    lora: LoraSettings = Field(default_factory=LoraSettings)  # LoRA adapters served as models

    @field_validator("admission_shares")
    @classmethod
    def _shares(cls, v: dict[Priority, float]) -> dict[Priority, float]:
        if any(not 0 < x <= 2 for x in v.values()):
            raise ValueError("admission shares are in (0, 2]")
        return v

    @model_validator(mode="after")
    def _placement(self) -> EngineSettings:
        if isinstance(self.placement, list) and len(self.placement) != self.replicas:
            raise ValueError(
                f"engine.placement lists {len(self.placement)} entries for {self.replicas} replicas"
            )
        return self

    def admission_room(self) -> dict[Priority, int]:
        """Per priority, the requests in flight beside which one more is still admitted."""
        limit = self.max_queued_requests
        return {p: max(1, math.ceil(limit * self.admission_shares.get(p, 1.0))) for p in PRIORITIES}


class RemoteReplicaConfig(BaseModel):
    """A vLLM replica served by ``python -m vllm.entrypoints.openai.api_server``.

    It runs the vcache plugins (``VLLM_PLUGINS=vcache,vcache-control``) with
    ``VCACHE_CONTROL_SECRET`` set, publishes KV events on ZMQ, and uses this
    gateway's ``engine.hash_seed`` as its ``PYTHONHASHSEED``.
    """

    model_config = ConfigDict(extra="forbid")

    url: str  # http://host:port of the API server (its control endpoint is there too)
    kv_events: str  # its KV events PUB endpoint, e.g. tcp://host:5557
    kv_events_replay: str | None = None  # its replay ROUTER endpoint, e.g. tcp://host:5558
    # the replicas' VCACHE_CONTROL_SECRET; unset: the gateway's own VCACHE_CONTROL_SECRET
    control_secret: SecretStr
    api_key: SecretStr | None = None  # the replica's --api-key, sent as a bearer token
    served_model_name: str | None = None  # its model's name there; None: its first model
    # the route token ids go to: vLLM's token-in/token-out /inference/v1/generate
    # (generate: the replica runs with --enable-scale-out), /v1/completions, or auto:
    # generate where the replica's OpenAPI document lists it
    api: Literal["auto", "completions", "generate"] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _secret_from_env(cls, data: Any) -> Any:
        secret = os.environ.get("VCACHE_CONTROL_SECRET")
        if isinstance(data, dict) and "control_secret" not in data and secret:
            return {**data, "control_secret": secret}
        return data


class RetentionSettings(BaseModel):
    """A session's KV kept on its replica across tool-call pauses (gateway/local/pauses.py)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True  # lease a paused session's blocks on its replica
    quantile: float = Field(0.9, gt=0, lt=1)  # of the session's (else tenant's) gaps
    margin: float = Field(1.5, ge=1)  # the lease is the quantile times this
    min_lease_s: float = Field(5.0, gt=0)  # the shortest lease
    max_lease_s: float = Field(120.0, gt=0)  # the longest lease
    default_gap_s: float = Field(30.0, gt=0)  # before any gap has been seen
    min_blocks: int = Field(2, ge=1)  # a shorter prompt is cheaper to prefill again
    max_sessions: int = Field(4096, ge=1)  # sessions remembered (least recent forgotten)
    # a lease past its expected pause runs on to max_lease_s while the pin budget has
    # room: another session's lease that the budget refuses takes its blocks first
    overtime: bool = True


class CacheSettings(BaseModel):
    """Exact KV spans on the local replicas (KV events, pins, routing)."""

    model_config = ConfigDict(extra="forbid")

    kv_events: bool = True  # subscribe to the engines' KV events; predictions need them
    # kv: the replica with the longest predicted cached prefix (within load_imbalance);
    # round_robin and least_loaded for comparison
    routing: Literal["kv", "round_robin", "least_loaded"] = "kv"
    load_imbalance: int = Field(4, ge=0)  # kv routing falls back to least loaded beyond it
    pin_max_share: float = Field(0.5, gt=0, le=1)  # most of the KV blocks pins may hold
    default_lease_s: float = Field(300, gt=0)  # a pin's lease when /v1/cache/pin names none
    # a request's predicted cached blocks are made the last its replica evicts before it
    # runs (gateway/local/refresh.py)
    refresh_predicted: bool = True
    # a routed request's predicted blocks held in its engine until its first token, at
    # most this share of a replica's KV blocks in all (0: no holds; predictions are then
    # approximate) (gateway/local/kv_holds.py)
    hold_max_share: float = Field(0.25, ge=0, lt=1)
    # the longest a hold lasts in the engine when its owner never gives it back
    hold_s: float = Field(10.0, gt=0)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
