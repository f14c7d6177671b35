"""fewerbits_operator."""
