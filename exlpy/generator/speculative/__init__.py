"""Speculative decoding for both generators: drafts from a draft model or from n-grams of the context, verified
by the target in one step of k+1 tokens per sequence, with the rejection rule that keeps the output distributed
exactly as the target's sampler (verify.py)."""
