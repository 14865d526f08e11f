"""Synthetic planning problems at scale: decoder chains and device fleets, nothing materialised.

A decoder is an embedding unit, then one attention unit and one MLP unit per layer, then the final
norm and LM head. Sizes follow the usual dense-transformer formulas (grouped-query attention, a
gated MLP), compute is FLOPs over each device type's GFLOP/s, and each attention unit's
``weight_bytes`` also counts its resident KV cache (the schema's summed per-stage bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.problem import PlanningProblem

GIB = 1024**3


@dataclass(frozen=True)
class DecoderShape:
    """A dense decoder-only transformer."""

    layers: int
    hidden: int
    ffn: int
    vocab: int
    kv_heads: int
    head_dim: int = 128
    dtype_bytes: int = 2
    tokens: int = 512
    """Tokens per micro-batch (one prompt being prefilled)."""
    kv_context: int = 4096
    """Tokens of KV cache each attention unit keeps resident."""
    tied_embeddings: bool = False

    @property
    def attention_params(self) -> int:
        """Q and O projections plus K and V for the key-value heads."""
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def mlp_params(self) -> int:
        """Gate, up and down projections."""
        return 3 * self.hidden * self.ffn

    @property
    def embedding_params(self) -> int:
        """One vocabulary table."""
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters (one table if tied, two otherwise)."""
        tables = 1 if self.tied_embeddings else 2
        return (
            self.layers * (self.attention_params + self.mlp_params) + tables * self.embedding_params
        )


LLAMA_100B = DecoderShape(layers=89, hidden=10240, ffn=28672, vocab=128000, kv_heads=8)
"""Just over 100 billion parameters, tied or not (180 units)."""

MID_20B = DecoderShape(layers=99, hidden=4096, ffn=14336, vocab=128000, kv_heads=8)
"""A 99-layer, roughly 20-billion-parameter decoder: exactly 200 units."""


@dataclass(frozen=True)
class DeviceKind:
    """Devices of one kind: how many, and what each has."""

    type: str
    count: int
    memory_bytes: int
    gflops: float
    bandwidth_mbps: float = 1000.0


HOME_LAB_16 = (
    DeviceKind("rpi5", 4, 8 * GIB, 30.0),
    DeviceKind("rpi5", 2, 4 * GIB, 30.0),
    DeviceKind("jetson-orin", 4, 16 * GIB, 1200.0),
    DeviceKind("laptop", 2, 32 * GIB, 2500.0, 300.0),
    DeviceKind("laptop", 2, 16 * GIB, 2500.0, 300.0),
    DeviceKind("rtx-desktop", 1, 24 * GIB, 40000.0, 2500.0),
    DeviceKind("rtx-desktop", 1, 12 * GIB, 40000.0, 2500.0),
)
"""16 devices of four types, seven kinds once memory and bandwidth are counted."""

CLUSTER_100B = (
    DeviceKind("laptop", 8, 16 * GIB, 2500.0),
    DeviceKind("rtx-desktop", 4, 24 * GIB, 40000.0),
    DeviceKind("workstation", 2, 48 * GIB, 60000.0, 2500.0),
    DeviceKind("mini-pc", 2, 12 * GIB, 800.0),
)
"""16 devices with 288 GiB together, enough for the 100B decoder's 200 GB of fp16 weights."""


def decoder_units(shape: DecoderShape, gflops: dict[str, float]) -> list[dict[str, object]]:
    """The unit list of ``shape``, with ``compute_s`` for every device type in ``gflops``."""
    t, h, size = shape.tokens, shape.hidden, shape.dtype_bytes
    hidden_bytes = t * h * size
    kv_bytes = 2 * shape.kv_heads * shape.head_dim * shape.kv_context * size
    scores = t * t * (h // shape.head_dim) * size
    embed_weight = 0 if shape.tied_embeddings else shape.embedding_params * size

    def unit(name: str, weight: int, out: int, flops: float, workspace: int) -> dict[str, object]:
        compute = {kind: flops / (rate * 1e9) for kind, rate in gflops.items()}
        return {
            "name": name,
            "weight_bytes": weight,
            "out_bytes": out,
            "workspace_bytes": workspace,
            "compute_s": compute,
        }

    units = [unit("embed", embed_weight, hidden_bytes, 2.0 * t * h, hidden_bytes)]
    for layer in range(shape.layers):
        attention_flops = 2.0 * shape.attention_params * t + 4.0 * t * t * h
        units.append(
            unit(
                f"layer{layer}.attn",
                shape.attention_params * size + kv_bytes,
                hidden_bytes,
                attention_flops,
                scores,
            )
        )
        units.append(
            unit(
                f"layer{layer}.mlp",
                shape.mlp_params * size,
                hidden_bytes,
                2.0 * shape.mlp_params * t,
                2 * t * shape.ffn * size,
            )
        )
    logits = shape.vocab * 4
    head_flops = 2.0 * shape.embedding_params
    units.append(unit("head", embed_weight, logits, head_flops, logits))
    return units


def fleet_devices(kinds: tuple[DeviceKind, ...]) -> list[dict[str, object]]:
    """One device entry per device of each kind, named ``type-index``."""
    devices: list[dict[str, object]] = []
    for kind in kinds:
        for _ in range(kind.count):
            devices.append(
                {
                    "name": f"{kind.type}-{len(devices)}",
                    "type": kind.type,
                    "memory_bytes": kind.memory_bytes,
                    "bandwidth_mbps": kind.bandwidth_mbps,
                }
            )
    return devices


def decoder_problem(
    shape: DecoderShape, kinds: tuple[DeviceKind, ...], name: str = ""
) -> PlanningProblem:
    """A ``fedshard.problem/1`` for ``shape`` on the devices ``kinds`` describe."""
    gflops = {kind.type: kind.gflops for kind in kinds}
    units = decoder_units(shape, gflops)
    shared = []
    if shape.tied_embeddings:
        table = shape.embedding_params * shape.dtype_bytes
        shared.append({"name": "embedding", "bytes": table, "units": [0, len(units) - 1]})
    return PlanningProblem.from_obj(
        {
            "name": name or f"synthetic decoder {shape.params / 1e9:.0f}B",
            "input_bytes": shape.tokens * 8,
            "queue_depth": 2,
            "units": units,
            "devices": fleet_devices(kinds),
            "shared_weights": shared,
        }
    )


def distinct_kinds(count: int = 16, same_lan: bool = False) -> tuple[DeviceKind, ...]:
    """``count`` devices no two of which are alike: each has its own memory and, unless
    ``same_lan``, its own bandwidth (the planner's worst case: every device its own class and
    its own sender group)."""
    return tuple(
        DeviceKind(
            type=("laptop", "jetson-orin", "rtx-desktop")[i % 3],
            count=1,
            memory_bytes=(6 + i) * GIB,
            gflops=(2500.0, 1200.0, 40000.0)[i % 3],
            bandwidth_mbps=1000.0 if same_lan else 500.0 + 100.0 * i,
        )
        for i in range(count)
    )
