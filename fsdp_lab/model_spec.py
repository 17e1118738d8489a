"""``--model module:factory``: load the factory, and check its contract (docs/cli.md) before sharding.

The contract: ``factory()``, called with no arguments, returns a `torch.nn.Module` that maps a
LongTensor of token ids ``(batch, seq)`` to a tensor of logits ``(batch, seq, vocab)``; the labs
train it with next-token cross-entropy on synthetic tokens drawn below ``vocab``.

Where ``vocab`` comes from, in this order (`vocab_size_of`, the one place that reads it):

    1. ``model.vocab_size``           our models, nanoGPT, torchtitan-style models
    2. ``model.config.vocab_size``    Hugging Face models (and `PipeGPT`)
    3. the last dim of the logits     any model: `check_forward` measures it on a probe batch

A library model that returns an *output object* (Hugging Face's ``CausalLMOutput``) is wrapped
in three lines; the wrapper has neither 1. nor 2., so its vocab is read from its logits::

    class Logits(nn.Module):
        def __init__(self, inner): super().__init__(); self.inner = inner
        def forward(self, x): return self.inner(x).logits

[Note: a real forward on CPU, not on meta] The check builds the model for real and runs one
forward on a tiny batch (2 sequences of `SEQ_LEN` tokens). On the meta device it would cost
nothing at any size, but it would also reject models that train fine — anything that reads a
value (``.item()``, a mask test, an init function without a meta kernel, a factory that loads
weights) fails on meta. The ranks build the model whole anyway, and the shard lab's
single-process reference builds it on this same CPU, so the check adds no new kind of cost.
It runs twice: on the driver before any rank starts (`check_model_apart`: `check_model` in a
child process under a time limit, so a module or factory that exits the process or never returns
is one line and exit code 2 too), and on rank 0 before anything is sharded (`check_on_rank0`:
the model where it really trains — its device, its process). Each check uses a model built for it alone and
thrown away, under a forked RNG, so nothing it does reaches the lab's numbers.

``module`` is imported as ``python -m`` would: the current directory comes first on
``sys.path``, on the driver and on the ranks (which start in the driver's directory), so a
``mymodel.py`` beside you works without ``PYTHONPATH=.``.

Loading is torch-free (the config modules import this one for ``fsdp-lab --help``); the checks
import torch, only when a lab is about to run.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXAMPLE = "fsdp_lab.models:tiny_gpt"
SEQ_LEN = 16  # tokens per probe sequence: what `reference.train_steps` trains on by default
PROBE_BATCH = 2
VOCAB_ORDER = "model.vocab_size, else model.config.vocab_size, else the logits' last dim"
WRAPPER_FIX = (
    "return the logits tensor, or wrap the model in a module whose forward returns "
    "self.inner(x).logits (the three-line `Logits` wrapper in docs/cli.md, section --model)"
)


# -- loading ----------------------------------------------------------------------------------


def _current_directory_importable() -> None:
    """Put the current directory first on sys.path unless it is there already (`python -m`)."""
    cwd = os.getcwd()
    if cwd not in {os.path.abspath(p) for p in sys.path}:  # "" and "." are the cwd too
        sys.path.insert(0, cwd)


def _not_found(spec: str, module_name: str, exc: ModuleNotFoundError) -> ValueError:
    """A typo in the module name: say where we looked, and a close match from the cwd."""
    here = [p.stem for p in Path.cwd().glob("*.py")] + [
        p.parent.name for p in Path.cwd().glob("*/__init__.py")
    ]
    top = module_name.split(".")[0]
    close = difflib.get_close_matches(top, here, n=1)
    guess = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(
        f"--model {spec!r}: no module named {exc.name!r} in the current directory "
        f"({os.getcwd()}) or on sys.path{guess}. Fix: a module file beside you or an installed "
        f"one, and a factory in it, e.g. --model {EXAMPLE}"
    )


MODEL_SEED = 0  # torch's seed before every build of a --model
CHECK_SECONDS = 120.0  # the driver's check of a --model: import, build, one forward


def _seeded(factory: Callable[..., Any]) -> Callable[..., Any]:
    """`factory`, called after ``torch.manual_seed(MODEL_SEED)``: every rank and the
    single-process reference build the same weights, also from a factory that does not seed
    (PyTorch's layers draw their init from the global generator). Without it, each rank of an
    unseeded factory started from its own weights and the labs compared different models."""

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
        import torch  # here: the configs import this module and stay torch-free

        torch.manual_seed(MODEL_SEED)
        return factory(*args, **kwargs)

    return build


def load_factory(spec: str) -> Callable[[], Any]:
    """``"package.module:factory"`` -> the factory, seeded (`_seeded`), or a ValueError naming
    what failed."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"--model {spec!r}: expected 'module:factory'. Fix: e.g. --model {EXAMPLE}"
        )
    _current_directory_importable()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name or module_name.startswith(f"{exc.name}."):  # the spec's own
            raise _not_found(spec, module_name, exc) from exc
        raise ValueError(  # an import inside the user's module failed
            f"--model {spec!r}: importing {module_name!r} failed: {exc}. "
            "Fix: install what it imports, or fix the import"
        ) from exc
    except Exception as exc:  # a syntax error, or the module raising while it is imported
        raise ValueError(
            f"--model {spec!r}: importing {module_name!r} raised {_one_line(exc)}. "
            f"Fix: `python -c 'import {module_name}'` shows where"
        ) from exc
    try:
        return _seeded(getattr(module, attr))
    except AttributeError as exc:
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        guess = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"--model {spec!r}: cannot load {attr!r} from {module_name!r} (it has no such "
            f"name{guess}). Fix: an importable module and a name in it, e.g. --model {EXAMPLE}"
        ) from exc


