"""Speculative decoding with drafts from a model (engine/serving/draft_model.py): a draft model
with the target's tokenizer, and DeepSeek-V3's and GLM-4.5's own next-token (MTP) layer loaded
from the checkpoint. Greedy output stays the target's; a draft model that is the target itself
has every draft accepted; the next-token layer drafts what transformers' own modules compute
from its stored weights; it follows a prompt prefilled on another engine; bad pairings are
refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from checkpoints import VOCAB, add_next_token_layer, make_checkpoint, prefill_then_decode

from evenflow import LLM, SamplingParams
from evenflow.engine.config.settings import ModelLoadError
from evenflow.engine.serving.engine import Engine, EngineConfig
from evenflow.engine.serving.speculation import Speculation

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("steady_row_cost")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """DeepSeek-V3 (random, saved by transformers) with its next-token layer; (path, the
    transformers model, the layer's tensors)."""
    path = tmp_path_factory.mktemp("deepseek_mtp")
    hf = make_checkpoint("deepseek_v3", path)
    return path, hf, add_next_token_layer(path, hf)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    piece = torch.randint(3, VOCAB, (5,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (29,), generator=g).tolist(), piece * 4,
            torch.randint(3, VOCAB, (7,), generator=g).tolist()]


def tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts(), params)]


def test_a_draft_model_keeps_the_targets_output(gpt_oss, tmp_path):
    base = tokens(LLM(str(gpt_oss), dtype="float32", block_size=4))
    # the target as its own draft: every draft token is the target's own greedy choice
    itself = LLM(str(gpt_oss), dtype="float32", block_size=4, speculative_config={
        "method": "draft_model", "model": str(gpt_oss), "num_speculative_tokens": 3})
    assert tokens(itself) == base
    counts = itself.engine.speculation.counts
    assert counts.accepted_tokens == counts.draft_tokens > 20
    # another model (the same tokenizer), as vLLM's config names it: a model and no method
    other = tmp_path / "draft"
    make_checkpoint("gpt_oss", other, seed=7)
    drafted = LLM(str(gpt_oss), dtype="float32", block_size=4,
                  speculative_config={"model": str(other), "num_speculative_tokens": 2})
    assert tokens(drafted) == base
    assert drafted.engine.speculation.counts.draft_tokens > 0
    assert not drafted.engine.speculation.drafter.shadows  # each let go at its end


