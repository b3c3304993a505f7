"""Data: tokenizers (tokenizer.py), the built-in corpus (corpus.py), the Megatron indexed format (indexed.py),
preprocessing (preprocess.py), megatron-core datasets and the data-parallel loader (gpt_data.py), the checks on
megatron-core's index caches before it reads them (index_cache.py), data stages (stages.py), and what the trainer gets
(dataset.py).

Nothing is imported here, so a preprocessing worker that needs only the tokenizer does not pay for torch.
"""