def _one_line(exc: BaseException) -> str:
    """``RuntimeError('its first line')``: an exception's repr, cut to one line."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}({first!r})"


# -- the vocabulary -----------------------------------------------------------------------------


def declared_vocab(model: Any) -> tuple[int, str] | None:
    """(vocab, where it was read) from 1. or 2. of the module docstring's order, else None."""
    for where, owner, attr in (
        ("model.vocab_size", model, "vocab_size"),
        ("model.config.vocab_size", getattr(model, "config", None), "vocab_size"),
    ):
        value = getattr(owner, attr, None) if owner is not None else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{where} of the {type(model).__name__} is {value!r}, expected an int >= 1 "
                f"(the labs draw token ids below it). Fix: set it to the number of tokens"
            )
        return value, where
    return None


def vocab_size_of(model: Any, logits: Any = None) -> int:
    """The vocabulary the labs draw token ids below: ``model.vocab_size``, else
    ``model.config.vocab_size``, else ``logits.shape[-1]`` (when `logits` is given)."""
    found = declared_vocab(model)
    if found is not None:
        return found[0]
    if logits is not None:
        return int(logits.shape[-1])
    raise ValueError(
        f"cannot tell the vocabulary of the {type(model).__name__}: it has no vocab_size and "
        f"no config.vocab_size (read in this order: {VOCAB_ORDER}). Fix: set self.vocab_size "
        "in its __init__, or pass vocab_size= (the last dim of its logits)"
    )


# -- the checks ---------------------------------------------------------------------------------


def check_forward(model: Any, spec: str, seq_len: int = SEQ_LEN) -> int:
    """One forward on a probe batch; the vocab if the output is logits ``(batch, seq, vocab)``.

    The probe is ``PROBE_BATCH`` sequences of `seq_len` token ids on the model's device, the
    highest id ``vocab - 1`` included (an embedding smaller than the declared vocab fails here);
    all zeros when the vocab is to be read from the logits. Run on a model built for the check:
    a forward may change buffers (running statistics, caches).
    """
    import torch

    declared = declared_vocab(model)
    param = next(model.parameters(), None)
    on = param.device if param is not None else torch.device("cpu")
    shape = (PROBE_BATCH, seq_len)
    if declared is not None:
        tokens = torch.arange(PROBE_BATCH * seq_len, device=on).remainder(declared[0])
        tokens[-1] = declared[0] - 1
        tokens = tokens.view(shape)  # (B, T)
        ids = f"values < {declared[0]} ({declared[1]})"
    else:
        tokens = torch.zeros(shape, dtype=torch.long, device=on)
        ids = "all 0: no model.vocab_size, no config.vocab_size, so the logits will tell"
    what = f"--model {spec!r}: the {type(model).__name__}'s forward"
    try:
        with torch.no_grad():
            out = model(tokens)
    except Exception as exc:
        raise ValueError(
            f"{what} raised {_one_line(exc)} on token ids of shape {shape} (int64, {ids}). "
            "Fix: make it map a LongTensor of token ids (batch, seq), each < vocab, to logits "
            "(batch, seq, vocab)"
        ) from exc
    size, source = declared if declared is not None else ("vocab", "the logits' last dim")
    expected = (
        f"a tensor of logits (batch, seq, vocab) = ({PROBE_BATCH}, {seq_len}, {size}), "
        f"vocab read from {source}"
    )
    if not isinstance(out, torch.Tensor):
        has_logits = isinstance(getattr(out, "logits", None), torch.Tensor)
        kind = type(out).__name__ + (" (an output object with .logits)" if has_logits else "")
        fix = WRAPPER_FIX if has_logits else "return the logits tensor itself"
        raise ValueError(f"{what} returned {kind}, expected {expected}. Fix: {fix}")
    if out.ndim != 3 or tuple(out.shape[:2]) != shape or not out.is_floating_point():
        raise ValueError(
            f"{what} returned a {out.dtype} tensor of shape {tuple(out.shape)}, expected "
            f"{expected} (floating point). Fix: return one score per token of the vocabulary "
            "at every position"
        )
    if declared is not None and out.shape[-1] != declared[0]:
        raise ValueError(
            f"{what} returned logits with {out.shape[-1]} scores per position, but "
            f"{declared[1]} is {declared[0]} (the vocab is read as {VOCAB_ORDER}). Fix: make "
            f"{declared[1]} the logits' last dim"
        )
    return vocab_size_of(model, out)


