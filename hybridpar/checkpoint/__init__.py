"""Checkpoints: sharded DCP saves and loads (dcp.py), where they lie and which are complete (layout.py), reads that
cannot run code (safe_load.py), what a resume checks against the checkpoint (resume_checks.py), the recovery from a
loss spike: host copies, rerun, rewind to a checkpoint with the spike's batches skipped (recovery.py) and the run
directory's lock (run_dir.py)."""
