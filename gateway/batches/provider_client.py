"""Both hosted providers' own batch APIs, spoken over the provider transport:
OpenAI's (a ``purpose: batch`` JSON lines file uploaded, ``POST /batches`` on it, the
batch polled until it ends, its output and error files read) and Anthropic's Message
Batches (``POST /messages/batches`` with the requests, polled, its ``results_url``
read).  Each item's line carries the exact bytes the gateway rendered for it (the
JSON body the online request would have sent), so what the provider receives is what
the session log recorded.  The calls that make a submission are retried (429, 5xx, no
answer: bounded), and a create whose answer was lost is looked for before a retry.

A lost create is looked for in the provider's list of batches, newest first, page by
page (``after`` / ``after_id``, 100 a page), back to the batches that were there before
the submission (its lookup: the newest page, read before the create), at most
``lookup_pages`` pages (:data:`LOOKUP_PAGES`: 2,000 batches made since).  Past that, or
where Anthropic's list holds two new batches of the submission's size, whether the
create made a batch cannot be told: :class:`Unreadable`, never a second batch.

Errors::

    BatchAPIError            the provider refused or failed (``transient``: worth a retry)
    └── Unreadable           a submission this gateway cannot follow: whether it was made
                             cannot be told, or its target's batch API is no longer here
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engines.providers.base import Rendered
from engines.providers.transport import AiohttpTransport, Transport, TransportError

log = logging.getLogger(__name__)

SUPPORTED = ("openai", "anthropic")
TERMINAL = {"completed", "failed", "expired", "cancelled", "ended"}
SUBMIT_ATTEMPTS = 5  # tries of each call that makes a submission, then its items fail
SUBMIT_BACKOFF_S = 1.0  # before the second try, doubling, at most SUBMIT_BACKOFF_CAP_S
SUBMIT_BACKOFF_CAP_S = 30.0
SUBMIT_FAILED = "provider_batch_submit_failed"  # the items' error code when it never took
LOOKUP_PAGE = 100  # batches a page when a submission is looked for (OpenAI's most)
LOOKUP_PAGES = 20  # pages read back to the batches before a submission, at most

# an item's result from a provider's batch: (status code, body), or never run
Result = tuple[int, Any] | Literal["canceled", "expired"]


@dataclass(frozen=True)
class Endpoint:
    """Where a target's batch API lives and how to authenticate to it."""

    provider: str
    base_url: str  # the provider's API root (…/v1)
    headers: Mapping[str, str]


@dataclass(frozen=True)
class Finished:
    """A provider's batch that has ended: its status there, custom_id → result, and what
    an item the results leave out is (``rest``; None: an item the provider lost)."""

    status: str
    results: dict[str, Result]
    rest: Result | None = None

    def of(self, custom_id: str) -> Result | None:
        return self.results.get(custom_id, self.rest)


