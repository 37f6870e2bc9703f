"""Tools: calibration, benchmarks, the demo and the CUDA-graph plan report, reached through ``wspool`` CLI commands.

Nothing in the library imports this package; it sits above the kernels
(:mod:`wspool.flashinfer`) and below the CLI, and imports FlashInfer lazily.
"""

from __future__ import annotations

__all__: list[str] = []
