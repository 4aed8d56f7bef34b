"""The driver of a backward: the block (``session``), the routing of backward calls to
it, the cache of compiled graphs, the rest of a backward whose graph stopped
(``continuation``) and the self-check.  Imported by the public API above it alone."""
