"""The compiled CPU step (``runtime/compiled.py``): equal to eager within the streaming tolerance, updating the
same slab tensors in place, eager for any key it does not have.

Compiling costs 10-20 s per (bucket, T) key: the module compiles its 8 keys once, into a cache of its own;
``serve --compile-only`` then compiles 4 more, as a user would, and a server runs them.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from cosystream.models import FRAME_SAMPLES
from cosystream.runtime import compiled
from cosystream.runtime.buckets import FRAME_BUCKETS as FRAME_BUCKETS_SERVED
from cosystream.runtime.runner import Runner, RunnerConfig
from cosystream.runtime.slab import StateSlab
from tests.conftest import speech_like
from tests.servers import Served
from tests.speech import encode, needs_espeak, silence, speech
from tests.test_engines import SENTENCE, transcribe
from tests.test_runtime import run_interleaved

FRAME_BUCKETS = (1, 4)  # (1, 2, 4, 8) x (1, 4): 8 keys, every shape run_interleaved steps
MAX_BATCH = 8

needs_compiler = pytest.mark.skipif(compiled.compiler_missing() is not None, reason="needs a C++ compiler")


def make_runner(model, compile=True, max_sessions=8, **config) -> Runner:
    config = {"compile_budget_s": None, **config}
    slab = StateSlab(model.cache_specs(), max_sessions)
    return Runner(
        model, slab, RunnerConfig(max_batch=MAX_BATCH, frame_buckets=FRAME_BUCKETS, compile=compile, **config)
    )


def within_tolerance(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return (got - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())


@pytest.fixture(scope="module")
def compiled_cache(model, tmp_path_factory):
    """Every key compiled once for the module, into a cache of its own."""
    cache = tmp_path_factory.mktemp("compiled")
    runner = make_runner(model, compile_cache_dir=str(cache))
    assert sorted(runner.compiled_keys) == sorted((b, t) for b in (1, 2, 4, 8) for t in FRAME_BUCKETS)
    assert runner.compiled_steps.compiled == 8
    again = make_runner(model, compile_cache_dir=str(cache), compile_budget_s=0).compiled_steps
    assert again.loaded == 8 and again.compiled == 0  # from the cache, no compiler run
    return cache


@pytest.fixture(scope="module")
def compiled_runner(model, compiled_cache):
    """Each test builds its own runner from the module's cache."""
    return lambda **config: make_runner(model, compile_cache_dir=str(compiled_cache), **config)


@needs_compiler
def test_interleaved_sessions_through_the_compiled_step_equal_their_solo_runs(model, compiled_runner):
    """Sessions that start at different times, step with different T in varying batches, through the
    compiled runner: each equals its own offline pass and the same schedule run eagerly."""
    compiled_sessions = run_interleaved(model, compiled_runner(), seed=7)
    eager_sessions = run_interleaved(model, make_runner(model, compile=False), seed=7)
    for c, e in zip(compiled_sessions, eager_sessions, strict=True):
        streamed, eager = torch.cat(c.logits), torch.cat(e.logits)
        assert within_tolerance(streamed, c.offline(model))
        assert within_tolerance(streamed, eager)


@needs_compiler
def test_the_compiled_step_updates_the_slab_tensors_in_place(model, compiled_runner):
    runner, eager = compiled_runner(), make_runner(model, compile=False)
    pointers = [t.data_ptr() for t in runner.slab.tensors]
    slots = [runner.slab.alloc() for _ in range(3)]
    assert slots == [eager.slab.alloc() for _ in range(3)]
    idle = runner.slab.alloc()
    audio = np.stack([speech_like(0.2, seed=i) for i in range(3)])
    for start in range(0, 20, 4):  # 3 rows in bucket 4: one padding row
        chunk = audio[:, start * FRAME_SAMPLES : (start + 4) * FRAME_SAMPLES]
        runner.run(slots, chunk)
        eager.run(slots, chunk)
    assert [t.data_ptr() for t in runner.slab.tensors] == pointers
    for got, expected in zip(runner.slab.tensors, eager.slab.tensors, strict=True):
        if expected.is_floating_point():
            assert within_tolerance(got[slots], expected[slots])
        else:
            assert torch.equal(got[slots], expected[slots])  # positions: exact
        assert not got[idle].any()  # padding rows touch only the scratch slot


