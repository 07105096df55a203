"""The sm100 kernel's pipelines, in one place, and a CPU model that runs them.

The kernel (``kernel.py``) reads from here: the stage counts and the initial phase of every
producer/consumer state (``pipeline_specs``), the arrive counts, the order in which the load warp
issues the prelude and the main K tiles (``load_order``), and the K tile after which each low-rank
chunk is issued into the accumulator (``lowrank_issue_ktile``, plain arithmetic that the kernel
evaluates on ``Int32``). The model below replays the same per-role sequence of
acquire/commit/wait/release on mbarriers with parity semantics for any number of tiles per CTA and
checks:

- no role waits forever (a deadlock is a state where every unfinished role is blocked);
- no stage is overwritten before it is consumed, and every consumer reads the item it expects
  (a wrong initial phase or a state reset between persistent tiles shows up as one of these);
- every low-rank atom is issued exactly once per tile, after the tile's first main MMA (which
  clears the accumulator) and before its commit.

Pipelines (per CTA; in 2-CTA mode the leader CTA's barriers carry the MMA side):

``ab``  (A/B/SFA/SFB stages)   producer: load warp (TMA, tx-count), consumer: MMA warp (tcgen05.commit)
``lr``  (low-rank prelude)     producer: load warp (TMA),           consumer: MMA warp (tcgen05.commit)
``acc`` (TMEM accumulators)    producer: MMA warp (tcgen05.commit), consumer: 4 epilogue warps
                               (every thread, of both CTAs in 2-CTA mode)

Phase convention (mbarrier parity): a fresh barrier is in phase 0; ``wait(parity p)`` returns once
the phase with parity ``p`` has completed, i.e. while the barrier's current phase parity differs
from ``p``. Consumers start at phase 0 (nothing has been produced). Producers start at phase 1:
waiting on parity 1 of a fresh empty barrier returns at once, which is the same as an empty
barrier pre-armed by init. States advance ``index``, flipping ``phase`` when ``index`` wraps, and
are never reset between persistent tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

from .host import ATOMS_PER_K_TILE, NUM_LOWRANK_STAGE, KernelConfig


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    num_stages: int
    producer_start_phase: int
    consumer_start_phase: int
    full_arrivals: int  # arrivals that complete a "full" phase
    empty_arrivals: int  # arrivals that complete an "empty" phase


PRODUCER_START_PHASE = 1
CONSUMER_START_PHASE = 0
EPILOGUE_WARPS = 4
EPILOGUE_THREADS = 32 * EPILOGUE_WARPS


def pipeline_specs(cfg: KernelConfig, num_ab_stage: int) -> dict[str, PipelineSpec]:
    """Stages, initial phases and arrive counts of the three pipelines (the kernel builds its
    ``cutlass.pipeline`` objects and states from this)."""
    cluster_m = cfg.cluster_shape_mn[0]
    return {
        # TMA of every CTA of the pair arrives on the leader's full barrier (expect-tx); one
        # tcgen05.commit (multicast to the pair) empties it.
        "ab": PipelineSpec("ab", num_ab_stage, PRODUCER_START_PHASE, CONSUMER_START_PHASE, cluster_m, 1),
        "lr": PipelineSpec("lr", NUM_LOWRANK_STAGE, PRODUCER_START_PHASE, CONSUMER_START_PHASE, cluster_m, 1),
        # one commit fills; every epilogue thread of each CTA of the pair arrives to empty it.
        "acc": PipelineSpec(
            "acc", cfg.num_acc_stage, PRODUCER_START_PHASE, CONSUMER_START_PHASE, 1, EPILOGUE_THREADS * cluster_m
        ),
    }


def lowrank_issue_ktile(chunk, k_tile_cnt, num_chunks):
    """The K tile after whose main MMAs low-rank chunk ``chunk`` is issued.

    Chunks are spread evenly over the tile's K loop (one low-rank atom every about
    ``K_atoms / R_atoms`` main atoms) and the last one lands after the last K tile at the latest:
    ``ceil((chunk + 1) * k_tile_cnt / num_chunks) - 1``. Works on Python ints and on DSL Int32.
    """
    return ((chunk + 1) * k_tile_cnt + num_chunks - 1) // num_chunks - 1


def lowrank_load_ktile(chunk, k_tile_cnt, num_chunks):
    """The K tile before whose loads the load warp issues low-rank chunk ``chunk`` (``k_tile_cnt``: after
    the K loop, or later). Chunk 0 comes first; chunk ``c >= 1`` right after the K tile at which chunk
    ``c - 1`` is consumed, ``lowrank_issue_ktile(c - 1) + 1``: it still lands ``~K / C`` tiles before its
    own MMA, and its stage, which the previous tile's chunk ``c`` held until that tile's K tile
    ``lowrank_issue_ktile(c)`` (its last one for the last chunk), is free by then. Loading every chunk
    first instead made the loader wait, at each tile's start, for the previous tile's last MMA: the A/B
    pipeline drained at every tile boundary at ranks 65-128 (two chunks). Python ints or DSL Int32."""
    if chunk == 0:
        return 0
    return lowrank_issue_ktile(chunk - 1, k_tile_cnt, num_chunks) + 1


def load_order(k_tile_cnt: int, num_chunks: int) -> list[tuple[str, int]]:
    """What the load warp issues for one tile: each chunk before the K tile ``lowrank_load_ktile`` names
    (chunk 0 first), the K tiles in order, and the chunks due past the last K tile at the end."""
    at = [lowrank_load_ktile(c, k_tile_cnt, num_chunks) for c in range(num_chunks)]
    out: list[tuple[str, int]] = []
    for t in range(k_tile_cnt):
        out += [("lr", c) for c in range(num_chunks) if at[c] == t]
        out.append(("ab", t))
    return out + [("lr", c) for c in range(num_chunks) if at[c] >= k_tile_cnt]


def mma_order(k_tile_cnt: int, num_chunks: int) -> list[tuple[str, int]]:
    """What the MMA warp consumes for one tile, in order: each K tile, then the chunks due after it."""
    out: list[tuple[str, int]] = []
    for t in range(k_tile_cnt):
        out.append(("ab", t))
        for c in range(num_chunks):
            if lowrank_issue_ktile(c, k_tile_cnt, num_chunks) == t:
                out.append(("lr", c))
    return out


# ---------------------------------------------------------------------------------------------
# The model


class ModelError(AssertionError):
    pass


class PipelineState:
    """The kernel's per-warp (index, phase, count); ``advance`` flips phase on wrap."""

    def __init__(self, num_stages: int, phase: int):
        self.num_stages, self.index, self.phase, self.count = num_stages, 0, phase, 0

    def advance(self):
        self.index += 1
        self.count += 1
        if self.index == self.num_stages:
            self.index = 0
            self.phase ^= 1


