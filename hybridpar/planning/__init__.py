"""Planning from shapes alone: per-parameter local shapes (shapes.py), FLOPs (flops.py), the per-GPU byte and step
time model (cost.py), the layout search and start-up memory choices (layouts.py), and the dry run that checks the
model against a real parallelisation on the meta device (dry_run.py)."""
