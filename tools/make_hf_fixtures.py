"""Tiny random-weight HuggingFace checkpoints, with reference outputs from HF transformers, for
the model types whose published configs have no fixture yet: Qwen3.5 and Gemma 4 as published
(`qwen3_5` / `gemma4`: `Qwen3_5ForConditionalGeneration` / `Gemma4ForConditionalGeneration`,
a vision tower included), Granite 4.0
(`granitemoehybrid`: Mamba-2 + attention, and the all-attention variant) and a Gemma 4 text
variant (double-wide MLP on KV-shared layers, values from the key projection, random layer
scalars).

Runs where torch and transformers are (not in CI): each fixture is a directory as a user
would download it (config.json, model.safetensors, tokenizer files with a chat template) plus
reference.json and logits.npz, in the shape tests/conftest.py reads. The logits are computed
on the CPU in float32, so that no TF32 or GPU kernel choice moves them.

usage: python tools/make_hf_fixtures.py OUT_DIR [--tokenizers DIR] [NAME ...]

The tokenizers are the existing fixtures' (`DIR/qwen3_5/tokenizer.json` byte-level,
`DIR/gemma4/tokenizer.json` metaspace; DIR defaults to tests/fixtures/hf-tiny).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PROMPTS = ["def main(argv):\n    return 0", "The quick brown fox jumps over the lazy dog. " * 18]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "what is a context manager?"},
    {"role": "assistant", "content": "An object with __enter__ and __exit__."},
    {"role": "user", "content": "and a generator?"},
]
QWEN35_TEXT = dict(
    model_type="qwen3_5_text",
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
    # As published: interleaved M-RoPE sections (sum = rotated dims / 2); text-only input has
    # equal positions on all three axes, which is plain RoPE.
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    ),
)
GRANITE = dict(
    model_type="granitemoehybrid",
    hidden_size=64,
    intermediate_size=160,
    shared_intermediate_size=160,
    num_local_experts=0,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    embedding_multiplier=12.0,
    logits_scaling=4.0,
    residual_multiplier=0.22,
    attention_multiplier=0.0156,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)


GEMMA4_TEXT = dict(
    model_type="gemma4_text",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    # Full layers' heads 64 wide, not the default 512: unscaled attention over 512 random dims
    # gives scores so far apart that f16 rounding flips which key wins (an ill-conditioned
    # fixture, not a test of the engine).
    global_head_dim=64,
    sliding_window=32,
    layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
    hidden_size_per_layer_input=16,
    num_kv_shared_layers=2,
    final_logit_softcapping=30.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
)
# Published wrappers: (config class, model class) by model_type.
WRAPPERS = {
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration"),
}


def specs() -> Iterator[tuple[str, str, str, dict[str, Any], Any, str]]:
    """(name, tokenizer, chat template, config, bos, eos) of each fixture."""
    yield (
        "qwen3_5_vlm",
        "qwen3_5",
        CHATML,
        dict(
            model_type="qwen3_5",
            text_config=QWEN35_TEXT,
            vision_config=dict(
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                patch_size=16,
                spatial_merge_size=2,
                temporal_patch_size=2,
                num_position_embeddings=64,
            ),
            tie_word_embeddings=True,
        ),
        None,
        "<|im_end|>",
    )
    yield (
        "gemma4_vlm",
        "gemma4",
        GEMMA,
        dict(
            model_type="gemma4",
            text_config=GEMMA4_TEXT,
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=16,
                position_embedding_size=64,
            ),
            audio_config=None,
            tie_word_embeddings=True,
        ),
        "<bos>",
        "<end_of_turn>",
    )
    # Granite 4.0-H: Mamba-2 layers and attention layers without positions.
    yield (
        "granitemoehybrid",
        "qwen3_5",
        CHATML,
        dict(
            GRANITE,
            layer_types=["mamba", "attention", "mamba", "mamba", "attention", "mamba"],
            position_embedding_type="nope",
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_expand=2,
            # Smaller than the long prompt, so the reference's chunked scan crosses chunks.
            mamba_chunk_size=64,
            mamba_conv_bias=True,
            mamba_proj_bias=False,
        ),
        None,
        "<|im_end|>",
    )
    # Granite 4.0 (not -H): every layer attention, with RoPE.
    yield (
        "granitemoehybrid_attn",
        "qwen3_5",
        CHATML,
        dict(
            GRANITE,
            layer_types=["attention"] * 4,
            num_hidden_layers=4,
            position_embedding_type="rope",
            rope_parameters=dict(rope_type="default", rope_theta=10_000.0),
        ),
        None,
        "<|im_end|>",
    )
    yield (
        "gemma4_wide",
        "gemma4",
        GEMMA,
        dict(
            model_type="gemma4_text",
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            global_head_dim=64,
            sliding_window=16,
            layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
            hidden_size_per_layer_input=8,
            num_kv_shared_layers=3,
            use_double_wide_mlp=True,
            attention_k_eq_v=True,
            final_logit_softcapping=30.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
        ),
        "<bos>",
        "<end_of_turn>",
    )


def randomize(model: Any, seed: int) -> None:
    """Random weights at unit scale (so that no layer is negligible), norms near 1, and
    per-layer buffers that multiply the residual stream (Gemma 4's layer scalars) away
    from 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif "norm" in name or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))