@needs_compiler
def test_no_compile_after_start_up(model, compiled_runner):
    runner = compiled_runner()
    with pytest.raises(RuntimeError, match="after start-up"):
        runner.compiled_steps.capture((16, 1), torch.nn.Identity(), (torch.zeros(1),))


def stream(runner: Runner, slots: list[int], audio: np.ndarray, frames: int, start: int, stop: int) -> list:
    """Step ``audio``'s rows (one per slot) from frame ``start`` to ``stop``, ``frames`` at a time; each step's
    ids and logits."""
    steps = []
    for frame in range(start, stop, frames):
        chunk = audio[:, frame * FRAME_SAMPLES : (frame + frames) * FRAME_SAMPLES]
        out = runner.run(slots, chunk, return_logits=True)
        steps.append((out.ids, out.logits))
    return steps


@needs_compiler
def test_shapes_compiled_by_another_process_swap_in_mid_stream_with_the_ids_of_eager(
    model, compiled_cache, tmp_path
):
    """A runner started on an empty cache steps eager; the packages another process compiles appear in its
    cache mid-stream (copied here from the module's), each is loaded, checked and installed between two
    steps, and the streams go on compiled: every step's ids are eager's, the logits within the tolerance, the
    slab the same tensors."""
    import shutil

    live = make_runner(model, compile_cache_dir=str(tmp_path), compile_budget_s=0)
    eager = make_runner(model, compile=False)
    assert live.compiled_keys == [] and len(live.eager_keys()) == 8
    assert live.load_compiled((1, 1)) is None  # nothing in the cache yet
    pointers = [t.data_ptr() for t in live.slab.tensors]
    slots = [live.slab.alloc() for _ in range(3)]
    assert slots == [eager.slab.alloc() for _ in range(3)]
    audio = np.stack([speech_like(0.8, seed=20 + i) for i in range(3)]).astype(np.float32)
    before = [stream(r, slots, audio, 1, 0, 12) + stream(r, slots, audio, 4, 12, 40) for r in (live, eager)]
    for path in compiled_cache.iterdir():
        shutil.copy(path, tmp_path / path.name)
    for key in live.eager_keys():
        loader = live.load_compiled(key)
        assert loader is not None, key
        live.install_compiled(key, loader)
    assert live.eager_keys() == [] and live.compiled_steps.swapped == 8
    after = [stream(r, slots, audio, 1, 40, 52) + stream(r, slots, audio, 4, 52, 80) for r in (live, eager)]
    for (got_ids, got), (ids, expected) in zip(before[0] + after[0], before[1] + after[1], strict=True):
        np.testing.assert_array_equal(got_ids, ids)
        assert within_tolerance(got, expected)
    assert [t.data_ptr() for t in live.slab.tensors] == pointers


@needs_compiler
def test_a_package_that_steps_unlike_eager_is_removed_from_the_cache(model, compiled_cache, tmp_path, caplog):
    """A package the index vouches for but compiled from other weights (folded into its code) fails the check
    against this model's eager step: the key runs eager and the package leaves the cache, which so holds only
    packages that passed (what a running engine's swap relies on: it loads without checking)."""
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        other.head.bias += 1.0
    empty = make_runner(other, compile_cache_dir=str(tmp_path), compile_budget_s=0).compiled_steps
    theirs = next(compiled_cache.glob("*-1-1.pt2"))
    ours = empty.path((1, 1))
    ours.write_bytes(theirs.read_bytes())
    (tmp_path / compiled.INDEX_FILE).write_text(json.dumps({ours.name: compiled.file_digest(ours)}))
    runner = make_runner(other, compile_cache_dir=str(tmp_path), compile_budget_s=0)
    assert (1, 1) not in runner.compiled_keys and "differs from eager" in caplog.text
    assert not ours.exists() and json.loads((tmp_path / compiled.INDEX_FILE).read_text()) == {}
    assert runner.load_compiled((1, 1)) is None


