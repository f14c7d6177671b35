"""The built-in text datasets: their names and the sha256 of each shipped file.

The files live with the quantization Job (``fewerbits_quantjob/data/<name>.txt``), which reads
them; the operator needs only their hashes, to put ``calibrationDatasetHash`` into an artifact key
without importing the Job's package. A unit test hashes the shipped files and compares them with
these constants, so an edited file cannot go unnoticed.
"""

from __future__ import annotations

BUILTIN_DATASET_SHA256: dict[str, str] = {
    "general-en": "19e8bffa6d01312ed0d7485039835ab605d13d9ddcd2292dbdad44f034f40fac",
    "general-en-heldout": "875f176ba28d9e2be60e7d3913ba3166146ab9a54affe1bbbb8b60a15857905c",
}
"""Name -> sha256 (hex) of the file the quantjob image ships."""

BUILTIN_DATASETS: tuple[str, ...] = tuple(BUILTIN_DATASET_SHA256)
"""The names a calibration or evaluation dataset may use without a scheme."""


def is_builtin_dataset_uri(uri: str) -> bool:
    """A dataset given without a scheme (``s3://``, ``hf://``) names a built-in set."""
    return "://" not in uri
