"""Fixtures shared by the CPU unit tests."""
import pytest


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test the moment anything loads a model or builds engines (a check that must
    answer before any model loads); the list of calls stays empty."""
    from flowrl.models import loading
    from flowrl.runtime.step import resources

    loaded = []

    def flag(*a, **k):
        loaded.append(a)
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(loading, "load_model", flag)
    monkeypatch.setattr(resources, "build_engines", flag)  # the job imports it at setup
    return loaded


@pytest.fixture
def fake_supervise(monkeypatch):
    """Replace torchrun's in-process agent (``runtime/control/supervise.py``) by a recorder: the
    dict it returns gets ``argv`` (torchrun's arguments) and ``overrides``; the launch then exits 0."""
    from flowrl.runtime.control import supervise

    seen: dict = {}

    def record(torchrun_args, overrides):
        seen["argv"], seen["overrides"] = torchrun_args, overrides
        return 0

    monkeypatch.setattr(supervise, "supervise", record)
    return seen


@pytest.fixture
def peer_pair():
    """Two ``PeerMonitor``s (ranks 0 and 1, heartbeat 20 s, stale after 60 s) over one local
    TCPStore, rank 0 checked once at t=0 right after rank 1's first beat."""
    import datetime

    from torch.distributed import TCPStore

    from flowrl.runtime.io.distributed import PeerMonitor

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=10))
    a, b = PeerMonitor(master, 0, 2, 20.0, 60.0), PeerMonitor(master, 1, 2, 20.0, 60.0)
    a._last_check = 0.0
    b.beat()
    a.check(0.0)
    return a, b
