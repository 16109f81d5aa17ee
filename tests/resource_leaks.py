"""A pytest plugin: what the tests open, they close.  A ResourceWarning (an unclosed file,
socket, subprocess pipe or ZMQ context, found by the garbage collector) raised while a
test is set up, run or torn down is recorded, listed at the end of the run, and fails
the run (its exit status), even when every test passed.

In ``tests/integration`` the collector runs after each test, so that what one leaves
(an SDK client's sockets, an engine's context) is recorded against it and not against a
test of another tier that happens to run the collector later.  Elsewhere the test named
is the one the collector ran in, which may be later than the one that leaked."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

COLLECTED_AFTER_EACH = "tests/integration/"  # the tier whose tests hold engines and clients


class ResourceLeaks:
    def __init__(self) -> None:
        self.failing: list[str] = []

    def pytest_warning_recorded(
        self, warning_message: object, when: str, nodeid: str, location: object
    ) -> None:
        category = getattr(warning_message, "category", None)
        if not (isinstance(category, type) and issubclass(category, ResourceWarning)):
            return
        self.failing.append(f"{nodeid or when}: {getattr(warning_message, 'message', '')}")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        try:
            return (yield)
        finally:
            if item.nodeid.startswith(COLLECTED_AFTER_EACH):
                gc.collect()  # inside the test's warning capture: recorded against it

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.failing and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.failing:
            terminalreporter.section("resources left to the garbage collector", red=True)
            for line in self.failing:
                terminalreporter.line(line)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", "always::ResourceWarning")
    config.pluginmanager.register(ResourceLeaks(), "resource-leaks")
