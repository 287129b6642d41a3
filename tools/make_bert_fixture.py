"""Writes tests/fixtures/mm/bert: a tiny random-weight BERT checkpoint (HF layout, as
sentence-transformers saves it: no `bert.` prefix, with the pooler and the saved position ids)
and a small lowercase WordPiece tokenizer. Its reference is the float64 numpy BERT in
tests/test_embeddings.py, not a stored output. Run: python tools/make_bert_fixture.py"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "mm" / "bert"
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = """the a an of to in and is was for on with as by at from it this that are be
cat cats dog dogs sat mat ran park sun rain weather today cold warm city car train bank
money river water fish boat eat ate food pizza cook kitchen music song play piano guitar
computer code program bug fix test fast slow big small happy sad red blue green""".split()
PIECES = ["##s", "##ed", "##ing", "##er", "##ly", *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz")]
CHARS = [*"abcdefghijklmnopqrstuvwxyz0123456789", *".,!?'-", "é", "ü", "東"]
CONFIG = {
    "architectures": ["BertModel"],
    "model_type": "bert",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "hidden_act": "gelu",
    "max_position_embeddings": 64,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "position_embedding_type": "absolute",
    "pad_token_id": 0,
}


def tokenizer(vocab: list[str]) -> Tokenizer:
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.decoder = decoders.WordPiece()
    return tok


def weights(vocab_size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    c = CONFIG
    h, inter = int(c["hidden_size"]), int(c["intermediate_size"])

    def normal(*shape: int, std: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}.weight": 1 + normal(h, std=0.1), f"{prefix}.bias": normal(h, std=0.1)}

    out = {
        "embeddings.word_embeddings.weight": normal(vocab_size, h, std=0.5),
        "embeddings.position_embeddings.weight": normal(int(c["max_position_embeddings"]), h),
        "embeddings.token_type_embeddings.weight": normal(2, h),
        "embeddings.position_ids": np.arange(int(c["max_position_embeddings"]))[None],
        **norm("embeddings.LayerNorm"),
        "pooler.dense.weight": normal(h, h),
        "pooler.dense.bias": normal(h),
    }
    for i in range(int(c["num_hidden_layers"])):
        p = f"encoder.layer.{i}"
        for name in ("query", "key", "value"):
            out[f"{p}.attention.self.{name}.weight"] = normal(h, h)
            out[f"{p}.attention.self.{name}.bias"] = normal(h)
        out[f"{p}.attention.output.dense.weight"] = normal(h, h)
        out[f"{p}.attention.output.dense.bias"] = normal(h)
        out.update(norm(f"{p}.attention.output.LayerNorm"))
        out[f"{p}.intermediate.dense.weight"] = normal(inter, h)
        out[f"{p}.intermediate.dense.bias"] = normal(inter)
        out[f"{p}.output.dense.weight"] = normal(h, inter)
        out[f"{p}.output.dense.bias"] = normal(h)
        out.update(norm(f"{p}.output.LayerNorm"))
    return out


def main() -> None:
    vocab = [*SPECIAL, *WORDS, *PIECES, *CHARS]
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer(vocab).save(str(OUT / "tokenizer.json"))
    (OUT / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": len(vocab)}, indent=2))
    (OUT / "tokenizer_config.json").write_text(json.dumps({"pad_token": "[PAD]"}))
    save_file(weights(len(vocab), np.random.default_rng(24)), str(OUT / "model.safetensors"))


if __name__ == "__main__":
    main()
