"""API keys: `APIKeyAuth`, pure ASGI middleware, as `vllm serve --api-key` does.

Every request whose path starts with /v1, the profiler's (which write files on the server)
and vLLM's tokenizer routes (which run the tokenizer) must carry `Authorization: Bearer
<key>`; anything else gets 401 with OpenAI's error body (code `invalid_api_key`) before the
request is read any further, unknown /v1 routes included (a 404 would tell a stranger which
routes exist). /health and /metrics stay open for probes and scrapers.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from serving.protocol import send_error

#: The environment variable `inferlab serve` reads the key from when `api_key=` is not given.
API_KEY_ENV = "INFERLAB_API_KEY"
PROTECTED_PREFIX = "/v1"
#: the profiler's write files on the server; vLLM's tokenizer routes run the tokenizer
PROTECTED_PATHS = ("/start_profile", "/stop_profile", "/tokenize", "/detokenize", "/tokenizer_info")


class APIKeyAuth:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        # Digests of equal length: the comparison's time says nothing about the key, not even
        # its length.
        self._digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if not path.startswith(PROTECTED_PREFIX) and path not in PROTECTED_PATHS:
            await self.app(scope, receive, send)
            return
        given = _bearer_token(scope)
        if given is not None and hmac.compare_digest(hashlib.sha256(given).digest(), self._digest):
            await self.app(scope, receive, send)
            return
        message = (
            "Incorrect API key provided"
            if given is not None
            else "You didn't provide an API key; send it in an Authorization header using "
            "Bearer auth (Authorization: Bearer YOUR_KEY)"
        )
        await send_error(
            send, 401, message, "invalid_api_key", headers=[(b"www-authenticate", b"Bearer")]
        )


def _bearer_token(scope: Scope) -> bytes | None:
    """The token of `Authorization: Bearer <token>` (the scheme is case-insensitive)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def is_loopback(host: str) -> bool:
    """Whether a listening address only accepts connections from this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface
