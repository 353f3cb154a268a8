"""fusebackend: the ``infinifuse`` torch.compile backend.

    import torch
    compiled = torch.compile(model, backend="infinifuse")   # no import needed
    import fusebackend
    fusebackend.explain(model, ids)      # what was fused, what was not, and why
    fusebackend.reports()                # every graph compiled so far (graph breaks, recompiles)
    fusebackend.stats()                  # CUDA-graph cache and fusion counters
    fusebackend.generate(model, ids, max_new_tokens=64)   # transformers' generate, device loop
    fusebackend.remember_dynamic_shapes()   # a restart traces the dynamic graph first

Public API: ``FusionConfig`` (the options), ``explain``, ``last_report``, ``reports``,
``FusionReport``, ``stats``, ``reset_stats``, ``set_fusion_enabled``, ``clear_cache``,
``generate`` (``fusebackend.generation``: its callable and reports; docs/GENERATION.md),
``remember_dynamic_shapes`` (``fusebackend.restart``; also ``FUSEBACKEND_DYNAMIC_SHAPES=1``,
read here at import: Dynamo imports this package at ``torch.compile(backend="infinifuse")``).
"""

from fusebackend.config import FusionConfig
from fusebackend.explaining import explain
from fusebackend.generation import generate
from fusebackend.report import FusionReport, last_report, reports
from fusebackend.restart import RememberedShapes, from_environment, remember_dynamic_shapes
from fusebackend.runtime.stats import clear_cache, reset_stats, set_fusion_enabled, stats

__all__ = [
    "FusionConfig",
    "FusionReport",
    "RememberedShapes",
    "clear_cache",
    "explain",
    "generate",
    "last_report",
    "remember_dynamic_shapes",
    "reports",
    "reset_stats",
    "set_fusion_enabled",
    "stats",
]
__version__ = "0.1.0"

from_environment()  # FUSEBACKEND_DYNAMIC_SHAPES: remember_dynamic_shapes before the first trace
