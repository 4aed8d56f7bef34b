"""Looking at captured graphs: CapturedGraph, tables, code, pictures, explanations.
Imported by the driver and the pipeline (and the public API); it reads the graphs the
tracer records and the passes that ran on them."""
