"""Check, in compiled HLO text, that the weave schedule overlaps communication with GEMMs.

``overlap_report(compiled_text)`` pairs each ``allreduce_rmsnorm_start`` with its ``done`` (by
workspace slot, in schedule order) and lists the GEMMs scheduled between them. Target names come
from ``kernel._ffi.TARGETS``. How the text is walked and what counts as a GEMM:
docs/PACKAGE.md#harnesshlo_check.
"""

from __future__ import annotations

import dataclasses
import re

from jax_tokenweave.kernel._ffi import TARGETS

START_TARGET = TARGETS["allreduce_rmsnorm_start"]
DONE_TARGET = TARGETS["allreduce_rmsnorm_done"]
SYNC_TARGET = TARGETS["allreduce_rmsnorm"]

_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition)=(\{[^}]*\}|%?[\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_SLOT = re.compile(r"\bslot\s*=\s*(-?\d+)")
_SHAPE = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")
_GEMM_TARGET = re.compile(r"^__(cublas|cudnn)")
_GEMM_FUSION = re.compile(r"__triton_gemm|__cudnn\$|__cublas")


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction in (flattened) schedule order."""

    name: str
    opcode: str
    shape: tuple[int, ...]  # first array shape of the result ([] for none)
    target: str | None  # custom_call_target
    slot: int | None  # ``slot = N`` in the backend config
    gemm: bool
    text: str


@dataclasses.dataclass(frozen=True)
class OverlapPair:
    """A start/done pair of the fused kernel and the GEMMs scheduled between them."""

    slot: int | None
    start: int  # index of the start in the flattened schedule
    done: int  # index of the done
    rows: int | None  # tokens of the start's call (leading dim of its first result, normed)
    gemms: tuple[Instr, ...]

    @property
    def overlapped(self) -> bool:
        return bool(self.gemms)

    def gemm_dims(self) -> set[int]:
        """Every dimension of the GEMMs' result shapes (to see which half's rows they have)."""
        return {d for g in self.gemms for d in g.shape}

    def describe(self) -> str:
        shapes = ", ".join(f"{g.opcode}{list(g.shape)}" for g in self.gemms) or "none"
        return (
            f"slot {self.slot} start #{self.start} (rows {self.rows}) -> done #{self.done}: "
            f"{len(self.gemms)} GEMM(s) between: {shapes}"
        )


def _shape(text: str) -> tuple[int, ...]:
    m = _SHAPE.search(text)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def _split_type(rest: str) -> tuple[str, str]:
    """``rest`` = ``TYPE OPCODE(OPERANDS), attrs``: returns (TYPE, the remainder)."""
    rest = rest.strip()
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].strip()
    head, _, tail = rest.partition(" ")
    return head, tail.strip()


def parse_instr(line: str) -> Instr | None:
    """Parse one instruction line of HLO text (None for anything else)."""
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.groups()
    type_text, remainder = _split_type(rest)
    opcode, paren, _ = remainder.partition("(")
    if not paren or not re.fullmatch(r"[\w\-]+", opcode.strip()):
        return None
    opcode = opcode.strip()
    target_m = _TARGET.search(line)
    target = target_m.group(1) if target_m else None
    slot_m = _SLOT.search(line) if target in (START_TARGET, DONE_TARGET, SYNC_TARGET) else None
    gemm = (
        opcode == "dot"
        or (opcode == "custom-call" and target is not None and bool(_GEMM_TARGET.match(target)))
        or (opcode == "fusion" and bool(_GEMM_FUSION.search(line)))
    )
    return Instr(
        name,
        opcode,
        _shape(type_text),
        target,
        int(slot_m.group(1)) if slot_m else None,
        gemm,
        line.strip(),
    )


def computations(text: str) -> tuple[str | None, dict[str, list[str]]]:
    """``(entry name, {computation name: instruction lines})`` of an HLO module's text."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("(")[0]:
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None and line.strip():
            comps[current].append(line)
    return entry, comps


def schedule(text: str) -> list[Instr]:
    """The entry computation's instructions in order, called computations expanded in place
    (a fusion's body comes before the fusion itself; a GEMM fusion whose body has a ``dot``
    counts once: the body's ``dot`` is dropped)."""
    entry, comps = computations(text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    out: list[Instr] = []

    def walk(comp: str, depth: int) -> None:
        if depth > 64:
            raise ValueError("HLO calls nest too deep")
        for line in comps.get(comp, []):
            instr = parse_instr(line)
            if instr is None:
                continue
            mark = len(out)
            for group in _CALLED.findall(line):
                for callee in group.strip("{}").split(","):
                    callee = callee.strip().lstrip("%")
                    if callee in comps:
                        walk(callee, depth + 1)
            if instr.gemm and any(i.gemm for i in out[mark:]):
                # the fusion/call already contributed its GEMM(s): keep those, not a duplicate
                out.append(dataclasses.replace(instr, gemm=False))
            else:
                out.append(instr)

    walk(entry, 0)
    return out


def overlap_report(compiled_text: str) -> list[OverlapPair]:
    """Start/done pairs of the fused kernel in ``compiled_text`` and the GEMMs between each
    (module docstring). Raises ``ValueError`` on a done without a start or a start never done."""
    instrs = schedule(compiled_text)
    open_: dict[int | None, list[int]] = {}
    pairs: list[OverlapPair] = []
    for i, ins in enumerate(instrs):
        if ins.target == START_TARGET:
            open_.setdefault(ins.slot, []).append(i)
        elif ins.target == DONE_TARGET:
            pending = open_.get(ins.slot)
            if not pending:
                raise ValueError(f"done on slot {ins.slot} at #{i} has no start before it")
            s = pending.pop(0)
            start = instrs[s]
            pairs.append(
                OverlapPair(
                    ins.slot,
                    s,
                    i,
                    start.shape[0] if start.shape else None,
                    tuple(g for g in instrs[s + 1 : i] if g.gemm),
                )
            )
    left = {slot: idx for slot, idx in open_.items() if idx}
    if left:
        raise ValueError(f"starts never done: {left}")
    return sorted(pairs, key=lambda p: p.start)


def count_targets(compiled_text: str) -> dict[str, int]:
    """How many start, done and synchronous fused calls the schedule holds."""
    counts = {"start": 0, "done": 0, "sync": 0}
    names = {START_TARGET: "start", DONE_TARGET: "done", SYNC_TARGET: "sync"}
    for ins in schedule(compiled_text):
        if ins.target in names:
            counts[names[ins.target]] += 1
    return counts


def overlap_problems(compiled_text: str, *, allow_unoverlapped: int = 1) -> list[str]:
    """What is wrong with the overlap ([] when fine): a start/done pair with no GEMM between,
    beyond the last ``allow_unoverlapped`` pairs (the stack's last fused call has nothing left
    to hide behind), or no pair at all."""
    pairs = overlap_report(compiled_text)
    if not pairs:
        return ["no allreduce_rmsnorm start/done pair in the compiled HLO"]
    head = pairs[: len(pairs) - allow_unoverlapped] if allow_unoverlapped else pairs
    return [f"serialised: {p.describe()}" for p in head if not p.overlapped]
