"""The chart's ``watchNamespaces`` (``FEWERBITS_NAMESPACES``) mapped onto kopf's scope.

| watchNamespaces             | kopf                                   | RBAC the chart grants                |
|-----------------------------|----------------------------------------|--------------------------------------|
| empty                       | ``clusterwide=True``                   | a ClusterRole                        |
| names only (`ml-a`, `ml-b`) | ``namespaces=[names]``: one watch per  | a Role per namespace                 |
|                             | name and kind, names taken as exact    |                                      |
| any glob or `!` (`team-*`)  | ``clusterwide=True`` and a ``when=``   | a ClusterRole (as before)            |
|                             | filter: ``namespace_watched``          |                                      |

kopf's own globs are not used: they need a list/watch of Namespaces, which
``settings.scanning.disabled`` turns off (kopf then takes every pattern as an exact name,
kopf/_core/reactor/observation.py), and their meaning differs (kopf: the rightmost matching glob
wins and the first is decisive; ours: any positive pattern includes, any `!pattern` excludes).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

GLOB_CHARS = set("*?[!")


def namespace_watched(namespace: str, patterns: list[str]) -> bool:
    """Included by any positive pattern (or all when there is none), excluded by any `!pattern`."""
    positive = [p for p in patterns if not p.startswith("!")]
    negative = [p[1:] for p in patterns if p.startswith("!")]
    included = not positive or any(fnmatch.fnmatchcase(namespace, p) for p in positive)
    return included and not any(fnmatch.fnmatchcase(namespace, p) for p in negative)


def plain_names(namespaces: list[str]) -> bool:
    """Namespace names only (no glob or `!` pattern, not empty)."""
    return bool(namespaces) and not any(set(ns) & GLOB_CHARS for ns in namespaces)


@dataclass(frozen=True)
class KopfScope:
    clusterwide: bool
    namespaces: tuple[str, ...]
    patterns: tuple[str, ...]
    """Filtered in the handlers' ``when=`` (empty: every namespace kopf delivers is served)."""

    def serves(self, namespace: str | None) -> bool:
        return not self.patterns or namespace is None or namespace_watched(namespace, list(self.patterns))


def kopf_scope(namespaces: list[str]) -> KopfScope:
    if plain_names(namespaces):
        return KopfScope(False, tuple(dict.fromkeys(namespaces)), ())
    return KopfScope(True, (), tuple(namespaces))
