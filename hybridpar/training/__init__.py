"""The parts of one optimizer step: the microbatch scheduler and its losses (microbatch.py), AdamW and gradient
clipping (optim.py), the learning-rate schedule (lr_schedule.py) and sampling (sampling.py). The loop that drives
them is hybridpar.trainer."""
