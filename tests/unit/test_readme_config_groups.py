"""README's config-groups table names every group of conf/ and each of its options (the
``cluster`` group was missing from it, so a reader never learnt of ``flowrl plan cluster=...``)."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_conf_group_and_option_is_in_the_readme_table():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Configuration"):readme.index("## Bundled tasks")]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| ([^|]*) \|", section, re.M)}
    groups = sorted(d.name for d in (REPO / "conf").iterdir() if d.is_dir())
    assert groups == ["cluster", "launcher", "model", "placement", "rollout", "teacher", "trainer"]
    for g in groups:
        assert g in rows, f"README's config-groups table has no `{g}` row"
        options = set(re.findall(r"`(\w+)`", rows[g]))
        assert options == {f.stem for f in (REPO / "conf" / g).glob("*.yaml")}, g
