"""What every decoding mode yields for each generated token (RiverLlama.generate): one typed step result."""
from __future__ import annotations


class Token(int):
    """A generated token: its id, an int as llama-cpp-python's create_completion and server consume it, the mode that
    decoded it, and `draft`: whose proposal stood there (exact mode: the drafter, "river", "ngram", "head", ...;
    gated mode: "river" where the river's token stood, None where the backbone decoded the position again), None
    where the mode's own model chose the token. Backbone, river and fast modes yield `draft` None."""

    mode: str
    draft: str | None

    def __new__(cls, token: int, mode: str, draft: str | None = None) -> Token:
        s = super().__new__(cls, token)
        s.mode, s.draft = mode, draft
        return s

    def __getnewargs__(self):   # copy and pickle keep the fields
        return int(self), self.mode, self.draft

    def __repr__(self) -> str:
        return f"Token({int(self)}, {self.mode!r}, {self.draft!r})"

    __str__ = int.__repr__   # its text is the id's, wherever a caller formats a token
