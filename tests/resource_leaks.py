"""A pytest plugin: the run fails when what it ran left a resource to the garbage
collector (a ResourceWarning: an unclosed file, socket, ZMQ context, subprocess pipe).

Python ignores ResourceWarnings by default; here every one raised while a test is set
up, run or torn down is recorded, and the run's exit status is a failure naming each
(with the test it showed up in: the collector may run in a later test than the one that
leaked).  Whatever the gateway opens, it closes on every path: this holds the tests'
gateways, engines, stores and clients to that."""

from __future__ import annotations

import pytest


class ResourceLeaks:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def pytest_warning_recorded(
        self, warning_message: object, when: str, nodeid: str, location: object
    ) -> None:
        category = getattr(warning_message, "category", None)
        if isinstance(category, type) and issubclass(category, ResourceWarning):
            self.seen.append(f"{nodeid or when}: {getattr(warning_message, 'message', '')}")

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.seen and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.seen:
            terminalreporter.section("resources left to the garbage collector", red=True)
            for line in self.seen:
                terminalreporter.line(line)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", "always::ResourceWarning")
    config.pluginmanager.register(ResourceLeaks(), "resource-leaks")
