"""The vmap backend: a client program run for a chunk of clients at once (torch.func.vmap).

The chunk's carries are stacked along a leading client dimension and each update of a local
step is one vmapped call over the clients that take it. Clients with smaller minibatches are
padded with weight-0 samples; a client without a minibatch of an update's plan at step s keeps
its carry (a masked select; a client whose minibatch at step s is empty, as a Poisson-sampled
one can be, still takes the step), so every client follows exactly the sequential backend's
trajectory (up to float summation order). Models with normalization layers are grouped by exact
batch size instead of padded, since padding would change batch statistics.

Data movement stays out of the per-step loop: the executor concatenates every client's
training data once into an :class:`Arena`; a chunk's plans become one (steps, clients, width)
tensor of arena rows per named plan, and each step gathers its minibatches with
``index_select`` into a buffer allocated once per chunk and plan slot. An update's random
draws (``Update.draw``) are made per client from its own stream, outside ``vmap``, and stacked;
so are a model's dropout masks, from the stream the sequential backend draws them from
(core/client_dropout.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.func import vmap

from fedloom.core.client_dropout import Call, ChunkDropout, has_dropout
from fedloom.core.protocol import ClientData
from fedloom.data.augment import augment_batch
from fedloom.solvers.ops import FUNC, FUNC_IN_PLACE, FuncOps
from fedloom.solvers.program import Batch, Carry, ClientProgram, ClientRun, Plan, Update
from fedloom.solvers.sequential import draw_streams, finish_metrics, run_steps

if TYPE_CHECKING:
    from fedloom.core.protocol import ClientTask, Message, State

SEQUENTIAL_TAIL = 4
"""When at most this many clients of a chunk still have steps left, they finish one at a time
on the sequential backend: a vmapped step over 1-4 clients costs more in dispatch than it saves
(benchmarks/README.md, Design measurements). Not for stacked updates (core/stacked.py), whose
step over a few clients costs about what one client's does."""

NO_BATCH = torch.empty(0, dtype=torch.long)
"""The minibatch of a step before a plan's start (no sample: the client is masked out)."""


def plan_steps(plans: dict[str, Plan]) -> int:
    """Local steps a client's program takes: the end of its latest plan."""
    return max((p.end for p in plans.values()), default=0)


def stack(leaves: list[Any]) -> Any:
    """One leaf of every client stacked along a new leading dimension (fresh memory). When all
    clients hold the same tensor object (FedAvg's clients all start from the broadcast model)
    the result is one broadcast copy, cheaper than stacking them (benchmarks/README.md,
    Design measurements)."""
    first = leaves[0]
    if all(leaf is first for leaf in leaves):
        return first.unsqueeze(0).expand(len(leaves), *first.shape).clone()
    return torch.stack(leaves)


Path = tuple[str, ...]


class Structure:
    """A carry's shape: the key paths of its tensors, in order, and those of its empty dicts
    (a model without buffers). Plain Python: torch's generic pytree flattening is slow per
    client (benchmarks/README.md, Design measurements)."""

    def __init__(self, tree: Carry) -> None:
        self.paths: list[Path] = []
        self.empty: list[Path] = []
        self._walk(tree, ())

    def _walk(self, tree: Carry, prefix: Path) -> None:
        if not tree and prefix:
            self.empty.append(prefix)
        for key, value in tree.items():
            if isinstance(value, dict):
                self._walk(value, (*prefix, key))
            else:
                self.paths.append((*prefix, key))

    def leaves(self, tree: Carry) -> list[Any]:
        return [pick(tree, path) for path in self.paths]

    def build(self, leaves: list[Any]) -> Carry:
        """The nested dict with ``leaves`` at the paths (the inverse of ``leaves``)."""
        out: Carry = {}
        for path in self.empty:
            _node(out, path[:-1])[path[-1]] = {}
        for path, leaf in zip(self.paths, leaves, strict=True):
            _node(out, path[:-1])[path[-1]] = leaf
        return out


def _node(tree: Carry, path: Path) -> Carry:
    for key in path:
        tree = tree.setdefault(key, {})
    return tree


