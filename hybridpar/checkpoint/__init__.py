"""Checkpoints: sharded DCP saves and loads (dcp.py), reads that cannot run code (safe_load.py), what a resume
checks against the checkpoint (resume_checks.py) and the run directory's lock (run_dir.py)."""
