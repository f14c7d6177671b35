"""Local control plane for tests, built from Go modules (see e2e/README.md)."""
