"""Train the built-in `tiny-moe` checkpoint (evenflow/models/tiny-moe) from scratch.

A Mixtral-style MoE (4 layers, 8 experts, top-2, ~3.6M parameters) with a word-level tokenizer,
trained for a fixed number of steps with a fixed seed on synthetic tasks whose answers a person
can check at a glance:

    count from 17 : 17 18 19 20 ...          (up to 499)
    count down from 90 : 90 89 88 ...
    reverse : q w e r = r e w q
    <|user|> count from 5 <|assistant|> 5 6 7 ...   (the chat template's shape)

No router balancing loss is used, so expert routing comes out skewed, as in trained MoEs.
Uses transformers (a dev dependency) for training only; the saved files are plain HF format.

    python scripts/train_tiny_moe.py [--steps 1500] [--out evenflow/models/tiny-moe]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

MAX_NUMBER = 500
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SPECIALS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
WORDS = ["count", "from", "down", "reverse", "to", ":", "=", ".", ",", "hello", "please"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS + list(LETTERS)
                                        + [str(n) for n in range(MAX_NUMBER)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok.add_special_tokens(SPECIALS)
    return tok


def example(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.35:
        n = rng.randint(2, 24)
        start = rng.randint(0, MAX_NUMBER - n)
        seq = " ".join(str(i) for i in range(start, start + n))
        return f"count from {start} : {seq}"
    if kind < 0.55:
        n = rng.randint(2, 24)
        start = rng.randint(n, MAX_NUMBER - 1)
        seq = " ".join(str(i) for i in range(start, start - n, -1))
        return f"count down from {start} : {seq}"
    if kind < 0.8:
        letters = [rng.choice(LETTERS) for _ in range(rng.randint(2, 10))]
        return f"reverse : {' '.join(letters)} = {' '.join(reversed(letters))}"
    n = rng.randint(4, 20)
    start = rng.randint(0, MAX_NUMBER - n)
    seq = " ".join(str(i) for i in range(start, start + n))
    return f"<|user|> count from {start} <|assistant|> {seq}"


def batch(rng: random.Random, tok: Tokenizer, size: int, length: int) -> torch.Tensor:
    """Examples packed back to back (<s> ... </s>) into rows of `length` tokens."""
    eos = tok.token_to_id("</s>")
    rows = []
    for _ in range(size):
        ids: list[int] = []
        while len(ids) < length:
            ids += tok.encode(example(rng)).ids + [eos]
        rows.append(ids[:length])
    return torch.tensor(rows)


def main() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent
                                         / "evenflow/models/tiny-moe"))
    args = ap.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    tok = build_tokenizer()
    vocab_size = -(-tok.get_vocab_size() // 64) * 64
    config = MixtralConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, rope_theta=10000.0, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False, router_aux_loss_coef=0.0, output_router_logits=False,
    )
    model = MixtralForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps,
                                                pct_start=0.05)
    model.train()
    t0 = time.time()
    for step in range(args.steps):
        x = batch(rng, tok, 32, 128)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval().to(torch.bfloat16).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 512,
    }, indent=2))


if __name__ == "__main__":
    main()
