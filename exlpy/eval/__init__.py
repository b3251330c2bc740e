"""exllamav2's test_inference.py workflows (spec §11): perplexity over a dataset, with the contiguous FP16 pass
or token by token through a chosen cache (FP16, FP8, Q4, Q6, Q8), and prefill / decode speed sweeps.
`exlpy eval ppl` and `exlpy eval speed` are the command line (exlpy/cli/eval.py)."""

from exlpy.eval.perplexity import (
    PerplexityResult,
    dataset_rows,
    perplexity,
    perplexity_streamed,
    perplexity_token_by_token,
)
from exlpy.eval.speed import decode_speed, prefill_lengths, prefill_speed

__all__ = ["PerplexityResult", "dataset_rows", "decode_speed", "perplexity", "perplexity_streamed",
           "perplexity_token_by_token", "prefill_lengths", "prefill_speed"]
