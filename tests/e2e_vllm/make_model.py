"""Write a tiny deterministic Llama target + draft pair for the vLLM e2e tests.

    python make_model.py OUT_DIR [--layer2-std 0.09] [--vocab 50257]

Writes ``OUT_DIR/target`` (2 layers) and ``OUT_DIR/draft`` (1 layer) as safetensors with a
``config.json`` each. Weights come from a seeded CPU generator, so they are identical on every
machine and independent of the TP size (unlike vLLM's dummy weights). The draft shares the
target's embeddings, first decoder layer, final norm and LM head, so its greedy proposals agree
with the target exactly as often as the target's second layer leaves the argmax unchanged; the
second layer's weight scale (``--layer2-std``) tunes the acceptance rate (larger -> fewer
accepts). The vocabulary is 50257 by default: not a multiple of 64 * TP, so vLLM pads it to
50304 and rank 1 of TP=2 holds 25088 - 63 = 25025 real columns and 63 padding columns.

No tokenizer is written: the engine runs with ``skip_tokenizer_init=True`` and token-id prompts.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

HIDDEN = 256
INTERMEDIATE = 512
HEADS = 4
HEAD_DIM = 64
SEED = 1234


def config(vocab: int, layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def weights(vocab: int, layer2_std: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).contiguous()

    w = {
        "model.embed_tokens.weight": randn(vocab, HIDDEN, std=1.0),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": randn(vocab, HIDDEN, std=0.05),
    }
    for layer in range(2):
        std = 0.2 if layer == 0 else layer2_std
        p = f"model.layers.{layer}."
        for proj in ("q", "k", "v", "o"):
            w[p + f"self_attn.{proj}_proj.weight"] = randn(HIDDEN, HIDDEN, std=std)
        w[p + "mlp.gate_proj.weight"] = randn(INTERMEDIATE, HIDDEN, std=std)
        w[p + "mlp.up_proj.weight"] = randn(INTERMEDIATE, HIDDEN, std=std)
        w[p + "mlp.down_proj.weight"] = randn(HIDDEN, INTERMEDIATE, std=std)
        w[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    return w


def write(out_dir: str, vocab: int, layer2_std: float) -> dict[str, str]:
    w = weights(vocab, layer2_std)
    paths = {}
    for name, layers in (("target", 2), ("draft", 1)):
        d = os.path.join(out_dir, name)
        os.makedirs(d, exist_ok=True)
        keep = {
            k: v
            for k, v in w.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
        }
        save_file(keep, os.path.join(d, "model.safetensors"))
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config(vocab, layers), f, indent=1)
        paths[name] = d
    with open(os.path.join(out_dir, "params.json"), "w") as f:
        json.dump({"vocab": vocab, "layer2_std": layer2_std, "seed": SEED}, f)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--layer2-std", type=float, default=float(os.environ.get("LAYER2_STD", "0.09")))
    ap.add_argument("--vocab", type=int, default=50257)
    args = ap.parse_args()
    for name, path in write(args.out_dir, args.vocab, args.layer2_std).items():
        print(name, path)


if __name__ == "__main__":
    main()
