"""Values and clients every layer may use: the closed `Action` union (`actions`), the observed
facts (`observed`), termination messages, foreign API coordinates (`apis`), the API client (`kube`)
and kopf's index readers, object storage, settings, metrics, claims, queueing and calibration pins.
Imports nothing of the operator but the planner.
"""