def test_a_key_not_compiled_runs_eager(model, tmp_path):
    """No budget and an empty cache: nothing is compiled, and the runner steps eagerly all the same."""
    runner = make_runner(model, compile_cache_dir=str(tmp_path), compile_budget_s=0)
    assert runner.compiled_keys == [] and runner.compiled_steps.skipped == 8
    slot = runner.slab.alloc()
    out = runner.run([slot], speech_like(0.04, seed=3)[None], return_logits=True)
    assert out.ids.shape == (1, 4, 1)
    assert not list(tmp_path.iterdir())


def test_without_a_compiler_the_runner_runs_eager(model, monkeypatch, tmp_path):
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    runner = make_runner(model, compile_cache_dir=str(tmp_path))
    assert runner.compiled_keys == [] and runner.compiled_steps is None


def test_the_cache_fingerprint_covers_weights_and_config(model):
    base = compiled.fingerprint(model, ("a",))
    assert compiled.fingerprint(model, ("a",)) == base
    assert compiled.fingerprint(model, ("b",)) != base
    weight = model.head.bias
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight[0] += 1e-3
        assert compiled.fingerprint(model, ("a",)) != base
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_the_cache_fingerprint_covers_the_cpus_feature_flags(model, monkeypatch):
    """The code is compiled for this very CPU (-march=native): a CPU of the same vector ISA class but other
    flags gets packages of its own (here, the flags another CPU would list)."""
    assert "sse2" in compiled.cpu_features().split()  # (x86-64: every one has it)
    base = compiled.fingerprint(model)
    monkeypatch.setattr(compiled, "cpu_features", lambda: "avx avx2 fma sse2")
    assert compiled.fingerprint(model) != base


def test_a_cache_with_packages_for_another_cpu_or_torch_says_so_in_one_line(tmp_path, caplog):
    caplog.set_level("INFO", logger="cosystream.runtime.compiled")
    (tmp_path / "0123456789abcdef0123456789abcdef-1-1.pt2").write_bytes(b"another machine's")
    compiled.CompiledSteps("fedcba9876543210fedcba9876543210", tmp_path, budget_s=0).freeze()
    lines = [r.getMessage() for r in caplog.records if "none for this step" in r.getMessage()]
    assert len(lines) == 1 and "holds 1 packages" in lines[0] and "run eager" in lines[0]


def test_the_engine_uses_cached_steps_by_default_and_compiles_nothing(model, tmp_path):
    """The engine's default: compiled packages from the cache, none compiled at start (an empty cache: every
    key eager, nothing written); compile=False does not even look."""
    from cosystream.engine.config import EngineConfig
    from cosystream.engine.core import EngineCore

    assert EngineConfig().compile and EngineConfig().compile_budget_s == 0
    config = EngineConfig(max_sessions=2, compile_cache_dir=str(tmp_path))
    core = EngineCore(model, config, torch.device("cpu"))
    assert core.runner.config.compile and core.runner.config.compile_cache_dir == str(tmp_path)
    assert core.runner.compiled_keys == [] and core.runner.compiled_steps.skipped > 0
    assert not list(tmp_path.iterdir())
    eager = EngineCore(model, EngineConfig(max_sessions=2, compile=False), torch.device("cpu"))
    assert not eager.runner.config.compile and eager.runner.compiled_steps is None


def test_models_not_in_float32_run_eager(tmp_path):
    from cosystream.models import load_model

    runner = make_runner(load_model(precision="int8"), compile_cache_dir=str(tmp_path))
    assert runner.compiled_steps is None and not list(tmp_path.iterdir())


def test_the_cache_keeps_its_size_dropping_the_least_recently_used(monkeypatch, tmp_path):
    import os

    for age, name in enumerate(["new", "mid", "old"]):
        path = tmp_path / f"{name}-1-1.pt2"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1e9 - age * 1e6, 1e9 - age * 1e6))
    monkeypatch.setattr(compiled, "CACHE_MAX_BYTES", 2500)
    compiled.CompiledSteps("unused", tmp_path).freeze()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mid-1-1.pt2", "new-1-1.pt2"]


