"""The web console: a static single-page app served by the coordinator at ``/``.

Every asset ships in this package (``static/``): nothing is fetched from outside, and the
Content-Security-Policy sent with the page forbids it. The page holds no data and needs no
token; its script reads ``?token=`` from the address the coordinator printed at start (or asks
for it), keeps it for the browser tab, and calls the token-protected API with it as a bearer
token. Pages: devices and pairing, the plan on each device with a what-if, live pipeline
metrics, models and versions, training runs, and a playground.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI, HTTPException, Response, status

_JS = "text/javascript; charset=utf-8"
ASSETS: dict[str, str] = {
    "app.js": _JS,
    "charts.js": _JS,
    "plan.js": _JS,
    "live.js": _JS,
    "play.js": _JS,
    "app.css": "text/css; charset=utf-8",
}
"""The files under ``/console/``, with their content types."""

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; form-action 'self'; "
        "base-uri 'none'; frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
"""Sent with every console file: only this origin may be reached from the page."""


def asset_text(name: str) -> str:
    """The text of a packaged console file (``index.html`` or one of :data:`ASSETS`)."""
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def install_console(app: FastAPI) -> None:
    """Serve the page at ``/`` and its script and style under ``/console/``."""

    @app.get("/", include_in_schema=False)
    def page() -> Response:
        return Response(asset_text("index.html"), media_type="text/html", headers=SECURITY_HEADERS)

    @app.get("/console/{name}", include_in_schema=False)
    def asset(name: str) -> Response:
        kind = ASSETS.get(name)
        if kind is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no console file {name!r}")
        return Response(asset_text(name), media_type=kind, headers=SECURITY_HEADERS)
