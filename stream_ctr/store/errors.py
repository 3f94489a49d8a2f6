"""The one error type of the embedding store that a user can cause."""
from __future__ import annotations


class StoreError(RuntimeError):
    """A store problem the user can act on (disk full, LMDB cap reached, a store
    directory that belongs to another run...). The message is one line that
    names the option or path at fault; the CLI prints it without a traceback."""
