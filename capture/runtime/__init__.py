"""What captured graphs call when they run: accumulation, opaque nodes and custom
backwards, saved-tensor unpacks and releases (``runtime_ops``), hooks and the
graph-task answers Python asks for (``hook_ops``), and the counters (``counters``).
Imported by the tracer and the backends, which emit calls to it, and by the driver."""
