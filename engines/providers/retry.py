"""Retries with jittered exponential backoff, honouring the provider's retry-after.

``retry-after-ms`` (milliseconds) wins over ``retry-after`` (seconds or an
HTTP date); a server-given delay longer than ``max_retry_after_s`` is not
waited for: the error goes to the caller (and to fallback) at once.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import random
from collections.abc import Mapping
from dataclasses import dataclass


def parse_retry_after(headers: Mapping[str, str], now: dt.datetime | None = None) -> float | None:
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return max(0.0, (when - (now or dt.datetime.now(dt.UTC))).total_seconds())


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 2
    base_s: float = 0.5
    cap_s: float = 8.0
    max_retry_after_s: float = 30.0

    def delay(self, attempt: int, retry_after_s: float | None, rng: random.Random) -> float | None:
        """Seconds to wait before retry number ``attempt + 1``; None: do not retry."""
        if attempt >= self.max_retries:
            return None
        if retry_after_s is not None:
            return retry_after_s if retry_after_s <= self.max_retry_after_s else None
        full = min(self.cap_s, self.base_s * 2.0**attempt)
        return full / 2 + rng.random() * full / 2  # "equal jitter"