def reference_drafts(hf, layer: dict[str, torch.Tensor], context: list[int], count: int
                     ) -> list[int]:
    """The next-token layer's greedy drafts after `context` as DeepSeek's design computes
    them, from transformers' own decoder layer and norms: row p takes the target's final
    hidden state at p and the token at p + 1; a later draft feeds the layer's own output."""
    from transformers.masking_utils import create_causal_mask
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
    )

    cfg = hf.config
    block = DeepseekV3DecoderLayer(cfg, layer_idx=cfg.num_hidden_layers).eval()
    block.load_state_dict({k: v for k, v in layer.items() if k.startswith(
        ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm."))})
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = DeepseekV3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        norms[name].weight.data = layer[f"{name}.weight"]
    eh_proj, head = layer["eh_proj.weight"], layer["shared_head.head.weight"]
    embed = hf.model.embed_tokens
    with torch.no_grad():
        h = hf.model(torch.tensor([context[:-1]])).last_hidden_state[0]  # positions 0 .. n-2
        drafts: list[int] = []
        inputs, rows = list(context[1:]), [h[p] for p in range(len(h))]
        for _ in range(count):
            e = embed(torch.tensor(inputs))
            e[0] = 0.0  # (position 0's embedding is zeroed)
            x = torch.cat([norms["enorm"](e), norms["hnorm"](torch.stack(rows))], -1) @ eh_proj.T
            pos = torch.arange(len(inputs)).unsqueeze(0)
            mask = create_causal_mask(config=cfg, inputs_embeds=x[None], attention_mask=None,
                                      cache=None, position_ids=pos)
            out = block(x[None], attention_mask=mask, position_ids=pos,
                        position_embeddings=hf.model.rotary_emb(x[None], pos))[0]
            token = int((norms["shared_head.norm"](out[-1]) @ head.T).argmax())
            drafts.append(token)
            inputs.append(token)
            rows.append(out[-1])
    return drafts


def test_the_next_token_layer_drafts_what_its_weights_predict(deepseek):
    path, hf, layer = deepseek
    engine = Engine(EngineConfig(model=str(path), dtype="float32", block_size=4,
                                 speculative_config={"method": "mtp",
                                                     "num_speculative_tokens": 2}))
    prompt = prompts()[0]
    engine.add_request("r", prompt, GREEDY)
    engine.step()  # the prompt: its first token, and its hidden states for the layer
    seq = engine._requests["r"]
    drafter = engine.speculation.drafter
    first = drafter.propose([(seq, 2)])[0]
    assert first == reference_drafts(hf, layer, seq.token_ids, 2)
    # as a verification that kept the first draft token and one more: the target's hidden
    # states of the two positions it computed, then a draft from there (the second draft
    # token's row rolled back, the first's recomputed from the target's state)
    n = seq.num_computed_tokens
    seq.token_ids += [first[0], 9]
    with torch.no_grad():
        hidden = hf.model(torch.tensor([seq.token_ids[:-1]])).last_hidden_state[0]
    seq.num_computed_tokens += 2
    drafter.take_hidden(seq, n, hidden[n:])
    assert drafter.propose([(seq, 2)])[0] == reference_drafts(hf, layer, seq.token_ids, 2)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """GLM-4.5 (grouped-query attention with partial rotary over DeepSeek-V3's MoE) with its
    next-token layer, stored as DeepSeek stores it."""
    path = tmp_path_factory.mktemp("glm_mtp")
    add_next_token_layer(path, make_checkpoint("glm4_moe", path))
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["deepseek", "glm"])
def test_greedy_output_is_the_same_with_the_next_token_layer(request, family, dtype,
                                                             monkeypatch):
    found = request.getfixturevalue(family)
    path = found[0] if family == "deepseek" else found
    # (a random layer's drafts fail, after which the cost rule stops asking: ask every step)
    monkeypatch.setattr(Speculation, "_length",
                        lambda self, seq, limit: min(limit, self.config.num_speculative_tokens))
    config = dict(model=str(path), dtype=dtype, block_size=4)
    base = tokens(LLM(**config))
    llm = LLM(**config, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert tokens(llm) == base
    assert llm.engine.speculation.counts.draft_tokens > 10


def test_the_next_token_layer_follows_a_prompt_prefilled_elsewhere(deepseek):
    """The prompt's last hidden states travel with its K/V: the decode engine's layer drafts
    what it would have drafted had it prefilled the prompt itself."""
    path, _, _ = deepseek
    config = EngineConfig(model=str(path), dtype="float32", block_size=4,
                          speculative_config={"method": "deepseek_mtp"})
    asked = dict(zip("abc", prompts(), strict=True))
    expected, handed_over, kvs = prefill_then_decode(config, asked, GREEDY)
    assert handed_over == expected
    assert all(len(kv.hidden) for kv in kvs.values())

    prompt, kv = asked["a"], kvs["a"]
    single = Engine(config)
    single.add_request("a", prompt, GREEDY)
    single.step()
    single.step()  # the first decode: the token after the prompt's first
    decode = Engine(config)
    decode.add_prefilled_request("a", prompt, expected["a"][0], GREEDY, kv)
    decode.step()
    drafts = [engine.speculation.drafter.propose([(engine._requests["a"], 1)])[0]
              for engine in (single, decode)]
    assert drafts[0] == drafts[1] != []
    # without the hidden states, the layer starts at the decode engine's first position
    blind = Engine(config)
    blind.add_prefilled_request("a", prompt, expected["a"][0], GREEDY,
                                replace(kv, hidden=b"", hidden_dtype=""))
    blind.step()
    shadow = next(iter(blind.speculation.drafter.shadows.values()))
    assert shadow.origin == len(prompt)


def test_bad_pairings_are_refused(gpt_oss, tmp_path):
    with pytest.raises(ModelLoadError, match="no next-token"):
        LLM(str(gpt_oss), dtype="float32", speculative_config={"method": "mtp"})
    other = tmp_path / "other_vocab"
    make_checkpoint("gpt_oss", other)
    (other / "tokenizer.json").write_text(
        (other / "tokenizer.json").read_text().replace('"w7"', '"zz"'))
    with pytest.raises(ModelLoadError, match="tokenizer other than"):
        LLM(str(gpt_oss), dtype="float32", speculative_config={"model": str(other)})
    with pytest.raises(ValueError, match='needs "model"'):
        EngineConfig(speculative_config={"method": "draft_model"})
