"""What each `ermedrag` command does (`ermedrag.cli` parses the command line and calls these): ask and demo (with their printed run), index, eval, run, export, train, report, traces."""

from __future__ import annotations
import argparse
import dataclasses
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from ermedrag.tools.models import parse_model_spec
from ermedrag.views import one_line, render_run, render_trace, retrieval_view, when


DEMO_QUESTION = (
    "A 52-year-old man is newly diagnosed with type 2 diabetes; his kidney function is normal. "
    "Which drug should he start first?"
)


DEMO_OPTIONS = {"A": "Insulin glargine", "B": "Glipizide", "C": "Metformin", "D": "Pioglitazone"}


def _server_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The context fields that the server flags set (None: not given), checked before any work starts."""
    from ermedrag.tools.model_server import ServerPolicy

    given = {name: getattr(args, name) for name in ("request_timeout_s", "connect_timeout_s", "max_retries")}
    policy_fields = {
        "request_timeout_s": "timeout_s",
        "connect_timeout_s": "connect_timeout_s",
        "max_retries": "max_retries",
    }
    ServerPolicy(**{policy_fields[name]: value for name, value in given.items() if value is not None})
    return given


def ask(args: argparse.Namespace) -> int:
    from ermedrag.graphs.durable import (
        default_checkpoint_db,
        durable,
        open_saver,
        run_config,
        run_durably,
        run_lock,
    )
    from ermedrag.graphs.registry import GRAPHS, load_graph

    checkpoint_db = args.checkpoint_db or default_checkpoint_db()
    with open_saver(checkpoint_db) as saver:
        if args.resume:
            run_id = args.resume
            graph_name, inputs, context = _resumed_run(args, saver, checkpoint_db)
        else:
            run_id = uuid.uuid4().hex
            graph_name = args.graph or "er_medrag"
            inputs = _new_question(args, run_id, graph_name)
            # The whole context is recorded with the run, so a resume runs with what the run started with; built
            # (and so checked) before anything is loaded.
            context = dataclasses.asdict(load_graph(graph_name).context_schema(**_ask_overrides(args, graph_name)))
        selective = _selective(args, graph_name, context)  # a calibration for another configuration fails here
        with run_lock(run_id, checkpoint_db):
            if not args.resume:
                again = " with the same --checkpoint-db" if args.checkpoint_db else ""
                print(
                    f"Run id: {run_id}; if interrupted, continue it with `ermedrag ask --resume {run_id}`{again}",
                    file=sys.stderr,
                )  # stderr, and before any work: a killed run can still be resumed
            if "index_dir" in GRAPHS[graph_name].settings and not context.get("index_dir"):
                from ermedrag.tools.data.starter_kb import starter_index_dir

                print(
                    "Starter knowledge base (demo content, not clinical advice): building/opening its index…",
                    file=sys.stderr,
                )  # stderr: keeps `ask --json` output parseable
                starter_index_dir(progress=True)
            graph = durable(load_graph(graph_name), saver)
            setup = None
            if args.resume:  # its first node, which loads what the run uses, ran before: load it here, timed apart
                from ermedrag.graphs.steps import prepare

                setup = prepare(graph.context_schema(**context), graph_name)
            started = time.perf_counter()
            state = run_durably(graph, run_config(run_id, graph_name, context), inputs, context)
            this_time = time.perf_counter() - started
            if setup is not None:
                state = state | {"setup": setup}
    answer = state.get("answer") or {}
    state = state | {"answer": answer | selective.fields(answer.get("option_probs"), answer.get("confidence"))}
    if args.json:
        print(json.dumps(state, indent=2, default=str))
    else:
        print(render_run(state, this_time, resumed=bool(args.resume)))
    return 0


def _selective(args: argparse.Namespace, graph_name: str, context: dict[str, Any]) -> Any:
    """The answer set and abstention `ask` was asked for; the calibration checked against this run's configuration."""
    from ermedrag.evals.rows import EvalConfig
    from ermedrag.evals.runner import selective_for

    calibration = getattr(args, "calibration", None)
    configs = [EvalConfig.for_graph(graph_name, context)] if calibration else []
    return selective_for(configs, calibration, getattr(args, "abstain_below", None))


