"""The `ermedrag` command line: demo, ask, index, eval, run, export, train, report, traces."""

from __future__ import annotations

import argparse
import atexit
import math
import os
import sys
from typing import Callable

from ermedrag.graphs.registry import GRAPHS
from ermedrag.tools.models import ModelSpecError, default_model
from ermedrag.tools.model_server import ModelServerError
from ermedrag.tools.retrieval.corpus import DEFAULT_ON_DUPLICATE_ID, DUPLICATE_ID_POLICIES, CorpusError
from ermedrag.tools.retrieval.encoder import DEFAULT_ENCODER
from ermedrag.tools.retrieval.index_files import IndexUnavailable
from ermedrag.tools.records.traces import TraceStoreError
from ermedrag import commands

USER_ERRORS = (CorpusError, IndexUnavailable, TraceStoreError, ModelSpecError, ValueError, FileNotFoundError)
SERVER_ERROR_EXIT = 3  # a model server failed (not the user's input): scripts can tell the two apart


QUICK_EXIT_COMMANDS = ("ask", "demo")


def run() -> None:
    """The `ermedrag` console script: `main`, then, after a question answered, an exit that does not tear the
    interpreter down. Python's finalisation of torch, transformers and a loaded model took 1.5 s after the answer's
    last line on 2 cores (benches/results/first_answer.json). Nothing is lost by skipping it: every record is
    committed as it is written (SQLite, files renamed into place), the output is flushed and the exit handlers run."""
    code = main()
    if sys.argv[1:2] and sys.argv[1] in QUICK_EXIT_COMMANDS:
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()  # what `sys.exit` would run first (logging's flush, libraries' own handlers)
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ModelServerError as err:  # one line naming the server, the cause and the knob; no traceback
        print(f"error: {err}", file=sys.stderr)
        return SERVER_ERROR_EXIT


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ermedrag", description=__doc__)
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="answer a sample question offline and show every stage")
    _add_question_args(demo, default_question=True)
    demo.set_defaults(handler=commands.ask)

    ask = sub.add_parser("ask", help="answer one question")
    _add_question_args(ask, default_question=False)
    ask.set_defaults(handler=commands.ask)

    index = sub.add_parser("index", help="index corpus files or folders (JSONL[.gz], .txt/.md, hf://dataset)")
    index.add_argument("paths", nargs="+", help="files, folders, or hf://name[:split]")
    index.add_argument("--index-dir", required=True, help="where the index lives (created or extended)")
    index.add_argument("--encoder", default=DEFAULT_ENCODER, help="sentence-transformers model id or path")
    index.add_argument("--chunk-size", type=count(16, 8192), default=256, help="chunk size in tokens")
    index.add_argument("--chunk-overlap", type=count(0, 8191), default=32, help="overlap between chunks in tokens")
    index.add_argument("--chroma-url", default=None, help="a Chroma server (http://host:port) instead of embedded")
    index.add_argument(
        "--encoding", default=None, help=".txt/.md/.jsonl encoding (default UTF-8, read strictly; e.g. latin-1, cp1252)"
    )
    index.add_argument(
        "--on-duplicate-id",
        choices=DUPLICATE_ID_POLICIES,
        default=DEFAULT_ON_DUPLICATE_ID,
        help="a document whose id is already indexed, with other text: replace the indexed version (default), "
        "keep both with the new one as id~2, id~3, ... (rename), keep the indexed one (skip), or stop before "
        "writing anything (error); the same text is left as it is, and a reused id within the input is renamed "
        "id~N (stopped under error)",
    )
    index.set_defaults(handler=commands.index)

    evaluate = sub.add_parser("eval", help="run systems on benchmarks (concurrent, resumable)")
    evaluate.add_argument("--system", default="er_medrag", help=f"comma-separated graphs: {', '.join(GRAPHS)}")
    evaluate.add_argument(
        "--bench", default="medqa", help="comma-separated benchmark names or JSONL question files, or 'all'"
    )
    evaluate.add_argument("--out", required=True, help="results folder (rerun with the same folder to resume)")
    evaluate.add_argument(
        "--samples", type=count(1, 64), default=1, help="answers per question (answer entropy; needs --temperature > 0)"
    )
    evaluate.add_argument(
        "--max-new-tokens",
        type=count(0),
        default=None,
        help="respondent generation budget (default: the graph context's)",
    )
    evaluate.add_argument(
        "--permute-options",
        type=count(1, 26),
        default=1,
        metavar="N",
        help="also ask each question with its options in N-1 other cyclic orders (answers mapped "
        "back to the option text) and add a position-bias section to the report (default 1: "
        "as given; results of order 0 are those of a run without it)",
    )
    _add_batch_args(evaluate)
    _add_selective_args(evaluate)
    evaluate.set_defaults(handler=commands.evaluate)

    calibrate = sub.add_parser(
        "calibrate",
        help="fit a conformal answer-set threshold on answered multiple-choice questions (an eval's results)",
    )
    calibrate.add_argument("results", nargs="+", help="folders written by `ermedrag eval` (the calibration questions)")
    calibrate.add_argument(
        "--alpha",
        type=number(0.001, 0.999),
        default=0.1,
        help="error rate: sets hold the right option with probability at least 1 - alpha (default 0.1)",
    )
    calibrate.add_argument("--system", default=None, help="the graph to calibrate, when the results hold several")
    calibrate.add_argument("--out", "-o", required=True, help="calibration file to write (JSON)")
    calibrate.set_defaults(handler=commands.calibrate)

    record = sub.add_parser("run", help="record traces for a file of questions (no report): training data")
    record.add_argument("--bench", required=True, help="JSONL questions file in the shared schema, or a benchmark name")
    record.add_argument("--system", default="er_medrag", choices=list(GRAPHS), help="graph that answers them")
    record.add_argument("--out", default=None, help="progress log folder (default: beside the trace db)")
    _add_batch_args(record)
    record.set_defaults(handler=commands.record)

    export = sub.add_parser(
        "export",
        help="recorded traces → DPO pairs (extractor), GRPO prompts (respondent), "
        "Med-R³ prompts (replayed from med_r3 runs) or MMedAgent-RL triage and "
        "curriculum data (mmedagent runs)",
    )
    export.add_argument("kind", choices=["dpo", "grpo", "med-r3", "mmedagent"])
    export.add_argument(
        "--trace-db",
        "--traces",
        dest="trace_db",
        default=None,
        help="trace database (default: ERMEDRAG_TRACE_DB or the cache)",
    )
    export.add_argument(
        "--data",
        default=None,
        help="mmedagent: shared data root (or its benchmarks/ folder) whose "
        "metadata labels the triage (default: ERMEDRAG_SHARED_DATA)",
    )
    export.add_argument("--out", required=True, help="output folder (rerun with the same folder to resume)")
    export.add_argument("--model", default=None, help="dpo: model that samples alternatives (default: recorded)")
    export.add_argument("--base-url", default=None)
    export.add_argument("--samples", type=count(0, 64), default=4, help="dpo: alternatives per recorded call")
    export.add_argument("--temperature", type=number(0, 2), default=0.7, help="dpo: sampling temperature (default 0.7)")
    export.add_argument("--margin", type=number(0), default=0.1, help="dpo: minimum reward gap of a pair")
    export.add_argument("--no-usefulness", action="store_true", help="dpo: skip the respondent usefulness check")
    export.add_argument(
        "--close-cut-lists",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="dpo: also score each candidate the token budget cut, ended after its last complete triplet (default: on)",
    )
    export.add_argument("--noise", type=number(0, 0.99), default=0.25, help="grpo: fraction of distractor triplets")
    export.add_argument(
        "--questions",
        nargs="*",
        default=[],
        help="grpo: write respondent prompts from these benchmark JSONL files instead of traces (evidence "
        "supporting the gold answer among distractors, only distractors, or none); med-r3: benchmark JSONL files the "
        "runs came from (gold evidence for the retrieval reward); mmedagent: more benchmark files whose "
        "metadata labels the triage",
    )
    export.add_argument(
        "--max-distractors",
        type=count(0, 32),
        default=4,
        help="grpo --questions: distractor triplets per prompt, drawn from 0 to this (default 4)",
    )
    export.add_argument(
        "--irrelevant",
        type=number(0, 1),
        default=0.25,
        help="grpo --questions: share of prompts with only distractors (default 0.25)",
    )
    export.add_argument(
        "--no-evidence",
        type=number(0, 1),
        default=0.1,
        help="grpo --questions: share of prompts with no evidence at all (default 0.1)",
    )
    export.add_argument("--qrels", default=None, help="med-r3: bioasq_qrels.jsonl for BioASQ questions")
    export.add_argument("--corpus-dir", default=None, help="med-r3: corpora folder (exact PubMedQA passage ids)")
    export.add_argument("--seed", type=int, default=0)
    export.add_argument("--limit", type=count(1), default=None, help="process at most N records")
    export.set_defaults(handler=commands.export)

    train = sub.add_parser("train", help="train an agent with TRL from an exported dataset (config as YAML)")
    train.add_argument(
        "kind",
        choices=["dpo", "sft", "grpo", "med-r3", "mmedagent"],
        help="dpo: extractor pairs; sft: a warm start on reference replies (the respondent's, the triage's or "
        "Med-R³'s reasoner's); grpo: respondent prompts; med-r3: the Med-R³ stage schedule; mmedagent: MMedAgent-RL's "
        "triage and attending curriculum",
    )
    train.add_argument(
        "--config",
        required=True,
        help="a preset (dpo_extractor, grpo_respondent, ...: training/configs/) or a YAML file of training.config fields",
    )
    train.add_argument(
        "--stages",
        default=None,
        help="med-r3: stages to run, e.g. 1,2,3 or 2 (default 1,2,3); mmedagent: e.g. "
        "triage,easy,medium,hard or hard (default: the config's whole schedule)",
    )
    train.set_defaults(handler=commands.train)

    report = sub.add_parser("report", help="markdown table and plots from result folders")
    report.add_argument("results", nargs="+", help="folders written by `ermedrag eval`")
    report.add_argument("--out", default=None, help="where to write report.md and PNGs (default: first folder)")
    report.add_argument("--trace-db", default=None, help="add RAG quality (context precision/recall) from these traces")
    report.add_argument("--corpus-dir", default=None, help="corpora folder (PubMedQA gold passages for recall)")
    report.add_argument("--qrels", default=None, help="BioASQ qrels (default: ERMEDRAG_SHARED_DATA/retrieval/…)")
    report.add_argument("--judge", default=None, help="judge model for ragas faithfulness/answer relevancy")
    report.add_argument("--base-url", default=None, help="server of an openai: judge")
    report.set_defaults(handler=commands.report)

    traces = sub.add_parser("traces", help="list or show recorded runs")
    traces.add_argument("action", choices=["list", "show"])
    traces.add_argument("run_id", nargs="?", help="run id (for show)")
    traces.add_argument(
        "--trace-db",
        "--db",
        dest="trace_db",
        default=None,
        help="trace database (default: ERMEDRAG_TRACE_DB or the cache)",
    )
    traces.add_argument("--limit", type=count(1), default=20, help="runs to list (newest first)")
    traces.add_argument("--json", action="store_true", help="show: the run, its events and retrievals as JSON")
    traces.set_defaults(handler=commands.traces)
    return parser