def _check_and_send(spec: str, conn: Any) -> None:
    """In the child: check, and say how it went (any exception, SystemExit included)."""
    try:
        answer: list[Any] = ["ok", check_model(spec)]
    except ValueError as exc:
        answer = ["error", str(exc)]
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: the module's own doing
        answer = ["error", f"--model {spec!r}: checking it raised {_one_line(exc)}. Fix: the "
                  "module and its factory must return, not end the process"]  # fmt: skip
    conn.send(json.dumps(answer))


@functools.cache  # the tour asks once per lab that takes --model
def check_model_apart(spec: str, timeout: float | None = None) -> int:
    """`check_model(spec)` in a child process: its vocab, or a ValueError — also when importing
    the module, building or running the model exits the process (``sys.exit``, ``os._exit``)
    or does not return within `timeout` seconds (default `CHECK_SECONDS`; the child is then
    killed). The child is forked from the ranks' fork server (torch imported, no threads: a
    fork of this process could deadlock on a lock another thread holds)."""
    from fsdp_lab.cluster import launcher

    timeout = CHECK_SECONDS if timeout is None else timeout
    ours, theirs = launcher.pipe()
    child = launcher.start_process(_check_and_send, (spec, theirs), name="fsdp_lab-model-check")
    theirs.close()
    try:
        answered = ours.poll(timeout)
        data = ours.recv() if answered else None
    except EOFError:  # the child ended without a word
        data = None
    finally:
        if child.is_alive() and data is None:
            child.kill()
        child.join(5.0)
        ours.close()
    if not answered:
        raise ValueError(
            f"--model {spec!r}: importing, building or running the model did not finish within "
            f"{timeout:g} s. Fix: `python -c 'import {spec.partition(':')[0]}'` and calling the "
            "factory should return in seconds (a loop that never ends? input()?)"
        )
    if data is None:
        raise ValueError(
            f"--model {spec!r}: importing or building the model ended the process (exit status "
            f"{child.exitcode}) instead of returning a model. Fix: remove sys.exit / os._exit "
            "from the module and its factory"
        )
    kind, value = json.loads(data)
    if kind == "error":
        raise ValueError(value)
    return int(value)


def check_model(spec: str, device: Any = "cpu", seq_len: int = SEQ_LEN) -> int:
    """Load `spec`, build its model on `device`, check it with one forward; its vocab.

    ValueError (one line, then ``Fix: ...``) if any step breaks the contract. The model is
    thrown away, and the RNG is as it was (the factory and the forward may draw from it).
    """
    import torch

    factory = load_factory(spec)
    module, _, name = spec.partition(":")
    if not callable(factory):
        raise ValueError(
            f"--model {spec!r}: {type(factory).__name__} {factory!r} is not callable. "
            f"Fix: name a function that returns the model, e.g. --model {EXAMPLE}"
        )
    device = torch.device(device)
    gpus = []  # whose RNG fork_rng saves and restores besides the CPU's
    if device.type == "cuda":
        gpus = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=gpus):
        try:
            model = factory()
        except Exception as exc:
            raise ValueError(
                f"--model {spec!r}: the factory raised {_one_line(exc)} when called with no "
                f"arguments. Fix: make it build the model with no arguments; `python -c 'import "
                f"{module}; {module}.{name}()'` shows the traceback"
            ) from exc
        if not isinstance(model, torch.nn.Module):
            raise ValueError(
                f"--model {spec!r}: the factory returned {type(model).__name__}, expected a "
                "torch.nn.Module. Fix: return the model itself"
            )
        meta = [name for name, p in model.named_parameters() if p.is_meta]
        if meta:
            raise ValueError(
                f"--model {spec!r}: the factory returned a {type(model).__name__} whose "
                f"parameter {meta[0]!r} (and {len(meta) - 1} more) is on the meta device: no "
                "values to train. Fix: build it with values (each rank trains what factory() "
                "returns)"
            )
        return check_forward(model.to(device), spec, seq_len)


def check_on_rank0(spec: str) -> int | None:
    """For `cluster.run`, before anything is sharded: rank 0 checks the model on its own
    device and in its own process; returns the vocab there, None on the other ranks."""
    from fsdp_lab.cluster import device, rank

    return check_model(spec, device()) if rank() == 0 else None
