"""capture: a model or callable + example inputs -> an ATen FX graph to shard.

Three ways in, one result (``Captured``): ``capture_forward`` (``torch.export``), ``capture_joint``
(the forward+backward graph, AOTAutograd) and ``capture_dynamo_graph`` (a graph dynamo hands the
``torch.compile`` backend).  Planned module boundaries are marked with ``fxshard::boundary`` nodes
(``markers``); repeated layers can be traced once and stitched (``stitch``, ``layers``).
"""

from .common import Captured, decomposition_table
from .dynamo import capture_dynamo_graph, dynamo_sources, source_fqn
from .export import capture_forward
from .joint import capture_joint
from .layers import alike_layers, layer_groups

__all__ = [
    "Captured",
    "capture_forward",
    "capture_joint",
    "capture_dynamo_graph",
    "dynamo_sources",
    "source_fqn",
    "decomposition_table",
    "layer_groups",
    "alike_layers",
]
