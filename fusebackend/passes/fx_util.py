"""Small FX helpers shared by the passes (a leaf module: imports nothing from the package)."""

from __future__ import annotations

import torch.fx

__all__ = ["example_value"]


def example_value(node: torch.fx.Node) -> object:
    """The fake tensor (or value) Dynamo recorded for ``node``, or None."""
    return node.meta.get("example_value", node.meta.get("val"))
