"""``fsdp-lab <lab> [options]`` — run a lab headless, save its figures and JSON.

(Over 450 lines on purpose: every subcommand's options, checks, messages and exit codes are the
command line's one contract, read in one sitting; the labs themselves live in their topics.)

    fsdp-lab collectives --world-size 4 --out out/     figures (PNG, diagrams SVG) + JSON in out/
    fsdp-lab collectives --json                        exactly one JSON object on stdout
    fsdp-lab tour --out out/                           every lab, with a summary.md/.json
    fsdp-lab grade submitted/ --csv grades.csv         grade exercise submissions (course mode)
    fsdp-lab bugs [--lab shard] [--json]               the bug gallery, measured
    torchrun --nproc-per-node 4 -m fsdp_lab collectives   the same on a multi-GPU node

Everything that can be checked is checked before any rank starts: the options, the config,
``--out`` (created, and written to once), ``--model`` (built, one forward on a tiny batch:
`fsdp_lab.model_spec`), the backend.
A wrong input is one line naming the value and what was expected, and one line with the fix.

With ``--json``, stdout carries exactly one JSON object whatever happens: the result, or
``{"error": ..., "hint": ...}``. Everything else (progress, rank output, C libraries) goes to
stderr. Exit codes: 0 done, 1 a rank or fsdp_lab itself failed, 2 wrong input, 130 Ctrl-C; SIGTERM
and SIGHUP end a command as Ctrl-C does (`fsdp_lab.endings`), with 143 and 129.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

# torch-free on purpose: `fsdp-lab --help` imports this module and the labs' config modules
# only (importing torch took 4-18 s); torch comes in when a lab is about to run.
from fsdp_lab.choices import BACKENDS, DEVICE_ENV, DEVICES
from fsdp_lab.cores import OversubscribedWarning, available_cores, too_many_ranks
from fsdp_lab.endings import Ending, ended_like_ctrl_c
from fsdp_lab.host import forget_stale_launcher_env, torchrun_rank, under_torchrun
from fsdp_lab.labs.options import add_config_arguments, config_overrides, to_flags
from fsdp_lab.labs.registry import LABS, PLANNED
from fsdp_lab.outputs import write_file

DEFAULT_OUT = "fsdp_lab_out"
LAB_LINE = (
    "Runs the lab on live ranks, prints what it measured and writes its figures and JSON to "
    f"{DEFAULT_OUT}/<lab>/ (--out DIR: there instead); --json prints one JSON object, and "
    "writes files only with --out."
)
COMMANDS = ("tour", "grade", "bugs", "plan")  # beside the labs
INTERRUPTED = "interrupted — ranks stopped"
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130  # 130 = 128 + SIGINT, as shells report


class Failed(Exception):
    """The command could not finish, for a reason it says in one line (exit 1, no traceback)."""

    def __init__(self, error: str, hint: str) -> None:
        super().__init__(error)
        self.error, self.hint = error, hint


class UsageError(Exception):
    """Wrong input: `error` names the value and what was expected, `hint` says the fix."""

    def __init__(self, error: str, hint: str, where: str | None = None) -> None:
        super().__init__(error)
        self.error, self.hint, self.where = error, hint, where


def usage_error(
    exc: ValueError, where: str | None = None, config_cls: type | None = None
) -> UsageError:
    """A config's ValueError ("... . Fix: x=1", the labs' convention) as error + hint, its
    ``field=value`` spoken as the command line's options (``--x 1``)."""
    message = to_flags(str(exc), config_cls) if config_cls is not None else str(exc)
    error, _, fix = message.partition(" Fix: ")
    hint = fix or (f"see `{where} --help` for the options" if where else "see `fsdp-lab --help`")
    return UsageError(error.rstrip().removesuffix("."), hint, where)


def _is_main_process() -> bool:
    # Under torchrun every rank runs this CLI; only global rank 0 prints and writes files
    # (`_run` checked torchrun's RANK first: an error here would cost the JSON object).
    try:
        return torchrun_rank() == 0
    except ValueError:
        return True


