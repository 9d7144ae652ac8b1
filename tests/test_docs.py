"""The documentation's commands, run as a reader would run them.

Every fenced block of README.md and docs/*.md names its language. A shell or Python block also says what it
is for: ```` ```bash run ```` / ```` ```python run ```` blocks are run here, from a copy of the repository root
(so the files they write land in a temporary folder, never in the checkout), with the venv's ``bin`` first
on PATH (as after the README's ``. .venv/bin/activate``), against a live ``cosystream serve`` on the
documented default ports: gRPC 50051, metrics 9090 (and HTTP 8080, where the server has an HTTP port). A
block that cannot run as is (a cluster, a GPU, a microphone, a server of its own) is tagged
```` ```bash illustration ```` and the prose right before it says it is an illustration.

A ```` ```text output ```` block right after a run block shows what that block prints, and its stdout must
have that shape: line for line, where a number stands for any number, ``…`` for any text within a line,
and a line of just ``…`` for any number of lines.

The blocks of one document run in order, in that document's own copy of the repository, so a block may use
a file an earlier block of the same page made (``espeak-ng -w speech.wav ...``). A bash block runs as one
``bash -e -o pipefail`` script, a Python block as a file in the copy's root; each must exit 0 within
``BLOCK_TIMEOUT_S``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"bash", "sh", "shell", "console", "zsh"}
PYTHONS = {"python", "py", "python3", "pycon"}
KINDS = {"run", "illustration"}
GRPC_PORT, METRICS_PORT, HTTP_PORT = 50051, 9090, 8080
BLOCK_TIMEOUT_S = 180
START_TIMEOUT_S = 120
VENV_BIN = Path(sys.executable).parent  # the Python running the tests, as the reader's activated venv
NUMBER = re.compile(r"[-+]?\d+(?:[.,]\d+)*")


@dataclass(frozen=True)
class Block:
    page: str  # the file's path from the repository root
    line: int  # of the opening fence, 1-based
    language: str
    kind: str  # the info string's second word: run, illustration, output, or ""
    text: str
    before: str  # the prose since the previous block

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.kind == "run" and self.language in SHELLS | PYTHONS


def blocks(doc: Path) -> list[Block]:
    """The fenced blocks of a Markdown file (``` or ~~~ fences, indented up to three spaces)."""
    page = str(doc.relative_to(ROOT)) if doc.is_relative_to(ROOT) else doc.name
    found, prose = [], []
    lines = doc.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^( {0,3})(`{3,}|~{3,})\s*(.*)$", lines[i])
        if not opening:
            prose.append(lines[i])
            i += 1
            continue
        indent, fence, info = len(opening.group(1)), opening.group(2), opening.group(3).split()
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", lines[j]):
            body.append(re.sub(rf"^ {{0,{indent}}}", "", lines[j]))  # the fence's own indent, no more
            j += 1
        language = info[0].lower() if info else ""
        kind = info[1].lower() if len(info) > 1 else ""
        found.append(Block(page, i + 1, language, kind, "\n".join(body) + "\n", "\n".join(prose)))
        prose = []
        i = j + 1
    return found


def problems(doc_blocks: list[Block]) -> list[str]:
    """What breaks the convention in one document's blocks."""
    found = []
    for index, block in enumerate(doc_blocks):
        if not block.language:
            found.append(
                f"{block.where}: a block with no language: name it (```text for output and diagrams, "
                "```bash run / ```bash illustration for commands)"
            )
        elif block.language in SHELLS | PYTHONS:
            if block.kind not in KINDS:
                found.append(
                    f"{block.where}: ```{block.language} needs a second word: run (the docs test runs it) "
                    "or illustration (it cannot run as is; the prose before it says so)"
                )
            elif block.kind == "illustration" and "illustrat" not in last_paragraphs(block.before).lower():
                found.append(f"{block.where}: an illustration whose prose before it does not say it is one")
        elif block.kind == "output":
            previous = doc_blocks[index - 1] if index else None
            if previous is None or previous.kind != "run":
                found.append(f"{block.where}: an output block that does not follow a run block")
    return found


def last_paragraphs(prose: str, count: int = 2) -> str:
    paragraphs = [p for p in re.split(r"\n\s*\n", prose) if p.strip()]
    return "\n".join(paragraphs[-count:])


