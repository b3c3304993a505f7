"""Other frameworks: Hugging Face GPT-2 / Llama-style checkpoints (hf.py) and Megatron-LM's (megatron.py), both
directions, from one name map each; and lm-evaluation-harness's model type `hybridpar` (lm_eval.py), which runs its
tasks on a hybridpar checkpoint."""
