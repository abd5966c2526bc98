"""Plain-torch references of what vLLM computes on the full logits (the oracles of the tests).

Nothing here is on a hot path: every function works on the gathered, unsharded logits with
torch ops (and Triton only where vLLM's own random numbers must be drawn bit for bit).

* :mod:`shardmax.reference.greedy` -- argmax, synthetic acceptance, greedy ``rejection_sample``
  and ``get_num_sampled_and_rejected`` (spec ``vllm-semantics.md`` §1-§3);
* :mod:`shardmax.reference.sampled` -- temperature, top-k, block LSE, keyed Gumbel, sampled
  ``rejection_sample`` (research ``sampled-verification.md`` §1);
* :mod:`shardmax.reference.nucleus` -- the exact top-k / top-p / min-p kept sets and the guard
  that decides where vLLM's approximate top-p search must agree with them.
"""

from shardmax.reference.greedy import (
    argmax,
    argmax_of_shards,
    get_num_sampled_and_rejected,
    greedy_verify,
    rejection_sample_greedy,
    synthetic_rates_from_length,
    synthetic_uniform,
    unconditional_to_conditional_rates,
)

__all__ = [
    "argmax",
    "argmax_of_shards",
    "get_num_sampled_and_rejected",
    "greedy_verify",
    "rejection_sample_greedy",
    "synthetic_rates_from_length",
    "synthetic_uniform",
    "unconditional_to_conditional_rates",
]
