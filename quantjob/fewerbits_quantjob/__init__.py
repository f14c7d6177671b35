"""fewerbits_quantjob: the quantization Job (fetch, calibrate, quantize, evaluate, publish).

Entry points: ``python -m fewerbits_quantjob`` and :func:`fewerbits_quantjob.job.run`.
Only this package imports torch and llm-compressor (STYLE.md rule 6), and only lazily: the
operator may import ``report``, ``errors``, ``recipes.build_recipe_spec`` and
``textdata.builtin_dataset_sha256`` without them.
"""


def run(contract, env=None) -> int:
    """Run the Job for ``contract`` (a QuantJobContract, its JSON, or a dict); returns the exit code."""
    from .job import run as _run

    return _run(contract, env)