# -- the parser ------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are raised as UsageError: one line and a hint, not usage + exit."""

    command: str | None = None  # the subcommand parse_args was given: its help is the one to read

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self.command = next((a for a in args or [] if not a.startswith("-")), None)
        return super().parse_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        prog = (
            f"{self.prog} {self.command}" if self.command in COMMANDS + tuple(LABS) else self.prog
        )
        hint = f"see `{prog} --help` for the options"
        if message.startswith("unrecognized arguments:"):
            typed = [w for w in message.split(":", 1)[1].split() if w.startswith("--")]
            known = self._option_strings()
            guesses = [difflib.get_close_matches(w.split("=")[0], known, n=1) for w in typed]
            found = [f"{w} -> {g[0]}" for w, g in zip(typed, guesses, strict=True) if g]
            if found:
                hint = f"did you mean: {', '.join(found)}? ({hint})"
        raise UsageError(message, hint, self.prog)

    def _option_strings(self) -> list[str]:
        """Every --option this parser and its lab subparsers know: what a typo is matched to."""
        options = []
        for action in self._actions:
            options += [o for o in action.option_strings if o.startswith("--")]
            choices = getattr(action, "choices", None)
            if isinstance(choices, dict):  # the lab subparsers
                for sub in choices.values():
                    if isinstance(sub, argparse.ArgumentParser):
                        options += _Parser._option_strings(sub)
        return sorted(set(options))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (expected >= 1)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (expected > 0)") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not a finite number > 0")
    return value


