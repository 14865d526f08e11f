"""The roofs a device states beside its compute roof, declared once.

:class:`RoofFields` is the base of every model that carries them: a device of ``DEVICES.json``
(:class:`~protocols.devices.DeviceSpec`), of a planning problem
(:class:`~protocols.problem.ProblemDevice`) and a device type's
:class:`~protocols.problem.Roofs`. A model that states fields before the roofs lists its own base
with those fields after :class:`RoofFields` (``class Device(RoofFields, Head)``): pydantic orders
fields from the last base to the first, so the JSON keeps the head first.
"""

from __future__ import annotations

from typing import Any

from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat

from protocols.base import FrozenModel


class RoofFields(FrozenModel):
    """Memory roof, the cache below it and the fixed costs (roofline pricing only)."""

    memory_gbps: PositiveFloat | None = None
    """Memory roof: streaming-read GB/s beyond the caches, as ``fedshard profile`` measures it.
    With it every unit is priced by the roofline, ``max(FLOPs / compute, bytes read /
    bandwidth)``; without it by FLOPs alone."""
    cache_bytes: NonNegativeInt = 0
    """Work reading at most this many bytes is read at ``cache_gbps``."""
    cache_gbps: PositiveFloat | None = None
    """Streaming-read bandwidth within the cache, GB/s."""
    op_us: NonNegativeFloat = 0.0
    """Fixed cost of one operator, microseconds."""
    call_us: NonNegativeFloat = 0.0
    """Fixed cost of running a stage's segment once, microseconds."""
    topk_ns: NonNegativeFloat = 0.0
    """Cost of a ``TopK`` per element it selects from, nanoseconds."""
    gemv_gflops: PositiveFloat | None = None
    """Compute roof of a product with 4-bit weights (``MatMulNBits``) over one row, as a
    decode step runs it: the kernel unpacks and scales every weight for a single row, so it
    runs far below the ``MatMul`` roof (about 10x here). None: priced at the compute roof."""
    vector_gflops: PositiveFloat | None = None
    """Element-wise roof: elements per nanosecond of a transformer block's element-wise
    operators (bias and residual adds, layer norm, GELU, softmax, transposes), counted one per
    element as the planner counts their FLOPs: about 100x below the ``MatMul`` roof here. None:
    priced at the compute roof."""


ROOF_FIELD_NAMES = tuple(RoofFields.model_fields)
"""The names of the roofs beyond compute, in their order."""


def roof_values(source: object) -> dict[str, Any]:
    """``source``'s roofs beyond compute by name, for building another model that carries them."""
    return {name: getattr(source, name) for name in ROOF_FIELD_NAMES}


def slowed_roofs(
    device: object, compute: float, memory: float, fixed: float, gemv: float | None = None
) -> dict[str, Any]:
    """The roofs of ``device`` (a device spec, a live device; ``gflops`` too) on which work
    takes ``compute`` times as long at the compute roofs (the 4-bit product roof ``gemv``
    times, ``compute`` when None), ``memory`` times at the bandwidths and ``fixed`` times in
    the fixed costs: the values to replace them with (a correction, a what-if slowdown)."""
    roofs = {"gflops": getattr(device, "gflops"), **roof_values(device)}  # noqa: B009

    def over(name: str, factor: float) -> float | None:
        return None if roofs[name] is None else float(roofs[name]) / factor

    return {
        "gflops": float(roofs["gflops"]) / compute,
        "gemv_gflops": over("gemv_gflops", compute if gemv is None else gemv),
        "vector_gflops": over("vector_gflops", compute),
        "memory_gbps": over("memory_gbps", memory),
        "cache_gbps": over("cache_gbps", memory),
        "op_us": float(roofs["op_us"]) * fixed,
        "call_us": float(roofs["call_us"]) * fixed,
        "topk_ns": float(roofs["topk_ns"]) * fixed,
    }
