"""The types a Flower strategy's methods take and return, named once for both strategies.

:mod:`coordinator.training.strategy` (shard-wise FedAvg) and
:mod:`coordinator.training.lora.server_app` (FedAvg over adapters) override the same
``Strategy`` methods; these aliases are Flower's own signatures, so an override stays
compatible with the base class.
"""

from __future__ import annotations

from flwr.common import EvaluateIns, EvaluateRes, FitIns, FitRes, Parameters, Scalar
from flwr.server.client_proxy import ClientProxy

FitInstructions = list[tuple[ClientProxy, FitIns]]
"""What ``configure_fit`` returns: each sampled client with its fit instruction."""
FitResults = list[tuple[ClientProxy, FitRes]]
"""The fit replies of the clients that answered."""
FitFailures = list[tuple[ClientProxy, FitRes] | BaseException]
"""The fit replies that failed, or the exceptions of the clients that did not answer."""
FitAggregate = tuple[Parameters | None, dict[str, Scalar]]
"""What ``aggregate_fit`` returns: the new global parameters (None: none) and metrics."""
EvaluateInstructions = list[tuple[ClientProxy, EvaluateIns]]
"""What ``configure_evaluate`` returns."""
EvaluateResults = list[tuple[ClientProxy, EvaluateRes]]
"""The evaluation replies of the clients that answered."""
EvaluateFailures = list[tuple[ClientProxy, EvaluateRes] | BaseException]
"""The evaluation replies that failed, or the exceptions of the clients that did not answer."""
EvaluateAggregate = tuple[float | None, dict[str, Scalar]]
"""What ``aggregate_evaluate`` returns: the aggregated loss (None: none) and metrics."""
ServerEvaluation = tuple[float, dict[str, Scalar]] | None
"""What ``evaluate`` returns: the server-side loss and metrics (None: no server evaluation)."""
