"""DP-SGD's randomness is the device's own (issue 39 item 1): the noise Opacus adds has the
distribution DP-SGD needs, and no seed anyone else knows reproduces it.

Statistical checks: each has a stated false-failure probability (the chance it fails on a correct
implementation); the whole file's is below 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats
from torch.utils.data import DataLoader, TensorDataset

from edge_agent.training.errors import DpSeedError
from edge_agent.training.lora.dp import check_seed, make_private, secure_generator
from edge_agent.training.lora.loop import shuffle_generator
from protocols.lora import RecordDp

ALPHA = 1e-6
"""False-failure probability of each statistical check."""
Z = stats.norm.isf(ALPHA / 2)  # two-sided: 4.89
WIDTH = 20_000
RECORDS, BATCH = 64, 16


def _noise_step(dp: RecordDp, grad_scale: float = 0.0) -> tuple[torch.Tensor, int]:
    """One private SGD step (lr 1) from zero weights on a loss whose per-example gradient is
    ``grad_scale`` times the unit vector ``1 / sqrt(WIDTH)``: the step taken, ``-(clipped sum
    + noise) / BATCH``, and how many examples Poisson sampling drew."""
    torch.manual_seed(0)  # a global seed changes nothing below (that is the point)
    model = torch.nn.Linear(WIDTH, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    x = torch.full((RECORDS, WIDTH), grad_scale / math.sqrt(WIDTH))
    loader = DataLoader(TensorDataset(x), batch_size=BATCH)
    _, private, opt, private_loader = make_private(model, optimizer, loader, dp)
    (batch,) = next(iter(private_loader))
    assert len(batch) > 0  # an empty Poisson batch has probability 0.75**64 < 1e-8
    opt.zero_grad()
    private(batch).sum().backward()
    opt.step()
    return model.weight.detach().reshape(-1).clone(), len(batch)


def test_noise_is_gaussian_with_the_dp_sgd_std() -> None:
    """Zero gradient: the step is pure noise, N(0, (sigma·C / batch)^2) per coordinate.
    Checks (each false-failure probability 1e-6): mean (z-test), variance (chi-square, normal
    approximation at 20 000 degrees of freedom), shape (Kolmogorov-Smirnov against the normal)."""
    dp = RecordDp(noise_multiplier=1.3, max_grad_norm=0.7)
    step = _noise_step(dp)[0].double().numpy()
    std = dp.noise_multiplier * dp.max_grad_norm / BATCH
    n = len(step)
    assert abs(step.mean()) <= Z * std / math.sqrt(n), step.mean()
    ratio = step.var(ddof=1) / std**2
    assert abs(ratio - 1) <= Z * math.sqrt(2 / (n - 1)), ratio
    assert stats.kstest(step / std, "norm").pvalue > ALPHA


def test_known_gradient_is_clipped_and_the_noise_centred_on_it() -> None:
    """Every example's gradient has norm 5 and is clipped to C = 1: the step is ``-(drawn · C ·
    u + noise) / BATCH`` (u the unit direction); what is left after the clipped sum is the
    noise, checked for mean and variance as above (false-failure probability 1e-6 each). An
    unclipped sum would leave a mean of ``-4 · drawn / (BATCH · sqrt(WIDTH))``, over 60 times
    the mean check's bound."""
    dp = RecordDp(noise_multiplier=1.0, max_grad_norm=1.0)
    step, drawn = _noise_step(dp, grad_scale=5.0)
    std = dp.noise_multiplier * dp.max_grad_norm / BATCH
    n = len(step)
    clipped = drawn * dp.max_grad_norm / math.sqrt(WIDTH) / BATCH
    residual = step.double().numpy() + clipped
    assert abs(residual.mean()) <= Z * std / math.sqrt(n), (residual.mean(), drawn)
    assert abs(residual.var(ddof=1) / std**2 - 1) <= Z * math.sqrt(2 / (n - 1))


def test_same_inputs_and_global_seed_give_different_noise() -> None:
    """Two DP steps with identical model, data and ``torch.manual_seed``: the noise differs
    (Opacus draws from an os.urandom-seeded generator, not torch's global one)."""
    dp = RecordDp(noise_multiplier=1.0, max_grad_norm=1.0)
    first, second = _noise_step(dp)[0], _noise_step(dp)[0]
    assert not torch.equal(first, second)
    # independent draws: their correlation is ~N(0, 1/n); false failure 1e-6
    corr = float(torch.corrcoef(torch.stack([first, second]))[0, 1])
    assert abs(corr) <= Z / math.sqrt(WIDTH), corr


def test_secure_generators_differ() -> None:
    draws = {int(secure_generator().initial_seed()) for _ in range(8)}
    assert len(draws) == 8  # 64-bit seeds from os.urandom: a collision has probability < 1e-17


def test_a_dp_round_refuses_a_seed_and_a_plain_one_takes_it() -> None:
    with pytest.raises(DpSeedError):
        check_seed(RecordDp(), 1234)
    with pytest.raises(DpSeedError):
        shuffle_generator(RecordDp(), 0)
    check_seed(RecordDp(), None)
    a, b = shuffle_generator(None, 7), shuffle_generator(None, 7)
    assert torch.equal(torch.randperm(50, generator=a), torch.randperm(50, generator=b))


def test_poisson_sampling_is_not_reproducible_from_a_global_seed() -> None:
    """The private loader's batches (which records each step sees) come from the device's own
    generator: two loaders over the same records, after the same ``torch.manual_seed``, draw
    different batches (the four batches of an epoch over 64 records at rate 1/4 all coinciding:
    0.625**256 < 1e-50)."""
    dp = RecordDp(noise_multiplier=1.0, max_grad_norm=1.0)

    def batches() -> list[list[int]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1)
        data = TensorDataset(torch.arange(RECORDS, dtype=torch.float32)[:, None])
        loader = DataLoader(data, batch_size=BATCH)
        _, _, opt, private_loader = make_private(
            model, torch.optim.SGD(model.parameters()), loader, dp
        )
        assert opt.secure_mode  # type: ignore[attr-defined]
        drawn = iter(private_loader)
        return [sorted(int(v) for v in next(drawn)[0][:, 0]) for _ in range(4)]

    assert batches() != batches()
