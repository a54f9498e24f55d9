"""MLC-LLM's entry points, with its signatures (in snake_case) and documented behaviour, in-place buffers
included, so an engine written against MLC-LLM calls them unchanged; where that behaviour is lossy the
docstring says so and names the lossless specsampler function (docs/design.md, "Upstream entry points").

- :mod:`.verify`: :func:`batch_spec_verify`, MLC's tree verification kernel (global node indices, in place);
- :mod:`.sampler`: :class:`Sampler`, MLC's sampler (``create_cpu_sampler``, ``create_gpu_sampler``, ...);
- :mod:`.config`: :class:`GenerationConfig`, :class:`RandomGenerator`; :mod:`.results`: :class:`SampleResult`;
- :mod:`.metrics`: :class:`SpecDecodeMetrics`; :mod:`.trace`: :class:`EventTraceRecorder`.
"""

from .config import GenerationConfig, RandomGenerator
from .metrics import SpecDecodeMetrics
from .results import SampleResult
from .sampler import Sampler
from .trace import EventTraceRecorder
from .verify import batch_spec_verify

__all__ = ["EventTraceRecorder", "GenerationConfig", "RandomGenerator", "SampleResult", "Sampler",
           "SpecDecodeMetrics", "batch_spec_verify"]
