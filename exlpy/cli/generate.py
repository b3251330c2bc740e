"""`exlpy generate`: stream text from a model directory (the bundled demo model by default)."""

from __future__ import annotations

import argparse
import sys
import time

from exlpy.demo import DEMO_MODEL_DIR


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streaming it to the terminal")
    p.add_argument("prompt_pos", nargs="?", metavar="PROMPT", help="the prompt (or use --prompt)")
    p.add_argument("--prompt", "-p", help="the prompt")
    p.add_argument("--model", "-m", default=None, help="model directory (default: the bundled 260K demo model)")
    p.add_argument("--max-new-tokens", "-n", type=int, default=100)
    p.add_argument("--max-seq-len", type=int, default=None, help="context length (default: the model's, "
                   "capped at 4096)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.8)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--greedy", action="store_true", help="greedy decoding (overrides sampling settings)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token")
    p.add_argument("--image", action="append", default=None, metavar="PATH", help="an image placed before the prompt "
                   "(vision-language models; repeatable)")
    p.add_argument("--gpu-split", default=None, help="comma-separated GB per GPU (default: automatic)")
    p.add_argument("--draft-model", default=None, metavar="DIR", help="speculative decoding with this draft model "
                   "(same vocabulary as the model, any format)")
    p.add_argument("--ngram-draft", action="store_true", help="speculative decoding with n-gram drafts from the "
                   "context (no draft model)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="tokens drafted per step (default: adapted "
                   "to the acceptance rate)")
    p.set_defaults(_run=run)


def run(args: argparse.Namespace) -> int:
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exlpy.errors import ConfigError
    from exlpy.generator import ExLlamaV2Sampler, ExLlamaV2StreamingGenerator
    from exlpy.generator.dynamic.validate import check_seed

    prompt = args.prompt if args.prompt is not None else args.prompt_pos
    if prompt is None:
        raise ConfigError("no prompt given: exlpy generate \"Once upon a time\" (or --prompt TEXT)")
    check_seed(args.seed, "--seed")  # before anything is loaded
    config = ExLlamaV2Config(args.model or DEMO_MODEL_DIR)
    config.max_seq_len = args.max_seq_len or min(config.max_seq_len, 4096)
    config.max_input_len = min(config.max_input_len, config.max_seq_len)
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, lazy=True)
    if args.gpu_split:
        model.load([float(x) for x in args.gpu_split.split(",")], progress=True)
    else:
        model.load_autosplit(cache, progress=sys.stderr.isatty())
    tokenizer = ExLlamaV2Tokenizer(config)

    embeddings = image_embeddings(config, model, tokenizer, args.image) if args.image else []
    content = "".join(e.text_alias + "\n" for e in embeddings) + prompt
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}]) if args.chat else content
    ids = tokenizer.encode(text, add_bos=not args.no_bos and not args.chat, encode_special_tokens=args.chat,
                           embeddings=embeddings or None)
    budget = config.max_seq_len - ids.shape[-1]
    if budget <= 0:
        raise ConfigError(f"the prompt has {ids.shape[-1]} tokens, the context holds {config.max_seq_len}")
    max_new = min(args.max_new_tokens, budget)

    if args.greedy:
        settings = ExLlamaV2Sampler.Settings.greedy()
    else:
        settings = ExLlamaV2Sampler.Settings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                             min_p=args.min_p, token_repetition_penalty=args.repetition_penalty)
    draft, draft_cache = load_draft(args.draft_model, config.max_seq_len) if args.draft_model else (None, None)
    if args.draft_model and args.ngram_draft:
        raise ConfigError("--draft-model and --ngram-draft are alternatives: pass one of them")
    generator = ExLlamaV2StreamingGenerator(model, cache, tokenizer, draft, draft_cache, args.num_draft_tokens)
    generator.speculative_ngram = args.ngram_draft
    generator.set_stop_conditions(sorted(tokenizer.stop_token_ids))
    if args.seed is not None:
        import torch

        torch.manual_seed(args.seed)
    sys.stdout.write(prompt if not args.chat else "")
    sys.stdout.flush()
    generator.begin_stream_ex(ids, settings, input_embeddings=embeddings or None)
    t0 = time.perf_counter()
    while True:
        # The budget counts sampled tokens (new_tokens), not the tokens whose text was released: text held back
        # (a partial UTF-8 character, a possible stop string) belongs to tokens already counted.
        left = max_new - generator.new_tokens
        if left <= 0:
            r = generator.end_stream("max_new_tokens")  # release what the counted tokens still hold back
        else:
            generator.token_budget = left  # speculative steps may emit several tokens: never past max_new
            r = generator.stream_ex()
        sys.stdout.write(r["chunk"])
        sys.stdout.flush()
        if r["eos"]:
            break
    n = generator.new_tokens
    dt = time.perf_counter() - t0
    sys.stdout.write("\n")
    sd = ""
    if draft is not None or args.ngram_draft:
        _, acc, _, drafted, accepted = generator.get_sd_stats()
        sd = f", {accepted}/{drafted} drafted tokens accepted ({acc:.0%})"
    print(f"[{n} tokens in {dt:.2f} s, {n / max(dt, 1e-9):.1f} tokens/s on {model.devices()[0]}{sd}]", file=sys.stderr)
    return 0


def image_embeddings(config: object, model: object, tokenizer: object, paths: list[str]) -> list[object]:
    """One ExLlamaV2MMEmbedding per --image file (the model's vision tower loaded for them)."""
    from exlpy.vision import ExLlamaV2VisionTower

    tower = ExLlamaV2VisionTower(config)  # a text-only model: MultimodalError saying so
    tower.load()
    return [tower.get_image_embeddings(model=model, tokenizer=tokenizer, image=p, text_alias=f"<image {i + 1}>")
            for i, p in enumerate(paths)]


def load_draft(path: str, max_seq_len: int) -> tuple[object, object]:
    """A draft model for speculative decoding, loaded next to the model, with a cache as long as the model's."""
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config

    config = ExLlamaV2Config(path)
    config.max_seq_len = max_seq_len
    config.max_input_len = min(config.max_input_len, max_seq_len)
    draft = ExLlamaV2(config)
    cache = ExLlamaV2Cache(draft, max_seq_len=max_seq_len, lazy=True)
    draft.load_autosplit(cache, progress=sys.stderr.isatty())
    return draft, cache
