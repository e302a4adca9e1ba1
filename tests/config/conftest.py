"""Every configuration test starts with the configuration variables unset."""

from __future__ import annotations

import pytest

from eventbus.config import CONFIG_ENV, SUBSCRIBERS_ENV


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv(SUBSCRIBERS_ENV, raising=False)
