"""The state slab and the batched runner (CPU; the CUDA-graph tests skip without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosystream.models import FRAME_SAMPLES
from cosystream.runtime.runner import GraphMode, Runner, RunnerConfig, batch_buckets
from cosystream.runtime.slab import SlabFullError, StateSlab, plan_slab, slot_bytes
from tests.conftest import speech_like


def make_runner(model, max_sessions=8, direct=True, device="cpu", graphs=False, max_batch=8, top_k=1) -> Runner:
    slab = StateSlab(model.cache_specs(), max_sessions, device=device)
    mode = GraphMode.GRAPHS if graphs else GraphMode.EAGER
    config = RunnerConfig(max_batch=max_batch, graph_mode=mode, direct_state=direct, top_k=top_k)
    return Runner(model, slab, config)


# --- slab -----------------------------------------------------------------------------------------------


def test_slab_alloc_free_reuse(model):
    slab = StateSlab(model.cache_specs(), 3)
    assert [t.shape[0] for t in slab.tensors] == [4] * len(slab.tensors)  # + scratch
    slots = [slab.alloc() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and slab.free_slots == 0
    with pytest.raises(SlabFullError):
        slab.alloc()
    slab.free(slots[1])
    assert slab.alloc() == slots[1]
    with pytest.raises(ValueError):
        slab.free(3)  # the scratch slot is never handed out
    slab.free(slots[0])
    with pytest.raises(ValueError):
        slab.free(slots[0])


def test_slab_allocates_nothing_per_session(model):
    slab = StateSlab(model.cache_specs(), 4)
    pointers = [t.data_ptr() for t in slab.tensors]
    for _ in range(10):
        slab.free(slab.alloc())
    assert [t.data_ptr() for t in slab.tensors] == pointers


def test_a_slot_costs_what_its_caches_hold(model):
    slab = StateSlab(model.cache_specs(), 5)
    assert slot_bytes(model.cache_specs()) * 6 == slab.nbytes  # (5 slots and the scratch one)


def test_the_slab_takes_what_the_device_memory_holds_beside_a_margin():
    gib = 1 << 30
    plan = plan_slab(256, 1 << 20, free_bytes=100 * gib, total_bytes=140 * gib)
    assert plan.fits and plan.slots == 256 and plan.margin_bytes == 14 * gib  # (10% of 140 GiB)
    small = plan_slab(4096, 1 << 20, free_bytes=3 * gib, total_bytes=8 * gib)  # margin 2 GiB: 1 GiB of room
    assert not small.fits and small.slots == 1024 and small.slab_bytes == gib
    assert plan_slab(8, 1 << 20, free_bytes=gib, total_bytes=8 * gib).slots == 1  # no room: CUDA says why


def test_a_cuda_engine_asked_for_more_slots_than_fit_gets_fewer_and_says_so(model, caplog):
    from cosystream.engine.config import EngineConfig
    from cosystream.engine.process import fit_slab

    per_slot = 3 * slot_bytes(model.cache_specs())  # two models' slabs, and room for a model loaded beside
    config = EngineConfig(max_sessions=64)
    free = (2 << 30) + 10 * per_slot  # the margin and ten slots
    with caplog.at_level("INFO", logger="cosystream.engine.process"):
        fitted = fit_slab(config, [model, model], torch.device("cuda:0"), free, 16 << 30)
    assert (fitted.max_sessions, fitted.max_batch) == (10, 10)
    assert "--max-sessions 64 does not fit in cuda:0's free memory" in caplog.text
    assert f"state slab on cuda:0: 10 slots x {per_slot} bytes" in caplog.text
    assert fit_slab(config, [model], torch.device("cuda:0"), 100 << 30, 140 << 30) is config


# --- runner ---------------------------------------------------------------------------------------------


def test_batch_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)


class Session:
    """One stream's audio and the logits the runner returned for it."""

    def __init__(self, runner: Runner, seed: int, seconds: float = 1.0):
        self.slot = runner.slab.alloc()
        self.audio = speech_like(seconds, seed)
        self.frames = len(self.audio) // FRAME_SAMPLES
        self.next_frame = 0
        self.logits: list[torch.Tensor] = []

    def take(self, frames: int) -> np.ndarray:
        chunk = self.audio[self.next_frame * FRAME_SAMPLES : (self.next_frame + frames) * FRAME_SAMPLES]
        self.next_frame += frames
        return chunk

    def offline(self, model) -> torch.Tensor:
        """The offline pass over the audio streamed so far, on the model's device."""
        device = next(model.parameters()).device
        with torch.no_grad():
            return model(torch.from_numpy(self.audio).to(device)[None])[0, : self.next_frame]


