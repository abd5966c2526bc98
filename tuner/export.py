"""Export: re-measure, decide with hysteresis, re-verify, write ``generated/<arch>/<op>.json``.

Per bucket (design §5 rule 4, aesthetics d2):

1. candidates = the best 3 COMPLETE trials + the incumbent (the current table row serving the
   bucket) + the built-in default + the plain path when it is in the space;
2. re-measure them interleaved (ABCABC..., ``rounds`` rounds) in this process; a candidate's
   time is the median of its per-round medians, its noise the IQR of those;
3. only candidates whose median is at or below the built-in default's (same interleaved run) may
   win, so a table row is never slower than what the dispatcher would do without a table; among
   them keep the incumbent (or, without one, the built-in default) unless the best challenger
   wins by ``max(3 %, 2 x IQR)``; among challengers within that band of the best, take fewer
   warps, then smaller block, then the name (deterministic);
4. re-verify the winner with ANOTHER seed and twice the rows; a failure drops it and repeats 3.

Tables match :func:`shardmax.runtime.dispatch.validate_table`: rows ordered so that the first match is
the right one (ascending ``rows_le`` inside each (dtype, tp, align, width_le) group, groups by
ascending width), a catch-all row last; rows of buckets not re-tuned are kept.
"""

from __future__ import annotations

import datetime as _dt
import json
import statistics
from importlib import resources
from pathlib import Path
from typing import Any

import triton

from shardmax.runtime.defaults import MAX_SPLITS, TARGET_PROGRAMS
from shardmax.runtime.dispatch import PLAIN, validate_table

from .objective import Lockstep
from .problems import ROW_BUCKETS, Bucket
from .space import Config
from .timing import Timing, quantile

TOP_K = 3
MIN_GAIN = 0.03
IQR_FACTOR = 2.0
VERIFY_SEED_OFFSET = 7919
MATCH_KEYS = ("dtype", "tp", "align", "width_le", "rows_le")


# ---------------------------------------------------------------------------- tables on disk
def packaged_generated_dir() -> Path:
    return Path(str(resources.files("shardmax.generated")))


def table_path(out_dir: Path, arch: str, op: str) -> Path:
    return out_dir / arch / f"{op}.json"


