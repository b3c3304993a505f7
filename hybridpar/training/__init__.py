"""The parts of the training loop (hybridpar.trainer drives them): its one mutable record (state.py), the microbatch
scheduler and its losses (microbatch.py), AdamW, Muon and gradient clipping (optim.py, muon.py), the learning-rate
schedule (lr_schedule.py), the queue of step statuses read back on the host (step_status.py), and the loss-spike test
with the skipped-batch windows and host-memory checkpoint copies (spikes.py)."""
