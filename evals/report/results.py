"""An eval's results as the report reads them: rows loaded from result folders (duplicates dropped, old rows normalised), grouped into configurations that differ in named settings, and summarised per configuration and benchmark."""

from __future__ import annotations
import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable
from ermedrag.evals.metrics import number, option_order, summarise
from ermedrag.evals.runner import RESULTS
from ermedrag.tools.records.jsonl import read_records


CONFIG_FIELDS = ("system", "model", "samples")  # beside `settings` in a row's `config`


MAX_VALUE_CHARS = 40  # a setting's value in the header and legend (an index path can be long)


MAX_LABEL_PART_CHARS = 24


ALL = "all"


@dataclass
class LoadedResults:
    rows: list[dict[str, Any]]
    duplicates: dict[str, int] = field(default_factory=dict)  # folder → rows dropped (key already loaded)
    malformed: dict[str, int] = field(default_factory=dict)  # folder → rows without benchmark/question id

    @property
    def duplicates_dropped(self) -> int:
        return sum(self.duplicates.values())


def _config_of(row: dict[str, Any]) -> dict[str, Any]:
    """The row's configuration as {system, model, samples, settings}; older rows kept the settings beside
    system and model instead of under `settings`."""
    config = row.get("config") if isinstance(row.get("config"), dict) else {}
    settings = config.get("settings")
    if not isinstance(settings, dict):
        settings = {k: v for k, v in config.items() if k not in CONFIG_FIELDS and k != "settings"}
    elif config.get("prompt_version"):  # part of the configuration's identity: shown when it differs
        settings = {**settings, "prompt_version": config["prompt_version"]}
    samples = number(config.get("samples"))
    return {
        "system": str(config.get("system") or row.get("system") or "unknown"),
        "model": str(config.get("model") or ""),
        "samples": int(samples) if samples else 1,
        "settings": dict(settings),
    }


def _derived_key(config: dict[str, Any]) -> str:
    """A key for rows written before the runner recorded one (same identity: everything but the questions)."""
    return "derived-" + hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def normalise_row(record: dict[str, Any]) -> dict[str, Any] | None:
    """A result row with `config`, `config_key`, `sample` and `order` always present; None without a
    benchmark or question id (nothing to count it under)."""
    if not isinstance(record.get("benchmark"), str) or record.get("question_id") is None:
        return None
    config = _config_of(record)
    key = record.get("config_key")
    sample = number(record.get("sample"))
    return {
        **record,
        "config": config,
        "config_key": key if isinstance(key, str) and key else _derived_key(config),
        "question_id": str(record["question_id"]),
        "sample": int(sample) if sample is not None else 0,
        "order": option_order(record),
    }


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["config_key"], row["benchmark"], row["question_id"], row["sample"], row["order"])


def load_results(result_dirs: Iterable[str | Path]) -> LoadedResults:
    """Rows of every folder, merged; a row whose key (configuration, benchmark, question, sample, option order)
    was already loaded is dropped, first one kept, and counted against the folder it came from."""
    loaded = LoadedResults(rows=[])
    seen: set[tuple[Any, ...]] = set()
    for folder in result_dirs:
        path = Path(folder) / RESULTS
        if not path.exists():
            raise FileNotFoundError(f"no {RESULTS} in {folder} (run `ermedrag eval --out {folder}` first)")
        for record in read_records(path):
            row = normalise_row(record)
            if row is None:
                loaded.malformed[str(folder)] = loaded.malformed.get(str(folder), 0) + 1
            elif row_key(row) in seen:
                loaded.duplicates[str(folder)] = loaded.duplicates.get(str(folder), 0) + 1
            else:
                seen.add(row_key(row))
                loaded.rows.append(row)
    return loaded


def load_rows(result_dirs: Iterable[str | Path]) -> list[dict[str, Any]]:
    return load_results(result_dirs).rows


@dataclass(frozen=True, eq=False)
class Configuration:
    key: str
    system: str
    model: str
    samples: int
    settings: dict[str, Any]
    label: str = ""

    def fields(self) -> dict[str, Any]:
        """What can differ between configurations: system, model, samples and every setting."""
        return {"system": self.system, "model": self.model, "samples": self.samples, **self.settings}


@dataclass(frozen=True)
class Comparison:
    configurations: list[Configuration]  # in report order: this order assigns the colours
    differs: dict[str, list[str]]  # field → its distinct values, as shown
    shares: dict[str, str]  # field → the one value every configuration has
    own: dict[str, str]  # setting only some configurations have, with one value → that value


