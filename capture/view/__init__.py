"""Looking at captured graphs: CapturedGraph, tables, code, pictures, explanations."""
