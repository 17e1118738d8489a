"""Build any size on the meta device, then give every rank the same values without talking.

A model built under ``torch.device("meta")`` has every shape and no storage: building
Llama-3-70B's shape costs its module and Parameter objects, not its parameters' bytes — plus,
the first time in a process, PyTorch's import of torch._dynamo that ``normal_`` on meta
triggers; `build_on_meta` skips init fills on meta (`fsdp_lab.meta_init.meta_device`) and so never pays
it. Lab 04 measures the 70B build in a fresh process (``fsdp-lab meta-init``);
``python benchmarks/bench_meta_init.py`` sets the plain build, this one and accelerate's
``init_empty_weights`` side by side. Left to do — torchtitan's ``to_empty`` + ``init_weights``, FSDP's ``param_init_fn`` — is to
materialise only each rank's shard and initialise it so that all ranks agree.

Ordinary init cannot do that shard by shard: ``manual_seed(s); kaiming_uniform_(w)`` draws
from one sequential stream, so a rank that initialises only its rows gets the *first* rows'
values, and a shard along dim 1 even gets a wider bound (lab 04 measures both). FSDP1's fix
is ``sync_module_states``: every rank initialises each unit whole, then rank 0's values are
broadcast over the others' (``shard(sync_module_states=True)`` here: rank 0 alone initialises).
The fix here is counter-based (Salmon et al. 2011, "Parallel random numbers: as easy as 1,
2, 3", the idea behind Philox and JAX's PRNG): `DeterministicInit` makes element i of
parameter `name` a pure function of (seed, name, i), so any rank computes any slice alone:

    k0, k1 = mix(seed, crc32(name), stream)      the *full* name: "layers.3.attention.wq.weight"
    bits   = mix(mix(low32(i) ^ k0) ^ high32(i) ^ k1) >> 8     mix = the lowbias32 hash
    uniform: bits / 2**24 in [0, 1);   normal: Box-Muller, radius from stream 0, angle from 1

A tied parameter goes by the name `named_parameters()` gives it first. Values are computed in
float64 with +, -, *, / and sqrt only (Box-Muller's log and cos are short series here), all
exactly rounded under IEEE 754, then rounded to float32, then to `dtype`: a value does not
depend on how [0, numel) is split, on the chunking or on vector widths. ``torch.log`` would
not do: its vectorised body and scalar tail may differ in the last bit. Normal tails end at
5.8 sigma (24-bit u1).

`param_shard` cuts the other way, one parameter at a time: a rank's equal piece of it, padded
(DeepSpeed ZeRO-3's partition of a parameter), generated alone; `init_param_shards` asks it for
every parameter of a meta model.

Speed: several integer hashes and float64 operations per element, so a CPU core generates
fewer elements per second than PyTorch's sequential ``uniform_`` does, and the ranks split the
work. ``python benchmarks/bench_meta_init.py`` measures elements per second (uniform, normal,
and PyTorch's own fills beside them) on the machine it runs on. Every step is elementwise, so on
a GPU it runs as plain elementwise kernels.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fsdp_lab.meta_init.meta_device import meta_device

# -- what a meta model is, and what it would cost ---------------------------------------------


def meta_summary(model: nn.Module) -> dict[str, Any]:
    """Parameters (a tied one once) and bytes by dtype, buffer bytes, module count.

    Reads only shapes and dtypes, so it works on meta: nothing is allocated or touched.
    """
    by_dtype: dict[str, dict[str, int]] = {}
    for p in model.parameters():  # deduplicated by identity: a tied Parameter counts once
        entry = by_dtype.setdefault(str(p.dtype).removeprefix("torch."), {"parameters": 0})
        entry["parameters"] += p.numel()
        entry["bytes"] = entry.get("bytes", 0) + p.numel() * p.element_size()
    unique = sum(1 for _ in model.parameters())
    names = sum(1 for _ in model.named_parameters(remove_duplicate=False))
    buffers = list(model.buffers())
    return {
        "parameters": sum(d["parameters"] for d in by_dtype.values()),
        "parameter_bytes": sum(d["bytes"] for d in by_dtype.values()),
        "by_dtype": by_dtype,
        "parameter_tensors": unique,
        "shared_names": names - unique,  # names that alias an already counted Parameter
        "buffers": sum(b.numel() for b in buffers),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in buffers),
        "modules": sum(1 for _ in model.modules()),
        "devices": sorted({str(t.device) for t in [*model.parameters(), *buffers]}),
    }


def build_on_meta(
    factory: Callable[[], nn.Module], skip_init: bool = True
) -> tuple[nn.Module, float]:
    """``factory()`` on the meta device, and the seconds it took (perf_counter).

    With `skip_init` (`fsdp_lab.meta_init.meta_device`), init fills are no-ops on meta: the same model,
    without PyTorch's one-time import of torch._dynamo; ``skip_init=False`` is a plain
    ``with torch.device("meta")`` build.
    """
    start = time.perf_counter()
    with meta_device(skip_init):
        model = factory()
    return model, time.perf_counter() - start


# -- counter-based deterministic init ---------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D  # lowbias32's multipliers (Wellons, hash-prospector)
# 0x846CA68B > 2**31 would overflow int64 when multiplied by a 32-bit value (undefined in C++);
# minus 2**32 it is the same number mod 2**32 and |M2| < 2**31, so the product stays in range
# and `& _MASK32` (two's complement) gives the exact low 32 bits.
_M2 = 0x846CA68B - (1 << 32)
_LOG_SERIES = [2.0 / (2 * k + 1) for k in range(7)]  # ln m = sum 2 s^(2k+1)/(2k+1)
_COS_SERIES = [(-1) ** k / math.factorial(2 * k) for k in range(9)]  # Taylor, to x^16


def _mix32(x: Any) -> Any:
    """lowbias32, a bijection on 32-bit values; an int64 tensor or a Python int in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def _horner(x: torch.Tensor, coefficients: list[float]) -> torch.Tensor:
    acc = torch.full_like(x, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        acc = acc * x + c  # two exactly rounded ops (no fused multiply-add)
    return acc


def _log_of_24bit(k: torch.Tensor) -> torch.Tensor:
    """ln(k / 2**24) in float64 for integers k in [1, 2**24]."""
    mant, exp = torch.frexp(k.to(torch.float64))  # exact: k = mant * 2**exp, mant in [.5, 1)
    low = mant < math.sqrt(0.5)
    mant = torch.where(low, mant * 2, mant)  # now in [sqrt(.5), sqrt(2)): |s| <= 0.172 below
    exp = (exp - low.to(exp.dtype) - 24).to(torch.float64)
    s = (mant - 1) / (mant + 1)
    return s * _horner(s * s, _LOG_SERIES) + exp * math.log(2.0)


def _cos_of_24bit(m: torch.Tensor) -> torch.Tensor:
    """cos(2 pi m / 2**24) in float64 for integers m in [0, 2**24): the quadrant from the top
    two bits (exact), then a series on [0, pi/2]."""
    quadrant = m >> 22
    x = (m & 0x3FFFFF).to(torch.float64) * (math.pi / 2 / 2**22)
    x = torch.where((quadrant & 1).bool(), math.pi / 2 - x, x)  # cos(pi/2 + x) = -cos(pi/2 - x)
    sign = torch.where((quadrant == 1) | (quadrant == 2), -1.0, 1.0).to(torch.float64)
    return sign * _horner(x * x, _COS_SERIES)


@dataclass(frozen=True)
class DeterministicInit:
    """Any slice of any parameter from (seed, name, index) alone: ranks agree without talking.

    Args:
        seed: the global seed (0 <= seed < 2**64).
        embedding_std: std of embedding weights. 1.0 is `nn.Embedding`'s default, so a model
            filled here is distributed like one built ordinarily (GPT-2 style labs use 0.02).
        chunk_elements: elements generated per step (bounds the int64 temporaries, 8 bytes
            an element, several alive at once); it changes no value, only the speed.
    """

    seed: int = 0
    embedding_std: float = 1.0
    chunk_elements: int = 1 << 16  # 512 KB of int64: stays in cache, no page faults

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: expected an int")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed={self.seed}: expected 0 <= seed < 2**64")
        if not isinstance(self.chunk_elements, int) or self.chunk_elements < 1:
            raise ValueError(f"chunk_elements={self.chunk_elements!r}: expected an int >= 1")

    def rule(self, name: str, shape: tuple[int, ...]) -> tuple[str, float, float]:
        """(kind, a, b): ("uniform", low, high), ("normal", mean, std) or ("constant", v, 0).

        The intent of PyTorch's defaults, read from the name and shape: a bias -> zeros; any
        1-D weight (RMSNorm/LayerNorm gains) -> ones; an embedding ("emb" in its module's
        name, or wte/wpe) -> normal(0, embedding_std); any other 2-D+ weight -> nn.Linear's
        kaiming_uniform_(a=sqrt(5)), i.e. uniform(+-1/sqrt(fan_in)), fan_in = shape[1] *
        prod(shape[2:]). Unlike nn.Linear, biases start at zero.
        """
        owner, _, leaf = name.rpartition(".")
        module = owner.rpartition(".")[2]
        if leaf.endswith("bias"):
            return ("constant", 0.0, 0.0)
        if len(shape) == 0:
            raise ValueError(f"{name!r} is a 0-d parameter: no default rule; initialise it by hand")
        if len(shape) == 1:
            return ("constant", 1.0, 0.0)
        if "emb" in module or module in ("wte", "wpe"):
            return ("normal", 0.0, float(self.embedding_std))
        fan_in = math.prod(shape[1:])
        bound = 1.0 / math.sqrt(fan_in) if fan_in else 0.0
        return ("uniform", -bound, bound)

    def _keys(self, name: str, stream: int) -> tuple[int, int]:
        k = _mix32((self.seed & _MASK32) ^ _mix32(self.seed >> 32))
        # crc32, not hash(): Python salts str hashes per process, ranks would disagree.
        k = _mix32(k ^ zlib.crc32(name.encode()))
        return _mix32(k ^ (2 * stream + 1)), _mix32(k ^ (2 * stream + 2))

    @staticmethod
    def _bits24(idx: torch.Tensor, keys: tuple[int, int]) -> torch.Tensor:
        x = _mix32((idx & _MASK32) ^ keys[0])
        return _mix32(x ^ (idx >> 32) ^ keys[1]) >> 8  # (n,) int64 in [0, 2**24)

    def fill_slice_(
        self, out: torch.Tensor, name: str, shape: tuple[int, ...], start: int
    ) -> torch.Tensor:
        """Write elements [start, start + out.numel()) of the flattened (C-order) parameter
        `name` of `shape` into the 1-D tensor `out`, chunk by chunk; returns `out`."""
        if out.dim() != 1:
            raise ValueError(f"out must be 1-D (a flat slice), got shape {tuple(out.shape)}")
        end = start + out.numel()
        self._check(name, shape, start, end, out.dtype)
        kind, a, b = self.rule(name, tuple(shape))
        with torch.no_grad():
            if out.is_meta:  # shapes only: nothing to write
                return out
            if kind == "constant":
                return out.fill_(a)
            keys = [self._keys(name, stream) for stream in (0, 1)]
            for lo in range(start, end, self.chunk_elements):
                hi = min(lo + self.chunk_elements, end)
                idx = torch.arange(lo, hi, dtype=torch.int64, device=out.device)
                if kind == "uniform":
                    u = self._bits24(idx, keys[0]).to(torch.float64) * 2.0**-24  # [0, 1)
                    v = u * (b - a) + a
                else:  # Box-Muller: radius from stream 0 (u1 in (0, 1]), angle from stream 1
                    log_u1 = _log_of_24bit(self._bits24(idx, keys[0]) + 1)
                    z = torch.sqrt((log_u1 * -2.0).clamp_min(0.0)) * _cos_of_24bit(
                        self._bits24(idx, keys[1])
                    )
                    v = z * b + a
                out[lo - start : hi - start] = v.to(torch.float32)  # then rounded to out.dtype
        return out

    def values(
        self,
        name: str,
        shape: tuple[int, ...],
        start: int,
        end: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """Elements [start, end) of parameter `name` flattened: a 1-D tensor of end - start.

        ``values(n, s, 0, 10)`` equals ``cat(values(n, s, 0, 4), values(n, s, 4, 10))``
        bitwise. In `dtype`, a value is the float32 value rounded once more.
        """
        self._check(name, shape, start, end, dtype)
        out = torch.empty(end - start, dtype=dtype, device=device)
        return self.fill_slice_(out, name, shape, start)

    def init_module_(self, module: nn.Module, prefix: str = "") -> nn.Module:
        """Fill every parameter of a materialised module in full: the single-process reference.

        `prefix` makes the names those of the whole model (``init_module_(block, "layers.3")``).
        """
        for name, p in module.named_parameters(prefix=prefix):
            if p.is_meta:
                raise ValueError(
                    f"parameter {name!r} is on the meta device: materialise it first "
                    "(module.to_empty(device=...)), or fill this rank's shard with values()"
                )
            with torch.no_grad():
                if p.is_contiguous():
                    self.fill_slice_(p.view(-1), name, tuple(p.shape), 0)
                else:
                    p.copy_(self.values(name, tuple(p.shape), 0, p.numel(), p.dtype, p.device))
        return module

    @staticmethod
    def _check(name: str, shape: tuple[int, ...], start: int, end: int, dtype: torch.dtype) -> None:
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"{name!r}: shape={tuple(shape)!r} must be ints >= 0")
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, end)):
            raise ValueError(f"{name!r}: start={start!r}, end={end!r} must be int indices")
        if not 0 <= start <= end:
            raise ValueError(f"{name!r}: [{start}, {end}) is not a range: need 0 <= start <= end")
        if end > math.prod(shape):
            raise ValueError(
                f"{name!r} of shape {tuple(shape)} has {math.prod(shape)} elements, end={end} "
                "is past it: clip the last shard to numel (FSDP's padding is zeros, not values)"
            )
        if not dtype.is_floating_point:
            raise ValueError(f"{name!r}: dtype={dtype} is not a floating-point dtype")