def shown_value(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, str) and not value else str(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


def _short(value: Any) -> str:
    """A setting's value in a label: a path's last part, a model without its backend prefix, bounded."""
    text = str(value)
    if isinstance(value, str) and not text:
        return '""'
    if isinstance(value, str):
        text = " + ".join(part.split(":", 1)[-1].rstrip("/").rsplit("/", 1)[-1] or part for part in text.split(" + "))
    return text if len(text) <= MAX_LABEL_PART_CHARS else text[: MAX_LABEL_PART_CHARS - 1] + "…"


def _differing_fields(configs: list[Configuration]) -> tuple[dict[str, list[str]], dict[str, str], dict[str, str]]:
    """Fields with several values (→ the values, in sort order); fields every configuration has with one value;
    fields only some configurations have, with one value (settings of one system)."""
    values: dict[str, list[str]] = {}
    for config in configs:
        for name, value in config.fields().items():
            shown = shown_value(value)
            if shown not in values.setdefault(name, []):
                values[name].append(shown)
    differs = {name: sorted(vals, key=_sort_value) for name, vals in values.items() if len(vals) > 1}
    if "model" in differs:  # the combined model name already says it; each role's model would repeat it
        differs = {name: vals for name, vals in differs.items() if not name.endswith("_model")}
    everywhere = set.intersection(*(set(c.fields()) for c in configs)) if configs else set()
    single = {name: vals[0] for name, vals in values.items() if len(vals) == 1}
    return (
        differs,
        {name: v for name, v in single.items() if name in everywhere},
        {name: v for name, v in single.items() if name not in everywhere},
    )


def _sort_value(value: Any) -> tuple[int, float, str]:
    """Numbers (also shown as text) in numeric order, before other values in text order."""
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(value))


def compare_configurations(rows: list[dict[str, Any]]) -> Comparison:
    """The configurations in `rows`, what differs between them, and a short unique label for each."""
    first: dict[str, dict[str, Any]] = {}
    for row in rows:
        first.setdefault(row["config_key"], row["config"])
    configs = [Configuration(key, c["system"], c["model"], c["samples"], c["settings"]) for key, c in first.items()]
    differs, shares, own = _differing_fields(configs)
    shown_fields = [name for name in differs if name != "system"]

    def label(config: Configuration) -> str:
        parts = [config.system]
        for name in shown_fields:
            if name in config.fields():
                value = config.fields()[name]
                parts.append(_short(value) if name == "model" else f"{name}={_short(value)}")
        return " · ".join(parts)

    labelled = [Configuration(c.key, c.system, c.model, c.samples, c.settings, label(c)) for c in configs]
    counts = defaultdict(int)
    for c in labelled:
        counts[c.label] += 1
    # Labels collide when configurations differ only in a setting one of them lacks, or in a part the short form
    # leaves out (hf:gemma vs offline:gemma, a long value cut short): the key tells them apart.
    labelled = [
        c
        if counts[c.label] == 1
        else Configuration(c.key, c.system, c.model, c.samples, c.settings, f"{c.label} #{c.key[:6]}")
        for c in labelled
    ]
    labelled.sort(key=lambda c: (c.system, [_sort_value(c.fields().get(n, "")) for n in shown_fields], c.label))
    return Comparison(labelled, differs, shares, own)


def comparison_header(comparison: Comparison) -> list[str]:
    configs = comparison.configurations
    shared = ", ".join(f"{k}={v}" for k, v in comparison.shares.items())
    if len(configs) == 1:
        return [f"One configuration: **{configs[0].label}** (`{configs[0].key}`).", "", f"Settings: {shared}."]
    differs = ", ".join(f"{name} ({' vs '.join(values)})" for name, values in comparison.differs.items())
    own = ", ".join(f"{k}={v}" for k, v in comparison.own.items())
    return [
        f"Configurations differ in: {differs or 'nothing shown (only in settings some systems lack)'}.",
        "",
        f"They share: {shared or 'nothing'}." + (f" Only where the system has them: {own}." if own else ""),
    ]


@dataclass(frozen=True)
class Summaries:
    """Per configuration: the summary over all its rows (original option order) and per benchmark."""

    overall: dict[str, dict[str, Any]]  # config key → summary
    by_benchmark: dict[str, dict[str, dict[str, Any]]]  # config key → benchmark → summary
    benchmarks: list[str]


def summaries(rows: list[dict[str, Any]], comparison: Comparison) -> Summaries:
    grouped: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        grouped[row["config_key"]][row["benchmark"]].append(row)
    overall, by_benchmark = {}, {}
    for config in comparison.configurations:
        benches = grouped.get(config.key, {})
        overall[config.key] = summarise([r for bench_rows in benches.values() for r in bench_rows])
        by_benchmark[config.key] = {b: summarise(benches[b]) for b in sorted(benches)}
    return Summaries(overall, by_benchmark, sorted({r["benchmark"] for r in rows}))