def build(name: str, tok_dir: str, template: str, cfg: dict[str, Any], bos: Any, eos: str,
          out: Path, tokenizers: Path) -> None:  # fmt: skip
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(tokenizers / tok_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    cfg = json.loads(json.dumps(cfg))
    model_type = cfg.pop("model_type")
    text = cfg["text_config"] if "text_config" in cfg else cfg
    text["vocab_size"] = vocab
    if "hidden_size_per_layer_input" in text:
        text["vocab_size_per_layer_input"] = vocab
    special = {s: tok.token_to_id(s) for s in (eos, bos, "<pad>") if s}
    for c in (cfg, text):
        c["eos_token_id"] = special[eos]
        c["bos_token_id"] = special[bos] if bos else None
        c["pad_token_id"] = special["<pad>"]
    if model_type in WRAPPERS:
        import transformers

        config_class, model_class = (getattr(transformers, n) for n in WRAPPERS[model_type])
        text.pop("model_type", None)
        config = config_class(**cfg)
        torch.manual_seed(0)
        model = model_class(config)
    else:
        config = AutoConfig.for_model(model_type, **cfg)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.float().cpu()
    randomize(model, seed=sum(map(ord, name)) + 1)
    model.eval()
    model.save_pretrained(d, safe_serialization=True)
    shutil.copy(tokenizers / tok_dir / "tokenizer.json", d / "tokenizer.json")
    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(d / "tokenizer.json"), bos_token=bos, eos_token=eos, pad_token="<pad>"
    )
    fast.chat_template = template
    fast.save_pretrained(d)
    rendered = fast.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ref: dict[str, Any] = {
        "model_type": model_type,
        "tokenizer": tok_dir,
        "chat": {"messages": MESSAGES, "rendered": rendered},
        "prompts": [],
    }
    arrays = {}
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt).ids
        if bos:
            ids = [special[bos]] + ids
        with torch.no_grad():
            seq, gen = list(ids), []
            for _ in range(16):
                nxt = int(
                    model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()
                )
                gen.append(nxt)
                seq.append(nxt)
            logits = model(input_ids=torch.tensor([seq[:-1]]), use_cache=False).logits[0]
        arrays[f"logits_{i}"] = logits.float().numpy().astype(np.float32)
        ref["prompts"].append(
            {"text": prompt, "input_ids": ids, "greedy_ids": gen, "n_tokens": len(ids)}
        )
    np.savez_compressed(d / "logits.npz", **arrays)
    ref["logits_note"] = (
        "logits_i[j] are the next-token logits after input_ids + greedy_ids[:-1] up to position j"
    )
    import transformers

    ref["transformers"] = transformers.__version__
    (d / "reference.json").write_text(json.dumps(ref, indent=1))
    size = sum(f.stat().st_size for f in d.iterdir())
    params = sum(p.numel() for p in model.parameters())
    print(f"{name}: vocab={vocab} params={params} {size / 1e6:.2f} MB", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    here = Path(__file__).resolve().parent.parent
    p.add_argument("--tokenizers", type=Path, default=here / "tests" / "fixtures" / "hf-tiny")
    p.add_argument("names", nargs="*")
    args = p.parse_intermixed_args()
    import torch
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    failed = 0
    for spec in specs():
        if args.names and spec[0] not in args.names:
            continue
        try:
            build(*spec, args.out, args.tokenizers)
        except Exception as e:  # one fixture's failure must not lose the others
            import traceback

            traceback.print_exc()
            print(f"FAILED {spec[0]}: {type(e).__name__}: {e}", flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
