from flowrl.graph.graph import Graph, GraphError, Stage, WeightSync, parse_ref
from flowrl.graph.validate import (
                                   ConditionalInputWarning,
                                   GraphWarning,
                                   UnusedOutputWarning,
                                   validate_graph,
)

__all__ = ["Graph", "GraphError", "Stage", "WeightSync", "parse_ref", "validate_graph",
           "GraphWarning", "UnusedOutputWarning", "ConditionalInputWarning"]
