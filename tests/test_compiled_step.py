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
def compiled_runner(model, tmp_path_factory):
    """Compiles every key once for the module, into a cache of its own; each test then builds its own runner
    from that cache."""
    cache = str(tmp_path_factory.mktemp("compiled"))
    runner = make_runner(model, compile_cache_dir=cache)
    assert sorted(runner.compiled_keys) == sorted((b, t) for b in (1, 2, 4, 8) for t in FRAME_BUCKETS)
    assert runner.compiled_steps.compiled == 8
    again = make_runner(model, compile_cache_dir=cache, compile_budget_s=0).compiled_steps
    assert again.loaded == 8 and again.compiled == 0  # from the cache, no compiler run
    return lambda **config: make_runner(model, compile_cache_dir=cache, **config)


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