def pick(tree: Carry, path: Path) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def stack_carries(carries: list[Carry], device: torch.device) -> tuple[list[torch.Tensor], Any]:
    """The chunk's carries as stacked leaves (on ``device``) and their common structure."""
    spec = Structure(carries[0])
    leaves = [stack([pick(c, path) for c in carries]).to(device) for path in spec.paths]
    return leaves, spec


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in its nested dicts, lists and tuples on ``device`` (the
    object itself on the CPU)."""
    if device.type == "cpu":
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


class Arena:
    """Every client's training samples concatenated once; a client is an offset into it,
    looked up by its client id."""

    def __init__(
        self, clients: Mapping[int, ClientData], device: torch.device | None = None
    ) -> None:
        self.clients = dict(clients)
        self.offsets: dict[int, int] = {}
        xs, ys, offset = [], [], 0
        for client_id, data in self.clients.items():
            self.offsets[client_id] = offset
            xs.append(data.x_train)
            ys.append(data.y_train)
            offset += data.num_train
        self.x = (torch.cat(xs) if xs else torch.empty(0)).to(device or "cpu")
        self.y = (torch.cat(ys) if ys else torch.empty(0)).to(device or "cpu")

    def holds(self, tasks: list[ClientTask]) -> bool:
        """Whether every task's data is the data registered under its client id."""
        return all(self.clients.get(t.client_id) is t.data for t in tasks)

    def batch_index(
        self,
        client_ids: list[int],
        plans: list[list[torch.Tensor]],
        entries: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(steps, clients, width) arena rows and 0/1 sample weights for the chunk's plans
        (padding rows point at row 0 with weight 0), the (steps, clients) minibatch sizes
        (0 where a client has no minibatch at step s), and ``entries`` (one row per plan entry,
        the clients' plans concatenated: augmentation draws) laid out the same way
        (steps, clients, width, k), zero at padding; None without ``entries``."""
        steps = [len(p) for p in plans]
        batches = [b for p in plans for b in p]
        lens = [b.shape[0] for b in batches]
        width = max(max(lens, default=1), 1)
        index = torch.zeros(max(steps, default=0), len(plans), width, dtype=torch.long)
        weight = torch.zeros(index.shape)
        sizes = torch.zeros(index.shape[:2], dtype=torch.long)
        laid = None
        if entries is not None:
            laid = entries.new_zeros((*index.shape, *entries.shape[1:]))
        if not lens:
            return index, weight, sizes, laid
        # one entry per minibatch: its step s and its client c, built with tensor ops (Python
        # lists of thousands of minibatches converted with torch.tensor were the slow part;
        # see benchmarks/README.md, Design measurements)
        steps_t = torch.tensor(steps)
        client_of = torch.repeat_interleave(torch.arange(len(plans)), steps_t)
        first = torch.cumsum(steps_t, 0) - steps_t
        step_of = torch.arange(len(batches)) - torch.repeat_interleave(first, steps_t)
        offsets = torch.tensor([self.offsets[c] for c in client_ids])
        lengths = torch.tensor(lens)
        rows = torch.cat(batches)
        sizes[step_of, client_of] = lengths
        if min(lens) == width:  # every minibatch full: one row of the index each
            index[step_of, client_of] = rows.view(-1, width) + offsets[client_of, None]
            weight[step_of, client_of] = 1.0
            if laid is not None and entries is not None:
                laid[step_of, client_of] = entries.view(-1, width, *entries.shape[1:])
            return index, weight, sizes, laid
        starts = torch.cumsum(lengths, 0) - lengths
        s_idx = torch.repeat_interleave(step_of, lengths)
        c_idx = torch.repeat_interleave(client_of, lengths)
        j_idx = torch.arange(len(rows)) - torch.repeat_interleave(starts, lengths)
        index[s_idx, c_idx, j_idx] = rows + offsets[c_idx]
        weight[s_idx, c_idx, j_idx] = 1.0
        if laid is not None and entries is not None:
            laid[s_idx, c_idx, j_idx] = entries
        return index, weight, sizes, laid


Rows = slice | list[int]


class ChunkRunner:
    """Runs one chunk of clients through a program's local steps."""

    def __init__(
        self, program: ClientProgram, arena: Arena, device: torch.device, group_by_size: bool
    ) -> None:
        self.program = program
        self.arena = arena
        self.device = device
        self.group_by_size = group_by_size
        self._vmapped = {
            (u.name, in_place): _vmapped(u, FUNC_IN_PLACE if in_place else FUNC)
            for u in program.updates
            for in_place in (False, True)
        }
        self.stacked = all(u.stacked is not None for u in program.updates)
        """Every update has a stacked form: a step over a few clients stays cheap, so the
        last few clients of a chunk are not handed to the sequential backend."""
        self.dropout: ChunkDropout | None = None
        """The chunk's dropout masks (core/client_dropout.py); None: the model has none."""
        self._has_dropout = has_dropout(program.model.module)
        self.num = 0
        self.streams: list[dict[str, torch.Generator]] = []
        """Each chunk client's draw streams (``Update.draw``), continued across steps."""
        self.augment_rows: dict[str, torch.Tensor] = {}
        """Each plan's augmentation draws (steps, clients, width, 3) laid out like its arena
        rows (data/augment.py); empty without augmentation."""
        self._padding = program.augment.spec.crop_padding if program.augment else 0
        self.sources: dict[str, Arena] = {}
        """The arena each plan of the chunk gathers its minibatches from (``_source``)."""

    def run(
        self,
        message: Message,
        tasks: list[ClientTask],
        states: list[State | None],
        plans: list[dict[str, Plan]],
        shared: dict[str, Any],
        shared_cpu: dict[str, Any],
    ) -> list[ClientRun]:
        """Every client's carry after its plans' local steps, with its metric sums and step
        counts: the chunk steps together (``_step_all``) until only a few clients have steps
        left, which finish on the sequential backend (``SEQUENTIAL_TAIL``)."""
        program = self.program
        num = self.num = len(tasks)
        leaves, spec = stack_carries(
            [program.init(message, s, t) for s, t in zip(states, tasks, strict=True)], self.device
        )
        index, present = self._lay_out(tasks, plans)
        self.streams = chunk_streams(program, tasks)
        buffers = self._gather_buffers(index, num)
        sums: dict[str, dict[str, torch.Tensor]] = {u.name: {} for u in program.updates}
        counts = {u.name: torch.zeros(num, dtype=torch.long) for u in program.updates}
        program.model.module.train()
        runs: list[ClientRun | None] = [None] * num
        alive_at = clients_alive([plan_steps(p) for p in plans])
        # with dropout every step stays in the chunk: the sequential tail would draw the masks
        # from torch's global generator, not from the chunk's per-client streams
        tail = not self.stacked and not self._has_dropout
        self.dropout = (
            ChunkDropout(program.seed, tasks[0].round, [t.client_id for t in tasks])
            if self._has_dropout
            else None
        )
        with self._dropout_swapped():
            for s in range(len(alive_at) - 1):
                alive = alive_at[s + 1]
                if 0 < alive <= SEQUENTIAL_TAIL < num and tail:
                    self._finish_tail(
                        leaves, spec, tasks, plans, shared_cpu, s, alive, sums, counts, runs
                    )
                    break
                self._step_all(leaves, spec, index, present, buffers, s, shared, sums, counts)
        self.dropout = None  # the chunk's generators end with it
        return self._results(leaves, spec, sums, counts, runs)

    def _dropout_swapped(self) -> contextlib.AbstractContextManager:
        """The block in which the model's dropout layers draw the chunk's per-client masks."""
        if self.dropout is None:
            return contextlib.nullcontext()
        return self.dropout.swapped(self.program.model.module)

    def _dropout_call(
        self,
        update: Update,
        index: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        s: int,
        rows: Rows,
        width: int,
        on: torch.Tensor,
        stacked: bool,
    ) -> contextlib.AbstractContextManager:
        """The block of one update call, in which dropout draws for its clients: the members
        ``rows``, those that take the step (``on``), and their real minibatch sizes of each of
        the update's plans at step s."""
        if self.dropout is None:
            return contextlib.nullcontext()
        members = list(range(self.num)[rows]) if isinstance(rows, slice) else list(rows)
        sizes = [
            index[name][2][s, members].tolist()
            if s < index[name][2].shape[0]
            else [0] * len(members)
            for name in update.plans
        ]
        return self.dropout.call(Call(members, on.tolist(), sizes, width, stacked))

    def _lay_out(
        self, tasks: list[ClientTask], plans: list[dict[str, Plan]]
    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
        """Each named plan of the chunk laid out over the arena (``Arena.batch_index``): its
        (steps, clients, width) rows and weights on the device with its (steps, clients)
        minibatch sizes, and its (steps, clients) presence (``plan_presence``); the plans'
        augmentation draws are laid out the same way into ``augment_rows``."""
        ids = [t.client_id for t in tasks]
        augments = [self.program.augmentations(p, t) for p, t in zip(plans, tasks, strict=True)]
        index: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        present: dict[str, torch.Tensor] = {}
        self.augment_rows = {}
        for name in plans[0]:
            padded = [[NO_BATCH] * p[name].start + p[name].batches for p in plans]
            draws = torch.cat([a[name].params for a in augments]) if name in augments[0] else None
            source = self.sources[name] = self._source(tasks, plans, name)
            rows, weight, sizes, laid = source.batch_index(ids, padded, draws)
            index[name] = (rows.to(self.device), weight.to(self.device), sizes)
            present[name] = plan_presence(plans, name, sizes.shape[0])
            if laid is not None:
                self.augment_rows[name] = laid.to(self.device)
        return index, present

    def _source(self, tasks: list[ClientTask], plans: list[dict[str, Plan]], name: str) -> Arena:
        """The run's arena of training inputs, or for a plan with inputs of its own
        (``Plan.inputs``, FedRep's head features) an arena of the chunk's."""
        inputs = [p[name].inputs for p in plans]
        if all(x is None for x in inputs):
            return self.arena
        if any(x is None for x in inputs):
            raise ValueError(f"plan {name}: every client of a chunk has inputs of its own or none")
        own = {
            t.client_id: dataclasses.replace(t.data, x_train=x)
            for t, x in zip(tasks, inputs, strict=True)
        }
        return Arena(own, self.device)

    def _step_all(
        self,
        leaves: list[torch.Tensor],
        spec: Any,
        index: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        present: dict[str, torch.Tensor],
        buffers: dict[str, tuple[torch.Tensor, torch.Tensor]],
        s: int,
        shared: dict[str, Any],
        sums: dict[str, dict[str, torch.Tensor]],
        counts: dict[str, torch.Tensor],
    ) -> None:
        """Step s of every update, in the program's order, for each group of clients that has
        a minibatch of the update's lead plan (``_groups``), counting the steps taken."""
        for update in self.program.updates:
            lead = update.plans[0]
            sizes = index[lead][2]
            if s >= sizes.shape[0]:
                continue
            on_s = present[lead][s]
            for rows, width in self._groups(sizes[s], on_s):
                on = on_s[rows]
                self._step(update, leaves, spec, index, buffers, s, rows, width, on, shared, sums)
                counts[update.name][rows] += on.long()

    def _results(
        self,
        leaves: list[torch.Tensor],
        spec: Any,
        sums: dict[str, dict[str, torch.Tensor]],
        counts: dict[str, torch.Tensor],
        runs: list[ClientRun | None],
    ) -> list[ClientRun]:
        """The chunk's stacked carries, metric sums and step counts unstacked into one run per
        client (on the CPU), except for the clients the sequential tail already ran."""
        per_client = [leaf.cpu().unbind(0) for leaf in leaves]
        sums_cpu = {u: {k: v.cpu().tolist() for k, v in m.items()} for u, m in sums.items()}
        counts_cpu = {u: n.tolist() for u, n in counts.items()}  # Python ints, not 0-d tensors
        return [
            done if done is not None else _client_run(c, spec, per_client, sums_cpu, counts_cpu)
            for c, done in enumerate(runs)
        ]

    # -- one update of one group of clients at step s ----------------------------------------
    def _step(
        self,
        update: Update,
        leaves: list[torch.Tensor],
        spec: Any,
        index: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        buffers: dict[str, tuple[torch.Tensor, torch.Tensor]],
        s: int,
        rows: Rows,
        width: int,
        on: torch.Tensor,
        shared: dict[str, Any],
        sums: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        """``on``: which of ``rows`` have a minibatch of the update's lead plan at step s (the
        others keep their carry). An update with a stacked form runs it on the clients that
        take the step, gathered, rather than vmapping ``fn`` over them all with the others
        masked (FedRep's phases start at each client's own step)."""
        everyone = bool(on.all())
        if update.stacked is not None and not everyone:
            members = range(self.num)[rows] if isinstance(rows, slice) else rows
            rows = [c for c, flag in zip(members, on.tolist(), strict=True) if flag]
            on, everyone = torch.ones(len(rows), dtype=torch.bool), True
        sub = [leaf[rows] for leaf in leaves]
        batches = []
        for name in update.plans:
            arena = self.sources[name]
            plan_rows, plan_weight, _ = index[name]
            picked = plan_rows[s, rows, :width]
            flat = picked.reshape(-1)
            n = flat.shape[0]
            x_buf, y_buf = buffers[name]
            xb = torch.index_select(arena.x, 0, flat, out=x_buf[:n])
            yb = torch.index_select(arena.y, 0, flat, out=y_buf[:n])
            if name in self.augment_rows:  # the same draws as the sequential backend's
                draws = self.augment_rows[name][s, rows, :width].reshape(n, -1)
                xb = augment_batch(xb, draws, self._padding)
            batches.append(
                (
                    xb.view(*picked.shape, *arena.x.shape[1:]),
                    yb.view(*picked.shape, *arena.y.shape[1:]),
                    plan_weight[s, rows, :width],
                )
            )
        if update.draw is not None:
            batches[0] = (*batches[0], self._draws(update, rows, on))
        stacked = everyone and update.stacked is not None
        masks = self._dropout_call(update, index, s, rows, width, on, stacked)
        on = on.to(self.device)
        if stacked:
            assert update.stacked is not None
            # every client steps: the stacked update, in place on views of the chunk's carry
            # (a slice of it) or on the gathered rows (copied back below)
            with masks:
                new_carry, metrics = update.stacked(
                    spec.build(sub), tuple(Batch(*b) for b in batches), shared
                )
        else:
            # in place only when no client's old value is needed by the masking below
            vmapped = self._vmapped[(update.name, everyone)]
            # torch.func.grad ignores an outer no_grad; everything else here records no graph
            with torch.no_grad(), masks:
                new_carry, metrics = vmapped(spec.build(sub), tuple(batches), shared)
        new_leaves = spec.leaves(new_carry)
        whole = rows == slice(0, self.num)
        for i, (old, new) in enumerate(zip(sub, new_leaves, strict=True)):
            if isinstance(rows, slice):
                if _same(old, new):  # passed through, or written in place (a view)
                    continue
                if everyone and whole:
                    leaves[i] = new
                else:
                    old.copy_(new if everyone else torch.where(_expand(on, new), new, old))
            else:
                merged = new if everyone else torch.where(_expand(on, new), new, old)
                leaves[i].index_copy_(0, torch.tensor(rows, device=new.device), merged)
        acc = sums[update.name]
        for key, value in metrics.items():
            masked = value.detach() * on.to(value.dtype)
            if key not in acc:
                acc[key] = torch.zeros(self.num, dtype=value.dtype, device=value.device)
            if isinstance(rows, slice):
                acc[key][rows] += masked
            else:
                acc[key].index_add_(0, torch.tensor(rows, device=value.device), masked)

    def _draws(self, update: Update, rows: Rows, on: torch.Tensor) -> dict[str, torch.Tensor]:
        """The step's draws of ``update`` for ``rows``, stacked: each client that takes the
        step draws from its own stream (in the order it takes steps, as on the sequential
        backend); the others get zeros, which their masked step ignores."""
        members = range(self.num)[rows] if isinstance(rows, slice) else rows
        draw = update.draw
        assert draw is not None
        drawn: list[dict[str, torch.Tensor] | None] = [
            draw(self.streams[c][update.name]) if flag else None
            for c, flag in zip(members, on.tolist(), strict=True)
        ]
        template = next(d for d in drawn if d is not None)
        return {
            k: torch.stack(
                [d[k] if d is not None else torch.zeros_like(template[k]) for d in drawn]
            ).to(self.device)
            for k in template
        }

    def _groups(self, sizes: torch.Tensor, present: torch.Tensor) -> list[tuple[Rows, int]]:
        """Which clients take an update together at step s (``sizes``: each client's
        minibatch size; ``present``: whether it has a minibatch, possibly empty), and their
        padded batch width (at least 1): without normalization layers the prefix up to the
        last client with a minibatch (the others masked), with them groups of exact batch
        size (no padding). Tensor ops, not a Python pass over the clients."""
        on = present.nonzero().flatten()
        if on.numel() == 0:
            return []
        if not self.group_by_size:
            last = int(on[-1]) + 1
            return [(slice(0, last), max(1, int(sizes[:last].max())))]
        by_size: dict[int, list[int]] = {}
        for c, size in zip(on.tolist(), sizes[on].tolist(), strict=True):
            by_size.setdefault(size, []).append(c)
        return [(members, size) for size, members in sorted(by_size.items())]

    def _gather_buffers(
        self, index: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], num: int
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """One preallocated (x, y) buffer per plan that every step's minibatches of that plan
        are gathered into (index_select with out=): faster than advanced indexing x[rows]
        for wide rows (benchmarks/README.md, Design measurements), and no fresh 31 MB block
        per step (W3)."""
        out = {}
        for name, (rows, _, _) in index.items():
            x, y = self.sources[name].x, self.sources[name].y
            n = num * rows.shape[2]
            out[name] = (
                torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=self.device),
                torch.empty((n, *y.shape[1:]), dtype=y.dtype, device=self.device),
            )
        return out

    def _finish_tail(
        self,
        leaves: list[torch.Tensor],
        spec: Any,
        tasks: list[ClientTask],
        plans: list[dict[str, Plan]],
        shared_cpu: dict[str, Any],
        s: int,
        alive: int,
        sums: dict[str, dict[str, torch.Tensor]],
        counts: dict[str, torch.Tensor],
        runs: list[ClientRun | None],
    ) -> None:
        """The last few clients of a chunk run their remaining steps on the sequential
        backend, continuing their carries, metric sums and step counts."""
        for c in range(alive):
            carry = spec.build([leaf[c].cpu().clone() for leaf in leaves])
            client_sums = {u: {k: float(v[c]) for k, v in m.items()} for u, m in sums.items()}
            client_counts = {u: int(n[c]) for u, n in counts.items()}
            streams = self.streams[c] if self.streams else None
            runs[c] = run_steps(
                self.program,
                carry,
                plans[c],
                shared_cpu,
                tasks[c],
                s,
                client_sums,
                client_counts,
                streams,
            )


def plan_presence(plans: list[dict[str, Plan]], name: str, steps: int) -> torch.Tensor:
    """(steps, clients) bool: whether each client has a minibatch (possibly empty) of plan
    ``name`` at each step, from the plans' extents (start .. end)."""
    starts = torch.tensor([p[name].start for p in plans])
    ends = torch.tensor([p[name].end for p in plans])
    s = torch.arange(steps)[:, None]
    return (s >= starts[None, :]) & (s < ends[None, :])


def chunk_streams(
    program: ClientProgram, tasks: list[ClientTask]
) -> list[dict[str, torch.Generator]]:
    """Each client's draw streams (``draw_streams``) when an update of ``program`` draws
    random tensors (``Update.draw``); empty otherwise."""
    if any(u.draw is not None for u in program.updates):
        return [draw_streams(program, t) for t in tasks]
    return []


def clients_alive(ends: list[int]) -> list[int]:
    """``alive_at[s]``: how many of the chunk's clients take at least ``s`` local steps, for s
    from 0 to max(ends) (``ends``: each client's steps; the chunk's clients come sorted by
    steps, so those clients are a prefix of the chunk)."""
    alive_at = [0] * (max(ends, default=0) + 1)
    for e in ends:
        alive_at[e] += 1
    for s in range(len(alive_at) - 2, -1, -1):
        alive_at[s] += alive_at[s + 1]
    return alive_at


def _client_run(
    c: int,
    spec: Structure,
    per_client: list[tuple[torch.Tensor, ...]],
    sums: dict[str, dict[str, list[float]]],
    counts: dict[str, list[int]],
) -> ClientRun:
    """Client ``c``'s run from the chunk's unstacked leaves, metric sums and step counts."""
    carry = spec.build([rows[c] for rows in per_client])
    client_counts = {u: n[c] for u, n in counts.items()}
    client_sums = {u: {k: v[c] for k, v in m.items()} for u, m in sums.items()}
    return ClientRun(carry, finish_metrics(client_sums, client_counts), client_counts)


def _vmapped(update: Update, ops: FuncOps) -> Any:
    def one_client(carry: Carry, batches: tuple, shared: dict[str, Any]) -> tuple[Carry, dict]:
        return update.fn(ops, carry, tuple(Batch(*b) for b in batches), shared)

    return vmap(one_client, in_dims=(0, 0, None))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _expand(on: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return on.view(-1, *([1] * (like.dim() - 1)))
