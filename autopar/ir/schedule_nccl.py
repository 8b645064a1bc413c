"""NCCL's point-to-point rules checked over lowered action lists, and the pass that batches transfers.

gloo matches a receive with a send by (source, tag), so any order of transfers that is deadlock-free in
schedule.py's execution model runs on it. NCCL does not: it ignores tags, both directions between two ranks
share one channel, and a send does not complete until its receive is posted unless both are issued in one
group (`torch.distributed.batch_isend_irecv`). 1F1B's steady state has stage s post `SEND_F(m+1)` before
`RECV_B(m)` while stage s+1 posts `SEND_B(m)` before `RECV_F(m+1)`: one at a time, both block.

`batch_transfers` is the pass that makes every schedule family complete under those rules: each maximal run
of adjacent transfer actions (with only actions the executor does not run at their place between them:
ALLREDUCE, launched after the schedule or asynchronously, and memory actions, which run inside their F/B)
becomes one batch, issued with one `batch_isend_irecv`; the in-between actions follow the batch. The runtime
executes exactly these steps (runtime/program.py `_run`, runtime/flushless.py).

`nccl_problems` simulates NCCL's rules, conservatively, over every rank's batches (`Batch`: its point-to-point
ops `P2POp`, peers resolved by the lowering, `lowering.PipelineLayout.peers`):

* one FIFO channel per directed rank pair, matched by order only: the k-th send from A to B pairs with the
  k-th receive at B from A (no tags); a pair whose k-th send and k-th receive are different messages (kind,
  stage, micro-batch, wave or byte size) is a silent mismatch, a send or receive without a counterpart hangs;
* an op completes only once its counterpart is posted; a rank posts one batch at a time and waits for all of
  its ops (sends included, as NCCL's stream does) before it posts the next;
* the ops of one batch are posted together and each completes as soon as its counterpart is posted.

A rank blocked on a batch that cannot complete is a deadlock; the report names each stuck rank and the
batch (its actions in the IR's string form) it waits in. Pure: no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import PlanError
from .schedule import MEMORY_KINDS

TRANSFER_KINDS = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})
# listed among the transfers but not run at their place by the executors (see the module docstring)
INERT_KINDS = frozenset({"ALLREDUCE"}) | frozenset(MEMORY_KINDS)

A = TypeVar("A")  # schedule.Action or schedule_waves.WaveAction: anything with .kind


def batch_transfers(actions: Sequence[A]) -> tuple[tuple[A, ...], ...]:
    """The steps an executor runs for `actions`: a tuple per step, a batch of adjacent transfer actions (one
    `batch_isend_irecv`) or one other action (module docstring). Flattened, the steps are `actions` with the
    inert actions of a run moved after its batch."""
    steps: list[tuple[A, ...]] = []
    run: list[A] = []
    moved: list[A] = []

    def close() -> None:
        if run:
            steps.append(tuple(run))
        steps.extend((a,) for a in moved)
        run.clear()
        moved.clear()

    for a in actions:
        kind = a.kind  # type: ignore[attr-defined]
        if kind in TRANSFER_KINDS:
            run.append(a)
        elif run and kind in INERT_KINDS:
            moved.append(a)
        else:
            close()
            steps.append((a,))
    close()
    return tuple(steps)


def unbatched(actions: Sequence[A]) -> tuple[tuple[A, ...], ...]:
    """Every action its own step: how transfers were issued before `batch_transfers` (one isend/irecv each)."""
    return tuple((a,) for a in actions)


@dataclass(frozen=True, slots=True)
class P2POp:
    """One point-to-point operation: a send to or a receive from `peer` of `message` (what travels: kind "F"
    or "B", the sending stage, the micro-batch, the wave), `nbytes` long (-1: not known)."""

    peer: int
    send: bool
    message: tuple[Any, ...]
    nbytes: int = -1


@dataclass(frozen=True, slots=True)
class Batch:
    """The ops a rank posts together, and its actions in the IR's string form (for messages)."""

    label: str
    ops: tuple[P2POp, ...]


