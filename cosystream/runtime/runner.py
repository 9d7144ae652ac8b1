"""The batched runner: gather the caches of a batch of slots, step the model once, scatter them back.

A model that also has ``step_slots(pcm, slab_tensors, slots)`` is stepped directly on the slab instead
(it reads and writes only the cache rows it needs); gather -> step -> scatter is the contract's path.

``run(slot_ids, frames)`` pads the batch up to the next bucket with the slab's scratch slot, so only a
fixed set of shapes ever runs: one per (batch bucket, frames per step). On CUDA each of those is captured
as a graph at start-up and replayed by copying inputs into the buffers it was captured with; on the CPU
(``compile``) each is compiled ahead of time (``compiled.py``) and called on those same buffers. A shape
with neither runs eager. The eager path always exists (``--no-cuda-graphs``, ``--no-compile``) and
computes the same thing, within the streaming tolerance.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cosystream.models.contract import FRAME_SAMPLES, StreamingModel
from cosystream.runtime.buckets import FRAME_BUCKETS, batch_buckets
from cosystream.runtime.compiled import CompiledSteps
from cosystream.runtime.settings import COMPILE_BUDGET_S, GraphMode
from cosystream.runtime.slab import StateSlab

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    max_batch: int  # rows per step, at most (the slab's size caps it too)
    frame_buckets: tuple[int, ...] = FRAME_BUCKETS
    graph_mode: GraphMode = GraphMode.EAGER
    # Use the model's in-place ``step_slots`` when it has one; False forces gather -> step -> scatter.
    direct_state: bool = True
    # Token candidates returned per frame: 1 for greedy decoding, more for beam search.
    top_k: int = 1
    # CPU only: run each (bucket, T) step compiled ahead of time (``compiled.py``) where a package is
    # cached or can be compiled within compile_budget_s; False: eager.
    compile: bool = False
    compile_cache_dir: str | None = None  # None: compiled.default_cache_dir()
    compile_budget_s: float | None = COMPILE_BUDGET_S  # start-up time for keys not in the cache; None: all

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if self.top_k < 1:
            raise ValueError("top_k must be >= 1")
        if self.compile_budget_s is not None and self.compile_budget_s < 0:
            raise ValueError("compile_budget_s must be >= 0 (or None: no limit)")
        if not self.frame_buckets or any(t < 1 for t in self.frame_buckets):
            raise ValueError("frame_buckets must be positive frame counts")
        if tuple(sorted(set(self.frame_buckets))) != self.frame_buckets:
            raise ValueError("frame_buckets must be strictly increasing")


@dataclass(slots=True)
class StepResult:
    """Per real row and frame, the ``top_k`` most likely token ids and their log-probabilities, best first
    (host arrays, ``[n, T, top_k]``)."""

    ids: np.ndarray
    logprobs: np.ndarray
    logits: torch.Tensor | None = None


class Runner:
    def __init__(self, model: StreamingModel, slab: StateSlab, config: RunnerConfig):
        self.model = model
        self.slab = slab
        self.config = config
        self.device = slab.device
        self.batch_buckets = batch_buckets(min(config.max_batch, slab.max_sessions))
        max_rows = self.batch_buckets[-1]
        dtype = next((s.dtype for s in slab.specs if s.dtype.is_floating_point), torch.float32)
        # Static buffers: every step reads its inputs from, and writes its outputs to, these same tensors.
        self._slots = torch.full((max_rows,), slab.scratch_slot, dtype=torch.long, device=self.device)
        self._pcm = {
            t: torch.zeros((max_rows, t * FRAME_SAMPLES), dtype=dtype, device=self.device)
            for t in config.frame_buckets
        }
        self.top_k = min(config.top_k, len(model.vocabulary))  # token candidates per frame it returns
        self._out = {
            t: torch.zeros((max_rows, t, self.top_k, 2), dtype=torch.float32, device=self.device)
            for t in config.frame_buckets
        }
        # On CUDA every host <-> device copy goes through pinned buffers allocated here, so that
        # ``non_blocking`` really is asynchronous and nothing is allocated per step; one stream sync per
        # step waits for the results (the step's one device-to-host copy).
        self._cuda = self.device.type == "cuda"
        pin = self._cuda
        self._host_slots = torch.zeros((max_rows,), dtype=torch.long, pin_memory=pin)
        self._host_pcm = (
            {t: torch.zeros(buffer.shape, dtype=dtype, pin_memory=True) for t, buffer in self._pcm.items()}
            if pin
            else {}
        )
        self._host_out = (
            {t: torch.zeros(buffer.shape, dtype=torch.float32, pin_memory=True) for t, buffer in self._out.items()}
            if pin
            else {}
        )
        self._direct = config.direct_state and hasattr(model, "step_slots")
        self._graphs = None
        self._compiled = None
        if config.graph_mode is GraphMode.GRAPHS:
            self._capture_graphs()
        elif config.compile and self.device.type == "cpu":
            self._compile_steps()

    @property
    def max_rows(self) -> int:
        return self.batch_buckets[-1]

    @property
    def compiled_steps(self) -> CompiledSteps | None:
        """What the start-up compiled, loaded and left eager (None: this runner does not compile)."""
        return self._compiled

    @property
    def compiled_keys(self) -> list[tuple[int, int]]:
        """The (bucket, T) keys that run compiled (empty: all eager)."""
        return [] if self._compiled is None else self._compiled.keys()

    def bucket_for(self, rows: int) -> int:
        for bucket in self.batch_buckets:
            if bucket >= rows:
                return bucket
        raise ValueError(f"{rows} rows exceed the largest batch bucket {self.batch_buckets[-1]}")

    def input_buffer(self, rows: int, frames_per_step: int) -> np.ndarray | None:
        """Where ``run`` reads a step's host input: ``[rows, T * 160]`` float32 that a caller may fill in
        place (then ``run`` copies nothing before the device copy), or None when the model's input is not
        float32. Valid until the next ``run``."""
        staging = self._host_pcm if self._cuda else self._pcm
        buffer = staging.get(frames_per_step)
        if buffer is None or buffer.dtype != torch.float32 or rows > len(buffer):
            return None
        return buffer[:rows].numpy()

    def run(
        self, slot_ids: Sequence[int], frames: np.ndarray | torch.Tensor, return_logits: bool = False
    ) -> StepResult:
        """Step ``frames [n, T * 160]`` (T a frame bucket) for the sessions in ``slot_ids`` (distinct)."""
        rows = len(slot_ids)
        if rows == 0:
            raise ValueError("run() needs at least one slot")
        frames_per_step, remainder = divmod(frames.shape[1], FRAME_SAMPLES)
        if remainder or frames_per_step not in self._pcm:
            raise ValueError(
                f"frames must be [n, T * {FRAME_SAMPLES}] with T in {self.config.frame_buckets}, got {tuple(frames.shape)}"
            )
        if frames.shape[0] != rows:
            raise ValueError(f"{rows} slots but {frames.shape[0]} rows of frames")
        bucket = self.bucket_for(rows)
        host_slots = self._host_slots[:bucket]
        host_slots[:rows] = torch.as_tensor(slot_ids, dtype=torch.long)
        host_slots[rows:] = self.slab.scratch_slot
        self._slots[:bucket].copy_(host_slots, non_blocking=True)
        pcm = self._pcm[frames_per_step]
        frames = torch.as_tensor(frames)
        if self._cuda and frames.device.type == "cpu":
            staged = self._host_pcm[frames_per_step][:rows]
            if frames.data_ptr() != staged.data_ptr():  # (not filled in place through input_buffer)
                staged.copy_(frames)
            frames = staged
        if frames.data_ptr() != pcm.data_ptr():
            pcm[:rows].copy_(frames, non_blocking=True)
        pcm[rows:bucket].zero_()
        key = (bucket, frames_per_step)
        with torch.no_grad():
            if self._graphs is not None and key in self._graphs:
                logits = self._graphs.replay(key)
            elif self._compiled is not None and key in self._compiled:
                logits = self._compiled.replay(key)
            else:
                logits = self._step(bucket, frames_per_step)
        # The one device-to-host copy of the step.
        if self._cuda:
            out = self._host_out[frames_per_step][:rows]
            out.copy_(self._out[frames_per_step][:rows], non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        else:
            out = self._out[frames_per_step][:rows]
        # Copies: the buffers are overwritten by the next step.
        result = StepResult(ids=out[..., 0].to(torch.int32).numpy(), logprobs=out[..., 1].clone().numpy())
        if return_logits:
            result.logits = logits[:rows].clone()
        return result

    def _step(self, bucket: int, frames_per_step: int) -> torch.Tensor:
        return self._step_on(*self._step_args(bucket, frames_per_step))

    def _step_args(self, bucket: int, frames_per_step: int) -> tuple[torch.Tensor, ...]:
        """The tensors a step of this key reads and writes: pcm, slots, out, then the slab's tensors."""
        return (
            self._pcm[frames_per_step][:bucket],
            self._slots[:bucket],
            self._out[frames_per_step][:bucket],
            *self.slab.tensors,
        )

    def _step_on(
        self, pcm: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, *slab: torch.Tensor
    ) -> torch.Tensor:
        """One step on explicit tensors (what ``compiled.py`` exports): updates ``slab`` rows ``slots`` and
        ``out`` in place, returns the logits."""
        if self._direct:
            logits = self.model.step_slots(pcm, list(slab), slots)
        else:
            caches = [tensor.index_select(0, slots) for tensor in slab]
            logits, caches = self.model.step(pcm, caches)
            for tensor, cache in zip(slab, caches, strict=True):
                tensor.index_copy_(0, slots, cache)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if self.top_k == 1:
            best, ids = logprobs.max(dim=-1, keepdim=True)
        else:
            best, ids = logprobs.topk(self.top_k, dim=-1)
        out[..., 0].copy_(ids)
        out[..., 1].copy_(best)
        return logits

    def _capture_graphs(self) -> None:
        from cosystream.runtime.cuda_graphs import CudaGraphs

        self._graphs = CudaGraphs(self.device)
        keys = [(b, t) for b in self.batch_buckets for t in self.config.frame_buckets]
        # Largest first: the smaller graphs then fit in blocks of the pool the largest one made.
        keys.sort(key=lambda key: key[0] * key[1], reverse=True)
        self._slots.fill_(self.slab.scratch_slot)
        with torch.no_grad():
            for bucket, frames_per_step in keys:
                self._graphs.capture(
                    (bucket, frames_per_step), lambda b=bucket, t=frames_per_step: self._step(b, t)
                )
        self._graphs.freeze()

    def _compile_steps(self) -> None:
        from cosystream.runtime.compiled import compiler_missing, fingerprint

        if not _float32(self.model):
            log.info("compiled CPU step: float32 models only (bfloat16 and int8 run eager)")
            return
        if self.config.compile_budget_s != 0:
            missing = compiler_missing()
            if missing:
                log.warning("compiled CPU step unavailable (%s): running eager", missing)
                return
        specs = [(spec.name, spec.shape, spec.dtype) for spec in self.slab.specs]
        steps = CompiledSteps(
            fingerprint(self.model, (specs, self._direct, self.top_k)),
            self.config.compile_cache_dir,
            self.config.compile_budget_s,
        )
        module = _StepModule(self)

        def dynamic() -> tuple:
            """The slab's slot count is dynamic: one package serves every max_sessions. (Called only when a
            key is compiled: ``Dim`` imports sympy, 0.27 s and ~475 modules, which a start from the cache or
            with nothing cached never needs.)"""
            from torch.export import Dim

            slots_dim = Dim("slab_slots", min=2, max=1 << 24)
            return (None, None, None, tuple({0: slots_dim} for _ in self.slab.tensors))

        with torch.no_grad():
            for key in self.compile_order():
                check = functools.partial(self._matches_eager, key)
                steps.capture(key, module, self._step_args(*key), dynamic, check)
        steps.freeze()
        self._compiled = steps

    def compile_order(self) -> list[tuple[int, int]]:
        """Every (bucket, T) key, in the order they are compiled: the live realtime shape (T=1) first, in case
        the budget runs out; small buckets before large."""
        return sorted(
            ((b, t) for b in self.batch_buckets for t in self.config.frame_buckets), key=lambda k: k[::-1]
        )

    def eager_keys(self) -> list[tuple[int, int]]:
        """The keys that run eager but could run compiled once a package for them is in the cache (none when
        this runner does not compile, or its cache is not trusted)."""
        steps = self._compiled
        if steps is None or steps.refused:
            return []
        return [key for key in self.compile_order() if key not in steps]

    def load_compiled(self, key: tuple[int, int]):
        """``key``'s package, if the cache now holds one, loaded; else None. Not checked here: every package in
        the cache passed the check against the eager step (``CompiledSteps.capture``). Touches none of the
        tensors a step uses: it may run in another thread while the loop steps. What it returns,
        :meth:`install_compiled` takes."""
        return self._compiled.load(key) if self._compiled is not None else None

    def install_compiled(self, key: tuple[int, int], loader) -> None:
        """Run ``key`` through ``loader`` from the next step on (in the thread that steps: O(1))."""
        self._compiled.install(key, loader, self._step_args(*key))

    def _matches_eager(self, key: tuple[int, int], loader) -> bool:
        """Whether ``loader``'s package steps like eager on ``key``'s shape, within the streaming tolerance: its
        logits and its slab update, each run on tensors of their own (the live buffers and slab untouched)."""
        with torch.no_grad():
            expected = self._check_step(key, self._step_on)
            got = self._check_step(key, lambda *args: CompiledSteps.call(loader, args))
        if _close(got[0], expected[0]) and all(map(_close, got[1], expected[1])):
            return True
        log.error("the compiled step %r differs from eager beyond the streaming tolerance: eager", key)
        return False

    def _check_step(self, key: tuple[int, int], step) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``step(pcm, slots, out, *slab)``'s first row of logits and the slab row it wrote, on check tensors:
        the same noise in every row, every row on slot 1 of a 2-slot zeroed slab (whichever row writes it last,
        it ends the same, so a compiled step's slab update can be compared with eager's)."""
        bucket, frames_per_step = key
        pcm = self._pcm[frames_per_step]
        noise = torch.randn(frames_per_step * FRAME_SAMPLES, generator=torch.Generator().manual_seed(bucket)) * 0.1
        rows = noise.to(pcm.dtype).expand(bucket, -1).clone()
        slots = torch.ones((bucket,), dtype=torch.long, device=self.device)
        out = torch.zeros_like(self._out[frames_per_step][:bucket])
        slab = [
            torch.zeros((2, *tensor.shape[1:]), dtype=tensor.dtype, device=self.device)
            for tensor in self.slab.tensors
        ]
        logits = step(rows.to(self.device), slots, out, *slab)
        return logits[:1].clone(), [tensor[1].clone() for tensor in slab]


class _StepModule(torch.nn.Module):
    """The runner's step as a module of its tensors, for ``torch.export``: the model is a submodule, so its
    weights export as parameters (folded and packed into the compiled code)."""

    def __init__(self, runner: Runner):
        super().__init__()
        self.model = runner.model
        self._step_on = runner._step_on

    def forward(
        self, pcm: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, *slab: torch.Tensor
    ) -> torch.Tensor:
        return self._step_on(pcm, slots, out, *slab)


def _float32(model: torch.nn.Module) -> bool:
    """Whether every weight is float32 and no layer is quantized (what the compiled step is checked for)."""
    tensors = list(model.state_dict().values())
    return all(
        t.dtype == torch.float32 for t in tensors if torch.is_tensor(t) and t.is_floating_point()
    ) and not any("quantized" in type(m).__module__ for m in model.modules())


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within the streaming tolerance (max abs difference <= 1e-4 * max(1, max |expected|)); integers exact."""
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return False
    if not expected.is_floating_point() or not expected.numel():
        return torch.equal(got, expected)
    scale = max(1.0, expected.abs().max().item())
    return (got.float() - expected.float()).abs().max().item() <= 1e-4 * scale