def _ask_overrides(args: argparse.Namespace, graph_name: str) -> dict[str, Any]:
    """The context fields that `ask`'s flags set, the same flags as `eval`'s (`--set` for any other field)."""
    from ermedrag.evals.rows import parse_overrides

    context: dict[str, Any] = {}
    if args.model:
        parse_model_spec(args.model)  # fail before retrieval, not in the middle of a run
        context.update(extractor_model=args.model, respondent_model=args.model)
    named = {
        "base_url": args.base_url,
        "snippets_k": args.snippets,
        "index_dir": args.index_dir,
        "chroma_url": args.chroma_url,
        "temperature": args.temperature,
        "trace_db": args.trace_db,
    }
    context.update({name: value for name, value in named.items() if value is not None})
    context.update({name: value for name, value in _server_overrides(args).items() if value is not None})
    return context | parse_overrides(args.settings, [graph_name])


def _new_question(args: argparse.Namespace, run_id: str, graph_name: str) -> dict[str, Any]:
    """The input of a new run, checked (question, options, images) before anything is loaded."""
    from ermedrag.graphs.registry import GRAPHS, load_graph
    from ermedrag.graphs.state import validate_question

    question = args.question
    if question is None:
        if not args.sample_question:
            raise ValueError("ask needs a question (or --resume RUN_ID to continue a run)")
        question = DEMO_QUESTION
    options = _parse_options(args.option)
    if question == DEMO_QUESTION and not options:
        options = DEMO_OPTIONS
    inputs: dict[str, Any] = {"question": question, "options": options, "run_id": run_id}
    validate_question(inputs)
    if args.image:
        takes = [name for name in GRAPHS if "images" in load_graph(name).get_input_jsonschema().get("properties", {})]
        if graph_name not in takes:
            raise ValueError(f"--image: the {graph_name} graph takes no images (--graph {' or '.join(takes)} does)")
        inputs["images"] = list(args.image)
    return inputs


