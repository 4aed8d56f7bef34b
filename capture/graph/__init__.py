"""Reading the live autograd graph: its structure, sizes, saved tensors and hooks."""
