"""DP-SGD randomness no one but this device can predict.

Every random draw DP relies on (Opacus' Poisson sampling of each batch, the Gaussian noise added
to the clipped gradient sum) comes from a :class:`torch.Generator` seeded with 64 bits from
``os.urandom``, fresh for each round and each use; nothing DP-related is seeded from a value
another party knows (the node id and round number are the SuperLink's, so the coordinator's).
Opacus' own ``secure_mode=True`` needs ``torchcsprng``, which has no build for the installed
torch; instead its optimizer is switched to its floating-point-attack-resistant noise (the sum of
four Gaussians, halved: what ``secure_mode`` draws), fed by the urandom-seeded generator.

A DP round given a fixed seed refuses it (:class:`~edge_agent.training.errors.DpSeedError`):
fixed seeds are for runs without DP only (benches, tests).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader

from edge_agent.training.errors import DpSeedError
from protocols.lora import RecordDp


def secure_generator() -> torch.Generator:
    """A CPU generator seeded with 64 bits from ``os.urandom`` (unknown to any other party)."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))


def check_seed(dp: RecordDp | None, seed: int | None) -> None:
    """Raise :class:`DpSeedError` when a DP round (``dp`` set) comes with a fixed seed."""
    if dp is not None and seed is not None:
        raise DpSeedError(
            "a DP round takes its sampling and noise from os.urandom; it refuses a fixed seed"
        )


def make_private(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader[Any], dp: RecordDp
) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer, DataLoader[Any]]:
    """Opacus' ``make_private`` (RDP accountant, Poisson sampling) with both the sampler's and
    the noise's generator from :func:`secure_generator`; (engine, module, optimizer, loader)."""
    from opacus import PrivacyEngine

    fresh = DataLoader(
        loader.dataset, batch_size=loader.batch_size, generator=secure_generator()
    )  # Opacus' Poisson sampler draws from the loader's generator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "secure RNG turned off": see the module doc
        engine = PrivacyEngine(accountant="rdp", secure_mode=False)  # True needs torchcsprng
        model, private_opt, private_loader = engine.make_private(
            module=module,
            optimizer=optimizer,
            data_loader=fresh,
            noise_multiplier=dp.noise_multiplier,
            max_grad_norm=dp.max_grad_norm,
            poisson_sampling=True,
            noise_generator=secure_generator(),
        )
    private_opt.secure_mode = True  # the noise as secure_mode draws it (robust to FP attacks)
    return engine, model, private_opt, private_loader
