"""API keys as the config keeps them: the key's sha256, its tenant, admin scope, the
priority its requests get and may ask for, and its limits."""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


def hash_api_key(key: str) -> str:
    """The form in which keys are stored in config: hex sha256 of the key."""
    return hashlib.sha256(key.encode()).hexdigest()


Priority = Literal["interactive", "default", "batch"]
PRIORITIES: tuple[Priority, ...] = ("interactive", "default", "batch")  # first is highest


class KeyLimits(BaseModel):
    """A key's limits (none by default): past one, a request is a 429 with Retry-After."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_minute: int | None = Field(None, ge=1)  # requests a minute
    tokens_per_minute: int | None = Field(None, ge=1)  # tokens a minute, prompt + completion
    max_concurrent: int | None = Field(None, ge=1)  # requests in flight at once

    def empty(self) -> bool:
        return (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent) == (
            None,
            None,
            None,
        )


class ApiKeyConfig(BaseModel):
    """One accepted key, stored as its sha256 (``vcache hash-key KEY`` prints it)."""

    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")  # the key's hex sha256 (vcache hash-key)
    # its callers' tenant: their cache salt (no KV shared across tenants) and sessions
    tenant: str = Field("default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    name: str = ""  # names the key in rate-limit errors, metrics and pin owners
    admin: bool = False  # the cache API and routing overrides, within its own tenant
    scope: Literal["tenant", "global"] = "tenant"  # global: an admin over every tenant
    priority: Priority = "default"  # x-vcache-priority when the request sends none
    max_priority: Priority = "interactive"  # the highest x-vcache-priority it may ask for
    limits: KeyLimits = Field(default_factory=KeyLimits)

    @model_validator(mode="after")
    def _priority_within_cap(self) -> ApiKeyConfig:
        if PRIORITIES.index(self.priority) < PRIORITIES.index(self.max_priority):
            raise ValueError(f"priority {self.priority} is above max_priority {self.max_priority}")
        return self
