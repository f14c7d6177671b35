"""fewerbits_api."""
