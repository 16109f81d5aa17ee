"""The admin key of the gateways the load tests start.

A caller without a key is never an admin (gateway/service/auth.py): the cache API
(``/v1/cache/...``) and the routing headers (``x-vcache-routing``, ``x-vcache-replica``)
answer 403 ``admin_required`` without a key that has ``admin: true`` in ``api_keys``.  A
load test that uses either starts its gateway with ``admin_env()`` (the setting
``VCACHE_API_KEYS``: ``ADMIN_KEY``, an admin of scope global whose tenant is "default", the
tenant of a caller without a key) and sends the key: ``bearer()`` on its own requests,
``locust_env()`` to its locust users (``VCACHE_API_KEY``, which locustfile.py and
agents_locust.py send as ``Authorization: Bearer``).  With keys configured every request
needs one, so the users send it on every request, not only on those with the headers.
"""

from __future__ import annotations

import json
from typing import Any

ADMIN_KEY = "sk-loadtest-admin"


def key_entry(key: str, **fields: Any) -> dict[str, Any]:
    """One entry of ``api_keys`` for ``key`` (its sha256 and ``fields``), checked the way
    the gateway reads it."""
    from gateway.core.keys import ApiKeyConfig, hash_api_key

    entry = ApiKeyConfig(sha256=hash_api_key(key), **fields)
    return entry.model_dump(mode="json", exclude_defaults=True)


def api_keys_env(*entries: dict[str, Any]) -> dict[str, str]:
    """The environment that configures a gateway's ``api_keys`` (entries of ``key_entry``)."""
    return {"VCACHE_API_KEYS": json.dumps(list(entries))}


def admin_entry(key: str = ADMIN_KEY) -> dict[str, Any]:
    """``key`` as a global admin of the tenant "default"."""
    return key_entry(key, name="loadtest-admin", admin=True, scope="global")


def admin_env(key: str = ADMIN_KEY) -> dict[str, str]:
    """The environment of a gateway whose one key is the admin ``key``."""
    return api_keys_env(admin_entry(key))


def bearer(key: str = ADMIN_KEY) -> dict[str, str]:
    """The header that sends ``key``."""
    return {"Authorization": f"Bearer {key}"}


def locust_env(key: str = ADMIN_KEY) -> dict[str, str]:
    """The environment that makes the locust users send ``key`` on every request."""
    return {"VCACHE_API_KEY": key}