# -- one rank's piece of each parameter, generated alone ------------------------------------------


def param_shard(
    init: DeterministicInit, name: str, shape: tuple[int, ...], rank: int, world_size: int
) -> torch.Tensor:
    """Rank `rank`'s piece of parameter `name`: the parameter flattened, zero-padded to a
    multiple of `world_size` and cut in equal pieces (DeepSpeed ZeRO-3's partition of one
    parameter; FSDP's flat layout of a one-parameter unit). A (ceil(numel / N),) float32 tensor,
    of which only this rank's elements are generated — the whole parameter never exists."""
    numel = math.prod(shape)
    per = -(-numel // world_size)
    start, end = min(rank * per, numel), min(rank * per + per, numel)
    out = torch.zeros(per)  # the padding (past numel, on the last ranks) stays zero
    init.fill_slice_(out[: end - start], name, tuple(shape), start)
    return out


SliceFn = Callable[[DeterministicInit, str, tuple[int, ...], int, int], torch.Tensor]


def init_param_shards(
    model: nn.Module,
    init: DeterministicInit,
    rank: int,
    world_size: int,
    slice_fn: SliceFn = param_shard,
) -> dict[str, torch.Tensor]:
    """This rank's piece of every parameter of `model` (a tied one once, by its first name),
    from `slice_fn` (course mode passes a learner's `param_shard`). Reads names and shapes only:
    `model` may be on meta. No communication: every rank computes its own pieces."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is not in [0, world_size={world_size})")
    return {
        name: slice_fn(init, name, tuple(p.shape), rank, world_size)
        for name, p in model.named_parameters()
    }
