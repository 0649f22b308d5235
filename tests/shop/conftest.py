"""Fixtures for the shop's tests, as a team would write them: a real Valkey (the plugin's
``framework_redis_url``), a fresh namespace per test, and a fresh SQLite database per test that
the services' resources open through ``$DATABASE_URL``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from example_services.shop import db


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def shop_db_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh SQLite database, set as ``$DATABASE_URL`` for the services' resources."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'shop.db'}"
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setenv("SHOP_GATEWAY_FLAKINESS", "0")  # tests that want failures set their own rate
    monkeypatch.setenv("SHOP_MAIL_FLAKINESS", "0")
    yield url


@pytest.fixture
async def shop_engine(shop_db_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine on that database with the shop's tables, for arranging and checking rows."""
    engine = db.open_engine(shop_db_url)
    await db.prepare(engine)
    yield engine
    await engine.dispose()
