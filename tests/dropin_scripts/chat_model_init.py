"""A chat set up as exllamav2's examples/chat.py: model_init's command line, the cache created after init (lazy
and loaded by autosplit with `-gs auto`), the streaming generator with stop conditions, ChatML turns."""

import argparse
import json

from exllamav2 import ExLlamaV2Cache, ExLlamaV2Cache_Q4, model_init
from exllamav2.generator import ExLlamaV2Sampler, ExLlamaV2StreamingGenerator

parser = argparse.ArgumentParser(description="Simple chat")
parser.add_argument("-cq4", "--cache_q4", action="store_true", help="Use Q4 cache")
parser.add_argument("-maxr", "--max_response_tokens", type=int, default=8)
parser.add_argument("--turn", action="append", default=[], help="a user turn (repeatable)")
model_init.add_args(parser)
args = parser.parse_args()
model_init.check_args(args)
model_init.print_options(args)
model, tokenizer = model_init.init(args, allow_auto_split=True, max_output_len=16, skip_load=True)
model_init.post_init_load(model, args, allow_auto_split=True)

cache = (ExLlamaV2Cache_Q4 if args.cache_q4 else ExLlamaV2Cache)(model, lazy=not model.loaded)
if not model.loaded:
    model.load_autosplit(cache)

generator = ExLlamaV2StreamingGenerator(model, cache, tokenizer)
generator.speculative_ngram = False
generator.set_stop_conditions([tokenizer.eos_token_id, "<|im_end|>"])
settings = ExLlamaV2Sampler.Settings.greedy()

context = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
responses, response_ids, contexts = [], [], []
for user in args.turn:
    context += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    active_context = tokenizer.encode(context, add_bos=False, encode_special_tokens=True)
    contexts.append(active_context[0].tolist())
    generator.begin_stream_ex(active_context, settings)
    generator.reset_sd_stats()
    response, ids = "", []
    while True:
        res = generator.stream_ex()
        response += res["chunk"]
        ids += res["chunk_token_ids"][0].tolist()
        if res["eos"] or len(ids) >= args.max_response_tokens or generator.full():
            break
    print(f"User: {user}\nAssistant: {response}")
    responses.append(response)
    response_ids.append(ids)
    context += response + "<|im_end|>\n"

print("RESULT " + json.dumps({"responses": responses, "response_ids": response_ids, "contexts": contexts,
                              "loaded": model.loaded,
                              "sd_stats": list(generator.get_sd_stats()), "max_seq_len": model.config.max_seq_len,
                              "cache": type(cache).__name__}))