def run_interleaved(model, runner: Runner, seed: int) -> list[Session]:
    """Sessions that start at different times, step with different T, in varying batch compositions."""
    rng = np.random.default_rng(seed)
    sessions = [Session(runner, seed=10 + i) for i in range(5)]
    started = 1
    while any(s.next_frame < s.frames for s in sessions):
        if started < len(sessions) and rng.random() < 0.3:
            started += 1
        live = [s for s in sessions[:started] if s.next_frame < s.frames]
        if not live:
            started += 1
            continue
        frames_per_step = int(rng.choice(runner.config.frame_buckets))
        batch = [s for s in live if s.frames - s.next_frame >= frames_per_step and rng.random() < 0.8]
        if not batch:
            batch = [s for s in live]
            frames_per_step = 1
        rng.shuffle(batch)
        chunk = np.stack([s.take(frames_per_step) for s in batch])
        out = runner.run([s.slot for s in batch], chunk, return_logits=True)
        k = runner.config.top_k
        assert out.ids.shape == out.logprobs.shape == (len(batch), frames_per_step, k)
        for row, s in enumerate(batch):
            s.logits.append(out.logits[row])
            best = torch.log_softmax(out.logits[row], -1).topk(k, dim=-1)
            np.testing.assert_array_equal(out.ids[row], best.indices.cpu().numpy())
            np.testing.assert_allclose(out.logprobs[row], best.values.cpu().numpy(), rtol=1e-5, atol=1e-5)
    return sessions


@pytest.mark.parametrize(
    ("direct", "top_k"), [(True, 1), (False, 1), (True, 6)], ids=["direct", "gather-scatter", "top6"]
)
def test_interleaved_sessions_equal_their_solo_runs(model, direct, top_k):
    runner = make_runner(model, direct=direct, top_k=top_k)
    for s in run_interleaved(model, runner, seed=7):
        streamed = torch.cat(s.logits)
        offline = s.offline(model)
        bound = 1e-4 * max(1.0, offline.abs().max().item())
        assert (streamed - offline).abs().max().item() <= bound


def test_padding_rows_touch_only_the_scratch_slot(model):
    runner = make_runner(model)
    slab = runner.slab
    a, b, c = (slab.alloc() for _ in range(3))
    idle = slab.alloc()
    frames = np.stack([speech_like(0.01, seed=i) for i in range(3)])
    runner.run([a, b, c], frames)  # 3 rows in bucket 4: one padding row
    assert all(not t[idle].any() for t in slab.tensors)
    assert any(t[slab.scratch_slot].any() for t in slab.tensors)
    # The padding row's garbage in the scratch slot never leaks into real rows.
    before = runner.run([a], speech_like(0.01, seed=9)[None], return_logits=True).logits
    for tensor in slab.tensors:
        tensor[slab.scratch_slot].fill_(7)
    slab.reset(a)
    runner2 = make_runner(model)
    s = runner2.slab.alloc()
    runner2.run([s], frames[:1])
    after = runner2.run([s], speech_like(0.01, seed=9)[None], return_logits=True).logits
    torch.testing.assert_close(before, after)


def test_freed_slot_starts_clean(model):
    runner = make_runner(model, max_sessions=2)
    first = Session(runner, seed=1)
    runner.run([first.slot], first.take(16)[None])
    runner.slab.free(first.slot)
    again = Session(runner, seed=2)
    assert again.slot == first.slot
    assert all(not t[again.slot].any() for t in runner.slab.tensors)
    out = runner.run([again.slot], again.take(16)[None], return_logits=True)
    torch.testing.assert_close(out.logits[0], again.offline(model), rtol=0, atol=1e-4)


def test_a_step_result_survives_the_next_step(model):
    """The runner reuses its output buffers: what it returned must be a copy."""
    runner = make_runner(model, top_k=3)
    slot = runner.slab.alloc()
    first = runner.run([slot], speech_like(0.01, seed=1)[None])
    ids, logprobs = first.ids.copy(), first.logprobs.copy()
    runner.run([slot], speech_like(0.01, seed=2)[None] * 0.5)
    np.testing.assert_array_equal(first.ids, ids)
    np.testing.assert_array_equal(first.logprobs, logprobs)


