"""Names the fetcher writes into the destination directory and the launch wrapper reads.

Standard library only (like ``launch``, ``errors`` and ``cli``): the launch wrapper runs inside
the vLLM image, which carries neither boto3 nor a pydantic we control.
"""

from fewerbits_api.names import DEST_MANIFEST_NAME

MARKER_NAME = ".fewerbits-verified"
"""In dest: the digest of the manifest whose files were all verified there."""
STAGING_DIR = ".fewerbits-partial"
"""In dest: temporary files (``<path>.part``) and their part state (``<path>.state``)."""
RESERVED_NAMES = frozenset({MARKER_NAME, DEST_MANIFEST_NAME, STAGING_DIR})
