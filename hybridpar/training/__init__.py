"""The parts of one optimizer step: the microbatch scheduler and its losses (microbatch.py), AdamW and gradient
clipping (optim.py) and the learning-rate schedule (lr_schedule.py). The loop that drives
them is hybridpar.trainer."""