def test_every_command_block_says_whether_it_runs():
    found = [problem for doc in DOCS for problem in problems(blocks(doc))]
    assert not found, "\n".join(found)


def test_the_convention_is_checked(tmp_path):
    """An untagged command, an unlabelled illustration and an orphan output block are each caught."""
    doc = tmp_path / "page.md"
    doc.write_text(
        "Text.\n\n```bash\nls\n```\n\n```\nls\n```\n\nNo word for it.\n\n```python illustration\nx\n```\n\n"
        "An illustration:\n\n```sh illustration\nmake\n```\n\n```text output\nx\n```\n\n```yaml\na: 1\n```\n"
    )
    found = problems(blocks(doc))
    assert [p.split(":")[1] for p in found] == ["3", "7", "13", "23"], found


def output_pattern(shown: str) -> list[re.Pattern | None]:
    """Line patterns of an output block (None: any number of lines)."""
    patterns = []
    for line in shown.strip().splitlines():
        line = line.strip()
        if not line:
            continue
        if line == "…":
            patterns.append(None)
            continue
        parts = []
        for token in re.split(rf"({NUMBER.pattern}|…|\s+)", line):
            if token == "…":
                parts.append(".*?")
            elif token.isspace():
                parts.append(r"\s*")
            elif NUMBER.fullmatch(token):
                parts.append(NUMBER.pattern)
            else:
                parts.append(re.escape(token))
        patterns.append(re.compile("".join(parts)))
    return patterns


def has_shape(output: str, patterns: list[re.Pattern | None]) -> bool:
    lines = [line.strip() for line in output.splitlines() if line.strip()]

    def match(i: int, j: int) -> bool:  # lines[i:] against patterns[j:]
        if j == len(patterns):
            return i == len(lines)
        if patterns[j] is None:
            return any(match(k, j + 1) for k in range(i, len(lines) + 1))
        return i < len(lines) and patterns[j].fullmatch(lines[i]) is not None and match(i + 1, j + 1)

    return match(0, 0)


def test_output_shapes():
    shown = "[   0.01 -    2.58] the quick …\n…\nrealtime=30 chunk p50=9.2ms errors=0\n"
    patterns = output_pattern(shown)
    assert has_shape("[  10.40 - 12.00] the quick red fox\nrealtime=4 chunk p50=10ms errors=0\n", patterns)
    assert has_shape("[ 0.01 - 2.58] the quick\na\nb\nrealtime=4 chunk p50=1.5ms errors=12\n", patterns)
    assert not has_shape("[ 0.01 - 2.58] a slow fox\nrealtime=4 chunk p50=1.5ms errors=0\n", patterns)
    assert not has_shape("[ 0.01 - 2.58] the quick\n", patterns)
    assert not has_shape("realtime=4 chunk p50=1.5ms errors=0\n", patterns)


# --- the live server and the runs -----------------------------------------------------------------------


def port_taken(port: int) -> bool:
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                return True
    return False


