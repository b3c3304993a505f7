"""The parts of the training loop (hybridpar.trainer drives them): its one mutable record (state.py), the microbatch
scheduler, its numerics and losses (microbatch.py), the gradient reduction over data-parallel ranks (reduction.py),
AdamW, Muon and gradient clipping (optim.py, muon.py), the learning-rate schedule (lr_schedule.py), the queue of step
statuses read back on the host (step_status.py), the loss-spike test and skipped-batch windows (spikes.py; the
rewind is hybridpar.checkpoint.recovery's), and the time accounting (goodput.py)."""
