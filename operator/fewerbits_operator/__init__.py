"""fewerbits_operator: the kopf controller, the planner, the renderers and the CLI."""

__version__ = "0.1.0"
