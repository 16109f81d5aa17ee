"""``vcache`` command line: ``serve``, ``hash-key``, ``demo-model``, ``sessions``, ``replay``,
``calibrate``, ``plan``."""

from __future__ import annotations

import argparse
import faulthandler
import ipaddress
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gateway.core.config import Settings, explain, hash_api_key, unknown_env
from gateway.core.logs import setup_logging
from gateway.core.version import version_info

DEMO_VISION_NAME = "demo-vision"  # the served name of `vcache serve --demo vision`

# Flags of `vcache serve` and where they land in Settings.  Absent flags are
# left out, so environment and YAML values still apply beneath them.
_SERVE_FLAGS: list[tuple[str, str, type, str]] = [
    ("--config", "config_file", Path, "YAML config file"),
    ("--model", "model", str, "local path or hub id (default: the demo model)"),
    ("--served-model-name", "served_model_name", str, "name clients use in 'model'"),
    ("--host", "host", str, "bind address (default 127.0.0.1)"),
    ("--port", "port", int, "HTTP port (default 8000)"),
    ("--grpc-port", "grpc_port", int, "gRPC port (default 50051)"),
    ("--data-dir", "data_dir", Path, "where the demo model and state live"),
    ("--max-request-body-bytes", "max_request_body_bytes", int, "request body limit"),
    ("--log-level", "log_level", str, "debug, info, warning, error"),
    ("--log-format", "log_format", str, "text or json (one object per line)"),
    ("--otlp-endpoint", "otlp_endpoint", str, "OTLP/HTTP traces endpoint (off when unset)"),
    ("--max-model-len", "engine.max_model_len", int, "context length"),
    ("--block-size", "engine.block_size", int, "KV block size in tokens"),
    ("--kv-cache-bytes", "engine.kv_cache_bytes", int, "KV cache size in bytes"),
    ("--gpu-memory-utilization", "engine.gpu_memory_utilization", float, "GPU memory share"),
    ("--hash-seed", "engine.hash_seed", str, "PYTHONHASHSEED of the engine (block hashes)"),
    ("--max-queued-requests", "engine.max_queued_requests", int, "admission limit"),
    ("--tensor-parallel-size", "engine.tensor_parallel_size", int, "GPUs per engine"),
    ("--replicas", "engine.replicas", int, "embedded vLLM engines"),
    (
        "--workers",
        "workers",
        int,
        "gateway processes on one port (embedded engine cores shared by them)",
    ),
    ("--routing", "cache.routing", str, "kv, round_robin or least_loaded"),
    ("--pin-max-share", "cache.pin_max_share", float, "most of the KV blocks pins may hold"),
]
# Switches of `vcache serve` (--x and --no-x), where they land, and their help.
_SERVE_SWITCHES: list[tuple[str, str, str]] = [
    ("--enforce-eager", "engine.enforce_eager", "disable CUDA graphs / compilation"),
    (
        "--allow-anonymous",
        "allow_anonymous",
        "serve a host other than loopback with no API keys (anonymous callers, never admins)",
    ),
]


