"""The built-in text datasets: their names and the sha256 of each shipped file.

The files live with the quantization Job (``fewerbits_quantjob/data/<name>.txt``), which reads
them; the operator needs only their hashes, to put ``calibrationDatasetHash`` into an artifact key
without importing the Job's package. A unit test hashes the shipped files and compares them with
these constants, so an edited file cannot go unnoticed.
"""

from __future__ import annotations

import hashlib

BUILTIN_DATASET_SHA256: dict[str, str] = {
    "general-en": "19e8bffa6d01312ed0d7485039835ab605d13d9ddcd2292dbdad44f034f40fac",
    "general-en-heldout": "875f176ba28d9e2be60e7d3913ba3166146ab9a54affe1bbbb8b60a15857905c",
}
"""Name -> sha256 (hex) of the file the quantjob image ships."""

BUILTIN_DATASETS: tuple[str, ...] = tuple(BUILTIN_DATASET_SHA256)
"""The names of the shipped files (an evaluation set may use these without a scheme)."""

AUTO_CALIBRATION = "auto"
"""The default calibration dataset: ``AUTO_HUB_DATASET`` when the Job reaches the Hub, else the
built-in ``AUTO_FALLBACK``; what was used is recorded in the manifest (``CalibrationUsed``)."""
AUTO_HUB_DATASET = ("hf://datasets/HuggingFaceH4/ultrachat_200k@8049631c405ae6576f93f445c6b8166f76f5505a"
                    "#default/train_sft")
"""llm-compressor's own calibration set in its examples (512 samples of up to 2048 tokens, rendered
with the model's chat template): multi-turn English chat, MIT licensed; its first samples of the
`train_sft` split at a pinned commit, so the same key always means the same text."""
AUTO_FALLBACK = "general-en"
"""What ``auto`` calibrates on when the Hub cannot be reached (an air-gapped cluster): far fewer
tokens than the default asks, which the Job reports (``CalibrationUsed.shortfall``)."""
AUTO_FALLBACK_HASH = BUILTIN_DATASET_SHA256[AUTO_FALLBACK]
"""What an ``auto`` artifact calibrated on the fallback names in its key (``calibrationDatasetHash``):
the fallback file's sha256, where the Hub set's artifact names ``named_dataset_hash("auto")``. Two
keys, so an artifact made offline is never taken for the Hub set's
(``fewerbits_api.artifact.auto_fallback_inputs``)."""

CALIBRATION_DATASETS: tuple[str, ...] = (AUTO_CALIBRATION, *BUILTIN_DATASETS)
"""The names a calibration dataset may use without a scheme."""

CALIBRATION_SPLITS: tuple[str, ...] = ("train",)
"""The split the Job calibrates on when a Hub dataset's URI names none (`#config/split`); a set
without it is read from its first split."""
EVALUATION_SPLITS: tuple[str, ...] = ("test", "validation", "train")
"""The splits the Job and the canary evaluate on when a Hub dataset's URI names none, the first
the set has; a set with none of them is read from its first split."""


def named_dataset_hash(name: str) -> str | None:
    """What a named calibration dataset puts into the artifact key: a shipped file's sha256; for
    ``auto`` the sha256 of the pinned Hub URI and the fallback file's hash (changing either is a
    new key; it is the key of the artifact calibrated on the Hub set, the fallback's names
    ``AUTO_FALLBACK_HASH``). None for an unknown name."""
    if name == AUTO_CALIBRATION:
        return hashlib.sha256(f"{AUTO_HUB_DATASET}\n{BUILTIN_DATASET_SHA256[AUTO_FALLBACK]}".encode()).hexdigest()
    return BUILTIN_DATASET_SHA256.get(name)


def is_builtin_dataset_uri(uri: str) -> bool:
    """A dataset given without a scheme (``s3://``, ``hf://``) names a built-in set."""
    return "://" not in uri