@needs_compiler
@needs_espeak
def test_serve_compile_only_fills_the_cache_a_server_then_runs(tmp_path):
    """``serve --compile-only`` compiles the shapes ``serve`` with the same flags steps, and exits; a server
    started after it runs them from the cache (the engine's log says so) and transcribes as an eager one."""
    flags = ("--frontends", "1", "--max-sessions", "1", "--compile-cache-dir", str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "cosystream", "serve", *flags, "--compile-only"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    shapes = len(FRAME_BUCKETS_SERVED)  # batch bucket 1 only, each T
    assert f": {shapes} shapes compiled ({shapes} now, 0 from the cache, 0 left eager)" in done.stdout
    assert len(list(tmp_path.glob("*.pt2"))) == shapes
    data = encode(np.concatenate([speech(SENTENCE), silence(1.0)]), "LINEAR16")
    texts = {}
    for name, extra in (("compiled", ()), ("eager", ("--no-compile",))):
        with Served(*flags, *extra) as served:
            texts[name] = transcribe(served.stub(), data)
            log = "".join(served.log)
        assert (f"{shapes} shapes compiled" in log) == (name == "compiled"), log
    assert texts["compiled"] == texts["eager"] and "stella" in texts["compiled"], texts


@needs_compiler
@needs_espeak
def test_serve_compiles_in_the_background_and_swaps_each_shape_in_mid_stream(tmp_path):
    """``serve`` on an empty cache serves at once, every shape eager, while ``cs-compiler`` compiles them at
    idle priority; one stream running across the swaps gets, utterance after utterance, the text an eager
    server gives, and ends OK."""
    import threading
    import time

    import grpc

    from cosystream.v1 import cosystream_pb2 as pb

    shapes = len(FRAME_BUCKETS_SERVED)  # batch bucket 1 only, each T
    flags = ("--frontends", "1", "--max-sessions", "1", "--compile-cache-dir", str(tmp_path))
    utterance = encode(np.concatenate([speech(SENTENCE), silence(1.0)]), "LINEAR16")
    with Served(*flags, "--no-compile") as served:
        expected = transcribe(served.stub(), utterance)
    assert "stella" in expected, expected
    with Served(*flags, background_compile=True) as served:
        # (spawned as "python", it takes its name once it runs)
        served.wait(lambda: "cs-compiler" in served.pids(), 60, "cs-compiler started")
        assert transcribe(served.stub(), utterance) == expected  # served before any shape is compiled
        assert served.metric("cosystream_compiled_shapes") < shapes
        compiled_all = threading.Event()

        def requests():
            yield pb.StreamingRecognizeRequest(
                config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000)
            )
            last = False
            while not last:
                last = compiled_all.is_set()  # (one more utterance once every shape runs compiled)
                for offset in range(0, len(utterance), 3200):  # 100 ms chunks, at real time
                    yield pb.StreamingRecognizeRequest(audio=utterance[offset : offset + 3200])
                    time.sleep(0.1)

        finals: list[str] = []
        call = served.stub().StreamingRecognize(requests(), timeout=600)
        reader = threading.Thread(
            target=lambda: finals.extend(r.transcript for x in call for r in x.results if r.is_final)
        )
        reader.start()
        served.wait(lambda: served.metric("cosystream_compiled_shapes") == shapes, 480, "every shape swapped in")
        compiled_all.set()
        reader.join(60)
        assert call.code() == grpc.StatusCode.OK
        assert len(finals) >= 2 and all(final == expected for final in finals), (expected, finals)
        served.wait(lambda: "ended (exit code 0) after" in "".join(served.log), 120, "the end logged")
        assert f"{shapes} shapes swapped in, 0 still eager" in "".join(served.log)
        assert "cs-compiler" not in served.pids()
    assert len(list(tmp_path.glob("*.pt2"))) == shapes


