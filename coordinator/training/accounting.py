"""Client-level (epsilon, delta) from Flower's RDP accountant (``flwr[dp]``); no hand-written math.

Every round that adds Gaussian noise to the clipped average is one Gaussian release with the
round's noise multiplier. Each round samples every connected client, so there is no sampling
amplification: the events are composed with ``SamplingMethod.NO_AMPLIFICATION`` under the
add-or-remove-one-client relation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

DEFAULT_DELTA = 1e-5


class RoundAccountant:
    """Composes one Gaussian release per round and reports the cumulative epsilon."""

    def __init__(self, population: int, delta: float = DEFAULT_DELTA) -> None:
        self.population = population
        self.delta = delta
        self._accountant: RdpAccountant = new_accountant(population, delta)

    def record_round(self, noise_multiplier: float, clients: int) -> float:
        """Compose one round with ``clients`` contributions; return the cumulative epsilon."""
        from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

        clients = max(1, min(clients, self.population))
        event = GaussianPrivacyEvent(
            noise_multiplier=noise_multiplier,
            sample_size=clients,
            population_size=self.population,
        )
        self._accountant.compose(event)
        return self.epsilon

    @property
    def epsilon(self) -> float:
        """Cumulative epsilon at :attr:`delta` (0 before any release)."""
        if self._accountant.num_releases == 0:
            return 0.0
        return self._accountant.get_epsilon(self.delta)

    @property
    def rounds(self) -> int:
        """Number of composed releases."""
        return self._accountant.num_releases


def new_accountant(population: int, delta: float = DEFAULT_DELTA) -> RdpAccountant:
    """A fresh Flower ``RdpAccountant`` configured the way fedshard accounts its rounds."""
    from flwr.supercore.privacy_accounting import (
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    config = PrivacyConfig(
        target_delta=delta,
        population_size=population,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION,
    )
    return RdpAccountant(config)
