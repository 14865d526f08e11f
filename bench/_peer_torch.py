"""One rank of bench/peer_pipelining.py's torch side (a helper, not a benchmark on its own).

Each rank holds the Hugging Face MiniLM layers of one segment, wraps them in a
``torch.distributed.pipelining.PipelineStage`` and runs ``ScheduleGPipe`` without a loss
(forward only) over gloo on loopback. The ranks stay up between measurements so that the parent
can interleave them with fedshard's: rank 0 reads one JSON command per line on stdin, broadcasts
it to the other ranks, and writes the reply to ``<out>/reply-<seq>.json``:

- ``{"op": "whole", "n": N}``: rank 0 alone times the whole model, torch eager and ONNX Runtime
  (the agents' session options), interleaved;
- ``{"op": "latency", "n": N}``: N requests one at a time through the three stages, the last rank
  sending each result back to rank 0 (the first reply also saves it to ``<out>/output.npy``);
- ``{"op": "throughput", "m": M, "n": N}``: N requests as steps of M one-request microbatches;
- ``{"op": "quit"}`` (or end of input).

Replies carry every rank's mean stage compute time during the measurement.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from transformers import AutoModel
from transformers.masking_utils import create_bidirectional_mask

from partitioner.models.packaged import minilm_dir

WARMUP = 3
OPS = ("quit", "whole", "latency", "throughput")
INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class StageModule(nn.Module):
    """Embeddings (first stage only) and a block of encoder layers; times its own forward."""

    def __init__(self, model: Any, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.embeddings = model.embeddings if first else None
        self.layers = nn.ModuleList(model.encoder.layer[i] for i in layers)
        self.last = last
        self.compute_s = 0.0
        self.calls = 0

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        if self.embeddings is not None:
            input_ids, attention_mask, token_type_ids = args
            hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        else:
            hidden, attention_mask = args
        mask = create_bidirectional_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=attention_mask
        )
        for layer in self.layers:
            hidden = layer(hidden, mask)
        self.compute_s += time.perf_counter() - start
        self.calls += 1
        return hidden if self.last else (hidden, attention_mask)

    def take_mean_ms(self) -> float:
        """Mean compute per call since the last take, in ms; resets the counters."""
        mean = self.compute_s / max(1, self.calls) * 1e3
        self.compute_s, self.calls = 0.0, 0
        return mean


class Rank:
    """This process's stage, its schedules (one per microbatch count) and the measurements."""

    def __init__(self, cfg: dict[str, Any], rank: int, world: int, model: Any) -> None:
        self.cfg, self.rank, self.world, self.model = cfg, rank, world, model
        with np.load(cfg["feeds"], allow_pickle=False) as data:
            self.feeds = {k: torch.from_numpy(data[k]) for k in INPUTS}
        first, end = cfg["ranges"][rank]
        self.module = StageModule(model, range(first, end), rank == 0, rank == world - 1)
        self.schedules: dict[int, ScheduleGPipe] = {}
        self.saved_output = False

    @property
    def hidden_shape(self) -> tuple[int, ...]:
        return (1, *self.feeds["input_ids"].shape[1:], self.model.config.hidden_size)

    def schedule(self, microbatches: int) -> ScheduleGPipe:
        """The schedule for ``microbatches`` one-request microbatches (made, and warmed, once)."""
        if microbatches not in self.schedules:
            if self.rank == 0:
                inputs: tuple[torch.Tensor, ...] = tuple(self.feeds[k] for k in INPUTS)
            else:
                inputs = (torch.zeros(self.hidden_shape), self.feeds["attention_mask"])
            outputs = self.module(*inputs)
            stage = PipelineStage(
                self.module,
                self.rank,
                self.world,
                torch.device("cpu"),
                input_args=inputs,
                output_args=outputs,
            )
            self.schedules[microbatches] = ScheduleGPipe(stage, n_microbatches=microbatches)
            self.step(microbatches)
        return self.schedules[microbatches]

    def step(self, microbatches: int) -> torch.Tensor | None:
        """One schedule step; the first rank feeds ``microbatches`` copies of the request."""
        schedule = self.schedules[microbatches]
        args = [self.feeds[k].repeat(microbatches, 1) for k in INPUTS] if self.rank == 0 else []
        out: torch.Tensor | None = schedule.step(*args)
        return out

    def compute_ms(self) -> list[float]:
        """Every rank's mean stage compute since the last call (collective)."""
        mine = torch.tensor([self.module.take_mean_ms()], dtype=torch.float64)
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world)]
        dist.all_gather(every, mine)
        return [float(t.item()) for t in every]

    def latency(self, runs: int) -> dict[str, Any]:
        """One request at a time; the last rank sends each result back to rank 0."""
        self.schedule(1)
        out = torch.empty(self.hidden_shape)
        times = []
        for i in range(WARMUP + runs):
            if i == WARMUP:
                self.module.take_mean_ms()
            start = time.perf_counter()
            result = self.step(1)
            if self.rank == self.world - 1:
                assert result is not None
                dist.send(result.contiguous(), dst=0)
            elif self.rank == 0:
                dist.recv(out, src=self.world - 1)
            times.append(time.perf_counter() - start)
        if self.rank == 0 and not self.saved_output:
            np.save(Path(self.cfg["out"]) / "output.npy", out.numpy(), allow_pickle=False)
            self.saved_output = True
        reply = {"latency_ms": statistics.median(times[WARMUP:]) * 1e3}
        return reply | {"compute_ms": self.compute_ms()}

    def throughput(self, microbatches: int, requests: int) -> dict[str, Any]:
        """``requests`` requests as steps of ``microbatches`` one-request microbatches."""
        self.schedule(microbatches)
        steps = max(1, requests // microbatches)
        dist.barrier()
        self.module.take_mean_ms()
        start = time.perf_counter()
        for _ in range(steps):
            self.step(microbatches)
        dist.barrier()
        elapsed = time.perf_counter() - start
        reply = {"microbatches": microbatches, "rps": steps * microbatches / elapsed}
        return reply | {"compute_ms": self.compute_ms()}

    def whole(self, runs: int) -> dict[str, Any]:
        """Median latency of the whole model here: torch eager and ONNX Runtime, interleaved."""
        import onnxruntime as ort

        from edge_agent.config import RuntimeConfig
        from edge_agent.runtime.engine import session_options

        session = ort.InferenceSession(
            self.cfg["onnx_model"],
            session_options(RuntimeConfig()),
            providers=["CPUExecutionProvider"],
        )
        ort_feeds = {k: v.numpy() for k, v in self.feeds.items()}
        torch_t, ort_t = [], []
        for i in range(WARMUP + runs):
            start = time.perf_counter()
            self.model(**self.feeds)
            middle = time.perf_counter()
            session.run(None, ort_feeds)
            if i >= WARMUP:
                torch_t.append(middle - start)
                ort_t.append(time.perf_counter() - middle)
        return {
            "torch_ms": statistics.median(torch_t) * 1e3,
            "ort_ms": statistics.median(ort_t) * 1e3,
        }

    def serve(self) -> None:
        """Follow the commands until ``quit``."""
        for seq in range(1_000_000):
            command = self.next_command()
            op = OPS[int(command[0])]
            if op == "quit":
                return
            if op == "whole":
                reply = self.whole(int(command[1])) if self.rank == 0 else None
            elif op == "latency":
                reply = self.latency(int(command[1]))
            else:
                reply = self.throughput(int(command[2]), int(command[1]))
            if self.rank == 0 and reply is not None:
                path = Path(self.cfg["out"]) / f"reply-{seq}.json"
                path.with_suffix(".tmp").write_text(json.dumps(reply))
                path.with_suffix(".tmp").replace(path)

    def next_command(self) -> torch.Tensor:
        """Rank 0 reads a command from stdin and broadcasts it; the others receive it."""
        command = torch.zeros(3, dtype=torch.int64)
        if self.rank == 0:
            line = sys.stdin.readline()
            cmd = json.loads(line) if line.strip() else {"op": "quit"}
            command[:] = torch.tensor(
                [OPS.index(cmd["op"]), cmd.get("n", 0), cmd.get("m", 0)], dtype=torch.int64
            )
        dist.broadcast(command, src=0)
        return command


def run_worker(config_path: Path, rank: int) -> int:
    """Load the model, join the process group (one rank per layer block), write
    ``ready-<rank>``, follow the commands."""
    cfg = json.loads(config_path.read_text())
    world = len(cfg["ranges"])
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    model = AutoModel.from_pretrained(minilm_dir()).eval()
    store = dist.FileStore(cfg["store"], world)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        with torch.no_grad():
            me = Rank(cfg, rank, world, model)
            (Path(cfg["out"]) / f"ready-{rank}").write_text(
                json.dumps(
                    {"torch": torch.__version__, "attention": model.config._attn_implementation}
                )
            )
            me.serve()
    finally:
        dist.destroy_process_group()
    return 0