@needs_compiler
def test_a_model_loaded_while_serving_gets_its_shapes_compiled_in_the_background(tmp_path):
    """A new version loaded through the Admin service (other weights: none of its shapes cached) runs eager,
    then compiled, shape by shape, as the start-up's models do."""
    from tests.test_admin import admin_cli, nudged_copy

    v2 = nudged_copy(tmp_path / "v2")
    shapes = len(FRAME_BUCKETS_SERVED)
    flags = ("--admin", "--frontends", "1", "--max-sessions", "1", "--compile-cache-dir", str(tmp_path / "cache"))
    with Served(*flags, background_compile=True) as served:
        served.wait(lambda: "background compile of" in "".join(served.log), 480, "the start-up's compile done")
        assert served.metric("cosystream_compiled_shapes", model="v2") == 0
        done = admin_cli(served, "load", "v2", v2)
        assert done.returncode == 0, done.stderr
        served.wait(lambda: served.metric("cosystream_compiled_shapes", model="v2") == shapes, 480, "v2 compiled")
        served.wait(lambda: "background compile of v2 ended (exit code 0)" in "".join(served.log), 120, "logged")
    assert len(list((tmp_path / "cache").glob("*.pt2"))) == 2 * shapes


def read_only(folder: Path) -> tuple[str, ...]:
    """A command prefix that runs a command with ``folder`` mounted read-only over itself, in a mount namespace
    of its own (skips where this user cannot make one)."""
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    prefix = ("unshare", "--mount", "sh", "-c", script, str(folder))
    try:
        denied = subprocess.run([*prefix, "touch", str(folder / "probe")], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"no mount namespace here: {err}")
    if denied.returncode == 0 or b"Read-only" not in denied.stderr:
        pytest.skip(f"cannot mount a folder read-only here: {denied.stderr.decode().strip()}")
    return prefix


@needs_compiler
def test_a_read_only_cache_runs_the_shapes_it_lacks_eager_and_starts_no_compiler(tmp_path):
    """A cache made at build time and read-only where the server runs, on a host with a C++ compiler: the
    shapes it lacks run eager, said in one line, and no compiler is started (it could put nothing there)."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    flags = ("--frontends", "1", "--max-sessions", "1", "--compile-cache-dir", str(cache))
    utterance = encode(np.concatenate([speech(SENTENCE), silence(1.0)]), "LINEAR16")
    with Served(*flags, background_compile=True, prefix=read_only(cache)) as served:
        assert transcribe(served.stub(), utterance)
        assert "cs-compiler" not in served.pids()
        log = "".join(served.log)
    shapes = len(FRAME_BUCKETS_SERVED)
    assert (
        f"{shapes} shapes not in the compile cache run eager: the compile cache {cache} is on a read-only" in log
    )
    assert "Traceback" not in log and "cs-compiler" not in log
    assert not list(cache.iterdir())


def test_the_compiler_is_paused_while_the_engine_is_busy_and_resumed_once_it_is_not():
    """Stopped and continued as a process group (the compiler and its compiler runs), with hysteresis: a
    load between the two limits changes nothing."""
    from cosystream.engine.background_compile import Pause

    group = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"], start_new_session=True)

    def states() -> set[str]:
        found = set()
        for entry in os.listdir("/proc"):
            try:
                line = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = line.rsplit(")", 1)[1].split()
            if entry.isdigit() and int(fields[2]) == group.pid:
                found.add(fields[0])
        return found

    def settled(expected: str) -> bool:
        import time

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if states() == {expected}:
                return True
            time.sleep(0.02)
        return False

    try:
        pause = Pause(group.pid, pause_load=0.5, resume_load=0.3)
        assert settled("S")
        pause.pace(0.45)
        assert not pause.paused and settled("S")
        pause.pace(0.7)
        assert pause.paused and settled("T")
        pause.pace(0.4)  # (between the limits: still paused)
        assert pause.paused and settled("T")
        pause.pace(0.1)
        assert not pause.paused and settled("S") and pause.pauses == 1
    finally:
        os.killpg(group.pid, 9)
        group.wait()


def test_the_cache_folder_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path / "mine"))
    assert compiled.default_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(compiled.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compiled.default_cache_dir() == tmp_path / "cosystream" / "compiled-steps"
    monkeypatch.delenv("XDG_CACHE_HOME")

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(compiled.Path, "home", staticmethod(no_home))
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    # Without a home: a folder of this user's own, never one shared by every user of the machine.
    private = compiled.default_cache_dir()
    assert private == tmp_path / f"cosystream-{os.getuid()}" / "compiled-steps"
    assert compiled.CompiledSteps("fp", private).refused is None
    for folder in (private, private.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()


# --- the cache is trusted only as far as nobody else can write to it ------------------------------------

KEY = (1, 1)


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """The packages handed to AOTInductor's loader (a stand-in: these tests compile nothing)."""
    import torch._inductor

    loaded: list[str] = []

    def load(path: str):
        loaded.append(path)
        return types.SimpleNamespace(loader=object())

    monkeypatch.setattr(torch._inductor, "aoti_load_package", load)
    return loaded


