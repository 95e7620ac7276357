"""The README, run as a new user runs it (issue 47): every ```bash block, in order, through one
bash shell, each command exactly as written, in a fresh clone (a directory whose name has a
space) with a fresh HOME; ```python blocks with the venv's python. A command that exits with
anything but 0, or any traceback in the output, fails the test.

Two things differ from a user's machine, both invisible to the README:

- `pip install` really runs (it resolves every requirement of the extra against what is
  installed, builds jaxmoe and installs it into the new venv), but offline: the packages it
  finds already installed are this test run's own (links to the CI venv's site-packages,
  its jaxmoe left out, on PYTHONPATH), with no index and no build isolation. So nothing is
  downloaded at test time.
- `JAXMOE_TEST_MAX_STEPS` caps every `jaxmoe train` (cli/train.py's test hook): the first
  command's 600 steps take minutes on 2 cores.

Blocks after a `readme-test: parse` comment (pod-sized, or needing downloads) are not run:
their jaxmoe commands are parsed and their configs loaded, and the repository files they
name must exist. The block after `readme-test: ci` is CI itself (.ci/run).

Slow lane: the walkthrough takes about 8-10 minutes on CI's 2 cores.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
STEPS_FOR_TESTS = "8"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!--\s*readme-test:\s*(\w+)\s*-->\s*$")
KINDS = ("parse", "ci")


@dataclass(frozen=True)
class Block:
    language: str
    text: str
    kind: str  # "run", or the marker on the line before it
    line: int


def readme_blocks(text: str = README) -> list[Block]:
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        kind = marker.group(1) if marker else "run"
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(match.group(1), match.group(2), kind, line))
    return blocks


def commands(block: Block) -> list[str]:
    """A block's commands: its lines, continuation lines joined, comments and blanks left out."""
    out, pending = [], ""
    for line in block.text.splitlines():
        if pending:
            line = pending + line
            pending = ""
        if line.endswith("\\"):
            pending = line[:-1]
        elif line.strip() and not line.lstrip().startswith("#"):
            out.append(line)
    return out


def jaxmoe_argv(command: str) -> list[str] | None:
    """The jaxmoe arguments of a command: `jaxmoe ...`, or what a launch/ script runs after
    `--`; None for a command that runs no jaxmoe."""
    words = shlex.split(command)
    if words[0] == "jaxmoe":
        return words[1:]
    if words[0].startswith("launch/") and "--" in words:
        return words[words.index("--") + 1 :]
    return None


def test_readme_blocks_are_marked_and_runnable_in_order():
    blocks = readme_blocks()
    assert [b.kind for b in blocks if b.kind not in ("run", *KINDS)] == []
    assert [b.language for b in blocks] and all(b.language in ("bash", "python") for b in blocks)
    first = commands(blocks[0])[0]
    assert "pip install -e '.[data]'" in first and "--workdir runs/default" in first
    assert sum(b.kind == "ci" for b in blocks) == 1


def test_table_examples_are_commands_the_readme_runs():
    """Each example in the command table starts a command of a bash block (run or parsed)."""
    shown = [
        " ".join(shlex.split(part))
        for b in readme_blocks()
        if b.language == "bash" and b.kind != "ci"
        for c in commands(b)
        for part in c.split("&&")
    ]
    examples = [
        span
        for line in README.splitlines()
        if line.startswith("| `")
        for span in re.findall(r"`(jaxmoe [^`]+)`", line)
        if len(shlex.split(span)) > 2
    ]
    assert len(examples) > 10
    missing = [
        e for e in examples if not any(s.startswith(" ".join(shlex.split(e))) for s in shown)
    ]
    assert not missing, f"table examples no README block runs: {missing}"


def test_parsed_blocks_name_real_files_flags_and_config_keys():
    from jaxmoe.cli import _split_overrides, build_parser
    from jaxmoe.config.loading import load_config

    checked = 0
    for block in (b for b in readme_blocks() if b.kind == "parse"):
        for command in commands(block):
            words = shlex.split(command)
            for word in words:
                path = word.split("=", 1)[-1].split(":", 1)[0]
                if re.match(r"(configs|launch|tests|examples)/", path):
                    assert (ROOT / path).exists(), f"README line {block.line}: no {path}"
            argv = jaxmoe_argv(command)
            if argv is None:
                continue
            rest, overrides = _split_overrides(argv)
            if rest[0] == "lm-eval":  # every flag is lm-eval's
                continue
            args = build_parser().parse_args(rest)
            if getattr(args, "config", None):
                load_config(args.config, overrides)
            checked += 1
    assert checked >= 3


