"""kopf's persistence turned off: the gap it fills is that kopf has no setting for "store nothing".
Its default storages write the progress of high-level handlers and the last-handled
configuration into ``kopf.zalando.org`` annotations; this operator registers no such handler, and
these storages make sure nothing is ever written if one were added (``store``/``touch``/``purge``
do nothing, ``fetch`` finds nothing)."""

from __future__ import annotations

import copy
from typing import Any

import kopf


class NoProgress(kopf.ProgressStorage):
    def fetch(self, **_: Any) -> None:
        return None

    def store(self, **_: Any) -> None:
        return None

    def purge(self, **_: Any) -> None:
        return None

    def touch(self, **_: Any) -> None:
        return None

    def clear(self, *, essence: Any) -> Any:
        return copy.deepcopy(essence)  # nothing of ours in it to strip


class NoDiffBase(kopf.DiffBaseStorage):
    def fetch(self, **_: Any) -> None:
        return None

    def store(self, **_: Any) -> None:
        return None
