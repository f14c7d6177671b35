"""fewerbits_quantjob."""
