"""Scale (issue 40 item 8), part A: a Llama-3-70B Q4_K_M plan on prima.cpp's home devices.

Writes a header-only GGUF with Llama-3-70B's shapes and llama.cpp's Q4_K_M type mix (a sparse
file of the full size: no weight is written or read), computes the unit table from its header
(:mod:`partitioner.models.gguf.units`) and plans it with the deploy's own planning problem
(:func:`coordinator.deploy.gguf_plan.planning_problem`, latency objective, one session of 1024
tokens as prima.cpp's ``-c 1024``) on ``bench/prima_home/DEVICES.json`` (the paper's four
devices; see the README beside it for sources and assumptions). Prints the plan and the
roofline-predicted ms/token next to prima.cpp's published 674 ms/token, per weights mode; where
the devices' memory cannot hold the model it prints the shortfall and plans again with every
device's memory scaled by the least factor that fits (a what-if, stated as such)::

    python bench/gguf_scale.py plan
    python bench/gguf_scale.py plan --devices bench/prima_home/DEVICES.json --context 1024

Part B (the Llama-3-8B-shaped deploy across agents) is ``bench/gguf_scale_deploy.py``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _gguf_llama3 import LLAMA3_70B, write_header_only

from coordinator.deploy.gguf_plan import GgufUnits, planning_problem, unit_table
from partitioner.errors import InfeasiblePlanError
from partitioner.models.gguf.header import GgufModel, read_header
from partitioner.models.gguf.kernels import WeightsMode
from partitioner.planning.planner import plan
from protocols.devices import DeviceList
from protocols.manifest import SessionLimits
from protocols.plan import Objective, Plan

HERE = Path(__file__).resolve().parent
PRIMA_MS_PER_TOKEN = 674.0
"""prima.cpp, Llama 3-70B on its four home devices (README Table 2; arXiv:2504.08791)."""
GB = 1e9
GIB = 1 << 30
MODES: tuple[WeightsMode, ...] = ("keep", "int4")


def scaled(devices: DeviceList, factor: float) -> DeviceList:
    """``devices`` with every memory budget times ``factor``."""
    return devices.model_copy(
        update={
            "devices": [
                d.model_copy(update={"memory_bytes": int(d.memory_bytes * factor)})
                for d in devices.devices
            ]
        }
    )


def try_plan(table: GgufUnits, devices: DeviceList) -> Plan | InfeasiblePlanError:
    """The latency-optimal plan, or the planner's refusal."""
    try:
        return plan(planning_problem(table, devices, "llama3-70b"), Objective.LATENCY)
    except InfeasiblePlanError as exc:
        return exc


def least_factor(table: GgufUnits, devices: DeviceList) -> tuple[float, Plan]:
    """The least memory factor (to 0.01) at which ``devices`` hold the model, and that plan."""
    lo, hi = 1.0, 2.0
    while isinstance(try_plan(table, scaled(devices, hi)), InfeasiblePlanError):
        lo, hi = hi, hi * 2
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        if isinstance(try_plan(table, scaled(devices, mid)), InfeasiblePlanError):
            lo = mid
        else:
            hi = mid
    found = try_plan(table, scaled(devices, hi))
    assert isinstance(found, Plan)
    return hi, found


def print_plan(result: Plan, table: GgufUnits, model: GgufModel) -> None:
    """One line per stage: device, units, layers, memory, compute, transfer."""
    names = [u.name for u in table.units.units]
    for s in result.stages:
        blocks = s.end - s.start - (s.start == 0) - (s.end == model.layers + 2)
        print(
            f"  {s.device:22s} units {names[s.start]}..{names[s.end - 1]} ({blocks} blocks) "
            f"memory {s.memory_bytes / GIB:6.2f} GiB  compute {s.compute_s * 1e3:7.1f} ms  "
            f"send {s.transfer_s * 1e3:5.2f} ms"
        )
    ratio = result.latency_s * 1e3 / PRIMA_MS_PER_TOKEN
    print(
        f"  roofline-predicted {result.latency_s * 1e3:.1f} ms/token  |  prima.cpp published "
        f"{PRIMA_MS_PER_TOKEN:.0f} ms/token  |  ratio {ratio:.2f}"
    )


def plan_mode(model: GgufModel, devices: DeviceList, mode: WeightsMode, context: int) -> None:
    """Plan ``model`` at ``mode`` on ``devices``; print the plan or the shortfall and what-if."""
    table = unit_table(model, SessionLimits(max_sessions=1, max_context=context), mode)
    weights = sum(u.weight_bytes for u in table.units.units)
    kv = sum(table.state_bytes)
    memory = sum(d.memory_bytes for d in devices.devices)
    print(
        f"\n--weights {mode}: resident weights {weights / GB:.2f} GB + KV {kv / GB:.2f} GB "
        f"(1 session x {context} tokens) against {memory / GB:.2f} GB on the devices"
    )
    result = try_plan(table, devices)
    if isinstance(result, Plan):
        print_plan(result, table, model)
        return
    print(
        f"  no plan fits the paper's available memory: short by "
        f"{result.shortfall_bytes / GB:.2f} GB on the tightest stage (prima.cpp streams "
        "weights from disk through mmap; fedshard keeps every weight resident)"
    )
    factor, found = least_factor(table, devices)
    print(f"  what-if: every device with {factor:.2f}x the paper's available memory:")
    print_plan(found, table, model)


def main() -> None:
    """Parse arguments and run part A."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    part_a = sub.add_parser("plan", help="part A: the 70B plan on prima.cpp's devices")
    part_a.add_argument("--devices", type=Path, default=HERE / "prima_home" / "DEVICES.json")
    part_a.add_argument("--context", type=int, default=1024)
    part_a.add_argument("--dir", type=Path, help="where to write the header-only file")
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="gguf-scale-"))
    path = work / "llama3-70b-q4_k_m.header-only.gguf"
    tensors = write_header_only(path, LLAMA3_70B)
    on_disk = path.stat().st_blocks * 512
    model = read_header(path)
    mix: dict[str, int] = {}
    for t in tensors:
        mix[t.type.name] = mix.get(t.type.name, 0) + t.nbytes
    print(
        f"{path.name}: {path.stat().st_size / GB:.2f} GB as listed ({on_disk / 1e6:.1f} MB on "
        f"disk), {model.layers} layers, hidden {model.hidden}, {model.heads} heads / "
        f"{model.kv_heads} KV, FFN {model.ffn}, vocab {model.vocab}; bytes per type: "
        + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in sorted(mix.items()))
    )
    devices = DeviceList.model_validate_json(args.devices.read_text())
    for mode in MODES:
        plan_mode(model, devices, mode, args.context)
    path.unlink()


if __name__ == "__main__":
    main()