def _describe(op: P2POp) -> str:
    kind, stage, mb, wave = (tuple(op.message) + (0, 0, 0, 0))[:4]
    what = (f"{'activations' if kind == 'F' else 'gradients'} of stage {stage} micro-batch {mb}"
            + (f" wave {wave}" if wave else ""))
    return what + (f" ({op.nbytes} B)" if op.nbytes >= 0 else "")


def nccl_problems(programs: Mapping[int, Sequence[Batch]]) -> list[str]:
    """What would go wrong on NCCL when each rank (key: global rank) posts its batches in order (module
    docstring): mismatched and unmatched transfers, then the ranks a deadlock leaves stuck. Empty: all complete."""
    return _simulate(programs)[0]


Op = tuple[int, int, int]  # (rank, batch, op)


def _simulate(programs: Mapping[int, Sequence[Batch]]
              ) -> tuple[list[str], dict[int, int], dict[Op, Op], set[Op]]:
    """(problems, the batch each rank ends in, op -> its counterpart, the ops that completed)."""
    problems: list[str] = []
    sends: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (src, dst) -> (rank, batch, op), in order
    recvs: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (src, dst) -> at dst, in order
    remaining: dict[int, list[int]] = {}
    for r, batches in programs.items():
        remaining[r] = [len(b.ops) for b in batches]
        for i, b in enumerate(batches):
            for j, op in enumerate(b.ops):
                pair = (r, op.peer) if op.send else (op.peer, r)
                (sends if op.send else recvs).setdefault(pair, []).append((r, i, j))
    partner: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    for pair in sorted(set(sends) | set(recvs)):
        out, into = sends.get(pair, []), recvs.get(pair, [])
        src, dst = pair
        for k, (s, r) in enumerate(zip(out, into, strict=False)):
            partner[s], partner[r] = r, s
            sent, got = programs[s[0]][s[1]].ops[s[2]], programs[r[0]][r[1]].ops[r[2]]
            if sent.message != got.message or sent.nbytes != got.nbytes:
                problems.append(f"mismatch: rank {src}'s send #{k} to rank {dst} ({programs[src][s[1]].label}) carries "
                                f"{_describe(sent)} but rank {dst}'s receive #{k} from rank {src} "
                                f"({programs[dst][r[1]].label}) expects {_describe(got)}")
        if len(out) != len(into):
            extra = out[len(into):] or into[len(out):]
            who = src if len(out) > len(into) else dst
            problems.append(f"unmatched: rank {src} sends {len(out)} messages to rank {dst}, which receives "
                            f"{len(into)}; rank {who}'s {programs[who][extra[0][1]].label} never completes")
    ptr = dict.fromkeys(programs, 0)
    posted = dict.fromkeys(programs, False)
    finished: set[tuple[int, int, int]] = set()
    todo = list(programs)
    while todo:
        r = todo.pop()
        batches, left = programs[r], remaining[r]
        while ptr[r] < len(batches):
            i = ptr[r]
            if not posted[r]:
                posted[r] = True
                for j in range(len(batches[i].ops)):
                    q, h, ll = partner.get((r, i, j), (None, -1, -1))
                    if q is not None and ptr[q] == h and posted[q]:
                        finished.update(((r, i, j), (q, h, ll)))
                        left[i] -= 1
                        remaining[q][h] -= 1
                        if remaining[q][h] == 0:
                            todo.append(q)
            if left[i] > 0:
                break
            ptr[r] += 1
            posted[r] = False
    stuck = [r for r in sorted(programs) if ptr[r] < len(programs[r])]
    if stuck:
        parts = []
        for r in stuck[:8]:
            b = programs[r][ptr[r]]
            waits = [op for j, op in enumerate(b.ops) if (r, ptr[r], j) not in finished]
            op = waits[0]
            parts.append(f"rank {r} blocks in [{b.label}] on its {'send to' if op.send else 'receive from'} rank "
                         f"{op.peer} ({_describe(op)})")
        more = f" (and {len(stuck) - 8} more ranks)" if len(stuck) > 8 else ""
        problems.append("deadlock: " + "; ".join(parts) + more)
    return problems, ptr, partner, finished


