"""Train the built-in `tiny-moe` checkpoint (evenflow/models/tiny-moe) from scratch.

A Mixtral-style MoE (4 layers, 8 experts, top-2, ~3.6M parameters) with a small WordPiece
tokenizer, trained for a fixed number of steps with a fixed seed on synthetic tasks whose answers
a person can check at a glance:

    count from 17 : 17 18 19 20 ...          (up to 499)
    count down from 90 : 90 89 88 ...
    reverse : q w e r = r e w q
    <|user|> count from 5 <|assistant|> 5 6 7 ...   (the chat template's shape)
    json : name bob age 12 = {"name": "bob", "age": 12}
    <|user|> json name bob <|assistant|> {"name": "bob"}
    copy : k 12 x to 40 = k 12 x to 40                 (up to 40 words, for copying text)
    edit : k 12 x to 40 ; x -> 7 = k 12 7 to 40        (the text again, one word replaced)
    <|user|> copy k 12 x <|assistant|> k 12 x

The vocabulary: the task words, the numbers 0..499, every printable ASCII character as a word
and as a continuation piece ("##x", joined to the token before it without a space), so any
single-spaced ASCII text, and JSON in particular, can be spelled (structured output). Words keep
the ids the word-level vocabulary of earlier versions gave them.

No router balancing loss is used, so expert routing comes out skewed, as in trained MoEs.
Uses transformers (a dev dependency) for training only; the saved files are plain HF format.

    python scripts/train_tiny_moe.py [--steps 2000] [--lr 3e-3] [--init-from DIR] [--out DIR]

The shipped checkpoint: the word-level model of earlier versions (this script before the JSON
task, 2,500 steps), continued with `--init-from` it, `--steps 1500 --lr 2e-3` (about 10 minutes
on two CPU cores): its counting and reversing stay as they were, JSON is learned on top; then
continued for the copy and edit tasks (speculative decoding's copying workload) in three runs,
each `--init-from` the one before: `--steps 1000 --lr 1.5e-3` with COPY_SHARE 0.2 (it had not
learned to copy yet), then `--steps 1500 --lr 1.5e-3` and `--steps 1500 --lr 1e-3` with
COPY_SHARE 0.4 (about 20 minutes in all). `evenflow bench quant`'s task table then reads count,
count down, reverse and copy 100%, edit 97% (300 prompts each).
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
COPY_WORDS = ["copy", "edit", ";", "->"]  # (";" is a printable; "->" and the rest are new)
PRINTABLE = [chr(c) for c in range(0x21, 0x7F)]
JSON_WORDS = ["json", "true", "false", "null"]
JSON_SHARE = 0.3  # of the training examples
COPY_SHARE = 0.4  # copy and edit, of the training examples
KEYS = ["name", "age", "city", "id", "tags", "ok", "count", "items", "score", "title", "kind",
        "value", "x", "y", "color", "size", "user", "email", "price", "active"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    words = SPECIALS + WORDS + list(LETTERS) + [str(n) for n in range(MAX_NUMBER)]
    words += [c for c in PRINTABLE if c not in words] + JSON_WORDS
    words += ["##" + c for c in PRINTABLE]
    words += [w for w in COPY_WORDS if w not in words]
    vocab = {t: i for i, t in enumerate(words)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", continuing_subword_prefix="##",
                                     max_input_chars_per_word=10_000))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok.add_special_tokens(SPECIALS)
    return tok


def word(rng: random.Random, longest: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, longest)))


def json_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.random()
    if kind < 0.4:
        return word(rng, 7)
    if kind < 0.65:
        return rng.randint(0, 999) * (-1 if rng.random() < 0.05 else 1)
    if kind < 0.72:
        return round(rng.uniform(-50, 50), rng.randint(1, 2))
    if kind < 0.82:
        return rng.choice([True, False, None])
    if kind < 0.93 or depth > 0:
        numbers = rng.random() < 0.5
        return [rng.randint(0, 99) if numbers else word(rng, 5)
                for _ in range(rng.randint(0, 4))]
    return json_object(rng, depth + 1)


def json_object(rng: random.Random, depth: int = 0) -> dict[str, object]:
    keys = rng.sample(KEYS, rng.randint(1, 4 if depth == 0 else 2))
    if rng.random() < 0.2:  # keys the model has not seen as words
        keys.append(word(rng, 8))
    return {k: json_value(rng, depth) for k in dict.fromkeys(keys)}


def json_example(rng: random.Random) -> str:
    obj = json_object(rng)
    text = json.dumps(obj, separators=rng.choice([(", ", ": "), (",", ":")]))
    flat = all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in obj.values())
    kind = rng.random()
    if flat and kind < 0.5:  # the object spelled out as "key value ..." first
        pairs = " ".join(f"{k} {v}" for k, v in obj.items())
        if kind < 0.3:
            return f"json : {pairs} = {text}"
        return f"<|user|> json {pairs} <|assistant|> {text}"
    if kind < 0.75:
        return f"json = {text}"
    return f"<|user|> json <|assistant|> {text}"


def copy_words(rng: random.Random) -> list[str]:
    """Text to copy: letters, numbers and task words, as code and prose mix names and values."""
    pool = [*LETTERS, *WORDS[:4], *WORDS[9:], "json", "true", "false", "null"]
    return [str(rng.randint(0, MAX_NUMBER - 1)) if rng.random() < 0.35 else rng.choice(pool)
            for _ in range(rng.randint(3, 40))]


def copy_example(rng: random.Random) -> str:
    words = copy_words(rng)
    text = " ".join(words)
    kind = rng.random()
    if kind < 0.45:
        return f"copy : {text} = {text}"
    if kind < 0.6:
        return f"<|user|> copy {text} <|assistant|> {text}"
    old = rng.choice(words)
    new = str(rng.randint(0, MAX_NUMBER - 1)) if rng.random() < 0.5 else rng.choice(LETTERS)
    edited = " ".join(new if w == old else w for w in words)
    return f"edit : {text} ; {old} -> {new} = {edited}"


def example(rng: random.Random) -> str:
    kind = rng.random()
    if kind < COPY_SHARE:
        return copy_example(rng)
    kind = (kind - COPY_SHARE) / (1 - COPY_SHARE)
    if kind < JSON_SHARE:
        return json_example(rng)
    kind = (kind - JSON_SHARE) / (1 - JSON_SHARE)
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


def init_from(model: torch.nn.Module, source: str) -> None:
    """Start from an earlier tiny-moe: every weight copied, and the rows of the embedding and
    the output layer for the token ids both vocabularies share (the new ids keep their random
    initialization)."""
    from transformers import MixtralForCausalLM

    old = MixtralForCausalLM.from_pretrained(source, dtype=torch.float32)
    shared = len(json.loads((Path(source) / "tokenizer.json").read_text())["model"]["vocab"])
    new_state, old_state = model.state_dict(), old.state_dict()
    with torch.no_grad():
        for name, tensor in new_state.items():
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                tensor[:shared] = old_state[name][:shared]
            else:
                tensor.copy_(old_state[name])


def main() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--init-from", default=None,
                    help="an earlier tiny-moe to continue from (its vocabulary's ids kept)")
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
    if args.init_from:
        init_from(model, args.init_from)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps,
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
