"""lm-evaluation-harness with hybridpar's model type registered: the same arguments as `lm_eval`.

    python launch/harness.py --model hybridpar --model_args checkpoint=runs/x --tasks hellaswag --batch_size 16
    python launch/harness.py --model hybridpar --model_args checkpoint=runs/x --include_path my_tasks/ --tasks mine
    torchrun --nproc_per_node 2 launch/harness.py --model hybridpar --model_args checkpoint=runs/x,tp=2 --tasks ...

model_args: checkpoint (a run dir, checkpoint dir or export), max_length, tokenizer, dp_replicate, dp_shard, tp,
sequence_parallel, precision, device (hybridpar/interop/lm_eval.py). Needs the eval extra: pip install -e ".[eval]".
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    # Python put launch/ first on sys.path, and launch/evaluate.py would shadow Hugging Face's `evaluate` package,
    # which lm-eval imports for some metrics: this command needs nothing from launch/.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != here]
    try:
        import lm_eval.__main__ as harness
    except ImportError:
        print('error: lm-evaluation-harness is not installed: pip install -e ".[eval]"', file=sys.stderr)
        return 2
    import hybridpar.interop.lm_eval  # noqa: F401  (registers --model hybridpar)
    from hybridpar.errors import UserError
    from hybridpar.parallel.distributed import shutdown

    try:
        harness.cli_evaluate()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