class Barrier:
    def __init__(self, arrivals: int):
        self.arrivals, self.pending, self.phase = arrivals, 0, 0

    def ready(self, parity: int) -> bool:
        return (self.phase & 1) != parity

    def arrive(self):
        self.pending += 1
        if self.pending == self.arrivals:
            self.pending = 0
            self.phase += 1


class Pipe:
    def __init__(self, spec: PipelineSpec):
        self.spec = spec
        self.full = [Barrier(spec.full_arrivals) for _ in range(spec.num_stages)]
        self.empty = [Barrier(spec.empty_arrivals) for _ in range(spec.num_stages)]
        self.content: list[object | None] = [None] * spec.num_stages  # item held, None when free
        self.writes: list[dict] = [dict() for _ in range(spec.num_stages)]  # item -> writers so far


@dataclass
class ModelResult:
    steps: int
    lowrank_atoms: dict  # (cta, tile) -> list of (chunk, atom)
    epilogue_tiles: dict  # cta -> tiles finished


def run_model(
    cfg: KernelConfig,
    num_ab_stage: int,
    k_tile_cnt: int,
    tiles_per_cta: int,
    *,
    producer_start_phase: int | None = None,
    reset_state_per_tile: bool = False,
    load_order_fn=load_order,
    max_steps: int = 10_000_000,
) -> ModelResult:
    """Run one cluster's roles over ``tiles_per_cta`` persistent tiles; raise ``ModelError`` on a
    deadlock, an overwrite, a wrong read or a low-rank atom issued other than once per tile.

    The keyword arguments inject the bugs the model must catch (tests use them).
    """
    specs = pipeline_specs(cfg, num_ab_stage)
    if producer_start_phase is not None:
        specs = {k: PipelineSpec(s.name, s.num_stages, producer_start_phase, s.consumer_start_phase,
                                 s.full_arrivals, s.empty_arrivals) for k, s in specs.items()}
    pipes = {name: Pipe(spec) for name, spec in specs.items()}
    n_cta = cfg.cluster_shape_mn[0]
    n_chunks = cfg.num_lowrank_chunks
    atoms_per_chunk = cfg.lowrank_atoms_per_chunk
    lowrank: dict = {}
    epi_done: dict = {v: 0 for v in range(n_cta)}

    def producer(pipe: Pipe, st: PipelineState, item, writer):
        """acquire (wait empty) then write + arrive on full (TMA complete_tx)."""
        while not pipe.empty[st.index].ready(st.phase):
            yield "blocked"
        held = pipe.content[st.index]
        if held is not None and held != item:
            raise ModelError(f"{pipe.spec.name} stage {st.index} overwritten with {item} before {held} was consumed")
        writers = pipe.writes[st.index].setdefault(item, set())
        if writer in writers:
            raise ModelError(f"{pipe.spec.name} stage {st.index}: {writer} wrote {item} twice")
        writers.add(writer)
        pipe.content[st.index] = item
        pipe.full[st.index].arrive()
        st.advance()
        yield "progress"

    def consumer_wait(pipe: Pipe, st: PipelineState, item):
        while not pipe.full[st.index].ready(st.phase):
            yield "blocked"
        if pipe.content[st.index] != item:
            raise ModelError(f"{pipe.spec.name} stage {st.index}: expected {item}, found {pipe.content[st.index]}")
        yield "progress"

    def consumer_release(pipe: Pipe, st: PipelineState, last_arrival: bool):
        if last_arrival:
            pipe.content[st.index] = None
            pipe.writes[st.index] = {}
        pipe.empty[st.index].arrive()
        st.advance()

    def fresh(name, role):
        s = specs[name]
        return PipelineState(s.num_stages, s.producer_start_phase if role == "p" else s.consumer_start_phase)

    def load_role(v):
        st = {"ab": fresh("ab", "p"), "lr": fresh("lr", "p")}
        for tile in range(tiles_per_cta):
            if reset_state_per_tile:
                st = {"ab": fresh("ab", "p"), "lr": fresh("lr", "p")}
            for kind, i in load_order_fn(k_tile_cnt, n_chunks):
                yield from producer(pipes[kind], st[kind], (tile, i), v)

    def mma_role():
        ab, lr, acc = fresh("ab", "c"), fresh("lr", "c"), fresh("acc", "p")
        for tile in range(tiles_per_cta):
            if reset_state_per_tile:
                ab, lr, acc = fresh("ab", "c"), fresh("lr", "c"), fresh("acc", "p")
            yield from _acquire(pipes["acc"], acc)
            cleared = False
            issued = lowrank.setdefault(tile, [])
            for kind, i in mma_order(k_tile_cnt, n_chunks):
                if kind == "ab":
                    # the K tile waits on the pair's TMA (full arrivals = cluster_m)
                    yield from consumer_wait(pipes["ab"], ab, (tile, i))
                    cleared = True  # first atom of the tile runs with ACCUMULATE=False
                    consumer_release(pipes["ab"], ab, True)
                else:
                    yield from consumer_wait(pipes["lr"], lr, (tile, i))
                    if not cleared:
                        raise ModelError(f"tile {tile}: low-rank chunk {i} before the accumulator was cleared")
                    issued.extend((i, a) for a in range(atoms_per_chunk))
                    consumer_release(pipes["lr"], lr, True)
            # commit: fill the accumulator stage
            pipes["acc"].content[acc.index] = ("acc", tile)
            pipes["acc"].full[acc.index].arrive()
            acc.advance()
            yield "progress"

    def _acquire(pipe: Pipe, st: PipelineState):
        while not pipe.empty[st.index].ready(st.phase):
            yield "blocked"
        if pipe.content[st.index] is not None:
            raise ModelError(f"acc stage {st.index} reused while it holds {pipe.content[st.index]}")
        yield "progress"

    def epilogue_role(v):
        # every epilogue thread of each CTA arrives once on the leader's acc-empty barrier.
        acc = fresh("acc", "c")
        for tile in range(tiles_per_cta):
            if reset_state_per_tile:
                acc = fresh("acc", "c")
            yield from consumer_wait(pipes["acc"], acc, ("acc", tile))
            empty = pipes["acc"].empty[acc.index]
            before = empty.phase
            for _ in range(EPILOGUE_THREADS):
                empty.arrive()
            if empty.phase != before:  # the last arrival of the pair frees the stage
                pipes["acc"].content[acc.index] = None
            acc.advance()
            epi_done[v] += 1
            yield "progress"

    roles = {f"load{v}": load_role(v) for v in range(n_cta)}
    roles["mma"] = mma_role()
    roles.update({f"epi{v}": epilogue_role(v) for v in range(n_cta)})
    steps = 0
    live = dict(roles)
    while live:
        progressed = False
        for name in list(live):
            while True:  # run a role until it blocks or finishes
                steps += 1
                if steps > max_steps:
                    raise ModelError("model did not finish")
                try:
                    r = next(live[name])
                except StopIteration:
                    del live[name]
                    progressed = True
                    break
                if r == "blocked":
                    break
                progressed = True
        if not progressed:
            raise ModelError(f"deadlock: roles {sorted(live)} all wait forever")
    for tile in range(tiles_per_cta):
        got = sorted(lowrank.get(tile, []))
        want = [(c, a) for c in range(n_chunks) for a in range(atoms_per_chunk)]
        if got != want:
            raise ModelError(f"tile {tile}: low-rank atoms issued {got}, expected each of {want} once")
    return ModelResult(steps, lowrank, epi_done)
