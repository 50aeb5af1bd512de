"""Fixtures of the structured-output tests."""

from __future__ import annotations

import threading

import pytest

from tokenmill.structured.matcher import BitmaskFiller


@pytest.fixture
def fill_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that fill grammar masks, one per `BitmaskFiller.fill` call."""
    names: list[str] = []
    fill = BitmaskFiller.fill

    def spy(self, *args, **kwargs):
        names.append(threading.current_thread().name)
        return fill(self, *args, **kwargs)

    monkeypatch.setattr(BitmaskFiller, "fill", spy)
    return names
