"""Seconds of the ``reward.rule`` stage's host work on one batch: decoding the responses and the
GSM8K verifier, the last-number fallback's scan against the whole-text scan it replaced.

Why: in the e2e benchmark's 0.5B pair the reward stage took 0.09-0.16 s of a ~2.5 s on-policy
step (256 responses of 256 random tokens: no ``####``, so every response goes to the fallback,
which scanned the whole text for numbers). Long reasoning responses scale the same scan.

    python benchmarks/reward_stage.py [--rows 256] [--tokens 256] [--rounds 5] [--md-out FILE]

Responses are random token ids of the bundled SmolLM2 tokenizer (what a random-weight model
samples), decoded as the stage decodes them (``ops.reward.decode_responses``); both verifiers
score every row against "42" and must agree row for row. Rounds interleave the two verifiers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (  # noqa: E402
    command_line,
    git_revision,
    machine_info,
    markdown_table,
    utc_now,
)


def whole_text_number(text: str, last: bool):
    """The first or last number of ``text`` by the definition: every ``_NUMBER`` match of the whole
    text listed (the scan ``gsm8k._number_in`` did before; tests/unit/test_gsm8k_reward.py holds
    the fast scan to it)."""
    from flowrl.rewards.gsm8k import _NUMBER, _canonical

    ms = list(_NUMBER.finditer(text))
    if not ms:
        return None
    m = ms[-1] if last else ms[0]
    return _canonical(m.group("sign") or "", m.group("digits"))


def whole_text_reward(text: str, truth: str) -> float:
    """gsm8k_reward with fallback_last_number=True as it was (:func:`whole_text_number`)."""
    from decimal import Decimal

    from flowrl.rewards.gsm8k import MARKER

    number_in = whole_text_number
    _, marker, tail = text.rpartition(MARKER)
    if marker and (found := number_in(tail.lstrip().split("\n", 1)[0], False)) is not None:
        return 1.0 if Decimal(found) == Decimal(truth) else 0.0
    found = number_in(text, True)
    return 1.0 if found is not None and Decimal(found) == Decimal(truth) else 0.0


def main(argv: "list[str] | None" = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--md-out", default=None)
    a = p.parse_args(argv)

    import torch

    from flowrl.models import ModelConfig, tiny_model_config
    from flowrl.models.loading import load_tokenizer
    from flowrl.ops.reward import decode_responses
    from flowrl.rewards.gsm8k import gsm8k_reward

    tok = load_tokenizer(ModelConfig(tiny=tiny_model_config()))
    ids = torch.randint(0, len(tok), (a.rows, a.tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.bool)
    variants = {
        "decode (batch_decode)": lambda: decode_responses(tok, ids, mask),
        "verify: whole-text scan (before)": lambda: [whole_text_reward(t, "42") for t in texts],
        "verify: last-digit run scan (now)": lambda: [
            gsm8k_reward(t, "42", fallback_last_number=True) for t in texts],
    }
    texts = decode_responses(tok, ids, mask)
    chars = statistics.mean(len(t) for t in texts)
    times: dict[str, list[float]] = {k: [] for k in variants}
    out: dict[str, object] = {}
    for r in range(a.rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            out[name] = fn()
            times[name].append(time.perf_counter() - t0)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.4f} s" for k, v in times.items()))
    if out["verify: whole-text scan (before)"] != out["verify: last-digit run scan (now)"]:
        sys.exit("the two verifiers disagree on some row")
    before = statistics.median(times["verify: whole-text scan (before)"])
    rows = [(k, f"{statistics.median(v):.4f}", f"{min(v):.4f}-{max(v):.4f}",
             f"{statistics.median(v) / before:.3f}x" if k.startswith("verify") else "")
            for k, v in times.items()]
    table = markdown_table(["part", "median s", "min-max s", "/ before"], rows)
    print(table)
    if a.md_out:
        m = machine_info()
        lines = ["# The reward.rule stage's host work: decode and the GSM8K verifier", "",
                 f"- command: `{command_line(None if argv is None else [__file__, *argv])}`",
                 f"- date: {utc_now()}; flowrl commit {git_revision()}",
                 f"- machine: {m['cpu']}, {m['logical_cpus']} CPUs, {m['memory']}; Python {m['python']}; "
                 f"load average (1 min) at the end {os.getloadavg()[0]:.2f}",
                 f"- batch: {a.rows} responses of {a.tokens} random SmolLM2-tokenizer ids "
                 f"({chars:,.0f} characters on average), every one scored against \"42\"; "
                 f"{a.rounds} interleaved rounds; the two verifiers agree on every row", "",
                 table, ""]
        with open(a.md_out, "w") as f:
            f.write("\n".join(lines))


if __name__ == "__main__":
    main()
