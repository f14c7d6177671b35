"""The long-running process: kopf's registrations (`handlers`), the Lease (`leader`), the work
queue and the periodic resync, one reconcile pass (`reconcile`), the loops beside it (the activator,
the zero router, the metrics probe, policy status). Owns threads, HTTP endpoints and timing. May
import core, serving, artifacts, autoscaler, planner and base; never the cli.
"""
