"""Vision-language models against Hugging Face transformers on one GPU: logits with an image in the prompt, and
the time to first token for a 1024x1024 image plus 100 text tokens (preprocessing, vision tower, prefill, first
token).

The model is random, with Qwen2.5-VL-7B's shapes (text: hidden 3584, 28 heads / 4 KV heads, MLP 18944, vocab
152064, M-RoPE [16, 24, 24]; vision: width 1280, 16 heads, MLP 3420, window 112 px, merge 2), or with `--arch
gemma3` Gemma-3-4B's (text: hidden 2560, 8 heads / 4 KV heads of 256, MLP 10240, vocab 262208, window 1024, five
local layers per global one; SigLIP: width 1152, 16 heads, MLP 4304, 896 px, 256 tokens per image), and fewer
layers (`--layers` of the language model, `--vision-layers` of the tower) so it builds in seconds. It is written
once with transformers' save_pretrained and loaded by both.

Logits: exlpy fp16 and transformers fp16 are each compared with transformers fp32 (all on the GPU): exlpy's error
should be of the size of transformers' own fp16 error. Time to first token: median of `--runs`, each with a new
random image (no cache of an earlier image or prompt helps either side), after a warm-up run.

    python benchmarks/vision.py                      # GPU: writes benchmarks/results/vision.md
    python benchmarks/vision.py --arch gemma3        # GPU: writes benchmarks/results/vision_gemma3.md
    python benchmarks/vision.py --tiny [--arch gemma3]   # CPU, tiny shapes, fp32: a correctness smoke run

Both sides also get a per-phase breakdown (exlpy's phase marks, exlpy/vision/timing.py; forward hooks on
transformers' modules): CUDA events at each mark, so a phase's GPU-timeline time includes host stalls, next to its
host time. The results file's generated block is rewritten; sections after it (`## ` headings) are kept.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from exlpy.vision.timing import PhaseTimer, mark  # noqa: E402
from tests.vision_models import (  # noqa: E402
    GEMMA_IDS,
    GEMMA_SPECIALS,
    GEMMA_TOKENIZER_CONFIG,
    IDS,
    random_image,
    write_tokenizer,
)

SEVEN_B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
               vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0)
SEVEN_B_VISION = dict(hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=112)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0)
TINY_VISION = dict(hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
                   spatial_merge_size=2, temporal_patch_size=2, window_size=56)


GEMMA_4B = dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4,
                head_dim=256, vocab_size=262208, max_position_embeddings=32768, sliding_window=1024,
                query_pre_attn_scalar=256, rope_scaling={"rope_type": "linear", "factor": 8.0})
GEMMA_4B_VISION = dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16, image_size=896, patch_size=14)
GEMMA_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=512, max_position_embeddings=4096, sliding_window=16, query_pre_attn_scalar=16,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
GEMMA_TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, image_size=112, patch_size=14)


def build_gemma3(path: Path, layers: int, vision_layers: int, tiny: bool, device: str) -> None:
    """A random Gemma 3 written to `path`, with tokenizer and processor config."""
    import json

    import transformers as tf

    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    text = dict(GEMMA_TINY if tiny else GEMMA_4B, num_hidden_layers=layers, layer_types=types,
                bos_token_id=GEMMA_IDS["<bos>"], eos_token_id=GEMMA_IDS["<eos>"], pad_token_id=GEMMA_IDS["<pad>"])
    vision = dict(GEMMA_TINY_VISION if tiny else GEMMA_4B_VISION, num_hidden_layers=vision_layers)
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16 if tiny else 256,
                          image_token_index=GEMMA_IDS["<image_soft_token>"],
                          boi_token_index=GEMMA_IDS["<start_of_image>"], eoi_token_index=GEMMA_IDS["<end_of_image>"])
    _save(tf.Gemma3ForConditionalGeneration, cfg, path, tiny, device)
    side = vision["image_size"]
    (path / "preprocessor_config.json").write_text(json.dumps({"size": {"height": side, "width": side}}))
    write_tokenizer(path, GEMMA_SPECIALS, GEMMA_TOKENIZER_CONFIG)


def _save(cls: Any, cfg: Any, path: Path, tiny: bool, device: str) -> None:
    torch.manual_seed(0)
    dtype = torch.float32 if tiny else torch.float16
    with torch.device(device):
        model = cls(cfg).to(dtype)
    with torch.no_grad():  # random norms and biases (the default init leaves them at 1 and 0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("ln_q.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
            elif name.endswith("mm_input_projection_weight"):
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)


def build(path: Path, layers: int, vision_layers: int, tiny: bool, device: str, max_pixels: int) -> None:
    """A random Qwen2.5-VL written to `path` (fp16 on a GPU, fp32 for --tiny), with tokenizer and processor."""
    import json

    import transformers as tf

    text = dict(TINY if tiny else SEVEN_B, num_hidden_layers=layers,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3] if tiny else [16, 24, 24]},
                bos_token_id=IDS["<|endoftext|>"], eos_token_id=IDS["<|im_end|>"])
    vision = dict(TINY_VISION if tiny else SEVEN_B_VISION, depth=vision_layers,
                  fullatt_block_indexes=list(range(3, vision_layers, 4)))
    cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IDS["<|image_pad|>"],
                              video_token_id=IDS["<|video_pad|>"], vision_start_token_id=IDS["<|vision_start|>"],
                              vision_end_token_id=IDS["<|vision_end|>"])
    _save(tf.Qwen2_5_VLForConditionalGeneration, cfg, path, tiny, device)
    gen = path / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text())
        g.update(bos_token_id=IDS["<|endoftext|>"], eos_token_id=IDS["<|im_end|>"])
        gen.write_text(json.dumps(g))
    (path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 56 * 56, "max_pixels": max_pixels}))
    write_tokenizer(path)


def _has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def text_ids(n: int) -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(32, 127, (n,), generator=g).tolist()  # printable bytes: one token each


class HF:
    def __init__(self, path: Path, device: str, dtype: torch.dtype, max_pixels: int, arch: str,
                 processor: str = "pil") -> None:
        import transformers as tf

        self.arch = arch
        cls = tf.Gemma3ForConditionalGeneration if arch == "gemma3" else tf.Qwen2_5_VLForConditionalGeneration
        self.model = cls.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
        self.pil = self._processor("pil", max_pixels)  # bit-equal to exlpy's: for the logits comparison
        self.processor, self.proc = "pil", self.pil  # the timed runs': transformers' default where it can
        if processor == "torchvision" or (processor == "auto" and _has_torchvision()):
            try:
                self.processor, self.proc = "torchvision", self._processor("torchvision", max_pixels)
            except ImportError:
                if processor == "torchvision":
                    raise
        # transformers' fast (torchvision) processors resize and normalize on the device they are given
        self.proc_kwargs: dict[str, Any] = {"device": device} if self.processor == "torchvision" else {}
        self.device = device

    def _processor(self, kind: str, max_pixels: int) -> Any:
        if self.arch == "gemma3":
            side = self.model.config.vision_config.image_size
            if kind == "torchvision":
                from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor as GemmaProc
            else:
                from transformers.models.gemma3.image_processing_pil_gemma3 import (
                    Gemma3ImageProcessorPil as GemmaProc,
                )
            return GemmaProc(size={"height": side, "width": side})
        if kind == "torchvision":
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as QwenProc
        else:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
                Qwen2VLImageProcessorPil as QwenProc,
            )
        return QwenProc(min_pixels=56 * 56, max_pixels=max_pixels)

    def logits(self, img: Any, before: list[int], after: list[int], keep: int = 0, pil: bool = False
               ) -> torch.Tensor:
        """Logits of every position (keep=0), or of the last `keep` (what a first token needs); pil: through the
        PIL processor whatever the timed one is."""
        proc, kwargs = (self.pil, {}) if pil else (self.proc, self.proc_kwargs)
        if self.arch == "gemma3":
            px = proc(images=[img], return_tensors="pt", **kwargs)["pixel_values"].to(self.device)
            n = self.model.config.mm_tokens_per_image
            ids = torch.tensor([before + [GEMMA_IDS["<start_of_image>"]] + [GEMMA_IDS["<image_soft_token>"]] * n +
                                [GEMMA_IDS["<end_of_image>"]] + after], device=self.device)
            mark("preprocess (processor) + upload")
            with torch.no_grad():
                return self.model(input_ids=ids, pixel_values=px.to(self.model.dtype), logits_to_keep=keep,
                                  token_type_ids=(ids == GEMMA_IDS["<image_soft_token>"]).long()).logits
        inputs = proc(images=[img], return_tensors="pt", **kwargs)
        n = int(inputs["image_grid_thw"].prod()) // 4
        ids = torch.tensor([before + [IDS["<|vision_start|>"]] + [IDS["<|image_pad|>"]] * n +
                            [IDS["<|vision_end|>"]] + after], device=self.device)
        px, thw = inputs["pixel_values"].to(self.device), inputs["image_grid_thw"].to(self.device)
        mark("preprocess (processor) + upload")
        with torch.no_grad():
            return self.model(input_ids=ids, pixel_values=px, image_grid_thw=thw,
                              mm_token_type_ids=(ids == IDS["<|image_pad|>"]).int(), logits_to_keep=keep).logits

    def first_token(self, img: Any, before: list[int], after: list[int]) -> int:
        token = int(self.logits(img, before, after, keep=1)[0, -1].argmax())
        mark("first token (argmax to host)")
        return token

    def phase_hooks(self) -> list[Any]:
        """Forward hooks that mark the phases of transformers' forward (exlpy/vision/timing.py); remove after."""
        m = self.model.model
        if self.arch == "gemma3":
            tower, embed, blocks, attn, merger = (m.vision_tower, m.vision_tower.embeddings,
                                                  m.vision_tower.encoder.layers, "self_attn", m.multi_modal_projector)
        else:
            v = m.visual
            tower, embed, blocks, attn, merger = v, v.patch_embed, v.blocks, "attn", v.merger
        layers = m.language_model.layers
        hooks = []

        def pre(mod: Any, name: str) -> None:
            hooks.append(mod.register_forward_pre_hook(lambda *a, **k: mark(name)))

        def post(mod: Any, name: str) -> None:
            hooks.append(mod.register_forward_hook(lambda *a, **k: mark(name)))

        pre(tower, "model: inputs before the tower")
        post(embed, "tower: patch embed")
        pre(blocks[0], "tower: rotary + window tables")
        for b in blocks:
            post(getattr(b, attn), "tower: attention")
            post(b, "tower: mlp")
        post(merger, "tower: merger")
        pre(layers[0], "prefill: image rows inserted + positions")
        post(layers[-1], "prefill: layers")
        post(self.model.lm_head, "prefill: norm + head")
        return hooks


