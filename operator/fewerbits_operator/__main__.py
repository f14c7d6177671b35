"""``python -m fewerbits_operator``: kopf runs the process (handlers.py registers what it watches
and indexes; runner.Operator is what acts) until SIGTERM, or until this replica lost its Lease."""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys

from fewerbits_operator.base import mallocarenas


def main() -> int:
    arenas = mallocarenas.limit()  # first: before kopf, the client or logging start a thread
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: every thread's stack on stderr
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kopf").setLevel(logging.WARNING)  # kopf's per-event INFO lines: one per event at 300 models
    logging.getLogger(__name__).info("malloc arenas: %s", mallocarenas.ARENAS if arenas else "the C library's default")
    import kopf

    from fewerbits_operator.runtime.handlers import register
    from fewerbits_operator.runtime.runner import Operator
    from fewerbits_operator.base.scope import kopf_scope
    from fewerbits_operator.base.settings import get_settings

    settings = get_settings()
    scope = kopf_scope(settings.namespaces)
    op = Operator()
    registry = kopf.OperatorRegistry()
    register(op, scope, registry)
    kopf.run(registry=registry, standalone=True, clusterwide=scope.clusterwide, namespaces=list(scope.namespaces),
             liveness_endpoint=f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None,
             stop_flag=op.stop_flag)
    return 1 if op.lost_leadership else 0


if __name__ == "__main__":
    sys.exit(main())
