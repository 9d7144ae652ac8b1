"""Ahead-of-time compiled CPU steps: the CPU counterpart of ``cuda_graphs.py``, and the only module in
cosystream that compiles the model step.

Each (batch bucket, frames per step) key is exported (``torch.export``) and compiled by AOTInductor into a
package of C++ kernels; a step is then one call into it, with no Python between the ops, and its matmuls
run as oneDNN calls on weights packed at compile time (about twice as fast as MKL's ``addmm`` on this AMD
EPYC: 70-80 vs 140 us for 64x576 @ 576x192). Through the runner, one thread, eager and compiled in turn
(``python benchmarks/step.py --max-batch 64 --frames 1 --iterations 300``): batch 1, T=1 0.28 vs 0.41 ms;
batch 64, T=1 1.19 vs 2.65 ms; 1.5-2.5x on every key up to batch 256, T=16. Measured and not used:
``torch.compile`` (JIT inductor) keeps MKL's matmuls with static shapes (batch 64: no gain) and, with a
dynamic batch, gathers the rings in scalar loops; TorchScript (trace, freeze, optimize_for_inference) cuts
batch 1 to 0.21 ms but leaves the matmuls as they are (batch 64: 2.3 ms).

The key table is the only source of truth: a key compiled (or loaded) at start-up, or installed later,
is replayed, anything else runs eager (the caller asks ``key in steps`` first). After ``freeze()`` any new
compile raises, so no compilation happens in a serving process; a package another process compiled (the
engine's background compiler, ``engine/background_compile.py``) may still be loaded (``load``) and
installed (``install``) between two steps. A compiled step reads the very tensors it was installed with (the
runner's static buffers and the slab's tensors: the caller ``copy_``s into them, never rebinds) and
updates the slab and the output buffer in place. Every package is checked against the eager step before it
enters the cache, and one that fails the check where it is loaded leaves it, so the cache holds only
packages that passed.

Compiling costs 10-20 s per key here (all 36 keys of max_batch 256: 7.5 min), so packages are cached on
disk under a fingerprint of everything the generated code depends on (torch version, CPU, threads, the
model's weights, the source of the model's package and of the runner's step); from the cache, 36 keys
load in 4 s. The slab's slot count is a dynamic dimension, so one package serves any ``max_sessions``.
Keys missing from the cache are compiled while the start-up budget lasts (none by default: ``serve
--compile`` compiles every one, ``--compile-only`` does so and exits); the rest run eager until ``serve``'s
background compiler has compiled them. Each loaded key holds about 6 MB of packed weights.

A package is native code the engine runs, so the cache is trusted only as far as nobody else can write to
it: the folder is made 0700, and one owned by another user (root aside) or writable by group or others is
not used at all (every key eager, with a warning; on a read-only mount only its owner is looked past); the
fallback without a home is per user (``$TMPDIR/cosystream-<uid>``). Each package's SHA-256 is recorded in
the cache's index (``index.json``) when it is written and checked before it is loaded: a package the index
does not vouch for (planted, changed, or half-copied) is discarded and its key compiled again or run eager.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import stat
import time
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path

import torch

from cosystream.model_files import user_cache_dir
from cosystream.runtime.settings import COMPILE_BUDGET_S

log = logging.getLogger(__name__)

CACHE_ENV = "COSYSTREAM_COMPILE_CACHE"


def default_cache_dir() -> Path:
    """``$COSYSTREAM_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/cosystream/compiled-steps`` (``~/.cache``
    without it; :func:`~cosystream.model_files.user_cache_dir`)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return user_cache_dir("compiled-steps")


def untrusted(directory: Path) -> str | None:
    """Make ``directory`` (0700, and any missing parent) if it is missing; then why its packages cannot be
    trusted, or None: it (or its parent) is owned by another user than this one or root, or can be written
    by group or others (a sticky parent such as /tmp aside; a read-only mount's modes do not matter)."""
    try:
        for folder in (*reversed(directory.parents), directory):
            if not folder.exists():
                folder.mkdir(mode=0o700, exist_ok=True)
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
        for folder, leaf in ((directory, True), (directory.parent, False)):
            info = os.stat(folder)
            if info.st_uid not in (os.getuid(), 0) and not (leaf and read_only):
                return f"{folder} is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
            shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            if shared and not read_only and (leaf or not info.st_mode & stat.S_ISVTX):
                return f"{folder} can be written by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    except OSError as err:
        return f"cannot use it: {err}"
    return None