class Exlpy:
    def __init__(self, path: Path, device: str, dtype: torch.dtype, mlp_align: int | None = None) -> None:
        from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer, ExLlamaV2VisionTower
        from exlpy.generator import ExLlamaV2DynamicGenerator

        self.config = ExLlamaV2Config(str(path))
        self.config.max_seq_len = 4096
        self.config.dtype = dtype if device == "cpu" else None
        self.model = ExLlamaV2(self.config)
        self.model.load(device=device)
        self.tokenizer = ExLlamaV2Tokenizer(self.config)
        self.tower = ExLlamaV2VisionTower(self.config)
        if mlp_align is not None and hasattr(self.tower.tower, "mlp_align"):
            self.tower.tower.mlp_align = mlp_align  # Qwen2.5-VL: the tower's MLP width padding (1: none)
        self.tower.load(device=device)
        self.cache = ExLlamaV2Cache(self.model, max_seq_len=4096)
        self.generator = ExLlamaV2DynamicGenerator(self.model, self.cache, self.tokenizer)

    def embedding(self, img: Any) -> Any:
        return self.tower.get_image_embeddings(model=self.model, tokenizer=self.tokenizer, image=img,
                                               text_alias="<image>")

    def logits(self, img: Any, before: list[int], after: list[int]) -> torch.Tensor:
        emb = self.embedding(img)
        ids = torch.tensor([before + emb.get_ids() + after])
        return self.model.forward(ids, indexed_embeddings=[emb])

    def first_token(self, img: Any, before: list[int], after: list[int]) -> int:
        """The whole request: image -> embedding -> prefill through the generator -> first sampled token."""
        from exlpy.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

        emb = self.embedding(img)
        ids = torch.tensor([before + emb.get_ids() + after])
        job = ExLlamaV2DynamicJob(ids, max_new_tokens=1, gen_settings=ExLlamaV2Sampler.Settings.greedy(),
                                  embeddings=[emb], stop_conditions=[])
        self.generator.enqueue(job)
        token = -1
        while self.generator.num_remaining_jobs():
            for r in self.generator.iterate():
                if r["stage"] == "streaming" and "token_ids" in r and r["token_ids"].numel():
                    token = int(r["token_ids"][0, 0])
        mark("prefill: layers + head + first token")
        return token


