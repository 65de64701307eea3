"""Loading a checkpoint's next-token (MTP) layer into engine/model/next_token.py's model: the
layer stored after the decoder's (`model.layers.<num_hidden_layers>.`: its decoder layer, enorm,
hnorm, eh_proj and shared_head.norm), beside the target model it shares its embedding and
lm_head with."""

from __future__ import annotations

from pathlib import Path

import torch

from evenflow.engine.config.settings import ModelLoadError
from evenflow.engine.model.next_token import NextTokenModel, next_token_config
from evenflow.engine.model.transformer import CausalLM
from evenflow.engine.quant.stacks import QuantConfig
from evenflow.engine.weights.loader import load_extra_layer

OWN_PARTS = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
             "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "model.norm.weight"}


def load_next_token_model(model_dir: Path, target: CausalLM, dtype: torch.dtype,
                          quantization: QuantConfig | None = None) -> NextTokenModel:
    cfg = target.config
    if cfg.num_nextn_predict_layers < 1:
        raise ModelLoadError(f"{model_dir.name} has no next-token (MTP) layer "
                             "(num_nextn_predict_layers is 0): speculative method mtp needs one")
    if target.tp is not None:
        raise ModelLoadError("speculative method mtp under tensor parallelism is not supported")
    one = next_token_config(cfg)
    with torch.device("meta"):
        model = NextTokenModel(one)
    extra = load_extra_layer(model_dir, one, cfg.num_layers, model.model.layers[0], dtype,
                             quantization, OWN_PARTS)
    missing = sorted(set(OWN_PARTS) - set(extra))
    if missing:
        raise ModelLoadError(f"the next-token layer lacks {missing}")
    state = {OWN_PARTS[name]: t for name, t in extra.items()}
    expected = model.state_dict()
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ModelLoadError(f"next-token tensor {name} has shape {tuple(t.shape)}, config "
                                 f"implies {tuple(expected[name].shape)}")
    model.load_state_dict(state, assign=True, strict=False)
    model.share_with(target)
    on_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if on_meta:
        raise ModelLoadError(f"next-token layer left {len(on_meta)} parameter(s) unset, e.g. "
                             f"{on_meta[:3]}")
    return model.eval().requires_grad_(False)