CACHE_MAX_BYTES = 2 << 30
"""The cache's size after start-up, at most: least recently used packages go first (every edit of the model
or the runner makes new ones, about 7 MB a key)."""

# reorder_for_locality moves the slab's functional index_put before the reads of the rows it replaces,
# and then the slab cannot be updated in place: every step would copy every slab tensor (measured: 2 ms
# more at batch 1 with 256 slots). Freezing folds the weights into the package, packed for the matmuls.
INDUCTOR_CONFIGS = {"reorder_for_locality": False, "freezing": True}

# The code a compiled step is made of, besides the model's own package: the runner's step, and this module.
_STEP_MODULES = ("cosystream.runtime.runner", "cosystream.runtime.compiled")

INDEX_FILE = "index.json"  # {package file name: its SHA-256}, written with each package
_LOCK_FILE = ".index.lock"  # held while a package and its index entry are written, or checked


def file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def compiler_missing() -> str | None:
    """Why nothing can be compiled here (no C++ compiler on the PATH), or None."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "no C++ compiler (g++ or c++) on the PATH"
    return None


def cpu_features() -> str:
    """The CPU's feature flags as the kernel lists them (``/proc/cpuinfo``'s ``flags``, ``Features`` on Arm),
    sorted; empty where there is no such file. The generated code is compiled with ``-march=native``: two CPUs
    of one vector ISA class (AVX-512 on AMD Zen 4 and on Intel Skylake) differ in the instructions it may use,
    so a package is only for CPUs with the very same flags."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return " ".join(sorted(value.split()))
    except OSError:
        pass
    return ""


def fingerprint(model: torch.nn.Module, extra: Iterable[object] = ()) -> str:
    """A digest of everything a compiled step depends on besides its key: a package compiled under another
    fingerprint is never loaded."""
    import importlib

    digest = hashlib.sha256()
    for part in (torch.__version__, platform.machine(), platform.processor(), torch.get_num_threads()):
        digest.update(f"{part}\0".encode())
    digest.update(f"{torch.backends.cpu.get_cpu_capability()}\0{sorted(INDUCTOR_CONFIGS.items())}\0".encode())
    digest.update(f"{cpu_features()}\0".encode())
    sources = set(Path(importlib.import_module(type(model).__module__).__file__).parent.glob("*.py"))
    sources.update(Path(importlib.import_module(name).__file__) for name in _STEP_MODULES)
    for path in sorted(sources):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}\0{data.dtype}\0{tuple(data.shape)}\0".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes())
    for part in extra:
        digest.update(f"{part!r}\0".encode())
    return digest.hexdigest()[:32]


