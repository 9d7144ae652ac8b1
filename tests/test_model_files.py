"""A model directory is its config, its vocabulary and its weights: one without weights, or whose weights do
not fit its config, is refused with a message naming what is wrong, never served with random weights.

Here through ``load_model``; ``tests/test_admin.py`` pins the same through a live server's Admin service,
and the last test through ``cosystream serve --model``.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from cosystream.models import load_model
from cosystream.models.loading import DEFAULT_MODEL_DIR, WEIGHTS_FILE, ModelFileError
from tests.servers import serve_argv


def copy_of_default(directory) -> str:
    shutil.copytree(DEFAULT_MODEL_DIR, directory, dirs_exist_ok=True)
    return str(directory)


def rewrite_weights(directory, change) -> None:
    """The weights of the model in ``directory`` after ``change(tensors)`` (a dict it edits in place)."""
    weights = f"{directory}/{WEIGHTS_FILE}"
    tensors = load_file(weights)
    change(tensors)
    save_file(tensors, weights)


def test_a_directory_without_weights_is_refused_naming_the_file(tmp_path):
    directory = copy_of_default(tmp_path / "m")
    (tmp_path / "m" / WEIGHTS_FILE).unlink()
    with pytest.raises(ModelFileError) as caught:
        load_model(directory)
    message = str(caught.value)
    assert str(tmp_path / "m" / WEIGHTS_FILE) in message and "no weights" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda t: t.pop("head.weight"), "missing head.weight"),
        (lambda t: t.update(extra=torch.zeros(3)), "unexpected extra"),
        (lambda t: t.update({"head.bias": torch.zeros(1)}), "head.bias has shape (1,)"),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_weights_that_do_not_fit_the_config_are_refused(tmp_path, change, says):
    directory = copy_of_default(tmp_path / "m")
    rewrite_weights(directory, change)
    with pytest.raises(ModelFileError) as caught:
        load_model(directory)
    message = str(caught.value)
    assert says in message and WEIGHTS_FILE in message and "\n" not in message, message


def test_a_directory_without_a_config_is_refused_naming_it(tmp_path):
    directory = copy_of_default(tmp_path / "m")
    (tmp_path / "m" / "config.json").unlink()
    with pytest.raises(ModelFileError, match=r"config\.json"):
        load_model(directory)


def test_the_embedded_models_load():
    from cosystream.model_files import EMBEDDED_MODELS

    for directory in EMBEDDED_MODELS.values():
        assert load_model(directory).config.vocabulary


def test_serve_refuses_a_model_without_weights_at_start(tmp_path):
    directory = copy_of_default(tmp_path / "m")
    (tmp_path / "m" / WEIGHTS_FILE).unlink()
    done = subprocess.run(
        serve_argv("--frontends", "1", "--model", directory), capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cosystream serve: "), done.stderr  # (before any engine)
    assert f"{tmp_path / 'm' / WEIGHTS_FILE}" in lines[0] and "no weights" in lines[0], lines
