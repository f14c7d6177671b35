"""Root pytest configuration: the local control plane's fixtures (cluster, s3, gpu_pool, namespace),
and the order test files are handed to pytest-xdist's workers."""

from pathlib import Path

pytest_plugins = ["e2e.pytest_plugin"]

_ROOT = Path(__file__).parent
_QUICK = _ROOT / "tests" / "unit"
# The files over 90 s in a warm CI run (`--durations` in scripts/test.sh's output); only the order
# depends on this list, so a stale entry costs time, never a result.
_LONGEST = tuple(_ROOT / f for f in (
    "tests/integration/test_autoscaling_vllm.py", "tests/integration/test_canary.py",
    "e2e/tests/test_vllm_cpu_serve.py", "tests/integration/test_load_small.py",
    "tests/integration/test_autoscaling.py", "tests/integration/test_adapters_served.py"))


def _rank(item) -> int:
    path = Path(str(item.path))
    return 0 if path in _LONGEST else 2 if _QUICK in path.parents else 1


def pytest_collection_modifyitems(items: list) -> None:
    """The longest files first, then the other files that start clusters or servers, unit tests
    last (a stable sort: otherwise in collection order). scripts/test.sh runs `--dist loadfile
    --no-loadscope-reorder`, so the workers take files in this order, one at a time. xdist's default
    instead orders files by their number of tests, which put the one-test cluster files (30-210 s
    each) at the end, where one worker ran them while the other had nothing left; the many short
    unit tests now fill that tail."""
    items.sort(key=_rank)
