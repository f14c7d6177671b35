"""``python -m fewerbits_operator``: run the controller."""

from __future__ import annotations

import asyncio
import logging
import sys

import kopf

from .settings import get_settings


def main() -> int:
    settings = get_settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from . import handlers  # noqa: F401  (registers the handlers)

    kwargs = {"namespaces": settings.namespaces} if settings.namespaces else {"clusterwide": True}
    asyncio.run(kopf.operator(
        standalone=True,  # no peering objects; one replica (the chart's default)
        liveness_endpoint=f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None,
        **kwargs,
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
