"""Issue 32's API rows, as a user of exllamav2 would try them, through `import exllamav2` (the compatibility
switch) on a real model; what it prints is quoted in benchmarks/results/tabbyapi.md ("Issue 32 checklist").

    python benchmarks/issue32_checks.py [--model EXL2_DIR] [--hf-model HF_DIR]

- the final result's draft counts only with speculative decoding (n-gram drafting off / on);
- a per-prompt filter list holding None (that prompt unfiltered);
- a PEFT adapter with LoRA on lm_head and embed_tokens, saved as adapter_model.bin (PEFT writes it from the HF
  model in --hf-model, which must have the EXL2 model's shapes);
- set_device_map() and layer streaming (load(lazy=True)) against a normal load.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

import exlpy.compat

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT.parent / "shared" / "models" / "smollm2-135m-exl2-4.0"))
    p.add_argument("--hf-model", default=None, help="HF checkpoint of the same shapes, for the PEFT adapter")
    args = p.parse_args()
    exlpy.compat.install()
    from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Lora, ExLlamaV2Tokenizer
    from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
    from exllamav2.generator.filters import ExLlamaV2PrefixFilter

    greedy = ExLlamaV2Sampler.Settings.greedy()
    cfg = ExLlamaV2Config(args.model)
    cfg.prepare()
    model = ExLlamaV2(cfg)
    cache = ExLlamaV2Cache(model, lazy=True, max_seq_len=1024)
    model.load_autosplit(cache)
    tok = ExLlamaV2Tokenizer(cfg)

    for ngram in (False, True):
        gen = ExLlamaV2DynamicGenerator(model, cache, tok, use_ngram_draft=ngram)
        gen.enqueue(ExLlamaV2DynamicJob(input_ids=tok.encode("Once upon a time", add_bos=True), max_new_tokens=8,
                                        gen_settings=greedy))
        final: dict = {}
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r["stage"] == "streaming" and r["eos"]:
                    final = r
        print(f"use_ngram_draft={ngram}: final keys with 'draft':", sorted(k for k in final if "draft" in k))

    gen = ExLlamaV2DynamicGenerator(model, cache, tok)
    out = gen.generate(prompt=["The sky is", "The sky is"], max_new_tokens=6, add_bos=True, completion_only=True,
                       filters=[None, [ExLlamaV2PrefixFilter(model, tok, [" green"])]], gen_settings=greedy)
    print("filters=[None, [prefix ' green']]:", out)

    ids = tok.encode("The capital of France is", add_bos=True)
    base_logits = model.forward(ids).float()
    if args.hf_model:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_pretrained(args.hf_model, dtype=torch.float32)
        peft_cfg = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                              target_modules=["q_proj", "v_proj", "lm_head", "embed_tokens"])
        adapter = tempfile.mkdtemp(prefix="exlpy-lora-")
        get_peft_model(hf, peft_cfg).save_pretrained(adapter, safe_serialization=False)
        print("adapter files:", sorted(os.listdir(adapter)))
        lora = ExLlamaV2Lora.from_directory(model, adapter)
        print("lora.lm_head:", None if lora.lm_head is None else tuple(lora.lm_head.shape),
              "lora.embed_tokens:", None if lora.embed_tokens is None else tuple(lora.embed_tokens.shape),
              "lora_scaling:", lora.lora_scaling)
        plain = gen.generate("Once upon a time", max_new_tokens=12, add_bos=True, completion_only=True,
                             gen_settings=greedy)
        gen.set_loras([lora])
        adapted = gen.generate("Once upon a time", max_new_tokens=12, add_bos=True, completion_only=True,
                               gen_settings=greedy)
        gen.set_loras(None)
        print("base:", repr(plain))
        print("lora:", repr(adapted))
        diff = (model.forward(ids, loras=[lora]).float() - base_logits).abs().max()
        print(f"logits change with the adapter: max |diff| {float(diff):.4g}")
    model.unload()

    print("set_device_map([4.0]) ->", ExLlamaV2(cfg).set_device_map([4.0]))
    streamed = ExLlamaV2(cfg)
    streamed.load(lazy=True)
    err = (streamed.forward(ids).float() - base_logits).abs().max() / base_logits.abs().max()
    print(f"layer streaming (load(lazy=True)) vs a normal load: max relative error {float(err):.3g}")


if __name__ == "__main__":
    main()