def capture(steps: compiled.CompiledSteps) -> bool:
    return steps.capture(KEY, torch.nn.Identity(), (torch.zeros(1),))


def package_in(cache, vouched: bool) -> compiled.CompiledSteps:
    """A cache holding a package for ``KEY`` (recorded in its index when ``vouched``), and steps on it that
    compile nothing."""
    steps = compiled.CompiledSteps("fp", cache, budget_s=0)
    path = steps.path(KEY)
    path.write_bytes(b"native code")
    if vouched:
        (cache / compiled.INDEX_FILE).write_text(json.dumps({path.name: compiled.file_digest(path)}))
    return steps


def test_a_package_the_index_vouches_for_is_loaded(tmp_path, loads):
    steps = package_in(tmp_path, vouched=True)
    assert capture(steps) and loads == [str(steps.path(KEY))] and steps.loaded == 1


def test_a_planted_package_is_discarded_not_loaded(tmp_path, loads, caplog):
    steps = package_in(tmp_path, vouched=False)
    assert not capture(steps) and loads == [] and steps.skipped == 1
    assert not steps.path(KEY).exists() and "not in the cache's index" in caplog.text


def test_a_changed_package_is_discarded_not_loaded(tmp_path, loads, caplog):
    steps = package_in(tmp_path, vouched=True)
    steps.path(KEY).write_bytes(b"other native code")
    assert not capture(steps) and loads == [] and not steps.path(KEY).exists()
    assert "SHA-256 differs" in caplog.text


@pytest.mark.parametrize("unsafe", ["group-writable", "other-writable", "foreign-owned", "foreign parent"])
def test_a_cache_folder_others_can_write_is_not_used(tmp_path, loads, caplog, unsafe):
    """Not even a package its index vouches for is loaded from it (the index is as writable as the
    package), and nothing is written to it: every key runs eager."""
    cache = tmp_path / "parent" / "cache"
    cache.mkdir(parents=True, mode=0o700)
    package_in(cache, vouched=True)
    if unsafe == "group-writable":
        cache.chmod(0o770)
    elif unsafe == "other-writable":
        cache.chmod(0o703)
    elif unsafe == "foreign-owned":
        os.chown(cache, 12345, 12345)
    else:  # as a /tmp/cosystream-<uid> another user made first
        os.chown(cache.parent, 12345, 12345)
    before = sorted(p.name for p in cache.iterdir())
    steps = compiled.CompiledSteps("fp", cache, budget_s=None)
    assert steps.refused and not capture(steps) and loads == [] and steps.skipped == 1
    steps.freeze()
    assert sorted(p.name for p in cache.iterdir()) == before
    assert "not used" in caplog.text and "runs eager" in caplog.text


def test_a_sticky_shared_parent_such_as_tmp_is_fine(tmp_path, loads):
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "cache").mkdir(mode=0o700)
    steps = package_in(shared / "cache", vouched=True)
    assert steps.refused is None and capture(steps)
