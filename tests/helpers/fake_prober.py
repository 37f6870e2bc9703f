"""A CPU stand-in for the MLA workspace probe, for the calibration and benchmark tests."""

from __future__ import annotations

from wspool.flashinfer.layouts import AlignedCarver
from wspool.flashinfer.refusals import parse_refusal
from wspool.tools.search import SearchResult, search_min_bytes
from wspool.tools.sweep import MLAShape

H200_SMS = 132


class FakeProber:
    """A CPU stand-in for MLAWorkspaceProbe: plan() carves like FlashInfer's fa3 MLAPlan."""

    def __init__(self, sm_count: int = H200_SMS, *, fail_verify: str | None = None, extra: int = 0) -> None:
        self.sm_count = sm_count
        self.fail_verify = fail_verify
        self.extra = extra  # bytes some shapes need beyond the formula (a changed kernel)
        self.verified: list[tuple[MLAShape, int]] = []

    def plan(self, shape: MLAShape, nbytes: int) -> None:
        rows = (self.sm_count // (2 if shape.q_len * shape.num_heads > 64 else 1)) * 64
        rows *= 2 if shape.q_len * shape.num_heads > 64 else 1
        carver = AlignedCarver(nbytes)
        carver.carve("mla_partial_o", 2 * rows * 2 * 512)
        carver.carve("mla_partial_lse", 2 * rows * 4 + (self.extra if shape.batch_size > 100 else 0))

    def fits(self, shape: MLAShape, nbytes: int) -> int | None:
        try:
            self.plan(shape, nbytes)
        except RuntimeError as exc:
            refusal = parse_refusal(exc)
            assert refusal is not None
            return refusal.needed_capacity(nbytes, padding=False)
        return None

    def describe(self) -> dict[str, str]:
        return {"device": "Fake H200 (132 SMs)", "flashinfer": "0.7.2.post1", "torch": "2.13", "path": "fake fa3"}

    def search(self, shape: MLAShape, *, granularity: int = 1) -> SearchResult:
        return search_min_bytes(lambda n: self.fits(shape, n), granularity=granularity)

    def verify(self, shape: MLAShape, nbytes: int) -> str | None:
        self.verified.append((shape, nbytes))
        if self.fits(shape, nbytes) is not None:
            return "overflow"
        return self.fail_verify
