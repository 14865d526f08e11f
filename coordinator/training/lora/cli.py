"""``fedshard train --model ID``: a LoRA run of a served decoder or encoder, through the
coordinator's API.

It posts ``{"model": ID, "method": "lora", ...}`` to ``POST /v1/training/runs`` of the running
coordinator (``--coordinator URL``, ``--token`` or ``$FEDSHARD_TOKEN``), then follows the run and
prints every round (held-out loss, epsilon, clients, upload) and the version it rolled out.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

POLL_S = 2.0


def lora_body(args: argparse.Namespace) -> dict[str, Any]:
    """The request body of ``fedshard train --model``."""
    lora: dict[str, Any] = {"rank": args.rank}
    if args.alpha is not None:
        lora["alpha"] = args.alpha
    if args.first_layer is not None:
        lora["first_layer"] = args.first_layer
    if args.lr is not None:
        lora["learning_rate"] = args.lr
    if args.local_epochs is not None:
        lora["local_epochs"] = args.local_epochs
    if args.batch_size is not None:
        lora["batch_size"] = args.batch_size
    return {
        "rounds": args.rounds,
        "model": args.model,
        "method": "lora",
        "secure_aggregation": not args.no_secagg,
        "dp": args.noise_multiplier > 0,
        "lora": lora,
    }


def train_served(args: argparse.Namespace, console: Any) -> int:
    """Start the run and follow it to its end; the exit code."""
    import httpx

    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    base = args.coordinator.rstrip("/")
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=60, trust_env=False) as api:
            started = api.post("/v1/training/runs", json=lora_body(args))
            if started.status_code != 200:
                console.print(f"[red]error ({started.status_code}):[/] {_detail(started)}")
                return 1
            run_id = started.json()["run_id"]
            console.print(f"LoRA run [bold]{run_id}[/] of {args.model} started")
            return _follow(api, run_id, console, time.monotonic() + args.timeout)
    except httpx.HTTPError as exc:
        console.print(f"[red]error:[/] cannot reach the coordinator at {base}: {exc}")
        return 1


def _follow(api: Any, run_id: str, console: Any, deadline: float) -> int:
    shown = 0
    while time.monotonic() < deadline:
        status = api.get(f"/v1/training/runs/{run_id}").json()
        for r in status["rounds"][shown:]:
            eps = f", ε {r['epsilon']:.2f}" if r["epsilon"] is not None else ""
            console.print(
                f"round {r['round']}: held-out loss {_num(r['loss'])}{eps}, "
                f"{r['clients']} clients, {r['bytes_uploaded']} B uploaded, {r['seconds']:.0f} s"
            )
        shown = len(status["rounds"])
        if status["status"] == "failed":
            console.print(f"[red]run failed:[/] {status['error']}")
            return 1
        if status["status"] == "finished":
            console.print(
                f"held-out loss {_num(status['baseline_loss'])} -> "
                f"{_num(status['final_loss'])}; ε per device {status['epsilon_per_device']}"
            )
            for name, p in sorted(status.get("privacy_per_device", {}).items()):
                left = "no budget" if p["budget"] is None else f"{p['remaining']:.2f} left"
                console.print(f"{name}: privacy ledger ε {p['epsilon_spent']:.2f} spent, {left}")
            if status.get("final_recall_at_1") is not None:
                console.print(
                    f"held-out recall@1 {status['baseline_recall_at_1']:.3f} -> "
                    f"{status['final_recall_at_1']:.3f}"
                )
            for r in status["rollouts"]:
                served = f"{r['model_id']} now serves v{r['version']}"
                console.print(f"[green]{served}[/]")
            return 0
        time.sleep(POLL_S)
    console.print(f"[red]error:[/] run {run_id} did not end in time")
    return 1


def _num(value: float | None) -> str:
    """A loss, or "-" where none was reported (a DP run without SecAgg+ sends none)."""
    return "-" if value is None else f"{value:.4f}"


def _detail(response: Any) -> str:
    try:
        return str(response.json().get("detail"))
    except ValueError:
        return str(response.text)