def test_run_rejects_bad_shapes(model):
    runner = make_runner(model)
    slot = runner.slab.alloc()
    with pytest.raises(ValueError, match="T in"):
        runner.run([slot], np.zeros((1, 3 * FRAME_SAMPLES), np.float32))
    with pytest.raises(ValueError, match="rows"):
        runner.run([slot], np.zeros((2, FRAME_SAMPLES), np.float32))
    with pytest.raises(ValueError, match="exceed"):
        runner.run(list(range(9)), np.zeros((9, FRAME_SAMPLES), np.float32))


# --- CUDA graphs ----------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def full_fp32():
    """Full float32 on CUDA: the offline reference's convolutions would otherwise run through cuDNN with TF32
    (allowed by default; about 1e-3 relative error) while the streamed step's matmuls do not."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "gather-scatter"])
def test_graph_replay_equals_eager(model, direct, full_fp32):
    gpu_model = model.to("cuda")
    try:
        graphs = make_runner(gpu_model, direct=direct, device="cuda", graphs=True, max_sessions=16, max_batch=16)
        eager = make_runner(gpu_model, direct=direct, device="cuda", graphs=False, max_sessions=16, max_batch=16)
        g = run_interleaved(gpu_model, graphs, seed=3)
        e = run_interleaved(gpu_model, eager, seed=3)
        for sg, se in zip(g, e, strict=True):
            torch.testing.assert_close(torch.cat(sg.logits), torch.cat(se.logits), rtol=1e-5, atol=1e-5)
            offline = se.offline(gpu_model)
            assert (torch.cat(sg.logits) - offline).abs().max().item() <= 1e-4 * max(1, offline.abs().max().item())
    finally:
        model.to("cpu")


@pytest.mark.gpu
@needs_cuda
def test_graphs_are_captured_on_the_device_asked_for(model):
    from cosystream.engine.process import resolve_device

    last = resolve_device(f"cuda:{torch.cuda.device_count() - 1}")
    assert resolve_device("cuda") == torch.device("cuda", 0)
    gpu_model = model.to(last)
    try:
        runner = make_runner(gpu_model, device=last, graphs=True, max_sessions=2, max_batch=2)
        assert torch.cuda.current_device() == last.index
        slot = runner.slab.alloc()
        out = runner.run([slot], speech_like(0.04, seed=4)[None], return_logits=True)
        assert out.logits.device == last and out.ids.shape == (1, 4, 1)
    finally:
        model.to("cpu")
        torch.cuda.set_device(0)


@pytest.mark.gpu
@needs_cuda
def test_no_capture_after_start_up(model):
    gpu_model = model.to("cuda")
    try:
        runner = make_runner(gpu_model, device="cuda", graphs=True, max_sessions=4, max_batch=4)
        with pytest.raises(RuntimeError, match="after start-up"):
            runner._graphs.capture(("late", 1), lambda: None)
    finally:
        model.to("cpu")


def test_engine_drops_frames_past_a_full_queue_instead_of_failing(model):
    from cosystream.engine import ipc
    from cosystream.engine.config import EngineConfig
    from cosystream.engine.core import EngineCore

    config = EngineConfig(max_sessions=2, max_batch=2, queue_frames=16, realtime_batch_window_s=0)
    core = EngineCore(model, config, torch.device("cpu"))
    message = ipc.ToEngine(ops=[ipc.Open(7, 1)])
    message.add_frames(7, np.zeros((40, FRAME_SAMPLES), np.float32))
    core.handle(0, message.pack())
    stepped = 0
    while (plan := core.step()) is not None:
        stepped += plan.rows * plan.frames
    assert stepped == 16
    box = core.take_outbox()[0]
    assert box.events == [ipc.Opened(7, 0)] and sum(len(ids) for _, ids, *_ in box.rows()) == 16


def test_a_cuda_device_that_is_not_there_is_refused_with_a_reason():
    from cosystream.engine.process import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"cuda:0\.\.cuda:"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda:1")
        assert resolve_device("auto") == torch.device("cpu")


def test_plain_cuda_is_a_device_the_engine_can_use():
    """``torch.cuda.set_device`` refuses ``torch.device("cuda")`` (no index) with a ValueError, with or without a
    GPU: the benchmarks and tests pass plain ``cuda``, so setting the device must not depend on an index."""
    from cosystream.engine.process import use_device

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        use_device(torch.device("cuda"))
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