def _common(
    p: argparse.ArgumentParser, world_size: int | None = None, takes_model: bool = True
) -> None:
    ranks = "number of ranks" + (f" (default {world_size})" if world_size else "")
    p.add_argument("--world-size", type=_positive_int, default=None, help=ranks)
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="process-group backend")
    p.add_argument(
        "--device",
        choices=DEVICES,
        default=None,
        help="where the ranks compute: auto (a GPU each under NCCL when there are enough, else "
        "the CPU), cpu (the CPU lab on a GPU machine), cuda (with fewer GPUs than ranks, the "
        "ranks share them: gloo on CUDA tensors)",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="module:factory",
        # A lab that builds its own models keeps the option (to refuse it, naming the labs that
        # take one) but does not offer it in its --help.
        help="a factory returning an nn.Module: token ids (batch, seq) -> logits (batch, seq, "
        "vocab); a module in the current directory works (labs that train a model)"
        if takes_model
        else argparse.SUPPRESS,
    )
    p.add_argument(
        "--out", default=None, help=f"folder for figures and JSON (default {DEFAULT_OUT}/)"
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every lab's options, built from the torch-free config modules."""
    parser = _Parser(prog="fsdp-lab", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="lab", required=True, metavar="<lab>")
    for name, lab in LABS.items():
        p = sub.add_parser(name, help=lab.title, description=f"{lab.title.rstrip('.')}. {LAB_LINE}")
        field = lab.config_class.__dataclass_fields__.get("world_size")  # not built: no torch
        _common(p, field.default if field is not None else None, name in model_labs())
        add_config_arguments(p, lab.config_class)
    tour = sub.add_parser("tour", help="run every lab headless; write figures and a summary")
    _common(tour)
    grade = sub.add_parser(
        "grade", help="grade submitted exercise notebooks or .py files, each in a sandbox"
    )
    grade.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="files or folders")
    grade.add_argument("--csv", type=Path, default=None, help="write one row per submission")
    grade.add_argument(
        "--time-limit", type=_positive_float, default=30.0, help="seconds per case (default 30)"
    )
    grade.add_argument("--only", default=None, metavar="EXERCISE", help="grade one exercise")
    grade.add_argument(
        "--max-files-per-student", type=_positive_int, default=10, metavar="N",
        help="grade at most N files of each student; the rest get a row saying so (default 10)",
    )  # fmt: skip
    grade.add_argument(
        "--class-time-limit", type=_positive_float, default=None, metavar="SECONDS",
        help="start no file after this long; the files left get a row saying so",
    )  # fmt: skip
    grade.add_argument("--json", action="store_true", help="print exactly one JSON object")
    bugs = sub.add_parser(
        "bugs",
        help="the bug gallery: classic bugs beside the correct run",
        description="The bug gallery: each classic bug switched on in the real mechanism, run "
        "beside the correct one. Prints one line per bug and the tally; with --lab, each of that "
        "lab's bugs with its measured rows and the fix.",
    )
    bugs.add_argument(
        "--lab", dest="labs", action="append", default=None, metavar="LAB",
        help=f"only this lab (repeatable): {', '.join(LABS)}",
    )  # fmt: skip
    bugs.add_argument("--out", type=Path, default=None, help="folder for figures and bugs.json")
    bugs.add_argument("--json", action="store_true", help="print exactly one JSON object")
    _plan_arguments(
        sub.add_parser(
            "plan",
            help="plan a real run: per-GPU memory, bytes, step time (--verify fake runs it)",
        )
    )
    return parser


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    from fsdp_lab.planning.planner import CHECKPOINTS, GPUS, PRECISIONS, STRATEGIES  # torch-free

    p.add_argument(
        "--model",
        default="llama3-8b",
        help="llama3-8b|70b|405b[-twin], mod:factory, or a parameter count (7.5e9, 70B)",
    )
    p.add_argument("--gpus", type=int, default=8, help="GPUs in all (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    p.add_argument("--strategy", default="zero3", choices=list(STRATEGIES))
    p.add_argument("--mesh", default=None, metavar="R,S", help="HSDP: replicas,shard-group")
    p.add_argument("--precision", default="bf16-mixed", choices=list(PRECISIONS))
    p.add_argument("--checkpoint", default="none", choices=CHECKPOINTS)
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU (default 1)")
    p.add_argument(
        "--grad-accumulation", type=int, default=1, help="micro-batches per step (default 1)"
    )
    p.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="share of peak FLOPS reached (default: the GPU preset's, 0.35-0.6)",
    )
    p.add_argument(
        "--verify", choices=("fake",), default=None, help="run one rank on fake ranks, compare"
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")


def model_labs() -> list[str]:
    """The labs whose config has a `model` field: those that take ``--model``."""
    labs = []
    for name, lab in LABS.items():
        if "model" in lab.config_class.__dataclass_fields__:
            labs.append(name)
    return labs


def check_lab_name(argv: list[str]) -> None:
    """The first word must be a lab; say so when it is a planned one or a typo."""
    if not argv or argv[0].startswith("-"):
        return  # --help, or nothing: argparse answers
    name, labs = argv[0], [*LABS, *COMMANDS]
    if name in labs:
        return
    available = f"available labs: {', '.join(labs)}"
    if name in PLANNED:
        raise UsageError(f"{name!r} is {PLANNED[name]}: planned, not built yet", available)
    close = difflib.get_close_matches(name, labs, n=1)
    guess = f"; did you mean {close[0]!r}?" if close else ""
    raise UsageError(f"invalid choice: {name!r} is not a lab{guess}", available)


# -- before any rank starts: everything that can be checked ---------------------------------


@dataclass(frozen=True)
class Planned:
    """A lab ready to run: its name, its validated config, where its files go."""

    name: str
    config: Any
    out: Path | None


def check_out(out: Path, where: str) -> None:
    """``--out`` is a folder this process can write (created now), or a UsageError."""
    example = f"--out {DEFAULT_OUT}/"
    if out.exists() and not out.is_dir():
        raise UsageError(
            f"--out {out}: is a file, not a folder", f"name a folder: {example}", where
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # permissions, read-only mounts, quotas: try it
            pass
    except OSError as exc:
        raise UsageError(
            f"--out {out}: cannot write there ({exc.strerror or exc})",
            f"name a folder you can write: {example}",
            where,
        ) from None


def prepare(name: str, args: argparse.Namespace, out: Path | None, tour: bool = False) -> Planned:
    """Validate one lab's options before any rank starts; UsageError names what is wrong."""
    where = f"fsdp-lab {name}"
    if out is not None:
        check_out(out, where)
    takes_model = name in model_labs()
    if args.model is not None and takes_model:
        from fsdp_lab.model_spec import check_model_apart

        try:  # first, apart: the config below imports the module in this process
            check_model_apart(args.model)
        except ValueError as exc:
            raise usage_error(exc, where) from None
    lab = LABS[name]
    config_cls = lab.config_class
    # The tour runs each lab at a laptop-friendly size (a lab's TOUR, if it has one).
    overrides: dict[str, Any] = lab.tour if tour else {}
    overrides["backend"] = args.backend
    if args.world_size is not None:
        overrides["world_size"] = args.world_size
    if under_torchrun() and "world_size" in config_cls.__dataclass_fields__:
        overrides["world_size"] = int(os.environ["WORLD_SIZE"])  # the job's size is given
    if args.model is not None and takes_model:
        overrides["model"] = args.model
    elif args.model is not None and not tour:  # the tour gives --model to the labs that take it
        raise UsageError(
            "--model is not used by this lab (it moves raw tensors or builds its own models)",
            f"drop --model, or pass it to a lab that trains a model: {', '.join(model_labs())}",
            where,
        )
    overrides.update(config_overrides(args, config_cls))
    try:
        config = config_cls(**overrides)
    except ValueError as exc:
        raise usage_error(exc, where, config_cls) from None

    # From here on torch is imported: the lab is going to run. Its ranks' fork server starts
    # first and imports torch beside this process (on two cores, seconds sooner up).
    from fsdp_lab.cluster import launcher

    launcher.warm_up()
    from fsdp_lab.cluster import resolve_placement
    from fsdp_lab.host import check_ranks_fit

    try:
        if not under_torchrun():  # under torchrun the job's size and devices are given
            check_ranks_fit(config.world_size)
            resolve_placement(config.backend, config.world_size)
        lab.preflight(config)  # the lab's own checks of this machine (e.g. host memory)
    except ValueError as exc:
        raise usage_error(exc, where, config_cls) from None
    return Planned(name, config, out)


def warn_about_cores(planned: list[Planned]) -> None:
    """One line on stderr per distinct warning, before the ranks start (not under torchrun)."""
    if under_torchrun():
        return
    said = set()
    for p in planned:
        warning = too_many_ranks(
            p.config.world_size, available_cores(), f"--world-size {available_cores()}"
        )
        if warning and warning not in said:
            print(f"fsdp-lab {p.name}: {warning}", file=sys.stderr, flush=True)
            said.add(warning)


# -- running ------------------------------------------------------------------------------------


def _save(lab: Any, result: Any, out: Path) -> list[Path]:
    from fsdp_lab.diagrams import Diagram
    from fsdp_lab.plots import save_figure

    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{result.lab}.json"]
    write_file(written[0], result.to_json(indent=1))
    for stem, fig in lab.figures(result).items():
        if isinstance(fig, Diagram):  # SVG, or its DOT source where graphviz's `dot` is missing
            written.append(fig.save(out / stem))
        else:
            written.append(save_figure(fig, out / f"{stem}.png"))
    return written


def run_lab(planned: Planned) -> Any:
    """Start the ranks, run the lab, stop the ranks (also on Ctrl-C or a failure), save."""
    from fsdp_lab.cluster import open_cluster

    lab = LABS[planned.name]
    with warnings.catch_warnings():  # prepare() already warned, naming the flag to change
        warnings.simplefilter("ignore", OversubscribedWarning)
        cluster = open_cluster(planned.config.world_size, planned.config.backend)
    try:
        result = lab.run(planned.config, cluster=cluster)
    finally:
        cluster.close()  # on KeyboardInterrupt too: no rank outlives the driver
    if planned.out is not None and _is_main_process():
        _save(lab, result, planned.out)
    return result


def tour(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out or DEFAULT_OUT)
    # Every lab's options checked before the first rank starts, not after three labs ran.
    planned = [prepare(name, args, out / name, tour=True) for name in LABS]
    warn_about_cores(planned)
    summary: dict[str, Any] = {}
    markdown = ["# fsdp_lab tour", ""]
    for i, p in enumerate(planned, 1):
        print(f"[{i}/{len(LABS)}] {p.name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        result = run_lab(p)
        seconds = time.perf_counter() - t0
        summary[p.name] = {"seconds": round(seconds, 2), "result": result.to_dict()}
        markdown += [f"## {p.name} ({seconds:.1f} s)", "", LABS[p.name].report(result), ""]
        print(f"[{i}/{len(LABS)}] {p.name} done in {seconds:.1f} s -> {p.out}/", file=sys.stderr)
    if _is_main_process():
        write_file(out / "summary.md", "\n".join(markdown))
        write_file(out / "summary.json", json.dumps(summary, indent=1))
        print(f"summary: {out / 'summary.md'}, {out / 'summary.json'}", file=sys.stderr)
    return summary


def one_lab(args: argparse.Namespace) -> dict[str, Any]:
    if args.out is not None:
        out: Path | None = Path(args.out)
    else:
        out = None if args.json else Path(DEFAULT_OUT) / args.lab
    planned = prepare(args.lab, args, out)
    warn_about_cores([planned])
    result = run_lab(planned)
    if not args.json and _is_main_process():
        print(LABS[args.lab].report(result))
        if out is not None:
            print(f"figures and {args.lab}.json written to {out}/")
    return result.to_dict()


def grade_command(args: argparse.Namespace) -> dict[str, Any]:
    """`fsdp-lab grade`: every submission graded in a sandbox; a table (or JSON), a CSV."""
    from fsdp_lab.course import gradebook, grading

    if args.csv is not None:  # before the first file: a class's grades are never lost at the end
        problem = gradebook.check_destination(args.csv)
        if problem:
            raise UsageError(problem, "give --csv a file in an existing folder", "fsdp-lab grade")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    missing = [str(p) for p in args.paths if not (p.exists() or p.is_symlink())]
    if missing:
        raise UsageError(
            f"no such file or folder: {', '.join(missing)}",
            "give the submitted files or their folder (e.g. nbgrader's submitted/)",
            "fsdp-lab grade",
        )
    try:
        graded = grading.grade_paths(
            args.paths, args.time_limit, args.only, progress,
            max_files=args.max_files_per_student, class_time_limit=args.class_time_limit,
        )  # fmt: skip
    except ValueError as exc:  # --only naming no exercise, a grader set-up it cannot use
        raise UsageError(str(exc), "see `fsdp-lab grade --help`", "fsdp-lab grade") from None
    except grading.GraderError as exc:  # the grader's own failure: no row blames a student
        raise Failed(
            str(exc),
            "grading stopped, no gradebook written: the reference solution itself failed on "
            "this machine (not a submission) — please report this line",
        ) from None
    results = graded["submissions"]
    if not args.json:  # first: the grades are on screen whatever happens to the CSV
        print(gradebook.text_report(results))
    if args.csv is not None:
        try:
            gradebook.write_csv(results, args.csv)
            print(f"gradebook CSV: {args.csv}", file=sys.stderr)
        except OSError as exc:  # a disk filled since the check: the grades are not lost
            shown = "the JSON on stdout" if args.json else "the table above"
            graded["gradebook_error"] = (
                f"the gradebook could not be written to {args.csv} ({exc.strerror or exc}); "
                f"every grade is in {shown}"
            )
            print(f"fsdp-lab grade: {graded['gradebook_error']}", file=sys.stderr)
    if graded["grader_errors"]:
        print(f"fsdp-lab grade: the grader failed on {graded['grader_errors']} file(s) (their "
              "rows say so): a bug in fsdp_lab, please report it", file=sys.stderr)  # fmt: skip
    return graded


def plan_command(args: argparse.Namespace) -> dict[str, Any]:
    """`fsdp-lab plan`: the planner; with --verify fake, one rank of the run on fake ranks."""
    from fsdp_lab.planning import plan, report

    where = "fsdp-lab plan"
    mesh = None
    if args.mesh is not None:
        try:
            mesh = tuple(int(x) for x in args.mesh.split(","))
        except ValueError:
            mesh = ()
        if len(mesh) != 2:
            nodes = max(1, args.gpus // args.gpus_per_node)
            example = f"e.g. --mesh {nodes},{args.gpus // nodes}"
            raise UsageError(f"--mesh {args.mesh!r}: expected R,S", example, where)
    if args.verify:
        print(
            f"{where}: running rank 0 of {args.gpus} on fake ranks ({args.model}, "
            f"{args.strategy}): the real-size model, no memory — seconds to a minute",
            file=sys.stderr,
            flush=True,
        )
    try:
        result = plan(
            args.model,
            args.gpus,
            args.gpus_per_node,
            args.gpu,
            args.strategy,
            mesh,
            args.precision,
            args.checkpoint,
            args.seq,
            args.micro_batch,
            args.verify,
            args.grad_accumulation,
            args.mfu,
        )
    except ValueError as exc:
        error, _, fix = str(exc).partition(". Fix: ")
        raise UsageError(error, fix or f"see `{where} --help`", where) from None
    if not args.json:
        print(report.summary(result))
    return result


def bugs_command(args: argparse.Namespace) -> dict[str, Any]:
    """`fsdp-lab bugs`: the bug gallery, each bug run beside the correct one."""
    from fsdp_lab.course import ClusterPool, gallery

    try:
        labs = gallery.check_labs(args.labs)
    except ValueError as exc:
        raise UsageError(str(exc), "see `fsdp-lab bugs --help`", "fsdp-lab bugs") from None
    if args.out is not None:
        check_out(args.out, "fsdp-lab bugs")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with ClusterPool() as pool:
        exhibits = gallery.run(pool, labs, progress)
    if not args.json:
        print(gallery.text_report(exhibits, detail=args.labs is not None))
    payload = {"bugs": [e.to_dict() for e in exhibits]}
    if args.out is not None:
        from fsdp_lab.plots import save_figure

        for e in exhibits:
            fig = gallery.figure(e)
            if fig is not None:
                save_figure(fig, args.out / f"{e.exercise}-{e.bug.slug}.png")
        write_file(args.out / "bugs.json", json.dumps(payload, indent=1))
        print(f"figures and bugs.json written to {args.out}/", file=sys.stderr)
    else:
        print(
            "nothing written to disk: --out DIR saves bugs.json and each bug's picture",
            file=sys.stderr,
        )
    return payload


# -- errors, stdout, exit codes ------------------------------------------------------------------


def _say(where: str, error: str, hint: str | None = None) -> None:
    print(f"{where}: {error}", file=sys.stderr)
    if hint:
        print(f"  hint: {hint}", file=sys.stderr)


def _rank_error(exc: BaseException) -> Any:
    # RankError lives in fsdp_lab.cluster (torch); if that was never imported, no rank ran.
    cluster = sys.modules.get("fsdp_lab.cluster")
    return exc if cluster is not None and isinstance(exc, cluster.RankError) else None


@contextlib.contextmanager
def device_chosen(device: str | None) -> Iterator[None]:
    """`--device`: every Cluster of this run places its ranks so (FSDP_LAB_DEVICE), then the
    environment is as it was."""
    before = os.environ.get(DEVICE_ENV)
    if device:
        os.environ[DEVICE_ENV] = device
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DEVICE_ENV, None)
        else:
            os.environ[DEVICE_ENV] = before


def _run(argv: list[str], ending: Ending) -> tuple[int, dict[str, Any]]:
    """Parse, validate, run; (exit code, the JSON payload: the result or the error object)."""
    where = "fsdp-lab"
    try:
        stale = forget_stale_launcher_env()
        if stale:
            kept = ", ".join(f"{k}={v!r}" for k, v in stale.items())
            print(f"fsdp-lab: ignoring {kept}: inherited from the shell, not set by a running "
                  "torchrun (unset them to silence this line)", file=sys.stderr)  # fmt: skip
        try:
            torchrun_rank()
        except ValueError as exc:
            raise usage_error(exc) from None
        check_lab_name(argv)
        args = build_parser().parse_args(argv)
        where = f"fsdp-lab {args.lab}"
        if getattr(args, "out", None) == "":  # not "no --out": an empty name is a mistake
            raise UsageError("--out '': an empty folder name", f"e.g. --out {DEFAULT_OUT}/")
        commands = {
            "tour": tour,
            "grade": grade_command,
            "bugs": bugs_command,
            "plan": plan_command,
        }
        with device_chosen(getattr(args, "device", None)):
            payload = commands.get(args.lab, one_lab)(args)
        failed = payload.get("grader_errors") or payload.get("gradebook_error")
        return (EXIT_FAILED if failed else 0), payload
    except UsageError as exc:
        _say(exc.where or where, exc.error, exc.hint)
        return EXIT_USAGE, {"error": exc.error, "hint": exc.hint}
    except Failed as exc:
        _say(where, exc.error, exc.hint)
        return EXIT_FAILED, {"error": exc.error, "hint": exc.hint}
    except KeyboardInterrupt:  # the cluster was closed on the way out (finally blocks)
        if ending.signum:  # SIGTERM, SIGHUP: the same clean-up, its own exit code
            said = f"ended by {ending.name}: ranks and sandboxes stopped, temporary files removed"
            print(f"fsdp-lab: {said}", file=sys.stderr)
            return 128 + ending.signum, {"error": said, "hint": "run it again to get a result"}
        print(f"fsdp-lab: {INTERRUPTED}", file=sys.stderr)
        return EXIT_INTERRUPTED, {"error": INTERRUPTED, "hint": "run it again to get a result"}
    except Exception as exc:
        failed = _rank_error(exc)
        if failed is not None:  # the summary first; the rank's own traceback under it
            error = f"rank {failed.rank}: {failed.message}"
            _say(where, error)
            if failed.remote_traceback:
                trace = failed.remote_traceback.rstrip()
                print(f"--- traceback on rank {failed.rank} ---\n{trace}", file=sys.stderr)
            hint = f"rank {failed.rank}'s traceback is on stderr, under the first line"
            return EXIT_FAILED, {"error": error, "hint": hint}
        traceback.print_exc()  # not the input: a bug in fsdp_lab, whose traceback helps
        error = f"internal error: {exc!r}"
        hint = "a bug in fsdp_lab, not in your options: please report it with the traceback"
        _say(where, error, hint)
        return EXIT_FAILED, {"error": error, "hint": hint}


def _wants_json(argv: list[str]) -> bool:
    # Decided before parsing, so that a parse error is reported as JSON too; argparse also
    # accepts an unambiguous prefix (--js).
    return any(len(a) >= 3 and "--json".startswith(a) for a in argv)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


@contextlib.contextmanager
def stdout_kept_for_json(enabled: bool) -> Iterator[Callable[[dict[str, Any]], None]]:
    """With --json, fd 1 belongs to the one JSON object alone.

    Rank processes inherit the driver's fd 1, and C code writes to it below Python's
    sys.stdout: a redirect in Python cannot stop them. So, before anything starts, keep a
    private duplicate of fd 1 for the JSON and point fd 1 itself at stderr; whatever anyone
    writes to fd 1 then lands on stderr. Yields the function that writes the JSON object.
    """
    if not enabled:
        yield lambda payload: None
        return
    python_stdout = sys.stdout
    python_stdout.flush()
    private = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # print() in order with stderr's lines
            yield lambda payload: _write_all(private, (json.dumps(payload) + "\n").encode())
    finally:
        python_stdout.flush()  # what was buffered for fd 1 goes where fd 1 pointed: stderr
        os.dup2(private, 1)
        os.close(private)


def main(argv: list[str] | None = None) -> int:
    """``fsdp-lab``: returns the exit code (0 done, 1 failed, 2 wrong input, 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = _wants_json(argv)
    with stdout_kept_for_json(as_json) as write_json, ended_like_ctrl_c() as ending:
        code, payload = _run(argv, ending)
        if as_json and _is_main_process():
            write_json(payload)
    return code
