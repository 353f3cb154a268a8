"""infinifuse's decode loop for transformers causal LMs (issue 36).

    import fusebackend
    out = fusebackend.generate(model, ids, max_new_tokens=64)          # like model.generate
    out = model.generate(ids, max_new_tokens=64, cache_implementation="static",
                         custom_generate=fusebackend.generation.DeviceDecoding(k=8))
    fusebackend.generation.last_report()    # the loop or transformers' (and why), k, replays

The decode step, the token selection, the position updates and the stop check run on the
device; on a GPU k steps are one CUDA-graph replay and the host reads one flag per replay.
See docs/GENERATION.md. Modules: ``selection`` (logits processors and token choice as
tensor functions), ``support`` (which options run on the device, else the reason),
``loop`` (prefill, chunks, capture, output), ``report`` (``GenerateReport``), ``entry``
(``generate``, ``DeviceDecoding``). Importing this package does not import transformers.
"""

from fusebackend.generation.entry import DEFAULT_K, DeviceDecoding, generate
from fusebackend.generation.report import GenerateReport, last_report

__all__ = ["DEFAULT_K", "DeviceDecoding", "GenerateReport", "generate", "last_report"]
