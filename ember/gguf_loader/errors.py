"""The one error type the loader raises for a file that is not valid GGUF."""
from __future__ import annotations


class GGUFError(ValueError):
    """A malformed or unsupported GGUF file.

    The message reads "<path>: offset <n>: <problem>" (path and offset when known);
    `path`, `offset` and `problem` are also kept as attributes for callers that want them.
    """

    def __init__(self, problem: str, *, offset: int | None = None, path: str | None = None):
        self.problem, self.offset, self.path = problem, offset, path
        where = [] if offset is None else [f"offset {offset}"]
        super().__init__(": ".join([*([path] if path else []), *where, problem]))

    def at_path(self, path: str) -> GGUFError:
        """The same error, with the file's path in front (the parser does not know it)."""
        return GGUFError(self.problem, offset=self.offset, path=path)


def quoted(name: str, limit: int = 60) -> str:
    """repr of a name for a message, shortened: a corrupt length can make names huge."""
    return repr(name) if len(name) <= limit else repr(name[:limit]) + f"... ({len(name)} chars)"
