"""Keep the garbage collector's full collections off the objects that existed before a build."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def older_objects_frozen():
    """Run the body with the objects that exist now frozen (``gc.freeze``), unfrozen after.

    Why: a build allocates enough to trigger a full (generation 2) collection, which walks
    every object in the process (hundreds of thousands with torch and a model loaded), a
    noticeable share of a build. Frozen, they are skipped; what the build makes is collected as
    usual, and after it the frozen objects are collected as before. Does nothing where the
    collector is off or objects are frozen already (the user's, or an outer build's:
    unfreezing them here would undo that)."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
