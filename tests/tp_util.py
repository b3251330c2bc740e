"""Helpers for the tensor-parallel tests: tiny random HF-layout model directories."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_model_dir(path: Path, arch: str = "LlamaForCausalLM", hidden: int = 192, heads: int = 6,
                   kv_heads: int = 3, head_dim: int = 32, intermediate: int = 768, vocab: int = 1600,
                   layers: int = 2, tie: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json + model.safetensors with random weights (std 0.05) for a Llama/Qwen2/Qwen3 model."""
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                  "MistralForCausalLM": "mistral"}.get(arch, "llama")
    cfg = {"architectures": [arch], "model_type": model_type, "hidden_size": hidden,
           "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": tie,
           "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(cfg))

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    t = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": norm(hidden)}
    if not tie:
        t["lm_head.weight"] = r(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = norm(hidden)
        t[f"{p}.post_attention_layernorm.weight"] = norm(hidden)
        t[f"{p}.self_attn.q_proj.weight"] = r(heads * head_dim, hidden)
        t[f"{p}.self_attn.k_proj.weight"] = r(kv_heads * head_dim, hidden)
        t[f"{p}.self_attn.v_proj.weight"] = r(kv_heads * head_dim, hidden)
        t[f"{p}.self_attn.o_proj.weight"] = r(hidden, heads * head_dim)
        if arch == "Qwen2ForCausalLM":
            for n, size in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                t[f"{p}.self_attn.{n}_proj.bias"] = r(size * head_dim)
        if arch == "Qwen3ForCausalLM":
            t[f"{p}.self_attn.q_norm.weight"] = norm(head_dim)
            t[f"{p}.self_attn.k_norm.weight"] = norm(head_dim)
        t[f"{p}.mlp.gate_proj.weight"] = r(intermediate, hidden)
        t[f"{p}.mlp.up_proj.weight"] = r(intermediate, hidden)
        t[f"{p}.mlp.down_proj.weight"] = r(hidden, intermediate)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    return path


class PrefillCase:
    """The two-GPU prefill tests' case: a 3-layer fp16 model (1,024 positions), a 600-token prompt of 2 rows and
    `n_steps` decode steps after it. `load_tp(options)` places it on two GPUs; `run(model, cache)` returns its
    prefill logits and each step's, on the CPU; `ref` / `ref_steps` are the one-GPU model's."""

    def __init__(self, tmp_path: Path, n_steps: int) -> None:
        from exlpy import ExLlamaV2, ExLlamaV2Cache

        self.dir = make_model_dir(tmp_path / "m", hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1024,
                                  vocab=3000, layers=3, dtype=torch.float16, seed=5)
        self.ids = torch.randint(3, 3000, (2, 600), generator=torch.Generator().manual_seed(0))
        self.steps = torch.randint(3, 3000, (2, n_steps), generator=torch.Generator().manual_seed(1))
        single = ExLlamaV2(self.config())
        single.load()
        self.ref, self.ref_steps = self.run(single, ExLlamaV2Cache(single, batch_size=2, max_seq_len=700))
        single.unload()

    def config(self):  # noqa: ANN201 - an ExLlamaV2Config (exlpy imported lazily, as the tests collect on CPU)
        from exlpy import ExLlamaV2Config

        cfg = ExLlamaV2Config(str(self.dir))
        cfg.max_seq_len = 1024  # the written model says 256 positions; the prompt is 600 tokens
        return cfg

    def load_tp(self, options):  # noqa: ANN001, ANN201 - RuntimeOptions -> ExLlamaV2
        from exlpy import ExLlamaV2

        m = ExLlamaV2(self.config())
        m.load_tp([1, 1], options=options)
        return m

    def run(self, m, cache) -> tuple[torch.Tensor, list[torch.Tensor]]:  # noqa: ANN001
        out = m.forward(self.ids, cache).float().cpu()
        return out, [m.forward(self.steps[:, k:k + 1], cache).float().cpu() for k in range(self.steps.shape[1])]

    def tp_cache(self, m):  # noqa: ANN001, ANN201
        from exlpy.cache.tp import ExLlamaV2Cache_TP

        return ExLlamaV2Cache_TP(m, batch_size=2, max_seq_len=700)

    def assert_close_to_one_gpu(self, got: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
        torch.testing.assert_close(got[0], self.ref, atol=2e-2, rtol=0)
        for a, b in zip(got[1], self.ref_steps):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=0)


def prefill_as_reference(m, ids: torch.Tensor, ref: torch.Tensor, ref_cache, max_seq_len: int = 64):  # noqa: ANN001, ANN201
    """Prefill `ids` on TP model `m` into a fresh ExLlamaV2Cache_TP; assert its logits and the cache rows it wrote
    equal the reference run's (fp32 CPU tolerance). Returns the cache, for the decode steps after it."""
    from exlpy.cache.tp import ExLlamaV2Cache_TP

    c = ExLlamaV2Cache_TP(m, batch_size=ids.shape[0], max_seq_len=max_seq_len)
    torch.testing.assert_close(m.forward(ids, c), ref, atol=2e-5, rtol=1e-5)
    n = ids.shape[1]
    for a, b in zip(c.all_tensors(), ref_cache.all_tensors()):
        torch.testing.assert_close(a[:, :n], b[:, :n], atol=2e-5, rtol=1e-5)
    return c
