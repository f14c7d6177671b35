"""The base class of every API model: camelCase on the wire, docstrings as descriptions."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

GROUP = "fewerbits.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"


class ApiModel(BaseModel):
    """Strict API model.

    Field docstrings become schema descriptions (``use_attribute_docstrings``), so the same text
    is what ``kubectl explain`` prints. Unknown fields are refused so a typo is an error that
    names the field, not a silently ignored setting.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
    )

    def to_wire(self) -> dict:
        """The object as the API server stores it: camelCase keys, unset optionals left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
