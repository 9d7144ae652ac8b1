"""The import-layer check (scripts/check_layers.py): the tree passes it, and it catches each kind of breach."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_layers.py"


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60)


def test_the_tree_keeps_its_layers():
    result = check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "layers: ok"


def copy_tree(tmp_path: Path) -> Path:
    for tree in ("cosystream", "training", "benchmarks", "clients"):
        shutil.copytree(ROOT / tree, tmp_path / tree, ignore=shutil.ignore_patterns("__pycache__", "default"))
    return tmp_path


def append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_an_import_against_the_layer_order_fails(tmp_path):
    root = copy_tree(tmp_path)
    append(root / "cosystream/engine/core.py", "from cosystream.server import servicer  # noqa")
    result = check(root)
    assert result.returncode == 1
    assert "cosystream/engine/core.py" in result.stdout and "against the layer order" in result.stdout


def test_audio_and_decoding_import_no_engine(tmp_path):
    root = copy_tree(tmp_path)
    append(root / "cosystream/decoding/lm.py", "import cosystream.engine.scheduler  # noqa")
    assert "decoding imports cosystream.engine.scheduler" in check(root).stdout


def test_a_client_may_use_only_the_wire_api(tmp_path):
    root = copy_tree(tmp_path)
    append(root / "clients/caption.py", "from cosystream.audio.codecs import encode_mulaw  # noqa")
    result = check(root)
    assert result.returncode == 1 and "a client imports cosystream.audio.codecs" in result.stdout


def test_a_cycle_fails_even_through_a_function_level_import(tmp_path):
    root = copy_tree(tmp_path)
    append(root / "training/text.py", "def late():\n    from training import corpus  # noqa")
    result = check(root)
    assert result.returncode == 1 and "import cycle: training.corpus <-> training.text" in result.stdout


def test_a_frontend_that_would_load_torch_fails(tmp_path):
    root = copy_tree(tmp_path)
    append(root / "cosystream/audio/vad.py", "import torch  # noqa")
    result = check(root)
    assert result.returncode == 1
    assert "a frontend process would load torch: cosystream.audio.vad" in result.stdout, result.stdout


def test_a_supervisor_that_would_load_torch_fails(tmp_path):
    """``serve``'s supervisor reads the engine's configuration and spawns it, without torch: an import of the
    engine's own module where the spawn is made is caught."""
    root = copy_tree(tmp_path)
    append(root / "cosystream/engine/launch.py", "from cosystream.engine.process import engine_main  # noqa")
    result = check(root)
    assert result.returncode == 1
    assert "the supervisor would load torch: cosystream.engine.launch" in result.stdout, result.stdout