def _fresh_clone(where: Path) -> Path:
    """The tracked files as they are now, as a new git repository (so `git status` can say
    what the walkthrough left untracked)."""
    clone = where / "my clone"
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in names)):
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    for step in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "fresh clone"]):
        subprocess.run([*git, *step], cwd=clone, check=True, capture_output=True)
    return clone


def _installed_packages(links: Path) -> Path:
    """A folder of links to what this test run has installed, without jaxmoe: the clone's
    venv must import the clone's jaxmoe (the editable install's finder module has the same
    name in every venv), and pip must not find a jaxmoe installed already."""
    links.mkdir()
    for site in {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}:
        for entry in Path(site).iterdir():
            name = entry.name.lower()
            if "jaxmoe" in name or entry.suffix == ".pth" or (links / entry.name).exists():
                continue  # .pth files run only in a venv's own site-packages
            (links / entry.name).symlink_to(entry)
    return links


def _user_env(where: Path) -> dict:
    """A new user's shell: a fresh HOME, `python3` the base interpreter, nothing of this
    test run's environment but the offline package source (see the module doc)."""
    bin_dir = where / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(getattr(sys, "_base_executable", sys.executable))
    env = {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(where / "home"),
        "LANG": "C.UTF-8",
        "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
        "PYTHONPATH": str(_installed_packages(where / "site-packages")),
        "PIP_NO_INDEX": "1",
        "PIP_NO_BUILD_ISOLATION": "0",  # pip reads this variable inverted: 0 = no isolation
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "JAXMOE_TEST_MAX_STEPS": STEPS_FOR_TESTS,
    }
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # CI's: the same programs compile once
        env["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
    (where / "home").mkdir()
    return env


def _script(blocks: list[Block], where: Path) -> str:
    """One bash script: each command as written, its exit status checked right after it."""
    lines = ["set -o pipefail"]
    for index, block in enumerate(b for b in blocks if b.kind == "run"):
        if block.language == "python":
            source = where / f"readme_block_{index}.py"
            source.write_text(block.text)
            todo = [f"python {shlex.quote(str(source))}"]
        else:
            todo = commands(block)
        for command in todo:
            label = shlex.quote(f"README line {block.line}: {command}")
            lines += [
                f"printf '@@ %s\\n' {label}",
                command,
                f"status=$?; if [ $status -ne 0 ]; then printf '@@ FAILED (exit %s): %s\\n' "
                f"$status {label}; exit $status; fi",
            ]
    return "\n".join(lines) + "\n"


@pytest.mark.slow
def test_readme_runs_as_typed_in_a_fresh_clone(tmp_path):
    clone, env = _fresh_clone(tmp_path), _user_env(tmp_path)
    script = tmp_path / "readme.sh"
    script.write_text(_script(readme_blocks(), tmp_path))
    log = tmp_path / "readme.log"
    with log.open("w") as out:
        result = subprocess.run(
            ["bash", str(script)], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT,
            timeout=2400,
        )  # fmt: skip
    text = log.read_text()
    assert result.returncode == 0, text[-6000:]
    assert "Traceback (most recent call last)" not in text, text[text.index("Traceback") - 3000 :]

    # The first command's story: what it wrote where, and what to run next.
    first = text[: text.index("@@ README", text.index("@@ README") + 1)]
    assert "runs/default/ holds:" in first and "next:" in first, first[-3000:]
    assert (clone / "runs/default/curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # What the training output tells to run for the TensorBoard logs is installed.
    tensorboard = subprocess.run(
        [str(clone / ".venv/bin/python"), "-c", "import tensorboard"], env=env, cwd=clone
    )
    assert tensorboard.returncode == 0
    # Run again, a finished run says so (and trains nothing).
    first_command = commands(readme_blocks()[0])[0].split("&&")[-1]  # jaxmoe train ...
    again = subprocess.run(
        [str(clone / ".venv/bin/python"), "-m", "jaxmoe", *shlex.split(first_command)[1:]],
        cwd=clone, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"runs/default is finished: step {STEPS_FOR_TESTS} of" in again.stdout, again.stdout
    # Nothing the walkthrough wrote is left untracked in the checkout (.gitignore covers it).
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=clone, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert status.stdout == "", status.stdout
