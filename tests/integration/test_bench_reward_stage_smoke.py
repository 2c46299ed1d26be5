"""CPU smoke test of benchmarks/reward_stage.py: both verifiers run, agree row for row (the
script exits otherwise) and the report holds the three parts."""
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import reward_stage  # noqa: E402


def test_smoke_rows_and_report(tmp_path):
    out = tmp_path / "rs.md"
    reward_stage.main(["--rows", "8", "--tokens", "32", "--rounds", "1", "--md-out", str(out)])
    text = out.read_text()
    assert "--rows 8 --tokens 32 --rounds 1" in text and "8 responses of 32" in text
    rows = [line for line in text.splitlines() if re.match(r"\| (decode|verify)", line)]
    assert [r.split(" | ")[0] for r in rows] == [
        "| decode (batch_decode)", "| verify: whole-text scan (before)",
        "| verify: last-digit run scan (now)"]
    assert rows[1].endswith("| 1.000x |")
