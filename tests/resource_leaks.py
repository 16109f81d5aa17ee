"""A pytest plugin: what the tests open, they close.  A ResourceWarning (an unclosed file,
socket, subprocess pipe or ZMQ context, found by the garbage collector) raised while a
test is set up, run or torn down is recorded and listed at the end of the run.

Outside ``tests/integration`` a recorded warning fails the run (its exit status), even
when every test passed.  ``tests/integration`` is listed, not failed: some of its tests
still leave loopback client sockets behind (docs/development.md).  The
collector runs after each of its tests, so that what one leaves is recorded against it
and not against a test of another tier that happens to run the collector later."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

LISTED_ONLY = "tests/integration/"  # recorded and listed, not failed (see the module doc)


class ResourceLeaks:
    def __init__(self) -> None:
        self.failing: list[str] = []
        self.listed: list[str] = []

    def pytest_warning_recorded(
        self, warning_message: object, when: str, nodeid: str, location: object
    ) -> None:
        category = getattr(warning_message, "category", None)
        if not (isinstance(category, type) and issubclass(category, ResourceWarning)):
            return
        line = f"{nodeid or when}: {getattr(warning_message, 'message', '')}"
        (self.listed if nodeid.startswith(LISTED_ONLY) else self.failing).append(line)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        try:
            return (yield)
        finally:
            if item.nodeid.startswith(LISTED_ONLY):
                gc.collect()  # inside the test's warning capture: recorded against it

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.failing and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.failing:
            terminalreporter.section("resources left to the garbage collector", red=True)
            for line in self.failing:
                terminalreporter.line(line)
        if self.listed:
            terminalreporter.section("resources left by tests/integration (listed only)")
            for line in self.listed:
                terminalreporter.line(line)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", "always::ResourceWarning")
    config.pluginmanager.register(ResourceLeaks(), "resource-leaks")
