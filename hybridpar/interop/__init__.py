"""Other frameworks' checkpoints: Hugging Face GPT-2 / Llama-style models (hf.py) and Megatron-LM (megatron.py),
both directions, from one name map each."""