def read_table(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    table: dict[str, Any] = json.loads(path.read_text())
    validate_table(table, str(path))
    return table


def current_table(out_dir: Path, arch: str, op: str) -> dict[str, Any] | None:
    """The table a merge starts from: the one in ``out_dir``, else the packaged one."""
    return read_table(table_path(out_dir, arch, op)) or read_table(
        table_path(packaged_generated_dir(), arch, op)
    )


def incumbent_of(table: dict[str, Any] | None, bucket: Bucket) -> Config | None:
    """The config the current (tuned) table uses for this bucket's problem, if any."""
    if not table or not table.get("tuned"):
        return None
    from shardmax.runtime.dispatch import Problem, _adapt, _row_matches

    p = Problem(bucket.op, bucket.dtype, bucket.tp, bucket.rows, bucket.width, bucket.align)
    for row in table["rows"]:
        if row["match"] and _row_matches(row["match"], p):
            return Config.from_selection(_adapt(row, p, True, "incumbent"))
    return None


# ---------------------------------------------------------------------------- decision
class Measured:
    def __init__(self, cfg: Config, rounds: list[Timing]) -> None:
        self.cfg = cfg
        p50s = [t.p50 for t in rounds]
        self.p50 = statistics.median(p50s)
        self.p20 = statistics.median(t.p20 for t in rounds)
        self.p80 = statistics.median(t.p80 for t in rounds)
        self.iqr = (quantile(p50s, 0.75) - quantile(p50s, 0.25)) if len(p50s) > 1 else rounds[0].iqr

    def __repr__(self) -> str:
        return f"{self.cfg.name}: {self.p50:.3f}us (iqr {self.iqr:.3f})"


def _threshold(a: Measured, b: Measured) -> float:
    return max(MIN_GAIN * a.p50, IQR_FACTOR * max(a.iqr, b.iqr))


def decide(
    measured: list[Measured], protected: Config | None, ceiling: Config | float | None = None
) -> Measured | None:
    """Winner under hysteresis (see the module docstring), or None if nothing is eligible.

    ``ceiling``: the built-in default (a config among ``measured``) or its measured median in
    microseconds; candidates with a larger median are not eligible (the default itself always
    is). A float keeps the cap when the default itself was dropped (failed re-verification).
    """
    if isinstance(ceiling, Config):
        cap = next((m for m in measured if m.cfg == ceiling), None)
        if cap is not None:
            measured = [m for m in measured if m is cap or m.p50 <= cap.p50]
    elif ceiling is not None:
        measured = [m for m in measured if m.p50 <= ceiling]
    if not measured:
        return None
    best = min(measured, key=lambda m: (m.p50, m.cfg.tie_key()))
    inc = next((m for m in measured if m.cfg == protected), None)
    if inc is not None and inc.p50 - best.p50 <= _threshold(inc, best):
        return inc
    band = [
        m
        for m in measured
        if m.p50 - best.p50 <= _threshold(best, m)
        and (inc is None or inc.p50 - m.p50 > _threshold(inc, m))
    ]
    return min(band or [best], key=lambda m: m.cfg.tie_key())


def top_complete(study: Any, k: int = TOP_K) -> list[Config]:
    from optuna.trial import TrialState

    trials = sorted(
        study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)),
        key=lambda t: (t.value, t.number),
    )
    out: list[Config] = []
    for t in trials:
        c = Config.parse(t.params["config"])
        if c not in out:
            out.append(c)
        if len(out) == k:
            break
    return out


def finalize_bucket(
    study: Any,
    runner: Lockstep,
    bucket: Bucket,
    *,
    incumbent: Config | None,
    default: Config,
    configs: list[Config],
    seed: int,
    rounds: int,
    log: Any = print,
) -> dict[str, Any] | None:
    """Rank 0: the table row of ``bucket`` (None if no trial completed)."""
    top = top_complete(study)
    if not top:
        log(f"  {bucket.slug}: no COMPLETE trial, bucket not exported")
        return None
    space = set(configs)
    cands = list(top)
    for extra in (incumbent, default, Config(0) if Config(0) in space else None):
        if extra is not None and extra not in cands and (extra in space or extra == incumbent):
            cands.append(extra)
    per: dict[Config, list[Timing]] = {c: [] for c in cands}
    for _ in range(rounds):  # interleaved: ABCABC...
        for c in cands:
            t = runner.bench(c)
            if t is not None:
                per[c].append(t)
    measured = [Measured(c, ts) for c, ts in per.items() if len(ts) == rounds]
    default_m = next((m for m in measured if m.cfg == default), None)
    plain_m = next((m for m in measured if m.cfg.is_plain), None)
    protected: Config | None = incumbent if incumbent is not None else default
    # the cap is the default's median in this re-measure, kept even if the default is dropped
    cap: Config | float | None = default_m.p50 if default_m is not None else default
    while True:
        win = decide(measured, protected, ceiling=cap)
        if win is None:
            log(f"  {bucket.slug}: no candidate at or below the default survived re-verification")
            return None
        reason = runner.gate(win.cfg, seed + VERIFY_SEED_OFFSET, 2)
        if reason is None:
            break
        log(f"  {bucket.slug}: {win.cfg.name} failed re-verification ({reason}); dropped")
        measured.remove(win)
        if win.cfg == protected:
            protected = None
    others = sorted((m for m in measured if m is not win), key=lambda m: (m.p50, m.cfg.tie_key()))
    row: dict[str, Any] = {
        "match": bucket.match,
        "variant": win.cfg.variant(bucket.dtype, bucket.align),
        "launch": win.cfg.launch(),
        "p20_us": round(win.p20, 3),
        "p50_us": round(win.p50, 3),
        "p80_us": round(win.p80, 3),
    }
    if default_m is not None:
        row["default_p50_us"] = round(default_m.p50, 3)
    if plain_m is not None:
        row["plain_p50_us"] = round(plain_m.p50, 3)
    if others:
        ru = others[0]
        row["runner_up"] = {
            "variant": ru.cfg.variant(bucket.dtype, bucket.align),
            "launch": ru.cfg.launch(),
            "p50_us": round(ru.p50, 3),
        }
        row["margin_pct"] = round(100.0 * (ru.p50 - win.p50) / win.p50, 2)
    row["kept_incumbent"] = bool(win.cfg == protected and any(m.p50 < win.p50 for m in others))
    row["models"] = list(bucket.models)
    return row