def _resumed_run(
    args: argparse.Namespace, saver: Any, checkpoint_db: str
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The graph, inputs and context of the run to resume. The run's own question is the one answered: another
    question, options or graph given with --resume is an error; other flags override the recorded settings
    (e.g. a server that moved) and are named on stderr."""
    from ermedrag.graphs.durable import saved_run

    saved = saved_run(saver, args.resume, checkpoint_db)
    question = str(saved.values.get("question") or "").strip()
    if args.question is not None and args.question.strip() != question:
        raise ValueError(
            f"run {args.resume} answers {question[:80]!r}, not the question given; "
            "omit the question to resume it, or drop --resume to ask a new one"
        )
    options, saved_options = _parse_options(args.option), saved.values.get("options")
    if options is not None and _same_options(options) != _same_options(saved_options):
        raise ValueError(f"run {args.resume} has options {saved_options}; omit -o to resume it")
    if args.graph and args.graph != saved.graph:
        raise ValueError(f"run {args.resume} ran the graph {saved.graph!r}, not {args.graph!r}")
    if args.image:
        raise ValueError(f"run {args.resume} keeps the images it was asked with; omit --image to resume it")
    overrides = _ask_overrides(args, saved.graph)
    changed = sorted(key for key, value in overrides.items() if saved.context.get(key) != value)
    if changed:
        print(f"Resuming with changed settings: {', '.join(changed)}", file=sys.stderr)
    state = "finished; printing its result" if saved.finished else "continuing from its last finished node"
    print(f"Run {args.resume} ({saved.graph}): {state}", file=sys.stderr)
    return saved.graph, {}, saved.context | overrides


def _same_options(options: Any) -> dict[str, str]:
    """Options as the graph keeps them (keys 'a' and ' A ' are the option 'A'), to compare a resume's with its run's."""
    if not isinstance(options, dict):
        return {}
    return {str(key).strip().upper(): str(text).strip() for key, text in options.items()}


def _parse_options(pairs: list[str]) -> dict[str, str] | None:
    options: dict[str, str] = {}
    seen: dict[str, str] = {}  # upper-cased key → the key as given: 'a' and 'A' are one option
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"option {pair!r} must look like KEY=TEXT, e.g. 'A=Metformin'")
        key = key.strip()
        if key.upper() in seen:
            raise ValueError(
                f"option {key!r} is given twice (-o {seen[key.upper()]}=... and -o {key}=...); "
                "option keys are letters A-Z, case-insensitive"
            )
        seen[key.upper()] = key
        options[key] = text.strip()
    return options or None


def index(args: argparse.Namespace) -> int:
    from ermedrag.tools.retrieval.corpus import read_corpus
    from ermedrag.tools.retrieval.index import build_index

    started = time.perf_counter()
    corpus = read_corpus(args.paths, on_duplicate_id=args.on_duplicate_id, encoding=args.encoding)
    print(f"read {len(corpus.documents)} documents in {time.perf_counter() - started:.1f}s")
    stats = build_index(
        corpus.documents,
        Path(args.index_dir),
        encoder=args.encoder,
        chunk_size=args.chunk_size,
        chunk_overlap=args.chunk_overlap,
        chroma_url=args.chroma_url,
        on_duplicate_id=args.on_duplicate_id,
    )
    print(_index_summary(len(corpus.documents), corpus.summary(), stats, time.perf_counter() - started))
    return 0


def _index_summary(documents: int, left_out: str, stats: dict[str, Any], seconds: float) -> str:
    """One line: documents (what was renamed or left out, and what happened to ids already indexed), chunks new /
    already there / in the index."""
    from ermedrag.tools.retrieval.index import describe_documents

    resumed, removed = stats["chunks_resumed"], stats["uncommitted_removed"]
    new = stats["chunks_added"] + resumed
    there = stats["chunks_seen"] - new
    repairs = (f"; {resumed} of them left by an interrupted build" if resumed else "") + (
        f"; removed {removed} uncommitted chunks of an interrupted build" if removed else ""
    )
    ids = describe_documents(stats)
    return (
        f"indexed {documents} documents"
        + (f" ({left_out})" if left_out else "")
        + ": "
        + (f"{ids}; " if ids else "")
        + f"{new} new chunks ({there} already indexed{repairs}), {stats['chunks_total']} in the index; {seconds:.1f}s"
    )


def evaluate(args: argparse.Namespace) -> int:
    from ermedrag.tools.data.benchmarks import BENCHMARKS
    from ermedrag.evals.runner import run_eval

    benches = list(BENCHMARKS) if args.bench == "all" else [b.strip() for b in args.bench.split(",") if b.strip()]
    systems = [s.strip() for s in args.system.split(",") if s.strip()]
    summary = run_eval(
        systems,
        benches,
        args.model,
        args.out,
        data_dir=args.data,
        limit=args.limit,
        seed=args.seed,
        concurrency=args.concurrency,
        base_url=args.base_url,
        trace_db=args.trace_db,
        checkpoint_db=args.checkpoint_db,
        samples=args.samples,
        permute_options=args.permute_options,
        progress=True,
        calibration=args.calibration,
        abstain_below=args.abstain_below,
        **_context_overrides(args, systems),
        respondent_max_new_tokens=args.max_new_tokens,
    )
    for system, counts in summary.items():
        print(f"{system}: {counts}")
    from ermedrag.evals.report import write_report

    written = write_report([args.out], args.out)
    print(f"report: {written['report']}  plots: {', '.join(written['plots'])}")
    return 0


def _context_overrides(args: argparse.Namespace, systems: list[str]) -> dict[str, Any]:
    """The graph context fields that `eval` and `run` set (None: the graph's default)."""
    from ermedrag.evals.rows import parse_overrides

    named = {
        "index_dir": args.index_dir,
        "snippets_k": args.snippets,
        "temperature": args.temperature,
        **_server_overrides(args),
    }  # timeouts/retries: context fields outside every graph's settings
    return {**named, **parse_overrides(args.settings, systems)}


def record(args: argparse.Namespace) -> int:
    from ermedrag.evals.runner import run_eval
    from ermedrag.tools.records.traces import default_trace_db

    trace_db = args.trace_db or default_trace_db()
    out = args.out or str(Path(trace_db).with_suffix("")) + "-runs"
    summary = run_eval(
        [args.system],
        [args.bench],
        args.model,
        out,
        data_dir=args.data,
        limit=args.limit,
        seed=args.seed,
        concurrency=args.concurrency,
        base_url=args.base_url,
        trace_db=trace_db,
        checkpoint_db=args.checkpoint_db,
        **_context_overrides(args, [args.system]),
    )
    print(f"{summary[args.system]}; traces in {trace_db}")
    return 0


def export(args: argparse.Namespace) -> int:
    from ermedrag.tools.records.traces import default_trace_db
    from ermedrag.training.export import (
        DPOExportConfig,
        GRPOExportConfig,
        MedR3ExportConfig,
        export_dpo,
        export_grpo,
        export_med_r3,
    )

    if args.kind == "grpo" and args.questions:  # prompts written from benchmark questions, no traces read
        from ermedrag.training.evidence_export import EvidenceExportConfig, export_grpo_evidence

        config = EvidenceExportConfig(
            questions=args.questions,
            out=args.out,
            max_distractors=args.max_distractors,
            irrelevant_fraction=args.irrelevant,
            no_evidence_fraction=args.no_evidence,
            seed=args.seed,
            limit=args.limit,
        )
        counts = export_grpo_evidence(config)
        print(f"grpo: {counts}; dataset in {Path(args.out) / 'dataset'} (datasets.load_from_disk)")
        return 0
    traces = args.trace_db or default_trace_db()
    if not Path(traces).exists():
        raise FileNotFoundError(f"no trace database at {traces}")
    if args.kind == "mmedagent":
        from ermedrag.training.mmedagent.data import MMedAgentExportConfig, export_mmedagent, export_summary

        counts = export_mmedagent(
            MMedAgentExportConfig(
                traces=traces, out=args.out, data=args.data, questions=args.questions, limit=args.limit
            )
        )
        print(export_summary(counts, args.out))
        return 0
    if args.kind == "dpo":
        counts = export_dpo(
            DPOExportConfig(
                traces=traces,
                out=args.out,
                model=args.model,
                base_url=args.base_url,
                samples=args.samples,
                temperature=args.temperature,
                margin=args.margin,
                usefulness=not args.no_usefulness,
                limit=args.limit,
                close_cut_lists=args.close_cut_lists,
            )
        )
    elif args.kind == "med-r3":
        counts = export_med_r3(
            MedR3ExportConfig(
                traces=traces,
                out=args.out,
                questions=args.questions,
                qrels=args.qrels,
                corpus_dir=args.corpus_dir,
                limit=args.limit,
            )
        )
    else:
        counts = export_grpo(
            GRPOExportConfig(traces=traces, out=args.out, noise_fraction=args.noise, seed=args.seed, limit=args.limit)
        )
    print(f"{args.kind}: {counts}; dataset in {Path(args.out) / 'dataset'} (datasets.load_from_disk)")
    return 0


def train(args: argparse.Namespace) -> int:
    if args.kind == "med-r3":
        from ermedrag.training.med_r3.train import train_med_r3

        summary = train_med_r3(args.config, stages=args.stages or "1,2,3")
        print(json.dumps(summary, indent=2, default=str))
        return 0
    if args.kind == "mmedagent":
        from ermedrag.training.mmedagent.train import train_mmedagent

        summary = train_mmedagent(args.config, stages=args.stages)
        print(json.dumps(summary, indent=2, default=str))
        return 0
    from ermedrag.training.trainers import train_from_file

    summary = train_from_file(args.kind, args.config)
    print(json.dumps({k: v for k, v in summary.items() if k != "final_metrics"}, indent=2, default=str))
    return 0


def calibrate(args: argparse.Namespace) -> int:
    """Fit a conformal threshold on one configuration's answered questions in eval results; write it."""
    from ermedrag.evals.conformal import coverage, fit
    from ermedrag.evals.runner import RESULTS
    from ermedrag.tools.records.jsonl import read_records

    rows = [
        row
        for folder in args.results
        for row in read_records(Path(folder) / RESULTS)
        if isinstance(row.get("config"), dict) and (not args.system or row["config"].get("system") == args.system)
    ]
    keys = {r["config_key"]: r for r in rows}
    if len(keys) != 1:
        found = ", ".join(sorted({r["config"]["system"] for r in keys.values()})) or "none"
        raise ValueError(
            f"the results hold {len(keys)} configurations ({found}): a calibration is for one; "
            + ("pick one with --system" if keys else "check the folders")
        )
    ((key, first),) = keys.items()
    calibration = fit(rows, args.alpha, {**first["config"], "config_key": key})
    path = calibration.save(args.out)
    seen = coverage(rows, calibration.threshold)
    threshold = (
        "every option (too few questions for this alpha)"
        if calibration.threshold == float("inf")
        else (f"options with probability >= {1 - calibration.threshold:.3f}")
    )
    print(
        f"calibrated {calibration.system} on {calibration.n_calibration} questions "
        f"({', '.join(calibration.benchmarks)}) at alpha={calibration.alpha:g}: sets keep {threshold}; "
        f"on these questions they average {seen['mean_set_size']:.2f} options. Wrote {path}"
    )
    return 0


def report(args: argparse.Namespace) -> int:
    from ermedrag.evals.report import write_report

    written = write_report(
        args.results,
        args.out or args.results[0],
        trace_db=args.trace_db,
        corpus_dir=args.corpus_dir,
        qrels=args.qrels,
        judge=args.judge,
        base_url=args.base_url,
    )
    print(Path(written["report"]).read_text())
    print(f"plots: {', '.join(written['plots'])}")
    return 0


def traces(args: argparse.Namespace) -> int:
    from ermedrag.tools.records.traces import TraceStore, default_trace_db

    path = Path(args.trace_db or default_trace_db())
    if not path.exists():
        raise FileNotFoundError(f"no trace database at {path}")
    store = TraceStore(path)
    if args.action == "list":
        for run in store.runs(args.limit):
            answer = (run.get("answer") or {}).get("answer")
            outcome = {"finished": f"answer={answer}", "failed": "FAILED"}.get(run["status"], "unfinished")
            error = f"  error: {one_line(run['error'], 300)}" if run["status"] == "failed" else ""
            print(
                f"{run['run_id']}  {when(run['created_at'])}  "
                f"{run['graph']}  events={run['n_events']}  retrievals={run['n_retrievals']}  {outcome}  "
                f"gold={run['gold']}  "
                f"{run['question']['question'][:60]!r}{error}"
            )
        return 0
    if not args.run_id:
        raise ValueError("traces show needs a run id (see `ermedrag traces list`)")
    run = store.run(args.run_id)
    if run is None:
        raise ValueError(f"no run {args.run_id!r} in {path}")
    events = [{k: v for k, v in e.items() if k != "logprobs"} for e in store.events(run_id=args.run_id)]
    retrievals = store.retrievals(args.run_id)
    if args.json:
        view = {"run": run, "events": events, "retrievals": [retrieval_view(r) for r in retrievals]}
        print(json.dumps(view, indent=2, default=str))
    else:
        print(render_trace(run, events, retrievals))
    return 0
