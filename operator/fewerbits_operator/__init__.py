"""fewerbits_operator: the controller (its own watch caches and work queue), the planner, the renderers and the CLI."""

__version__ = "0.1.0"
