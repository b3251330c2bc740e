"""Batched decoding over a list of caches, one per prompt, as exllamav2's tests/test.py test_multicache: each
prompt is prefilled into its own cache, then every step runs all rows with model.forward(ids, caches)."""

import argparse
import json

import torch
from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
from exllamav2.generator import ExLlamaV2Sampler

parser = argparse.ArgumentParser()
parser.add_argument("-m", "--model_dir", required=True)
parser.add_argument("-n", "--max_new_tokens", type=int, default=10)
args = parser.parse_args()

config = ExLlamaV2Config(args.model_dir)
model = ExLlamaV2(config)
model.load()
tokenizer = ExLlamaV2Tokenizer(config)
settings = ExLlamaV2Sampler.Settings.greedy()

prompts = ["Echoes of vectors", "Once", "The gentle hum of", "A"]
caches = [ExLlamaV2Cache(model, max_seq_len=128) for _ in range(len(prompts))]
input_ids = []
for i in range(len(prompts)):
    input_ids.append(tokenizer.encode(prompts[i], add_bos=True))
    model.forward(input_ids[i][:, :-1], caches[i], input_mask=None, preprocess_only=True)

for _ in range(args.max_new_tokens):
    inputs = torch.cat([x[:, -1:] for x in input_ids], dim=0)
    logits = model.forward(inputs, caches, input_mask=None).float().cpu()
    for j in range(len(input_ids)):
        token, _, _, _, _ = ExLlamaV2Sampler.sample(logits[j:j + 1, :, :], settings, input_ids[j], 0.5, tokenizer)
        input_ids[j] = torch.cat([input_ids[j], token], dim=1)

output = [tokenizer.decode(ids)[0] for ids in input_ids]
for o in output:
    print(o)
    print("---")
print("RESULT " + json.dumps({"ids": [x[0].tolist() for x in input_ids], "text": output,
                              "cache_lens": [c.current_seq_len for c in caches]}))