def phase_table(who: str, runs: list[dict[str, tuple[float, float]]], device: str) -> str:
    """A markdown table of each phase's median device and host milliseconds over `runs` (PhaseTimer.phases())."""
    names = list(dict.fromkeys(n for r in runs for n in r))
    gpu = device.startswith("cuda")
    head = "| phase | GPU timeline ms | host ms |\n|---|---:|---:|" if gpu else "| phase | ms |\n|---|---:|"
    rows, total_d, total_h = [], 0.0, 0.0
    for n in names:
        d = statistics.median(r.get(n, (0.0, 0.0))[0] for r in runs)
        h = statistics.median(r.get(n, (0.0, 0.0))[1] for r in runs)
        total_d, total_h = total_d + d, total_h + h
        rows.append(f"| {n} | {d:.2f} | {h:.2f} |" if gpu else f"| {n} | {h:.2f} |")
    rows.append(f"| sum of medians | {total_d:.2f} | {total_h:.2f} |" if gpu else f"| sum of medians | {total_h:.2f} |")
    where = "CUDA events between marks (host stalls included) and the host clock" if gpu else "the host clock"
    return (f"{who}, per phase (median of {len(runs)} runs, {where}; phases met in every block summed):\n\n"
            + head + "\n" + "\n".join(rows) + "\n")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, fp32 on the CPU (a smoke run)")
    ap.add_argument("--arch", choices=["qwen2_5_vl", "gemma3"], default="qwen2_5_vl")
    ap.add_argument("--layers", type=int, default=None, help="language-model layers (default 4; Gemma 3: 6, one "
                    "global; 7B has 28, 4B 34)")
    ap.add_argument("--vision-layers", type=int, default=8, help="vision-tower blocks (7B has 32, 4B 27)")
    ap.add_argument("--image-size", type=int, default=None, help="square image side (default 1024; --tiny 112)")
    ap.add_argument("--text-tokens", type=int, default=100)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--hf-processor", choices=["auto", "pil", "torchvision"], default="auto",
                    help="transformers' image processor for its timed runs: its torchvision one (its default, on "
                    "the GPU) when torchvision is installed (auto), or its PIL one")
    ap.add_argument("--mlp-align", type=int, default=None, help="Qwen2.5-VL: pad the tower's MLP width to a "
                    "multiple of this (default: exlpy's choice, 128 on GPUs; 1: no padding, for an A/B run)")
    ap.add_argument("--no-phases", action="store_true", help="skip the per-phase breakdown runs")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top GPU kernels of one exlpy "
                    "request (after the timed runs): where the time of a slow phase goes")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (on a shared machine, 1 keeps "
                    "small host ops from waiting on busy cores)")
    ap.add_argument("--out", default=None, help="results file (default: benchmarks/results/vision.md on a GPU)")
    args = ap.parse_args()
    args.layers = args.layers or (6 if args.arch == "gemma3" else 4)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda:0"
    side = args.image_size or (112 if args.tiny else 1024)
    max_pixels = 28 * 28 * 1280 * 10  # HF's default for Qwen2.5-VL (12845056): a 1024x1024 image is not shrunk
    half = torch.float32 if device == "cpu" else torch.float16
    before, after = text_ids(args.text_tokens // 2), text_ids(args.text_tokens - args.text_tokens // 2)
    lines: list[str] = []
    tables: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        t0 = time.perf_counter()
        if args.arch == "gemma3":
            build_gemma3(path, args.layers, args.vision_layers, args.tiny, device)
        else:
            build(path, args.layers, args.vision_layers, args.tiny, device, max_pixels)
        say(f"built and saved the random model in {time.perf_counter() - t0:.1f} s")
        img = random_image(side, side, seed=0)
        ex = Exlpy(path, device, torch.float32 if device == "cpu" else half, args.mlp_align)
        got = ex.logits(img, before, after)
        hf = HF(path, device, half, max_pixels, args.arch, args.hf_processor)
        want_half = hf.logits(img, before, after, pil=True)
        if device != "cpu":  # the fp32 reference, then free it
            ref = HF(path, device, torch.float32, max_pixels, args.arch)
            want = ref.logits(img, before, after)
            del ref
            torch.cuda.empty_cache()
        else:
            want = want_half
        n_tokens = got.shape[1]
        say(f"prompt: {n_tokens} tokens ({side}x{side} image, {args.text_tokens} text tokens)")
        say(f"logits rel. error vs transformers fp32: exlpy {rel_err(got, want):.2e}, transformers {half} "
            f"{rel_err(want_half, want):.2e}; last-position argmax equal: "
            f"{bool(got[0, -1].argmax() == want[0, -1].argmax())}")

        def timed(fn: Any) -> list[float]:
            out = []
            for i in range(args.runs + 1):
                im = random_image(side, side, seed=100 + i)  # a new image: no cached embedding or prefix
                sync(device)
                t = time.perf_counter()
                fn(im)
                sync(device)
                out.append(time.perf_counter() - t)
            return out[1:]  # the first run warms up

        t_ex = timed(lambda im: ex.first_token(im, before, after))
        t_hf = timed(lambda im: hf.first_token(im, before, after))
        mx, mh = statistics.median(t_ex), statistics.median(t_hf)
        say(f"time to first token (median of {args.runs}): exlpy {mx * 1e3:.1f} ms, transformers {mh * 1e3:.1f} ms "
            f"({mh / mx:.2f}x); transformers' image processor: {hf.processor}")
        if args.profile and device != "cpu":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                ex.first_token(random_image(side, side, seed=300), before, after)
                sync(device)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90),
                  flush=True)
        if not args.no_phases:
            def phased(fn: Any) -> list[dict[str, tuple[float, float]]]:
                out = []
                for i in range(args.runs + 1):
                    im = random_image(side, side, seed=200 + i)
                    sync(device)
                    with PhaseTimer(device) as pt:
                        fn(im)
                    out.append(pt.phases())
                return out[1:]

            tables.append(phase_table("exlpy", phased(lambda im: ex.first_token(im, before, after)), device))
            hooks = hf.phase_hooks()
            tables.append(phase_table(f"transformers ({hf.processor} processor)",
                                      phased(lambda im: hf.first_token(im, before, after)), device))
            for h in hooks:
                h.remove()
            for t in tables:
                print(t, flush=True)

    dev_name = torch.cuda.get_device_name(0) if device != "cpu" else platform.processor() or "CPU"
    name = "vision.md" if args.arch == "qwen2_5_vl" else f"vision_{args.arch}.md"
    out = args.out or (None if device == "cpu" else str(ROOT / "benchmarks" / "results" / name))
    if out:
        import transformers

        kept = ""  # hand-written sections (## headings) after the generated block survive a new run
        if Path(out).exists():
            old = Path(out).read_text()
            at = old.find("\n## ")
            kept = old[at:] if at >= 0 else ""
        Path(out).write_text(
            f"# Vision: {'Gemma 3' if args.arch == 'gemma3' else 'Qwen2.5-VL'} vs transformers\n\n"
            f"- device: {dev_name}; date: {datetime.date.today()}; torch {torch.__version__}, transformers "
            f"{transformers.__version__}\n"
            f"- command: `python benchmarks/vision.py {' '.join(sys.argv[1:])}`\n"
            f"- model: random, {'tiny' if args.tiny else 'Gemma-3-4B' if args.arch == 'gemma3' else 'Qwen2.5-VL-7B'} "
            f"shapes, {args.layers} "
            f"language layers, {args.vision_layers} vision "
            "blocks\n\n" + "\n".join(f"- {line}" for line in lines) + "\n" +
            "".join(f"\n{t}" for t in tables) + kept)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
