"""SchemaError, and the JSON pointer that says where in the schema its cause is."""
from __future__ import annotations


class SchemaError(ValueError):
    """The schema cannot be converted; `path` is a JSON pointer to the cause."""

    def __init__(self, message: str, path: str | None = None):
        self.message, self.path = message, path
        super().__init__(f"{path}: {message}" if path else message)


def pointer(path: tuple) -> str:
    """A JSON pointer (#/a/b) to a schema path, shortened from the left when long."""
    text = "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)
    return text if len(text) <= 160 else "#/..." + text[-150:]