class BatchAPIError(Exception):
    """The provider's batch API refused or failed the submission (``transient``: a 429,
    a 5xx or no answer, worth another try)."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class Unreadable(BatchAPIError):
    """A submission this gateway cannot follow (never transient): whether its create made
    a batch cannot be told (the provider's list read to its bound, or two candidates),
    or its target's batch API is no longer configured.  Its items end with this error;
    nothing is submitted again."""


class BatchAPIClient:
    def __init__(
        self,
        transport: Transport | None = None,
        poll_s: float = 30.0,
        *,
        attempts: int = SUBMIT_ATTEMPTS,
        backoff_s: float = SUBMIT_BACKOFF_S,
        call_timeout_s: float = 120.0,
        lookup_pages: int = LOOKUP_PAGES,
    ) -> None:
        """``transport``: how requests reach the providers (None: an aiohttp session of its
        own, closed by :meth:`aclose`); ``poll_s``: between two reads of a running batch;
        ``attempts``, ``backoff_s``: how often and how far apart a call that makes a
        submission is tried (a 429, 5xx or timeout); ``call_timeout_s``: one call's bound;
        ``lookup_pages``: pages of the provider's list read looking for a submission."""
        self._own = transport is None
        self._transport: Transport = transport or AiohttpTransport()
        self._poll_s = poll_s
        self._attempts = max(1, attempts)
        self._backoff_s = backoff_s
        self._call_timeout_s = call_timeout_s
        self._lookup_pages = max(1, lookup_pages)

    async def aclose(self) -> None:
        if self._own:
            await self._transport.aclose()

    async def _call(
        self, e: Endpoint, method: str, url: str, body: bytes | None = None, ctype: str = ""
    ) -> tuple[int, bytes]:
        """Status and body; :class:`BatchAPIError` (transient) when no answer came."""
        headers = dict(e.headers)
        if ctype:
            headers["content-type"] = ctype
        full = url if url.startswith("http") else e.base_url.rstrip("/") + url
        try:
            async with asyncio.timeout(self._call_timeout_s):
                async with self._transport.request(method, full, headers, body) as r:
                    data = await r.read()
                    return r.status, data
        except (TransportError, TimeoutError) as exc:
            raise BatchAPIError(f"{e.provider} {method} {url}: no answer ({exc!r})", True) from exc

    async def _json(
        self, e: Endpoint, method: str, url: str, body: bytes | None = None, ctype: str = ""
    ) -> Any:
        status, data = await self._call(e, method, url, body, ctype)
        if status >= 400:
            raise BatchAPIError(
                f"{e.provider} {method} {url}: HTTP {status}: {data[:300]!r}",
                status == 429 or status >= 500,
            )
        return json.loads(data)

    async def _tried(
        self,
        e: Endpoint,
        what: str,
        call: Callable[[], Awaitable[Any]],
        made: Callable[[], Awaitable[Any]] | None = None,
    ) -> Any:
        """``call()``, tried again after a transient failure (backoff doubling from
        ``backoff_s``), at most ``attempts`` times; before another try, ``made()`` looks
        for what a call whose answer was lost may have made (not None: that, no retry).
        :class:`BatchAPIError` naming the last failure when every try failed."""
        for attempt in range(self._attempts):
            try:
                return await call()
            except BatchAPIError as exc:
                if not exc.transient or attempt + 1 == self._attempts:
                    raise BatchAPIError(f"{what} failed after {attempt + 1} tries: {exc}") from exc
                log.warning("%s: try %d failed (%s), trying again", what, attempt + 1, exc)
                await asyncio.sleep(min(SUBMIT_BACKOFF_CAP_S, self._backoff_s * 2.0**attempt))
                if made is not None:
                    found = await made()
                    if found is not None:
                        return found
        raise AssertionError("unreachable")

    async def lookup(self, e: Endpoint) -> dict[str, Any]:
        """What finds a submission besides its token, read before it is made (and kept
        with it): the ids of the newest batches already there (``before``), where a look
        for it stops (the list is newest first).  OpenAI's batches carry the token as
        metadata; Anthropic's Message Batches carry none: the one batch of the
        submission's size listed before those is it."""
        if e.provider not in SUPPORTED:
            return {}
        page, _ = await self._page(e, None)
        return {"before": sorted(str(b["id"]) for b in page)}

    async def submit(
        self,
        e: Endpoint,
        items: Sequence[tuple[str, Rendered]],
        token: str,
        lookup: Mapping[str, Any] | None = None,
    ) -> str:
        """Submit ``items`` (custom_id, rendered request) as one batch: its id at the
        provider.  ``token`` and ``lookup`` (:meth:`lookup`; read now when None) name the
        submission: a create whose answer was lost is looked for by them before it is
        tried again, so a batch is never made twice."""
        if e.provider not in SUPPORTED:
            raise BatchAPIError(f"{e.provider} has no batch API here")
        found = lookup if lookup is not None else await self.lookup(e)
        before = set(found.get("before") or ())
        if e.provider == "openai":
            return await self._openai_submit(e, items, token, before)
        return await self._anthropic_submit(e, items, token, before)

    async def made(self, e: Endpoint, token: str, lookup: Mapping[str, Any], n: int) -> str | None:
        """The id of the batch a submission of ``n`` items named ``token`` (and
        ``lookup``) made, if the provider has it (None: it was never made).  OpenAI: the
        batch whose metadata carries the token; Anthropic: the one batch of ``n`` requests
        made since ``before`` (weaker: another client's batch of that size made since is
        taken for it).  :class:`Unreadable` when it cannot be told (see the module);
        :class:`BatchAPIError` when the provider's list cannot be read."""
        before = set(lookup.get("before") or ())
        if e.provider == "openai":
            b = await self._openai_made(e, token, before)
        elif e.provider == "anthropic":
            b = await self._anthropic_made(e, token, before, n)
        else:
            raise BatchAPIError(f"{e.provider} has no batch API here")
        return None if b is None else str(b["id"])

    async def wait(
        self, e: Endpoint, run_id: str, cancelled: Callable[[], Awaitable[bool]]
    ) -> Finished:
        """Poll the provider's batch until it ends, then its results.  Once
        ``cancelled()`` is true the provider's batch is cancelled (once); the results
        then hold what it finished before it stopped, the rest canceled.  A poll
        that fails for a while (429, 5xx, no answer) is tried again at the next poll;
        a refusal (another 4xx: the batch is gone) is :class:`BatchAPIError`."""
        url = f"/batches/{run_id}" if e.provider == "openai" else f"/messages/batches/{run_id}"
        key = "status" if e.provider == "openai" else "processing_status"
        asked = False
        while True:
            try:
                row = await self._json(e, "GET", url)
            except BatchAPIError as exc:
                if not exc.transient:
                    raise
                log.warning("polling %s's batch %s failed (%s)", e.provider, run_id, exc)
                row = {}
            if row.get(key) in TERMINAL:
                break
            if not asked and await cancelled():
                try:
                    await self._tried(
                        e, f"cancelling {run_id}", lambda: self._json(e, "POST", url + "/cancel")
                    )
                except BatchAPIError as exc:  # it ended first (409), or the provider is down:
                    log.warning("%s", exc)  # its results are read as they are
                asked = True
                continue
            await asyncio.sleep(self._poll_s)
        if e.provider == "openai":
            results = await self._openai_results(e, row)
        else:
            results = await self._anthropic_results(e, row)
        status = str(row[key])
        rest: Result | None = None  # an item the results leave out: not answered
        if status in ("cancelled", "expired") or asked:
            rest = "expired" if status == "expired" else "canceled"
        return Finished(status, results, rest)

    async def _openai_submit(
        self, e: Endpoint, items: Sequence[tuple[str, Rendered]], token: str, before: set[str]
    ) -> str:
        lines = b"".join(
            b'{"custom_id":'
            + json.dumps(cid).encode()
            + b',"method":"POST","url":'
            + json.dumps("/v1" + r.path).encode()
            + b',"body":'
            + r.body
            + b"}\n"
            for cid, r in items
        )
        boundary = f"vcache-{uuid.uuid4().hex}"
        form = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                f'filename="batch.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
            ).encode()
            + lines
            + f"\r\n--{boundary}--\r\n".encode()
        )
        ctype = f"multipart/form-data; boundary={boundary}"
        f = await self._tried(
            e, "uploading the batch file", lambda: self._json(e, "POST", "/files", form, ctype)
        )
        endpoint = "/v1" + items[0][1].path
        spec = {
            "input_file_id": f["id"],
            "endpoint": endpoint,
            "completion_window": "24h",
            "metadata": {"vcache_submission": token},
        }
        body = json.dumps(spec).encode()

        async def made() -> Any:
            return await self._openai_made(e, token, before)

        b = await self._tried(
            e,
            "creating the batch",
            lambda: self._json(e, "POST", "/batches", body, "application/json"),
            made,
        )
        return str(b["id"])

    async def _page(self, e: Endpoint, after: str | None) -> tuple[list[Any], str | None]:
        """One page of the provider's batches, newest first, after the batch ``after``
        (None: the newest): the batches and the cursor of the next page (None: the last).
        Tried as a submission's calls are: one that cannot be read ends the submission's
        tries rather than risk a second batch."""
        if e.provider == "openai":
            url, cursor = f"/batches?limit={LOOKUP_PAGE}", "after"
        else:
            url, cursor = f"/messages/batches?limit={LOOKUP_PAGE}", "after_id"
        if after is not None:
            url += f"&{cursor}={after}"
        page = await self._tried(e, f"listing {url}", lambda: self._json(e, "GET", url))
        data = list(page.get("data") or [])
        last = page.get("last_id") or (data[-1]["id"] if data else None)
        return data, (str(last) if page.get("has_more") and last else None)

    async def _since(
        self, e: Endpoint, token: str, before: set[str], found: Callable[[Any], bool]
    ) -> list[Any]:
        """The batches made since ``before`` that ``found`` takes for the submission
        ``token``, the list read newest first back to a batch of ``before`` (or its end);
        OpenAI's (``before`` empty: a submission kept by an older gateway) stop at the
        first found.  :class:`Unreadable` when ``lookup_pages`` pages hold neither."""
        out: list[Any] = []
        after: str | None = None
        for _ in range(self._lookup_pages):
            page, after = await self._page(e, after)
            for b in page:
                if str(b["id"]) in before:
                    return out
                if found(b):
                    out.append(b)
                    if e.provider == "openai":
                        return out
            if after is None:
                return out
        raise Unreadable(
            f"could not tell whether submission {token} made a batch on {e.provider}: "
            f"{self._lookup_pages * LOOKUP_PAGE} batches read without finding it "
            "or the batches there before it"
        )

    async def _openai_made(self, e: Endpoint, token: str, before: set[str]) -> Any:
        """The batch a failed create made, found by its token (None: none)."""

        def carries(b: Any) -> bool:
            return (b.get("metadata") or {}).get("vcache_submission") == token

        found = await self._since(e, token, before, carries)
        return found[0] if found else None

    async def _openai_results(self, e: Endpoint, row: Any) -> dict[str, Result]:
        if row["status"] == "failed":
            raise BatchAPIError(f"openai batch {row['id']} failed: {row.get('errors')}")
        out: dict[str, Result] = {}
        for key in ("output_file_id", "error_file_id"):
            if not row.get(key):
                continue
            url = f"/files/{row[key]}/content"
            data = await self._tried(e, f"reading {url}", functools.partial(self._bytes, e, url))
            for ln in data.splitlines():
                if not ln.strip():
                    continue
                x = json.loads(ln)
                resp = x.get("response")
                if resp is not None:
                    out[x["custom_id"]] = (int(resp["status_code"]), resp["body"])
                else:
                    code = (x.get("error") or {}).get("code")
                    out[x["custom_id"]] = "expired" if code == "batch_expired" else "canceled"
        return out

    async def _bytes(self, e: Endpoint, url: str) -> bytes:
        status, data = await self._call(e, "GET", url)
        if status >= 400:
            raise BatchAPIError(
                f"{e.provider} GET {url}: HTTP {status}", status == 429 or status >= 500
            )
        return data

    async def _anthropic_submit(
        self, e: Endpoint, items: Sequence[tuple[str, Rendered]], token: str, before: set[str]
    ) -> str:
        reqs = b",".join(
            b'{"custom_id":' + json.dumps(cid).encode() + b',"params":' + r.body + b"}"
            for cid, r in items
        )
        body = b'{"requests":[' + reqs + b"]}"
        ids = {cid for cid, _ in items}

        async def made() -> Any:
            return await self._anthropic_made(e, token, before, len(ids))

        b = await self._tried(
            e,
            "creating the message batch",
            lambda: self._json(e, "POST", "/messages/batches", body, "application/json"),
            made,
        )
        return str(b["id"])

    async def _anthropic_made(self, e: Endpoint, token: str, before: set[str], n: int) -> Any:
        """The batch a lost create made: Message Batches carry no metadata, so the one
        batch of ``n`` requests made since ``before`` (None: none; two:
        :class:`Unreadable`, either may be it)."""

        def sized(b: Any) -> bool:
            return sum(int(v) for v in (b.get("request_counts") or {}).values()) == n

        new = await self._since(e, token, before, sized)
        if len(new) > 1:
            ids = ", ".join(str(b["id"]) for b in new)
            raise Unreadable(
                f"could not tell whether submission {token} made a batch on {e.provider}: "
                f"{len(new)} batches of its {n} requests made since ({ids})"
            )
        return new[0] if new else None

    async def _anthropic_results(self, e: Endpoint, row: Any) -> dict[str, Result]:
        url = str(row["results_url"])
        data = await self._tried(e, f"reading {url}", lambda: self._bytes(e, url))
        out: dict[str, Result] = {}
        for ln in data.splitlines():
            if not ln.strip():
                continue
            x = json.loads(ln)
            result = x["result"]
            if result["type"] == "succeeded":
                out[x["custom_id"]] = (200, result["message"])
            elif result["type"] == "errored":
                err = result.get("error") or {}
                kind = (err.get("error") or {}).get("type")
                out[x["custom_id"]] = (500 if kind == "api_error" else 400, err)
            elif result["type"] in ("canceled", "expired"):
                out[x["custom_id"]] = result["type"]
        return out
