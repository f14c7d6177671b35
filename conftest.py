"""Root pytest configuration: the local control plane's fixtures (cluster, s3, gpu_pool, namespace)."""

pytest_plugins = ["e2e.pytest_plugin"]
