"""fewerbits_runtime."""
