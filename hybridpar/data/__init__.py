"""Data: tokenizers (tokenizer.py), the built-in corpus (corpus.py), the Megatron indexed format (indexed.py),
preprocessing (preprocess.py), megatron-core datasets and the data-parallel loader (gpt_data.py), the checks on
megatron-core's index caches before it reads them (index_cache.py), data stages (stages.py), the one rule from a step
to its global batch under skipped windows (positions.py), the record of what each start read (record.py), the
provenance ledger built from it (provenance.py), and what the trainer gets and the checks of its sizes (dataset.py).

Nothing is imported here, so a preprocessing worker that needs only the tokenizer does not pay for torch.
"""