class CompiledSteps:
    """The compiled steps by key, each with the argument tensors it is called on, like ``CudaGraphs``."""

    def __init__(
        self, fingerprint: str, cache_dir: str | Path | None = None, budget_s: float | None = COMPILE_BUDGET_S
    ):
        self.fingerprint = fingerprint
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.budget_s = budget_s
        self._spent_s = 0.0
        self._loaders: dict[Hashable, torch._C._aoti.AOTIModelPackageLoader] = {}
        self._args: dict[Hashable, tuple[torch.Tensor, ...]] = {}
        self._frozen = False
        self._compiling = True  # until the first failure: then the cause is likely the same for every key
        # Why the cache folder is not used (every key eager), or None.
        self.refused = untrusted(self.cache_dir)
        if self.refused:
            log.warning("compile cache %s not used: %s; every shape runs eager", self.cache_dir, self.refused)
        self.loaded = 0  # keys found in the cache
        self.compiled = 0  # keys compiled by this process
        self.skipped = 0  # keys left eager: the budget was spent, or compiling failed
        self.swapped = 0  # keys installed after start-up (compiled by the background compiler)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._loaders

    def keys(self) -> list[Hashable]:
        return list(self._loaders)

    def path(self, key: Hashable) -> Path:
        name = "-".join(str(part) for part in (key if isinstance(key, tuple) else (key,)))
        return self.cache_dir / f"{self.fingerprint}-{name}.pt2"

    def capture(
        self,
        key: Hashable,
        module: torch.nn.Module,
        args: tuple[torch.Tensor, ...],
        dynamic_shapes: Callable[[], tuple] | None = None,
        check: Callable[[object], bool] | None = None,
    ) -> bool:
        """Load ``key``'s package from the cache, or export ``module(*args)`` and compile it (while the
        budget lasts; ``dynamic_shapes()`` gives the export's dynamic dimensions, asked only then). Replay
        calls it on these same ``args``. ``check(loader)`` (``call(loader, ...)`` against eager) decides
        whether it is used: a package that fails it is removed from the cache, and a compiled one is put in
        the cache only once it passes, so that every package the cache holds passed the check (what
        :meth:`load` relies on). Returns whether ``key`` is now compiled."""
        if self._frozen:
            raise RuntimeError(f"step compile after start-up (key {key!r}): every key is compiled at start-up")
        if key in self._loaders:
            raise ValueError(f"step {key!r} already compiled")
        if self.refused:
            self.skipped += 1
            return False
        path = self.path(key)
        if path.exists() and not self._vouched_for(path):
            with contextlib.suppress(OSError):
                path.unlink()  # (a read-only cache keeps it: the key then runs eager, its package unloaded)
            if path.exists():
                self.skipped += 1
                return False
        if path.exists():
            self.loaded += 1
            loader = self._load(key, path)
            if loader is not None and check is not None and not check(loader):
                self._discard(path)
                loader = None
        else:
            loader = self._compile_checked(key, module, args, dynamic_shapes, check, path)
        if loader is None:
            self.skipped += 1
            return False
        self.install(key, loader, args)
        return True

    def _compile_checked(self, key, module, args, dynamic_shapes, check, path: Path) -> object | None:
        """Compile ``key`` into a file of its own, load and check it, then put it in the cache; its loader, or
        None (no budget left, compiling failed, or the check)."""
        if not self._compiling or (self.budget_s is not None and self._spent_s >= self.budget_s):
            return None
        partial = path.with_name(f".{path.stem}.{os.getpid()}.pt2")
        started = time.perf_counter()
        try:
            self._compile(module, args, dynamic_shapes() if dynamic_shapes else None, partial)
            loader = self._load(key, partial)
            if loader is None or (check is not None and not check(loader)):
                return None
            digest = file_digest(partial)
            with self._locked(fcntl.LOCK_EX):
                os.replace(partial, path)  # atomic: a concurrent start sees the whole package or none
                self._update_index({path.name: digest})
            self.compiled += 1
            return loader
        except Exception:
            log.exception("compiling the step for %r failed: it and every key not cached run eager", key)
            self._compiling = False
            return None
        finally:
            partial.unlink(missing_ok=True)
            self._spent_s += time.perf_counter() - started

    def load(self, key: Hashable) -> object | None:
        """``key``'s package as another process (the background compiler) put it in the cache (so checked),
        loaded but not installed: None if the cache holds none the index vouches for (or it fails to load).
        Compiles and checks nothing, touches none of this object's keys: it may run in another thread while
        steps replay (the loader's constructor holds the GIL for about 10 ms)."""
        if self.refused or key in self._loaders:
            return None
        path = self.path(key)
        if not path.exists() or not self._vouched_for(path):
            return None
        return self._load(key, path)

    def _load(self, key: Hashable, path: Path) -> object | None:
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: kept by the size limit
        import torch._inductor  # (heavy: 1 s and 75 MB, imported only where steps are compiled or loaded)

        if compiler_missing():
            # Without a compiler (the container image) torch's first way of loading a package probes the CPU
            # by compiling, fails, and it logs "Loading outdated pt2 file" for each package before the second
            # way loads it. The packages are not outdated: their fingerprint is this torch's.
            logging.getLogger("torch._inductor.package.package").setLevel(logging.ERROR)
        try:
            package = torch._inductor.aoti_load_package(str(path))
        except Exception:
            log.exception("loading %s failed: removed; %r runs eager", path, key)
            self._discard(path)
            return None
        # The loader's boxed_run takes the flat tensor list: the package's __call__ would parse its pytree
        # spec on every call (about 30 us at batch 1).
        return package.loader

    def _discard(self, path: Path) -> None:
        """Remove ``path``'s package and its index entry (a read-only cache keeps both)."""
        with contextlib.suppress(OSError), self._locked(fcntl.LOCK_EX):
            path.unlink(missing_ok=True)
            self._update_index({path.name: None})

    def install(self, key: Hashable, loader, args: tuple[torch.Tensor, ...]) -> None:
        """Replay ``key`` through ``loader`` (from :meth:`load`) on ``args`` from the next step on; after
        start-up too: in the thread that replays, between two steps."""
        if key in self._loaders:
            raise ValueError(f"step {key!r} already compiled")
        self._args[key] = args
        self._loaders[key] = loader  # (last: ``key in self`` is what makes replay use it)
        if self._frozen:
            self.swapped += 1

    @staticmethod
    def call(loader, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """A loaded package's step on ``args`` (any tensors of the shapes it was compiled for)."""
        return loader.boxed_run(list(args))[0]

    def _compile(
        self, module: torch.nn.Module, args: tuple[torch.Tensor, ...], dynamic_shapes: tuple | None, path: Path
    ) -> None:
        """Export ``module(*args)`` and compile it into a package at ``path``."""
        import torch._inductor
        import torch.export

        with torch.no_grad():
            exported = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
            torch._inductor.aoti_compile_and_package(
                exported, package_path=str(path), inductor_configs=dict(INDUCTOR_CONFIGS)
            )

    @contextlib.contextmanager
    def _locked(self, mode: int):
        """The cache's lock (``LOCK_EX`` to write a package and its entry, ``LOCK_SH`` to check one); none
        where there is no lock file and none can be made (a read-only cache: nothing writes it)."""
        try:
            fd = os.open(self.cache_dir / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)

    def _index(self) -> dict[str, str]:
        try:
            index = json.loads((self.cache_dir / INDEX_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return index if isinstance(index, dict) else {}

    def _update_index(self, changes: dict[str, str | None]) -> None:
        """Set (a digest) or remove (None) entries of the index, under the caller's exclusive lock."""
        index = self._index()
        for name, digest in changes.items():
            if digest is None:
                index.pop(name, None)
            else:
                index[name] = digest
        partial = self.cache_dir / f".{INDEX_FILE}.{os.getpid()}"
        partial.write_text(json.dumps(index, indent=0, sort_keys=True) + "\n")
        os.replace(partial, self.cache_dir / INDEX_FILE)

    def _vouched_for(self, path: Path) -> bool:
        """Whether ``path``'s SHA-256 is the one the index recorded when it was written (warns if not)."""
        with self._locked(fcntl.LOCK_SH):
            expected = self._index().get(path.name)
            try:
                digest = file_digest(path)
            except OSError:
                digest = None
        if expected is not None and digest == expected:
            return True
        why = "not in the cache's index" if expected is None else "its SHA-256 differs from the index's"
        log.warning("compiled package %s discarded, not loaded: %s", path, why)
        return False

    def freeze(self) -> None:
        self._frozen = True
        self._trim_cache()
        if not self._loaders and not self.refused:
            with contextlib.suppress(OSError):
                others = [p for p in self.cache_dir.glob("*.pt2") if not p.name.startswith(self.fingerprint)]
                if others:
                    log.info(
                        "compile cache %s holds %d packages, none for this step (fingerprint %s: this torch, CPU "
                        "(vector ISA %s, its feature flags), thread count, model and cosystream version): its "
                        "shapes run eager until compiled here",
                        self.cache_dir,
                        len(others),
                        self.fingerprint,
                        torch.backends.cpu.get_cpu_capability(),
                    )
        log.info(
            "compiled CPU steps: %d keys (%d from the cache, %d compiled in %.1f s), %d left eager; cache %s",
            len(self._loaders),
            self.loaded,
            self.compiled,
            self._spent_s,
            self.skipped,
            self.cache_dir,
        )

    def _trim_cache(self) -> None:
        """Remove the least recently used packages past ``CACHE_MAX_BYTES`` (never one this process uses)."""
        if self.refused:
            return
        try:
            packages = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.cache_dir.glob("*.pt2")]
        except OSError:
            return
        total = sum(size for _, size, _ in packages)
        in_use = {self.path(key) for key in self._loaders}
        removed: list[str] = []
        for _, size, path in sorted(packages):
            if total <= CACHE_MAX_BYTES:
                break
            if path not in in_use:
                with contextlib.suppress(OSError):
                    path.unlink()
                    total -= size
                    removed.append(path.name)
        if any(name in self._index() for name in removed):
            with contextlib.suppress(OSError), self._locked(fcntl.LOCK_EX):
                self._update_index(dict.fromkeys(removed))

    def replay(self, key: Hashable, args: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """Run ``key``'s compiled step on its captured arguments (or on ``args``, tensors of the same shapes);
        returns its output (a new tensor)."""
        return self.call(self._loaders[key], self._args[key] if args is None else args)
