"""Data: tokenizers (tokenizer.py), the Megatron indexed format (indexed.py), preprocessing (preprocess.py),
megatron-core datasets and the data-parallel loader (gpt_data.py), and what the trainer gets (dataset.py).

Nothing is imported here, so a preprocessing worker that needs only the tokenizer does not pay for torch.
"""
