"""Tools of tests/unit/test_multi_turn.py, importable by spawned tool workers (no torch import:
the workers run under a memory cap)."""
import time


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return str(a + b)


def hangs(seconds: float) -> str:
    """Sleep (a hung tool).

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "woke"


def raises(message: str) -> str:
    """Raise (a broken tool).

    Args:
        message: the error text.
    """
    raise RuntimeError(message)


def garbage(n: int):
    """Return something that is neither text nor JSON.

    Args:
        n: ignored.
    """
    return {1, 2, 3}


def allocates(megabytes: int) -> str:
    """Allocate memory (beyond the workers' cap).

    Args:
        megabytes: how much.
    """
    block = bytearray(megabytes << 20)
    return str(len(block))
