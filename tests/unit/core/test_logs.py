"""JSON log lines: one object per record, extras kept, exceptions included."""

from __future__ import annotations

import json
import logging

from gateway.core.logs import JsonFormatter, setup_logging


def test_a_record_is_one_json_object_with_its_extras() -> None:
    record = logging.LogRecord("gateway.app", logging.WARNING, "x.py", 1, "hi %s", ("you",), None)
    record.replica = "replica-0"
    out = json.loads(JsonFormatter().format(record))
    assert out["level"] == "warning" and out["logger"] == "gateway.app"
    assert out["message"] == "hi you" and out["replica"] == "replica-0"
    assert out["ts"].endswith("+00:00")


def test_an_exception_is_in_the_object() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("g", logging.ERROR, "x.py", 1, "failed", (), sys.exc_info())
    out = json.loads(JsonFormatter().format(record))
    assert "ValueError: boom" in out["exc"]


def test_setup_installs_one_handler_in_the_chosen_format() -> None:
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    names = ("uvicorn", "uvicorn.error", "uvicorn.access")
    others = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).propagate) for n in names}
    try:
        setup_logging("warning", "json")
        assert len(root.handlers) == 1 and isinstance(root.handlers[0].formatter, JsonFormatter)
        assert root.level == logging.WARNING
        assert logging.getLogger("uvicorn.access").propagate
        setup_logging("info", "text")
        assert not isinstance(root.handlers[0].formatter, JsonFormatter)
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
        for n, (handlers, propagate) in others.items():
            logging.getLogger(n).handlers[:] = handlers
            logging.getLogger(n).propagate = propagate
