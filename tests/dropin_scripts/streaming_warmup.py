"""Streaming as exllamav2's streaming example: warmup(), begin_stream_ex(), stream_ex() until EOS or a token
budget, timed with Timer; then generate_simple() on the same generator."""

import argparse
import json
import sys

from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer, Timer
from exllamav2.generator import ExLlamaV2Sampler, ExLlamaV2StreamingGenerator

parser = argparse.ArgumentParser()
parser.add_argument("-m", "--model_dir", required=True)
parser.add_argument("-p", "--prompt", default="Echoes of")
parser.add_argument("-n", "--max_new_tokens", type=int, default=16)
args = parser.parse_args()

config = ExLlamaV2Config(args.model_dir)
model = ExLlamaV2(config)
cache = ExLlamaV2Cache(model, lazy=True)
model.load_autosplit(cache)
tokenizer = ExLlamaV2Tokenizer(config)

generator = ExLlamaV2StreamingGenerator(model, cache, tokenizer)
settings = ExLlamaV2Sampler.Settings()
settings.temperature = 0.0  # below 0.01 is greedy
settings.token_repetition_penalty = 1.0
settings.disallow_tokens(tokenizer, [tokenizer.eos_token_id])

input_ids = tokenizer.encode(args.prompt, add_bos=True)
generator.warmup()
generator.set_stop_conditions([])

with Timer() as t_prompt:
    generator.begin_stream_ex(input_ids, settings)
print(args.prompt, end="")
tokens, text = [], ""
with Timer() as t_gen:
    while True:
        res = generator.stream_ex()
        text += res["chunk"]
        tokens += res["chunk_token_ids"][0].tolist()
        print(res["chunk"], end="")
        sys.stdout.flush()
        if res["eos"] or len(tokens) >= args.max_new_tokens:
            break
print()
print(f"Response generated in {t_gen.interval:.2f} seconds, {len(tokens)} tokens")

simple = generator.generate_simple(args.prompt, settings, args.max_new_tokens, add_bos=True, completion_only=True)
print("RESULT " + json.dumps({"text": text, "tokens": tokens, "simple": simple, "prompt_ids": input_ids[0].tolist(),
                              "interval": t_gen.interval, "is_base": type(generator).__mro__[1].__name__}))
