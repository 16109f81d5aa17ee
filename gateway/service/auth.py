"""Bearer API keys, stored as sha256 hashes; the key names the caller's tenant."""

from __future__ import annotations

import dataclasses
import hmac

from fastapi import Request

from gateway.core.config import PRIORITIES, ApiKeyConfig, Priority, hash_api_key
from gateway.core.errors import AuthenticationFailed, InvalidRequest
from gateway.core.types import Principal

PRIORITY_HEADER = "x-vcache-priority"

# The caller when no key is configured: never an admin (the cache API and the routing
# headers need a key with ``admin: true`` in ``api_keys``).
ANONYMOUS = Principal(tenant="default", key_name="anonymous", admin=False, global_admin=False)


class KeyRing:
    def __init__(self, keys: list[ApiKeyConfig]) -> None:
        self._keys = list(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None, priority: str | None = None) -> Principal:
        """The principal of a bearer header (anonymous when no key is configured), at the
        ``priority`` it asks for (``x-vcache-priority``), capped at its key's."""
        if not self._keys:
            return with_priority(ANONYMOUS, priority, "default", "interactive")
        if not authorization:
            raise AuthenticationFailed(
                "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'",
                code="missing_api_key",
            )
        scheme, _, token = authorization.partition(" ")
        digest = hash_api_key(token.strip()) if scheme.lower() == "bearer" else ""
        match = None
        for key in self._keys:  # compare every key: no early exit to time
            if hmac.compare_digest(digest, key.sha256):
                match = key
        if match is None:
            raise AuthenticationFailed("Incorrect API key provided", code="invalid_api_key")
        who = Principal(
            tenant=match.tenant,
            key_name=match.name,
            admin=match.admin,
            global_admin=match.admin and match.scope == "global",
            limits=None if match.limits.empty() else match.limits,
        )
        return with_priority(who, priority, match.priority, match.max_priority)


def with_priority(who: Principal, asked: str | None, default: Priority, cap: Priority) -> Principal:
    """``who`` at the priority asked for (its key's default when none), never above
    ``cap``; a value that is not a priority is a 400 naming the header."""
    if asked is None:
        chosen = default
    elif asked in PRIORITIES:
        chosen = PRIORITIES[max(PRIORITIES.index(asked), PRIORITIES.index(cap))]
    else:
        raise InvalidRequest(
            f"{PRIORITY_HEADER} must be one of {', '.join(PRIORITIES)}",
            param=PRIORITY_HEADER,
            code="invalid_value",
        )
    return dataclasses.replace(who, priority=chosen)


async def require_principal(request: Request) -> Principal:
    """FastAPI dependency for every /v1 route."""
    keyring: KeyRing = request.app.state.keyring
    h = request.headers
    return keyring.authenticate(h.get("authorization"), h.get(PRIORITY_HEADER))


async def require_anthropic_principal(request: Request) -> Principal:
    """The Messages API's keys: ``x-api-key`` as Anthropic's clients send it, or a bearer
    header, checked against the same keys."""
    keyring: KeyRing = request.app.state.keyring
    h = request.headers
    key = h.get("x-api-key")
    auth = f"Bearer {key}" if key else h.get("authorization")
    return keyring.authenticate(auth, h.get(PRIORITY_HEADER))
