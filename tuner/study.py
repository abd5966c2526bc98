"""Optuna studies: one per (arch, op, bucket), journal file per (arch, op), resumable.

* storage: ``JournalStorage(JournalFileBackend(tuner/studies/<arch>/<op>.journal))`` by default
  (append-only, survives kills, fine for several workers on one node); ``--storage URL`` for a
  shared RDB (``postgresql://...``, ``mysql://...``) or another journal path.
* study name: ``shardmax|<arch>|<bucket slug>|m=<generator manifest hash>|s=<space hash>``;
  a regenerated kernel set or a changed space starts a new study instead of mixing trials.
* sampler: ``GridSampler({"config": [...]}, seed=...)`` -- exhaustive, seeded order; the
  incumbent (current table row) and the built-in default are enqueued first.
* resume: trials left RUNNING by a killed process are marked FAIL on start (journal storage has
  no heartbeat); the grid sampler revisits FAILed points.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from .objective import Lockstep, optuna_objective
from .problems import Bucket
from .space import Config, space_hash


def manifest_hash() -> str:
    try:
        text = (resources.files("shardmax.generated") / "MANIFEST.json").read_text()
        return str(json.loads(text)["manifest_hash"])
    except (FileNotFoundError, KeyError, OSError, ModuleNotFoundError):
        return "unknown"


def default_studies_dir() -> Path:
    return Path(__file__).resolve().parent / "studies"


def make_storage(arch: str, op: str, storage: str | None, studies_dir: Path | None) -> Any:
    """Journal file per (arch, op), or the ``--storage`` URL."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if storage and "://" in storage:
        return (
            optuna.storages.RDBStorage(storage)
            if not storage.startswith("journal")
            else JournalStorage(JournalFileBackend(storage.split("://", 1)[1]))
        )
    if storage:
        path = Path(storage)
    else:
        path = (studies_dir or default_studies_dir()) / arch / f"{op}.journal"
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


def study_name(arch: str, bucket: Bucket, configs: list[Config]) -> str:
    return f"shardmax|{arch}|{bucket.slug}|m={manifest_hash()}|s={space_hash(configs)}"


def fail_stale(study: Any) -> int:
    """Mark trials left RUNNING (a killed run) as FAIL; returns how many."""
    from optuna.trial import TrialState

    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(t.number, state=TrialState.FAIL)
        n += 1
    return n


def open_study(
    arch: str,
    bucket: Bucket,
    configs: list[Config],
    storage: Any,
    seed: int,
    provenance: dict[str, Any],
) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = [c.name for c in configs]
    sampler = optuna.samplers.GridSampler({"config": names}, seed=seed)
    study = optuna.create_study(
        study_name=study_name(arch, bucket, configs),
        storage=storage,
        sampler=sampler,
        direction="minimize",
        load_if_exists=True,
    )
    stale = fail_stale(study)
    if stale:
        print(f"  resumed: {stale} trial(s) left RUNNING by a killed run marked FAIL")
    for k, v in {
        **provenance,
        "bucket": bucket.slug,
        "models": list(bucket.models),
        "vocab": bucket.vocab,
    }.items():
        study.set_user_attr(k, v)
    return study


def enqueue(study: Any, configs: list[Config], *incumbents: Config | None) -> None:
    names = {c.name for c in configs}
    for c in incumbents:
        if c is not None and c.name in names:
            study.enqueue_trial({"config": c.name}, skip_if_exists=True)


def remaining(study: Any, configs: list[Config]) -> int:
    from optuna.trial import TrialState

    done = {
        t.params.get("config")
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    }
    return sum(1 for c in configs if c.name not in done)


def run_bucket(
    study: Any,
    runner: Lockstep,
    configs: list[Config],
    *,
    seed: int,
    n_trials: int | None,
    timeout: float | None,
    progress: bool = True,
) -> None:
    """Rank 0: sweep the bucket's grid (or ``n_trials`` of it), with a progress bar."""
    todo = remaining(study, configs)
    if n_trials is not None:
        todo = min(todo, n_trials)
    if todo <= 0:
        print(f"  {runner.bucket.slug}: grid already exhausted ({len(configs)} points)")
        return
    from shardmax.generator.console import format_us
    from shardmax.generator.console import progress as make_progress

    # a terminal: a tqdm bar; a log file: a line every tenth of the trials or 30 s, with ETA
    bar = make_progress(
        todo, f"  {runner.bucket.slug} trials", enabled=progress, every=max(1, todo // 10)
    )

    def tick(study: Any, trial: Any) -> None:
        bar.set_postfix_str(f"best {format_us(study.best_value)}" if _has_complete(study) else "")
        bar.update(1)

    objective = optuna_objective(runner, [c.name for c in configs], seed)
    study.optimize(
        objective, n_trials=todo, timeout=timeout, callbacks=[tick], gc_after_trial=False
    )
    bar.close()


def _has_complete(study: Any) -> bool:
    from optuna.trial import TrialState

    return bool(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
