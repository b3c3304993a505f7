"""Checkpoints: sharded DCP saves and loads (dcp.py), where they lie and which are complete (layout.py), reads that
cannot run code (safe_load.py), what a resume checks against the checkpoint (resume_checks.py) and the run
directory's lock (run_dir.py). A rewind after a loss spike is hybridpar.training.recovery's."""
