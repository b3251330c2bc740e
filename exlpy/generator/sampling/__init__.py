"""The sampler's steps, one small pure-torch module each;
`exlpy.generator.sampler.ExLlamaV2Sampler` runs them.

penalties (repetition/frequency/presence), dry, logit_masks (blocked tokens, bias, filters, healing, vocab
limit), cfg, temperature (incl. smoothing and dynamic temperature), truncation (top-p/top-a/min-p/TFS/
typical; top-k lives in chain.candidates), mirostat, xtc, skew, draw; chain assembles them from Settings.
"""

from exlpy.generator.sampling.hooks import PostSamplingResult
from exlpy.generator.sampling.settings import SamplerSettings

__all__ = ["PostSamplingResult", "SamplerSettings"]
