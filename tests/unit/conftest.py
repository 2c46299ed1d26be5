"""Fixtures shared by the CPU unit tests."""
import pytest


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test the moment anything loads a model or builds engines (a check that must
    answer before any model loads); the list of calls stays empty."""
    from flowrl.models import loading
    from flowrl.runtime import resources

    loaded = []

    def flag(*a, **k):
        loaded.append(a)
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(loading, "load_model", flag)
    monkeypatch.setattr(resources, "build_engines", flag)  # the job imports it at setup
    return loaded