# ---------------------------------------------------------------------------- writing
def provenance(
    *,
    arch: str,
    device: Any,
    mode: str,
    metric: str,
    quick: bool,
    storage: str,
    note: str = "",
    space: str = "",
) -> dict[str, Any]:
    import torch

    from .study import manifest_hash

    prov: dict[str, Any] = {
        "arch": arch,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "manifest_hash": manifest_hash(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "metric": metric,
        "mode": mode,
        "quick": quick,
        **({"space": space} if space else {}),
        "studies": storage,
    }
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        props = torch.cuda.get_device_properties(device)
        prov["device_name"] = props.name
        prov["sm_count" if not torch.version.hip else "cu_count"] = props.multi_processor_count
        prov["cuda" if not torch.version.hip else "hip"] = torch.version.hip or torch.version.cuda
    else:
        prov["device_name"] = "cpu (TRITON_INTERPRET=1)"
    if note:
        prov["note"] = note
    return prov


def _row_sort_key(row: dict[str, Any]) -> tuple[Any, ...]:
    m = row["match"]
    return tuple((0, m[k]) if k in m else (1, 0) for k in MATCH_KEYS)


def order_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Specific rows sorted (dtype, tp, align, width_le, rows_le); partial rows keep their order
    after them; the catch-all last."""
    full = [r for r in rows if r["match"] and set(MATCH_KEYS) <= set(r["match"])]
    partial = [r for r in rows if r["match"] and not set(MATCH_KEYS) <= set(r["match"])]
    catch = [r for r in rows if not r["match"]]
    return [*sorted(full, key=_row_sort_key), *partial, *catch[-1:]]


def portable_rows(arch: str, op: str) -> list[dict[str, Any]]:
    """Untuned portable rows: :func:`shardmax.runtime.dispatch.builtin_default`'s rule per row bucket
    (about 2 programs per SM/CU; narrow shards use block 1024), catch-all last."""
    target = 2 * 256 if arch.startswith("gfx") else TARGET_PROGRAMS

    def splits_for(rows: int) -> int:
        want = triton.cdiv(target, rows)
        s = 1
        while s * 2 <= min(want, MAX_SPLITS):
            s *= 2
        return s

    rows: list[dict[str, Any]] = []
    if op == "sampled":
        return _portable_sampled_rows(splits_for)
    for width_le, block, warps in ((4095, 1024, 4), (None, 4096, 8)):
        for r in ROW_BUCKETS:
            match: dict[str, Any] = {"rows_le": r}
            if width_le is not None:
                match["width_le"] = width_le
            rows.append(
                {
                    "match": match,
                    "variant": f"shard_keys_bf16_va16_b{block}",
                    "launch": {
                        "splits": splits_for(r),
                        "num_warps": warps,
                        "num_stages": 2,
                        "transport": "allgather",
                    },
                    "tuned": False,
                }
            )
    rows.append(
        {
            "match": {},
            "variant": "shard_keys_bf16_va16_b4096",
            "launch": {"splits": 1, "num_warps": 8, "num_stages": 2, "transport": "allgather"},
            "tuned": False,
        }
    )
    return rows


def _portable_sampled_rows(splits_for: Any) -> list[dict[str, Any]]:
    """Op ``sampled``: the record kernel's built-in rule per row bucket (block 2048, 4 warps,
    C = 64, splits for about 2 programs per SM/CU), catch-all last."""
    from shardmax.ops.sampled import DEFAULT_RECORD_BLOCK, MAX_RECORD_SPLITS, TOPK_CANDIDATES

    def row(match: dict[str, Any], splits: int) -> dict[str, Any]:
        return {
            "match": match,
            "variant": f"sampled_record_bf16_b{DEFAULT_RECORD_BLOCK}",
            "launch": {
                "splits": min(splits, MAX_RECORD_SPLITS),
                "num_warps": 4,
                "candidates": TOPK_CANDIDATES,
                "transport": "allgather",
            },
            "tuned": False,
        }

    return [*(row({"rows_le": r}, splits_for(r)) for r in ROW_BUCKETS), row({}, 1)]


def merge_rows(
    existing: dict[str, Any] | None, new_rows: list[dict[str, Any]], arch: str, op: str
) -> list[dict[str, Any]]:
    """New rows replace same-match rows; other rows are kept (an untuned table's rows marked
    ``"tuned": false`` so a per-row flag can tell them apart), the catch-all stays last."""
    new_keys = {json.dumps(r["match"], sort_keys=True) for r in new_rows}
    kept: list[dict[str, Any]] = []
    catch = portable_rows(arch, op)[-1]
    if existing is not None:
        for r in existing["rows"]:
            if not r["match"]:
                catch = r
            elif json.dumps(r["match"], sort_keys=True) not in new_keys:
                kept.append(r if existing.get("tuned") else {**r, "tuned": False})
    return order_rows([*new_rows, *kept, catch])


def dump_table(table: dict[str, Any]) -> str:
    """JSON with one row per line (clean diffs)."""
    head = {k: v for k, v in table.items() if k != "rows"}
    lines = json.dumps(head, indent=2, sort_keys=False)[:-2]
    rows = ",\n".join("    " + json.dumps(r, sort_keys=False) for r in table["rows"])
    return f'{lines},\n  "rows": [\n{rows}\n  ]\n}}\n'


def write_table(
    out_dir: Path,
    arch: str,
    op: str,
    new_rows: list[dict[str, Any]],
    prov: dict[str, Any],
    tuned: bool,
) -> Path:
    path = table_path(out_dir, arch, op)
    existing = current_table(out_dir, arch, op)
    table: dict[str, Any] = {
        "schema": 1,
        "arch": arch,
        "op": op,
        "tuned": tuned,
        "provenance": prov,
        "rows": merge_rows(existing, new_rows, arch, op),
    }
    if not tuned:  # an untuned sweep (CPU) never inherits measured rows
        table["rows"] = order_rows([*new_rows, table["rows"][-1]])
    validate_table(table, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    text = dump_table(table)
    json.loads(text)
    path.write_text(text)
    return path


def write_portable(out_dir: Path, arch: str, op: str) -> Path:
    """The committed untuned table of an arch (``"tuned": false``)."""
    prov = {
        "arch": arch,
        "untuned": True,
        "manifest_hash": _manifest(),
        "note": (
            "portable defaults (builtin_default rule per row bucket), NOT measured; "
            f"tune with: shardmax-tune --op {op}  (see tuner/README.md)"
        ),
    }
    table = {
        "schema": 1,
        "arch": arch,
        "op": op,
        "tuned": False,
        "provenance": prov,
        "rows": portable_rows(arch, op),
    }
    path = table_path(out_dir, arch, op)
    validate_table(table, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_table(table))
    return path


def _manifest() -> str:
    from .study import manifest_hash

    return manifest_hash()


__all__ = ["PLAIN", "decide", "finalize_bucket", "merge_rows", "write_portable", "write_table"]
