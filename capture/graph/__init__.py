"""Reading the live autograd graph: its structure, sizes, saved tensors and hooks, and
what kind each node is.  It imports only the compiled part and the shared modules:
everything above reads the live graph through it."""
