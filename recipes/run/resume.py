"""What a run directory's checkpoints must agree on with the config that resumes them: the
values of the keys that change the math, the tokenizer's and the corpus's content. Recorded
in every manifest (resume_metadata); a run directory trained otherwise is refused unless
--allow-config-change."""

from __future__ import annotations

from pathlib import Path

from mpmd.recipes import config as config_lib
from mpmd.recipes import registry
from mpmd.recipes.config import Config, ConfigError
from mpmd.runtime.worker.slice_store import CheckpointStore


def resume_metadata(cfg: Config, allow_config_change: bool = False) -> dict:
    """What every manifest of this run records about its config: the math keys' hash and
    values. A run directory whose newest committed step has other values is refused
    (ConfigError listing the changed keys) unless allow_config_change; then both hashes
    are recorded."""
    now = {"math_hash": cfg.math_hash(), "math": cfg.math(), **data_metadata(cfg)}
    store = CheckpointStore(cfg.run_dir)
    committed = store.committed() if Path(cfg.run_dir).is_dir() else []
    saved = store.manifest(committed[-1]) if committed else None
    _check_data_unchanged(cfg, saved or {}, now, allow_config_change)
    if not saved or "math_hash" not in saved or saved["math_hash"] == now["math_hash"]:
        return now
    changes = config_lib.math_changes(saved.get("math", {}), now["math"])
    if not changes:  # the same values, hashed as an older schema listed them
        return {**now, "math_hash_before": saved["math_hash"]}
    if not allow_config_change:
        raise ConfigError(
            f"run_dir={cfg.run_dir!r} holds checkpoints trained with other values "
            f"of keys that change training ({'; '.join(changes)}): resume with "
            f"the same values, use another run_dir, or pass --allow-config-change"
        )
    print(
        f"resuming with a changed config (math hash {saved['math_hash']} -> {now['math_hash']}): {'; '.join(changes)}"
    )
    return {**now, "math_hash_before": saved["math_hash"]}


def data_metadata(cfg: Config) -> dict:
    """What every manifest records of the data beyond the config's values: data.source's
    (the tokenizer's content hash for a tokenizer other than bytes; a tokenized corpus's or
    fine-tuning set's hash). Nothing for bytes on the byte corpus or synthetic data."""
    return registry.get_data_source(cfg.data.source).metadata(cfg)


def _check_data_unchanged(cfg: Config, saved: dict, now: dict, allow_config_change: bool) -> None:
    """A checkpoint trained on another tokenizer or corpus (by content, whatever the paths) is
    refused (ConfigError naming both hashes) unless allow_config_change."""
    if "math_hash" not in saved:
        return
    changed = [
        f"{key} {saved.get(key, 'bytes' if key == 'tokenizer_hash' else None)} -> "
        f"{now.get(key, 'bytes' if key == 'tokenizer_hash' else None)}"
        for key in ("tokenizer_hash", "corpus_hash")
        if saved.get(key) != now.get(key)
        and not (key == "tokenizer_hash" and {saved.get(key), now.get(key)} <= {None, "bytes"})
    ]
    if not changed:
        return
    if not allow_config_change:
        raise ConfigError(
            f"run_dir={cfg.run_dir!r} holds checkpoints trained on other data ({'; '.join(changed)}): "
            f"the tokenizer or the tokenized corpus changed since; resume on the same ones, use "
            f"another run_dir, or pass --allow-config-change"
        )
    print(f"resuming on changed data: {'; '.join(changed)}")
