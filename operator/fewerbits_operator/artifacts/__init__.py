"""The artifact lifecycle: keys and Job names (`keys`), the evaluation Job, calibration pins, the
quality gate, the dataset check, Job sizing and failures, and the effective spec under policies
(`effective`). Pure; may import the other features (serving's Job renderer) and base.
"""
