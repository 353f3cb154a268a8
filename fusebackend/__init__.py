"""fusebackend: the ``infinifuse`` torch.compile backend.

    import torch
    compiled = torch.compile(model, backend="infinifuse")   # no import needed
    import fusebackend
    fusebackend.explain(model, ids)      # what was fused, what was not, and why
    fusebackend.reports()                # every graph compiled so far (graph breaks, recompiles)
    fusebackend.stats()                  # CUDA-graph cache and fusion counters
    fusebackend.generate(model, ids, max_new_tokens=64)   # transformers' generate, device loop

Public API: ``FusionConfig`` (the options), ``explain``, ``last_report``, ``reports``,
``FusionReport``, ``stats``, ``reset_stats``, ``set_fusion_enabled``, ``clear_cache``,
``generate`` (``fusebackend.generation``: its callable and reports; docs/GENERATION.md).
"""

from fusebackend.config import FusionConfig
from fusebackend.explaining import explain
from fusebackend.generation import generate
from fusebackend.report import FusionReport, last_report, reports
from fusebackend.runtime.stats import clear_cache, reset_stats, set_fusion_enabled, stats

__all__ = [
    "FusionConfig",
    "FusionReport",
    "clear_cache",
    "explain",
    "generate",
    "last_report",
    "reports",
    "reset_stats",
    "set_fusion_enabled",
    "stats",
]
__version__ = "0.1.0"
