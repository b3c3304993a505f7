"""Using a trained model: generation with a KV cache (generate.py), a model of any layout loaded from any checkpoint
hybridpar reads (load.py), downstream evaluation tasks (tasks.py) and their evaluator (evaluate.py), and the
evaluations a training run makes of its own model (in_training.py)."""
