"""fewerbits_quantjob: the quantization Job (fetch, calibrate, quantize, evaluate, publish).

Entry points: ``python -m fewerbits_quantjob`` and :func:`fewerbits_quantjob.job.run`.
Only this package imports torch and llm-compressor, and only lazily: ``report``, ``errors``,
``recipes.build_recipe_spec`` and ``textdata`` import without them. The operator imports nothing
from this package (what it shares with the Job is in ``fewerbits_api``).
"""


def run(contract, env=None) -> int:
    """Run the Job for ``contract`` (a QuantJobContract, its JSON, or a dict); returns the exit code."""
    from .job import run as _run

    return _run(contract, env)