def serve_flags() -> dict[str, str]:
    """The settings `vcache serve` flags set: dotted setting name to the flag."""
    out = {dest: flag for flag, dest, _, _ in _SERVE_FLAGS}
    out |= {dest: f"--[no-]{flag.removeprefix('--')}" for flag, dest, _ in _SERVE_SWITCHES}
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vcache", description=__doc__)
    info = version_info()
    p.add_argument(
        "--version",
        action="version",
        version=f"vcache {info['version']} (vllm {info['vllm']}, python {info['python']})",
    )
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    for flag, dest, typ, help_ in _SERVE_FLAGS:
        serve.add_argument(flag, dest=dest, type=typ, help=help_, default=argparse.SUPPRESS)
    for flag, dest, help_ in _SERVE_SWITCHES:
        serve.add_argument(
            flag,
            dest=dest,
            action=argparse.BooleanOptionalAction,
            default=argparse.SUPPRESS,
            help=help_,
        )
    serve.add_argument(
        "--demo",
        dest="_demo",
        choices=("vision",),
        default=None,
        help="serve a demo model built here: vision, the demo vision model (Idefics3, "
        "served as demo-vision); without --model and --demo, the text demo",
    )
    hk = sub.add_parser("hash-key", help="print the sha256 to put in api_keys")
    hk.add_argument("key")
    dm = sub.add_parser("demo-model", help="build the demo model and print its path")
    dm.add_argument("--data-dir", dest="data_dir", type=Path, default=argparse.SUPPRESS)
    dm.add_argument(
        "--vision", dest="_vision", action="store_true", help="the demo vision model (Idefics3)"
    )
    ss = sub.add_parser("sessions", help="list the session log's sessions, with sizes")
    rp = sub.add_parser("replay", help="rebuild a request from the session log, check its sha256")
    rp.add_argument("request_id")
    rp.add_argument("--quiet", action="store_true", help="print only the digests")
    for cmd in (ss, rp):
        cmd.add_argument("--config", dest="config_file", type=Path, default=argparse.SUPPRESS)
        cmd.add_argument("--data-dir", dest="data_dir", type=Path, default=argparse.SUPPRESS)
        cmd.add_argument("--model", dest="model", type=str, default=argparse.SUPPRESS)
        cmd.add_argument("--db", dest="_db", type=Path, default=None, help="the log's file")
    ss.add_argument("--limit", dest="_limit", type=int, default=50)
    cal = sub.add_parser(
        "calibrate", help="probe a provider target and fit its cache rules from its telemetry"
    )
    cal.add_argument("target", help="provider/model, e.g. anthropic/claude-sonnet-4-5")
    cal.add_argument("--config", dest="config_file", type=Path, default=argparse.SUPPRESS)
    cal.add_argument("--data-dir", dest="data_dir", type=Path, default=argparse.SUPPRESS)
    cal.add_argument(
        "--emulator-clock",
        dest="_emulator",
        default=None,
        help="the emulator's URL: advance its clock instead of waiting out each TTL",
    )
    pl = sub.add_parser("plan", help="the observed provider traffic's economics (a gateway's plan)")
    pl.add_argument("--url", dest="_url", default="http://127.0.0.1:8000")
    pl.add_argument("--api-key", dest="_key", default=os.environ.get("VCACHE_API_KEY"))
    pl.add_argument(
        "--batch-file", dest="_batch_file", default=None, help="plan a batch file, no gateway"
    )
    pl.add_argument(
        "--target",
        dest="_targets",
        action="append",
        default=[],
        help="with --batch-file: a hosted provider/model to plan the batch on (online in "
        "DAG order against its batch API); may be repeated",
    )
    pl.add_argument("--rpm", dest="_rpm", type=float, default=None, help="requests/min left")
    pl.add_argument("--tpm", dest="_tpm", type=float, default=None, help="input tokens/min left")
    return p


def overrides_from_flags(ns: argparse.Namespace) -> dict[str, Any]:
    """Turn dotted flag destinations into nested Settings keyword arguments (a
    destination starting with ``_`` is the command's own, e.g. ``--demo``: not a
    setting)."""
    out: dict[str, Any] = {}
    for dest, value in vars(ns).items():
        if dest == "command" or dest.startswith("_"):
            continue
        *parents, leaf = dest.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def is_loopback(host: str) -> bool:
    """True for an address only this host reaches: 127.0.0.0/8, ::1 (an IPv4-mapped
    127.x too) or ``localhost``.  Other names are not resolved: they count as public."""
    name = host.strip().removeprefix("[").removesuffix("]").lower()
    if name == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def anonymous_bind_refusal(host: str, keyed: bool, allow_anonymous: bool) -> str | None:
    """Why ``vcache serve`` must not start on ``host`` (None when it may): a host other
    than loopback with no API keys serves anyone who reaches it, unless asked for by name."""
    if keyed or allow_anonymous or is_loopback(host):
        return None
    return (
        f"refusing to serve {host} with no API keys (anyone who reaches it could call the "
        "gateway): configure api_keys, or pass --allow-anonymous (setting allow_anonymous, "
        "env VCACHE_ALLOW_ANONYMOUS=true) to serve it anonymously"
    )


def serve(settings: Settings, argv: list[str]) -> int:
    import uvicorn

    from engines.vllm.lifeline import die_with_parent
    from engines.vllm.shared_core import slots_from_env
    from gateway.app import create_app
    from gateway.http.server import guarded_protocol
    from gateway.local.build import build_replicas
    from gateway.workers import WORKER_ENV, reuse_port_socket

    setup_logging(settings.log_level, settings.log_format)
    # `kill -USR1 <pid>` prints every thread's stack to stderr: a process that hangs says where
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if settings.workers > 1 and WORKER_ENV not in os.environ:  # the parent of the workers
        return serve_workers(settings, argv)
    attached = slots_from_env(os.environ)  # a worker beside its parent's engine cores
    if settings.workers > 1:
        die_with_parent(signal.SIGTERM)
        settings = settings.model_copy(
            update={"instance_id": f"{settings.instance_id}-w{settings.worker_index}"}
        )
    # A lost terminal (SIGHUP) shuts down gracefully like SIGTERM: engines are closed.
    signal.signal(signal.SIGHUP, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    with tempfile.TemporaryDirectory(prefix="vcache-") as runtime:
        if attached is None:
            replicas = build_replicas(settings, Path(runtime))
        else:
            replicas = build_replicas(settings, Path(attached[0]), attached[1])
        app = create_app(settings, replicas)
        h = settings.http
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            log_config=None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
            timeout_graceful_shutdown=10,
            http=guarded_protocol(
                h.max_header_bytes, h.header_timeout_s, h.max_requests_per_connection
            ),
            timeout_keep_alive=int(max(1, h.keep_alive_s)),
            limit_concurrency=h.max_connections,
        )
        sockets = (
            [reuse_port_socket(settings.host, settings.port)] if settings.workers > 1 else None
        )
        uvicorn.Server(config).run(sockets=sockets)
    return 0


