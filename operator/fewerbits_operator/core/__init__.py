"""One reconcile: `observe` reads everything into an `Observed`, `decide` (pure) returns the status,
actions and events, `execute` is the single writer; and the lifecycles that reuse those steps
(`retention`, the node-cache references loop). May import serving, artifacts, autoscaler, planner
and base; never runtime or cli.
"""
