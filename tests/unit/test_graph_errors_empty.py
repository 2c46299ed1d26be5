"""An empty graph file is named as such (it said "got a NoneType": YAML reads nothing as None)."""
from __future__ import annotations

import pytest

from flowrl.graph import GraphError
from flowrl.graph.validate import load_graph


@pytest.mark.parametrize("text, got", [("", "an empty file"), ("# only a comment\n", "an empty file"),
                                       ("- a\n- b\n", "a list")])
def test_a_graph_file_that_is_not_a_mapping_says_what_it_is(tmp_path, text, got):
    f = tmp_path / "g.yaml"
    f.write_text(text)
    with pytest.raises(GraphError) as e:
        load_graph(f)
    assert str(e.value).endswith(f"a graph file is a mapping with keys name, imports, algorithm, "
                                 f"data, bundles, stages, weight_sync; got {got}")
    assert str(e.value).startswith(str(f))
