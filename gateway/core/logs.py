"""Log output: plain text for a terminal, or one JSON object per line for a log
pipeline (``log_format: json``), for the gateway's loggers and uvicorn's.  (The
engine processes vLLM starts keep vLLM's own format.)"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's coloured copy of the message
}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        for key, value in vars(record).items():  # fields passed with extra={...}
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                out[key] = value if isinstance(value, str | int | float | bool) else repr(value)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(level: str, fmt: str) -> None:
    """Root handler for everything; uvicorn's and vLLM's own handlers are replaced so
    every line has one format."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if fmt == "json":
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            lg = logging.getLogger(name)
            lg.handlers[:] = []
            lg.propagate = True
