"""fewerbits_operator: the controller (kopf, and the few modules that fill its gaps), the planner, the renderers and the CLI."""

__version__ = "0.1.0"
