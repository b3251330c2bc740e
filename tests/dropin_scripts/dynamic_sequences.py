"""Dynamic generation as exllamav2's examples/dynamic_gen.py: several jobs enqueued at once, iterate() until
all end, and at each job's end the display of its input (job.sequences[0].input_ids) and its statistics."""

import argparse
import json

from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler

parser = argparse.ArgumentParser()
parser.add_argument("-m", "--model_dir", required=True)
parser.add_argument("-n", "--max_new_tokens", type=int, default=12)
args = parser.parse_args()

prompts = ["Echoes of", "Once", "The gentle hum of"]
config = ExLlamaV2Config(args.model_dir)
config.arch_compat_overrides()
config.max_seq_len = 1024  # the demo model was trained for 128 positions; the cache needs whole 256-token pages
model = ExLlamaV2(config)
cache = ExLlamaV2Cache(model, max_seq_len=1024, lazy=True)
model.load_autosplit(cache, progress=False)
tokenizer = ExLlamaV2Tokenizer(config)
generator = ExLlamaV2DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, max_batch_size=4)
generator.warmup()

jobs = []
for i, prompt in enumerate(prompts):
    job = ExLlamaV2DynamicJob(input_ids=tokenizer.encode(prompt, add_bos=True), max_new_tokens=args.max_new_tokens,
                              stop_conditions=[], gen_settings=ExLlamaV2Sampler.Settings.greedy(), identifier=i)
    jobs.append(job)
before = [tokenizer.decode(j.sequences[0].input_ids.torch(), decode_special_tokens=True)[0] for j in jobs]
generator.enqueue(jobs)

shown = {}
while generator.num_remaining_jobs():
    for r in generator.iterate():
        if r["stage"] == "streaming" and r["eos"]:
            job = r["job"]
            in_prompt = tokenizer.decode(job.sequences[0].input_ids.torch(), decode_special_tokens=True)[0]
            seq = job.sequences[0].sequence_ids.torch()
            print(f"Input: {in_prompt}\nOutput: {r['full_completion']}")
            print(f"New tokens: {r['new_tokens']:7} t, cached: {r['cached_tokens']:7} t / {r['prompt_tokens']:7} t")
            shown[r["identifier"]] = {"input": in_prompt, "completion": r["full_completion"],
                                      "new_tokens": r["new_tokens"], "prompt_tokens": r["prompt_tokens"],
                                      "sequence": seq[0].tolist(), "kv_position": job.sequences[0].kv_position}
print("RESULT " + json.dumps({"jobs": [shown[i] for i in range(len(prompts))], "before": before}))