def settle(steps: Mapping[Any, Sequence[tuple[A, ...]]], ranks: Mapping[Any, Sequence[int]],
           ops: Callable[[Any, int, A], tuple[P2POp, ...]], label: Callable[[A], str] = str
           ) -> dict[Any, tuple[tuple[A, ...], ...]]:
    """Device groups' steps (key: group; `batch_transfers`' output) with receives pulled into earlier batches
    until every rank completes under NCCL's rules, where batching adjacent transfers alone does not: a rank
    blocked on a send whose receive its peer posts only in a later batch, while the peer is blocked in an
    earlier one (interleaved 1F1B's cross-chunk exchanges), gets that receive, and every receive from the
    same sender before it, posted in the batch the peer is blocked in (posting a receive early is always
    safe: its buffer is new, and the executors wait for it only where its data is consumed). `ranks[g]`: the
    group's ranks by tensor-parallel index; `ops(g, tp_index, action)`: a transfer action's ops. Returns
    the steps unchanged where nothing blocks, or as far as repairs go (`nccl_problems` then reports why)."""
    cur = {g: [tuple(st) for st in sts] for g, sts in steps.items()}
    while True:
        programs: dict[int, list[Batch]] = {}
        where: dict[int, tuple[Any, list[int], list[list[A]]]] = {}  # rank -> group, step of batch, op actions
        for g, sts in cur.items():
            for k, r in enumerate(ranks[g]):
                batches, index, acts = [], [], []
                for i, st in enumerate(sts):
                    pairs = [(a, op) for a in st if a.kind in TRANSFER_KINDS for op in ops(g, k, a)]  # type: ignore[attr-defined]
                    if pairs:
                        batches.append(Batch(" ".join(label(a) for a in st if a.kind in TRANSFER_KINDS),  # type: ignore[attr-defined]
                                             tuple(op for _, op in pairs)))
                        index.append(i)
                        acts.append([a for a, _ in pairs])
                programs[r], where[r] = batches, (g, index, acts)
        problems, ptr, partner, finished = _simulate(programs)
        if not any(p.startswith("deadlock") for p in problems):
            break
        move = None
        for r in sorted(programs):
            i = ptr[r]
            if i >= len(programs[r]):
                continue
            for j, op in enumerate(programs[r][i].ops):
                q, h, ll = partner.get((r, i, j), (None, -1, -1))
                if op.send and (r, i, j) not in finished and q is not None and h > ptr[q]:
                    move = (q, h, ll)
                    break
            if move:
                break
        if move is None:
            break
        q, h, ll = move
        g, index, acts = where[q]
        target, into = acts[h][ll], index[ptr[q]]
        sender = partner[move][0]
        moved = [a for hh in range(ptr[q] + 1, h + 1) for a, op in zip(acts[hh], programs[q][hh].ops, strict=True)
                 if not op.send and op.peer == sender]
        moved = moved[:moved.index(target) + 1]
        sts = cur[g]
        for i in range(into + 1, index[h] + 1):
            sts[i] = tuple(a for a in sts[i] if a not in moved)
        sts[into] = sts[into] + tuple(moved)
        cur[g] = [st for st in sts if st]
    return {g: tuple(sts) for g, sts in cur.items()}


def check_nccl(programs: Mapping[int, Sequence[Batch]], what: str = "the schedule") -> None:
    """Raise PlanError naming the ranks and batches if `programs` would hang or mismatch on NCCL."""
    problems = nccl_problems(programs)
    if problems:
        raise PlanError(f"{what} would hang or mis-deliver on NCCL, which matches sends and receives by order "
                        f"only: " + " | ".join(problems[:6]) + (f" | (and {len(problems) - 6} more)"
                                                                 if len(problems) > 6 else "")
                        + ". Transfers must be issued in batches of adjacent sends and receives "
                          "(schedule_nccl.batch_transfers) in the same per-pair order on both ranks.")


__all__ = ["Batch", "INERT_KINDS", "P2POp", "TRANSFER_KINDS", "batch_transfers", "check_nccl", "nccl_problems",
           "settle", "unbatched"]
