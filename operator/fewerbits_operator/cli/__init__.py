"""The commands a person runs: `fewerbits plan`, `explain`, `quality`, `validate` (`main` is the
entry point). May import every layer below; nothing imports it but `__main__`.
"""
