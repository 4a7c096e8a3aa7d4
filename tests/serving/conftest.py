"""Fixtures the server tests share: an httpx client of the module's `server` fixture (a
module that speaks through another client defines its own `client`)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from serving.testing import RunningServer


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c