def count(low: int = 0, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` (to `high`); the error names the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected a whole number from {low}" + (f" to {high}" if high else ""))
        return value

    return parse


def number(low: float, high: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite number from `low` (to `high`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected a number from {low:g}" + (f" to {high:g}" if high else ""))
        return value

    return parse


def _add_context_args(parser: argparse.ArgumentParser, *, replicas: bool) -> None:
    """The flags that set a graph's context, the same on every command that runs graphs (ask, demo, eval, run)."""
    parser.add_argument("--model", default=None, help=f"chat model for every agent (default here: {default_model()})")
    if replicas:
        parser.add_argument(
            "--base-url",
            action="append",
            default=None,
            metavar="URL",
            help="OpenAI-compatible server for openai: models; repeat it for replicas of one model (each "
            "question goes to the least busy live one, a server that is down leaves the rotation)",
        )
    else:
        parser.add_argument(
            "--base-url", default=None, metavar="URL", help="OpenAI-compatible server for openai: models"
        )
    parser.add_argument("--index-dir", default=None, help="corpus index (default: the starter knowledge base)")
    parser.add_argument(
        "--chroma-url",
        default=None,
        help="the Chroma server of an index built with --chroma-url (default: the one it records)",
    )
    parser.add_argument("--snippets", type=count(0), default=None, help="snippets per question (RAG graphs)")
    parser.add_argument(
        "--temperature", type=number(0, 2), default=None, help="sampling temperature of every agent (default 0)"
    )
    parser.add_argument("--trace-db", default=None, help="trace database (default: ERMEDRAG_TRACE_DB or the cache)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="settings",
        help="any other context field of the graph, e.g. --set max_searches=2 (repeat)",
    )
    _add_server_args(parser)


def _add_selective_args(parser: argparse.ArgumentParser) -> None:
    """What `ask` and `eval` return beside an answer: its conformal set and whether it is withheld."""
    parser.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="a file of `ermedrag calibrate` for this configuration: each answer also gets the set of options that "
        "holds the right one with probability at least 1 - alpha",
    )
    parser.add_argument(
        "--abstain-below",
        type=number(0, 1),
        default=None,
        metavar="T",
        help="withhold an answer whose confidence (its option's probability) is below T, saying why",
    )


def _add_batch_args(parser: argparse.ArgumentParser) -> None:
    """What `eval` and `run` share: the context flags, the questions' selection and concurrency."""
    _add_context_args(parser, replicas=True)
    parser.add_argument(
        "--data",
        default=None,
        help="the data root holding benchmarks/, or that benchmarks folder itself (default: "
        "ERMEDRAG_SHARED_DATA, either form; without either, the upstream datasets)",
    )
    parser.add_argument("--limit", type=count(1), default=None, help="seeded sample of N questions per benchmark")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed for --limit")
    parser.add_argument("--concurrency", type=count(1, 4096), default=8, help="questions in flight at once")
    parser.add_argument(
        "--checkpoint-db",
        default=None,
        help="where questions in flight keep their checkpoints (a rerun continues them): a SQLite "
        "file or a postgres:// URL (default: OUT/checkpoints.sqlite)",
    )


def _add_question_args(parser: argparse.ArgumentParser, default_question: bool) -> None:
    if default_question:
        parser.add_argument("--question", default=None, help="the question to answer (default: a sample question)")
    else:
        parser.add_argument(
            "question",
            nargs="?",
            default=None,
            help="the question to answer (with --resume: optional, must be the run's question)",
        )
    parser.set_defaults(sample_question=default_question)
    parser.add_argument(
        "--option",
        "-o",
        action="append",
        default=[],
        metavar="KEY=TEXT",
        help="an answer option, e.g. -o 'A=Metformin' (repeat)",
    )
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH|URL",
        help="an image of the case, for graphs that take images (mmedagent); repeat for several",
    )
    parser.add_argument(
        "--graph", default=None, choices=list(GRAPHS), help="the graph that answers (default er_medrag)"
    )
    _add_context_args(parser, replicas=False)
    _add_selective_args(parser)
    parser.add_argument("--json", action="store_true", help="print the final state as JSON")
    parser.add_argument(
        "--resume",
        default=None,
        metavar="RUN_ID",
        help="continue a killed or failed run from its last finished node (its question, graph and "
        "settings come from its checkpoints; flags given here override those settings)",
    )
    parser.add_argument(
        "--checkpoint-db",
        default=None,
        help="checkpoint store: a SQLite file or a postgres:// URL (default: ERMEDRAG_CHECKPOINT_DB, "
        "else ~/.cache/ermedrag/checkpoints.sqlite)",
    )


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    """Timeouts and retries of model-server calls (openai: models); they never change an answer."""
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        dest="request_timeout_s",
        metavar="SECONDS",
        help="deadline of each attempt at a model-server call, from connecting to the last byte (default 60; env "
        "ERMEDRAG_REQUEST_TIMEOUT_S)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=None,
        dest="connect_timeout_s",
        metavar="SECONDS",
        help="seconds to connect to a model server (default 5; env ERMEDRAG_CONNECT_TIMEOUT_S)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=None,
        dest="max_retries",
        metavar="N",
        help="retries of a failed model-server request, with exponential backoff (default 2; env ERMEDRAG_MAX_RETRIES)",
    )


if __name__ == "__main__":
    sys.exit(main())
