"""Banned strings as exllamav2's examples/inference_banned_strings.py: the same prompt with and without a ban
list through the dynamic generator, printing what each ban suppressed; then the streaming generator's
stream_ex() with the same ban list."""

import argparse
import json

from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
from exllamav2.generator import (
    ExLlamaV2DynamicGenerator,
    ExLlamaV2DynamicJob,
    ExLlamaV2Sampler,
    ExLlamaV2StreamingGenerator,
)

parser = argparse.ArgumentParser()
parser.add_argument("-m", "--model_dir", required=True)
parser.add_argument("-p", "--prompt", default="Echoes of")
parser.add_argument("-b", "--ban", action="append", default=[])
parser.add_argument("-n", "--max_new_tokens", type=int, default=16)
args = parser.parse_args()

config = ExLlamaV2Config(args.model_dir)
config.max_seq_len = 512
model = ExLlamaV2(config)
cache = ExLlamaV2Cache(model, max_seq_len=512, lazy=True)
model.load_autosplit(cache)
tokenizer = ExLlamaV2Tokenizer(config)
generator = ExLlamaV2DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer)


def generate(bs):
    input_ids = tokenizer.encode(args.prompt, add_bos=True)
    job = ExLlamaV2DynamicJob(input_ids=input_ids, max_new_tokens=args.max_new_tokens, banned_strings=bs,
                              stop_conditions=[], gen_settings=ExLlamaV2Sampler.Settings.greedy())
    generator.enqueue(job)
    text, ids, suppressed = "", [], []
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r["stage"] == "streaming":
                text += r.get("text", "")
                ids += r["token_ids"][0].tolist() if "token_ids" in r else []
                if "suppressed_text" in r:
                    print(f"[suppressed: {r['suppressed_text']!r} {r['suppressed_tokens'].tolist()}]")
                    suppressed.append([r["suppressed_text"], r["suppressed_tokens"][0].tolist()])
    return text, ids, suppressed


plain, plain_ids, _ = generate(None)
banned, banned_ids, suppressed = generate(args.ban)
print(f"Without bans: {plain}\nWith bans:    {banned}")

streaming_cache = ExLlamaV2Cache(model, max_seq_len=512)
streamer = ExLlamaV2StreamingGenerator(model, streaming_cache, tokenizer)
streamer.set_stop_conditions([])
streamer.begin_stream_ex(tokenizer.encode(args.prompt, add_bos=True), ExLlamaV2Sampler.Settings.greedy(),
                         banned_strings=args.ban)
streamed, stream_suppressed, n = "", [], 0
for _step in range(4 * args.max_new_tokens):  # held or rewound steps release nothing: bound the loop
    if n >= args.max_new_tokens:
        break
    res = streamer.stream_ex()
    streamed += res["chunk"]
    n += res["chunk_token_ids"].shape[-1]
    if "suppressed" in res:
        stream_suppressed.append(res["suppressed"])
print("RESULT " + json.dumps({"plain": plain, "banned": banned, "plain_ids": plain_ids, "banned_ids": banned_ids,
                              "suppressed": suppressed, "streamed": streamed,
                              "stream_suppressed": stream_suppressed}))