def serve_workers(settings: Settings, argv: list[str]) -> int:
    """The parent of ``--workers``: it runs the embedded replicas' engine cores, if any,
    and the workers attached to them (gateway/workers.py)."""
    from gateway.workers import run_workers

    n, host, port = settings.workers, settings.host, settings.port
    if settings.engine.replicas == 0:
        return run_workers(n, host, port, argv)
    from engines.vllm.shared_core import SharedCores
    from gateway.local.build import engine_configs, resolve_model

    with tempfile.TemporaryDirectory(prefix="vcache-") as runtime:
        configs = engine_configs(settings, Path(runtime), resolve_model(settings))
        cores = SharedCores(configs, n, runtime)
        return run_workers(n, host, port, argv, cores)


def _settings(ns: argparse.Namespace) -> Settings:
    """Flags over environment over the YAML file; a bad setting exits with its key named."""
    try:
        lines = unknown_env(os.environ)
        if not lines:
            return Settings(**overrides_from_flags(ns))
    except ValidationError as exc:
        lines = explain(exc)
    except (OSError, yaml.YAMLError) as exc:
        lines = [f"cannot read the config file: {exc}"]
    print("vcache: invalid configuration", file=sys.stderr)
    for line in lines:
        print(f"  {line}", file=sys.stderr)
    raise SystemExit(2)


def _demo_vision(ns: argparse.Namespace, settings: Settings) -> Settings:
    """``settings`` serving the demo vision model (built once under the data dir), named
    ``demo-vision`` unless ``--served-model-name`` says otherwise."""
    from engines.vllm.demo_vision import ensure_demo_vision_model

    if settings.model:
        print("vcache: --demo vision serves its own model: drop --model", file=sys.stderr)
        raise SystemExit(2)
    ns.model = str(ensure_demo_vision_model(settings.data_dir))
    if not settings.served_model_name:
        ns.served_model_name = DEMO_VISION_NAME
    return _settings(ns)


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.command == "hash-key":
        print(hash_api_key(ns.key))
        return 0
    if ns.command in ("sessions", "replay"):
        from gateway import session_cli

        db, limit = ns._db, getattr(ns, "_limit", 50)
        rid, quiet = getattr(ns, "request_id", ""), getattr(ns, "quiet", False)
        for name in ("_db", "_limit", "request_id", "quiet"):
            if hasattr(ns, name):
                delattr(ns, name)
        settings = _settings(ns)
        if ns.command == "sessions":
            return session_cli.list_sessions(settings, db, limit)
        return session_cli.replay(settings, db, rid, quiet)
    if ns.command == "plan":
        from gateway import plan_cli

        if ns._batch_file is not None:
            return plan_cli.main_file(Path(ns._batch_file), ns._targets, ns._rpm, ns._tpm)
        return plan_cli.main(ns._url, ns._key)
    if ns.command == "calibrate":
        from gateway.providers import calibrate

        target, emulator = ns.target, ns._emulator
        del ns.target, ns._emulator
        return calibrate.main(_settings(ns), target, emulator)
    vision = bool(getattr(ns, "_vision", False))
    demo = getattr(ns, "_demo", None)
    for name in ("_vision", "_demo"):
        if hasattr(ns, name):
            delattr(ns, name)
    settings = _settings(ns)
    if demo == "vision":
        settings = _demo_vision(ns, settings)
    if ns.command == "demo-model":
        from engines.vllm.demo_model import ensure_demo_model
        from engines.vllm.demo_vision import ensure_demo_vision_model

        build = ensure_demo_vision_model if vision else ensure_demo_model
        print(build(settings.data_dir))
        return 0
    refusal = anonymous_bind_refusal(
        settings.host, bool(settings.api_keys), settings.allow_anonymous
    )
    if refusal is not None:
        print(f"vcache: {refusal}", file=sys.stderr)
        raise SystemExit(2)
    return serve(settings, list(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
