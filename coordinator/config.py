"""The coordinator's configuration: built once at the entry point and passed down."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from coordinator.state import write_atomic

TOKEN_FILE = "api_token"


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything ``fedshard coordinator`` was told."""

    state_dir: Path
    interface: str = "127.0.0.1"
    port: int = 8470
    token: str = ""

    @property
    def console_url(self) -> str:
        """The console address with the login token, as printed at start."""
        return f"http://{self.interface}:{self.port}/?token={self.token}"


def load_or_create_token(state_dir: Path) -> str:
    """The API token kept in the state dir (mode 0600), created on first start."""
    path = state_dir / TOKEN_FILE
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(24)
    write_atomic(path, token.encode(), mode=0o600)
    return token