def serving(address: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            request = health_pb2.HealthCheckRequest(service="cosystream.v1.CosyStream")
            status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status
        except grpc.RpcError:
            return False
    return status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``cosystream serve`` with its default ports, as the README starts it (on loopback only)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("the docs make their speech with espeak-ng (apt-get install espeak-ng)")
    # (--admin: MODELS.md loads; no background compile: it would compile into this user's own cache)
    command = [str(VENV_BIN / "cosystream"), "serve", "--host", "127.0.0.1", "--admin", "--no-background-compile"]
    ports = {"gRPC": GRPC_PORT, "metrics": METRICS_PORT}
    help_text = subprocess.run([*command[:2], "--help"], capture_output=True, text=True, timeout=60).stdout
    if "--http-port" in help_text:
        command += ["--http-port", str(HTTP_PORT)]
        ports["HTTP"] = HTTP_PORT
    taken = [f"{name} {port}" for name, port in ports.items() if port_taken(port)]
    if taken:
        pytest.fail(
            f"taken: {', '.join(taken)}. The docs use the default ports, so this test serves on them: stop "
            "what listens there (ss -ltnp) and run it again",
            pytrace=False,
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYSTREAM_")}
    process = subprocess.Popen(
        command,
        cwd=tmp_path_factory.mktemp("serve"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(process.stdout), daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not serving(f"127.0.0.1:{GRPC_PORT}"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"{' '.join(command)} did not start:\n" + "".join(log), pytrace=False)
        time.sleep(0.2)
    try:
        yield log
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Page:
    """One document's copy of the repository and which of its run blocks ran."""

    root: Path
    ran: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)


def repository_files() -> list[str]:
    """What a clone has, plus this checkout's new files: tracked and untracked, not ignored."""
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", ".cache", "data", "runs", "build", ".gpu", "__pycache__"}
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.parts)]
    return [name for name in listing.decode().split("\0") if name]


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """``pages(doc)``: the document's :class:`Page`, its copy of the repository made on first use."""
    files = repository_files()
    made: dict[Path, Page] = {}

    def page(doc: Path) -> Page:
        if doc not in made:
            root = tmp_path_factory.mktemp(doc.stem.lower())
            for name in files:
                if (ROOT / name).is_file():
                    (root / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / name, root / name)
            (root / ".venv").symlink_to(VENV_BIN.parent, target_is_directory=True)  # for `. .venv/bin/activate`
            made[doc] = Page(root)
        return made[doc]

    return page


def run_block(block: Block, root: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYSTREAM_") and k != "PYTHONPATH"}
    env.update(PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(VENV_BIN.parent))
    env.pop("PYTHONHOME", None)
    if block.language in PYTHONS:
        script = root / f"docs_block_{block.line}.py"
        script.write_text(block.text)
        command = ["python", script.name]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", block.text]
    try:
        return subprocess.run(
            command,
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        output = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else err.stdout or ""
        pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT_S} s:\n{block.text}--- stdout\n{output}")


def report(block: Block, done: subprocess.CompletedProcess, why: str, server_log: list[str]) -> str:
    return (
        f"{block.where}: {why}\n--- the block\n{block.text}--- exit {done.returncode}, stdout\n{done.stdout}"
        f"--- stderr\n{done.stderr}--- the server's last lines\n{''.join(server_log[-15:])}"
    )


ALL_BLOCKS = {doc: blocks(doc) for doc in DOCS}
RUN_BLOCKS = [(doc, i) for doc, found in ALL_BLOCKS.items() for i, b in enumerate(found) if b.runs]


@pytest.mark.parametrize(
    ("doc", "index"), RUN_BLOCKS, ids=[ALL_BLOCKS[doc][i].where.replace("/", "-") for doc, i in RUN_BLOCKS]
)
def test_run_block(server, pages, doc, index):
    found = ALL_BLOCKS[doc]
    page = pages(doc)
    for earlier in [i for i, b in enumerate(found[:index]) if b.runs]:
        if earlier in page.failed:
            pytest.fail(f"{found[index].where} comes after {found[earlier].where}, which failed", pytrace=False)
        if earlier not in page.ran:  # (a block chosen alone with -k: what comes before it on its page first)
            done = run_block(found[earlier], page.root)
            page.ran.add(earlier)
            if done.returncode != 0:
                page.failed.add(earlier)
                pytest.fail(report(found[earlier], done, "an earlier block failed", server), pytrace=False)
    block = found[index]
    done = run_block(block, page.root)
    page.ran.add(index)
    if done.returncode != 0:
        page.failed.add(index)
        pytest.fail(report(block, done, "exited non-zero", server), pytrace=False)
    shown = found[index + 1] if index + 1 < len(found) and found[index + 1].kind == "output" else None
    if shown is not None and not has_shape(done.stdout, output_pattern(shown.text)):
        pytest.fail(
            report(
                block, done, f"its output does not have the shape shown at {shown.where}:\n{shown.text}", server
            ),
            pytrace=False,
        )


def test_transcribe_prints_only_its_results_as_the_readme_says(server, tmp_path):
    """In-process and through a server: the transcript on stdout and nothing on stderr; ``--log-level info``
    (after the command name too) brings the logs back."""
    wav = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "the quick brown fox jumps over the lazy dog"], check=True)
    command = [str(VENV_BIN / "cosystream"), "transcribe", str(wav)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYSTREAM_")}
    for extra in ([], ["--server", f"localhost:{GRPC_PORT}"]):
        done = subprocess.run([*command, *extra], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert re.fullmatch(r"\[ *[\d.]+ - +[\d.]+\] \S.*\n", done.stdout), done.stdout
    done = subprocess.run([*command, "--log-level", "info"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and " INFO " in done.stderr and "engine ready" in done.stderr, done.stderr
