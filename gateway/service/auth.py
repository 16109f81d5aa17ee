"""Bearer API keys, stored as sha256 hashes; the key names the caller's tenant."""

from __future__ import annotations

import hmac

from fastapi import Request

from gateway.core.config import ApiKeyConfig, hash_api_key
from gateway.core.errors import AuthenticationFailed
from gateway.core.types import Principal

ANONYMOUS = Principal(tenant="default", key_name="anonymous", admin=True, global_admin=True)


class KeyRing:
    def __init__(self, keys: list[ApiKeyConfig]) -> None:
        self._keys = list(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of a bearer header; anonymous when no key is configured."""
        if not self._keys:
            return ANONYMOUS
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
        return Principal(
            tenant=match.tenant,
            key_name=match.name,
            admin=match.admin,
            global_admin=match.admin and match.scope == "global",
        )


async def require_principal(request: Request) -> Principal:
    """FastAPI dependency for every /v1 route."""
    keyring: KeyRing = request.app.state.keyring
    return keyring.authenticate(request.headers.get("authorization"))


async def require_anthropic_principal(request: Request) -> Principal:
    """The Messages API's keys: ``x-api-key`` as Anthropic's clients send it, or a bearer
    header, checked against the same keys."""
    keyring: KeyRing = request.app.state.keyring
    key = request.headers.get("x-api-key")
    return keyring.authenticate(f"Bearer {key}" if key else request.headers.get("authorization"))
