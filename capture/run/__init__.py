"""Running one backward: routing, the block, the cache, and what graphs call."""
