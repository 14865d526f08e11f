"""The base class of every wire and file model: frozen, unknown fields and non-finite numbers
(``NaN``, ``Infinity``) refused."""

from __future__ import annotations

from typing import Self

import pydantic
from pydantic import BaseModel, ConfigDict

from protocols.errors import SchemaError


class FrozenModel(BaseModel):
    """Immutable pydantic model that refuses unknown fields and non-finite floats."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @classmethod
    def from_json(cls, data: str | bytes) -> Self:
        """Parse and validate a JSON document, raising :class:`SchemaError` on any problem."""
        try:
            return cls.model_validate_json(data)
        except pydantic.ValidationError as exc:
            raise SchemaError(f"invalid {cls.__name__}: {_summarise(exc)}") from exc

    @classmethod
    def from_obj(cls, data: object) -> Self:
        """Validate already-parsed JSON, raising :class:`SchemaError` on any problem."""
        try:
            return cls.model_validate(data)
        except pydantic.ValidationError as exc:
            raise SchemaError(f"invalid {cls.__name__}: {_summarise(exc)}") from exc

    def to_json(self) -> str:
        """Serialise to indented JSON."""
        return self.model_dump_json(indent=2)


def _summarise(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{where}: {err['msg']}")
    more = exc.error_count() - len(parts)
    if more > 0:
        parts.append(f"... and {more} more")
    return "; ".join(parts)
