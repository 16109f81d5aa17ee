"""Values every stage passes around: who calls, an admin's routing choice, where a
request was served (read into the ``x-vcache-*`` response headers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from gateway.core.config import LOCAL_TARGET, KeyLimits, Priority
from manifest.sessionlog import session_name

T = TypeVar("T")


@dataclass(frozen=True)
class Principal:
    """Who is calling.  The tenant salts the engine's prefix cache."""

    tenant: str
    key_name: str = ""
    admin: bool = False
    global_admin: bool = False  # may act on other tenants' spans (names them or raw hashes)
    priority: Priority = "default"  # this request's (x-vcache-priority, within the key's cap)
    limits: KeyLimits | None = None  # the key's


# x-vcache-priority as vLLM's request priority (lower is scheduled first)
ENGINE_PRIORITY: dict[Priority, int] = {"interactive": -1, "default": 0, "batch": 1}


def tenant_salt(tenant: str) -> str:
    """vLLM's cache_salt for a tenant: tenants never share a prefix-cache span."""
    return f"tenant:{tenant}"


def request_salt(tenant: str, client_salt: str | None) -> str:
    """The cache salt of a request: its tenant's, and within it the client's own
    (vLLM's ``cache_salt``) where given; a client salt never replaces the tenant's."""
    salt = tenant_salt(tenant)
    return salt if client_salt is None else f"{salt}|salt:{client_salt}"


@dataclass(frozen=True)
class RouteOverride:
    """An admin's choice for one request: a policy, or one replica (load-test oracles)."""

    policy: str | None = None
    replica: str | None = None


class Placement(Protocol):
    """The local replica a request went to, and what the manifest predicted there."""

    @property
    def replica_id(self) -> str: ...

    @property
    def predicted_cached_tokens(self) -> int | None: ...

    @property
    def approximate(self) -> str:
        """Why the prediction may be wrong ("": exact)."""
        ...

    def headers(self) -> dict[str, str]: ...


@dataclass
class Served:
    """Where a request was served, read into the ``x-vcache-*`` response headers after
    the first token.  The service loop is the one writer."""

    target: str = LOCAL_TARGET
    dispatch: Placement | None = None
    notes: dict[str, str] = field(default_factory=dict)  # headers of how it was prepared
    fallback_from: tuple[str, ...] = ()
    # of an alias's targets: "cost" (a later one went first, cheaper) or "order" (the
    # alias's first went first); None for a model with one target
    routed_by: str | None = None
    session: str | None = None  # the stored id of the session-log session it was appended to
    session_kind: str | None = None  # named, found (by prefix digests) or new
    answer_seq: int | None = None  # the sequence number of its answer in that session
    limits: dict[str, str] = field(default_factory=dict)  # the key's x-ratelimit-* headers

    def headers(self) -> dict[str, str]:
        h = {"x-vcache-target": self.target}
        if self.dispatch is not None:
            h.update(self.dispatch.headers())
        h.update(self.notes)
        if self.session:
            h["x-vcache-session"] = session_name(self.session)
            if self.session_kind:
                h["x-vcache-session-kind"] = self.session_kind
        if self.routed_by:
            h["x-vcache-routed-by"] = self.routed_by
        if self.fallback_from:
            h["x-vcache-fallback-from"] = ", ".join(self.fallback_from)
        h.update(self.limits)
        return h


@dataclass(frozen=True)
class Routed(Generic[T]):
    """A result and where it was served (for the x-vcache-* response headers)."""

    body: T
    served: Served

    def headers(self) -> dict[str, str]:
        return self.served.headers()
