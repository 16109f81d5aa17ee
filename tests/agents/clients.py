"""The agent CLIs the tier runs: pinned versions, their install from the npm registry,
and a two-step task (a task, then the same conversation resumed) run by each.

Versions are pinned here and nowhere else; ``VCACHE_AGENT_CODEX_VERSION``,
``VCACHE_AGENT_CLAUDE_CODE_VERSION`` and ``VCACHE_AGENT_OPENCODE_VERSION`` check
another one.  Each version is installed once into
``~/.cache/vcache/agent-clis/<agent>-<version>`` (outside the repository, reused
while its binary answers ``--version``).

A run is isolated: a scratch git repository to work in, a HOME (and CODEX_HOME)
of its own, an environment built from nothing but what the CLI needs, and the
settings that keep each CLI off the internet (Codex: plugins and analytics
off; Claude Code: ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``; opencode: no
models.dev list, update check, language servers or sharing; it still installs its
plugin package from the npm registry into its HOME).  Every step
runs under a timeout in a process group of its own, killed whole when the step
ends, however it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CODEX_VERSION = "0.171.0"
CLAUDE_CODE_VERSION = "2.1.337"
OPENCODE_VERSION = "1.18.33"

Target = Literal["local", "emulated"]
TARGETS: tuple[Target, ...] = ("local", "emulated")

INSTALL_TIMEOUT_S = 600.0
STEP_TIMEOUT_S = 180.0

TASK = "Add a line 'Usage: run make' to README.md"
FOLLOW_UP = "Now also add a License section"


@dataclass(frozen=True)
class Agent:
    name: str  # codex | claude-code
    package: str  # on the npm registry
    version: str
    bin: str  # the command the package installs
    default_model: str  # what the CLI asks for unless told otherwise

    def model(self, target: Target) -> str:
        """The model name the agent asks the gateway for: its own default on the local
        model, an alias of the same name with ``-emulated`` for the emulator."""
        return self.default_model if target == "local" else f"{self.default_model}-emulated"


CODEX = Agent(
    "codex",
    "@openai/codex",
    os.environ.get("VCACHE_AGENT_CODEX_VERSION") or CODEX_VERSION,
    "codex",
    "gpt-5.5",
)
CLAUDE_CODE = Agent(
    "claude-code",
    "@anthropic-ai/claude-code",
    os.environ.get("VCACHE_AGENT_CLAUDE_CODE_VERSION") or CLAUDE_CODE_VERSION,
    "claude",
    "claude-opus-5-5",
)
# an agent on Chat Completions: opencode through the AI SDK's OpenAI-compatible provider,
# asking for a model a vLLM host would serve it
OPENCODE = Agent(
    "opencode",
    "opencode-ai",
    os.environ.get("VCACHE_AGENT_OPENCODE_VERSION") or OPENCODE_VERSION,
    "opencode",
    "qwen3-coder",
)
AGENTS = (CODEX, CLAUDE_CODE, OPENCODE)


def aliases(providers: dict[str, str]) -> dict[str, list[str]]:
    """The gateway aliases the agents' model names need: each default to ``local``, each
    ``-emulated`` name to the emulated provider's model (``providers``: agent → target)."""
    out = {a.model("local"): ["local"] for a in AGENTS}
    out |= {a.model("emulated"): [providers[a.name]] for a in AGENTS}
    return out


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vcache" / "agent-clis"


class NpmMissing(RuntimeError):
    pass


def _answers(binary: Path) -> bool:
    try:
        r = subprocess.run(
            [str(binary), "--version"], capture_output=True, timeout=60, env=_base_env()
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def install(agent: Agent, root: Path | None = None) -> Path:
    """The agent's binary, installed from the npm registry into the cache when it is not
    there yet.  Raises :class:`NpmMissing` without ``npm``."""
    root = root or cache_root()
    home = root / f"{agent.name}-{agent.version}"
    binary = home / "node_modules" / ".bin" / agent.bin
    if binary.exists() and _answers(binary):
        return binary
    npm = shutil.which("npm")
    if npm is None:
        raise NpmMissing(f"npm is not installed: cannot install {agent.package}@{agent.version}")
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{agent.name}-", dir=root))
    try:
        cmd = [
            npm,
            "install",
            "--no-audit",
            "--no-fund",
            "--prefix",
            str(staging),
            f"{agent.package}@{agent.version}",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-4000:]}")
        shutil.rmtree(home, ignore_errors=True)
        staging.rename(home)  # whole or not at all: a killed install leaves only staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not _answers(binary):
        raise RuntimeError(f"{binary} --version fails after installing it")
    return binary


def _base_env() -> dict[str, str]:
    """PATH for git, bash and node (the CLIs' shims); locale."""
    node = shutil.which("node")
    dirs = [str(Path(node).parent)] if node else []
    dirs += ["/usr/local/bin", "/usr/bin", "/bin"]
    return {"PATH": os.pathsep.join(dict.fromkeys(dirs)), "LANG": "C.UTF-8"}


@dataclass(frozen=True)
class Step:
    argv: tuple[str, ...]
    returncode: int | None  # None: killed at the timeout
    seconds: float
    stdout: str
    stderr: str

    def describe(self) -> str:
        rc = "timed out" if self.returncode is None else f"exit {self.returncode}"
        return (
            f"{' '.join(self.argv[1:3])} ... ({rc}, {self.seconds:.1f} s)\n"
            f"--- stdout (tail)\n{self.stdout[-1500:]}\n--- stderr (tail)\n{self.stderr[-2500:]}"
        )


def _run(argv: list[str], cwd: Path, env: dict[str, str], logs: Path, timeout_s: float) -> Step:
    """One step in a process group of its own, stdin closed, killed whole at the end."""
    out, err = logs.with_suffix(".out"), logs.with_suffix(".err")
    t0 = time.monotonic()
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=o,
            stderr=e,
            start_new_session=True,
        )
        rc: int | None = None
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its children too (tools, sub-agents)
            proc.wait()
    return Step(
        tuple(argv),
        rc,
        time.monotonic() - t0,
        out.read_text(errors="replace"),
        err.read_text(errors="replace"),
    )


def _scratch_repo(work: Path, env: dict[str, str]) -> None:
    work.mkdir(parents=True)
    (work / "README.md").write_text("# demo\n\nA scratch project.\n")
    who = ["-c", "user.email=agents@vcache.test", "-c", "user.name=vcache agents"]
    for cmd in (["init", "-q", "."], ["add", "README.md"], [*who, "commit", "-qm", "init"]):
        subprocess.run(["git", *cmd], cwd=work, env=env, check=True, timeout=60)


def _codex(binary: Path, model: str, base_url: str, key: str, root: Path) -> Runner:
    codex_home = root / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "vcache"\n\n'
        '[model_providers.vcache]\nname = "vcache"\n'
        f'base_url = "{base_url}/v1"\nwire_api = "responses"\nenv_key = "VCACHE_API_KEY"\n\n'
        # off the internet: no plugin sync (github.com, chatgpt.com), no analytics
        "[features]\nplugins = false\n\n[analytics]\nenabled = false\n"
    )
    env = {"CODEX_HOME": str(codex_home), "VCACHE_API_KEY": key}
    first = [str(binary), "exec", "--skip-git-repo-check", TASK]
    again = [str(binary), "exec", "resume", "--last", "--skip-git-repo-check", FOLLOW_UP]
    return Runner(env, first, again)


def _claude(binary: Path, model: str, base_url: str, key: str, root: Path) -> Runner:
    env = {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no calls home
        # every model slot on the leg's name: a sub-agent or a small-model request asks
        # for one of these, and the gateway knows only the leg's aliases
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_FABLE_MODEL": model,  # a sub-agent asked claude-fable-5-2 once
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_WORKFLOW_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_AUTO_MODE_MODEL": model,
        "CLAUDE_CODE_BG_CLASSIFIER_MODEL": model,
    }
    if model != CLAUDE_CODE.default_model:
        env["ANTHROPIC_MODEL"] = model
    if os.geteuid() == 0:  # --dangerously-skip-permissions refuses root otherwise
        env["IS_SANDBOX"] = "1"
    flags = ["--dangerously-skip-permissions"]
    first = [str(binary), "-p", TASK, *flags]
    again = [str(binary), "-p", "--continue", FOLLOW_UP, *flags]
    return Runner(env, first, again)


def _opencode(binary: Path, model: str, base_url: str, key: str, root: Path) -> Runner:
    config = {
        "provider": {
            "vcache": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "vcache",
                "options": {"baseURL": f"{base_url}/v1", "apiKey": "{env:VCACHE_API_KEY}"},
                "models": {model: {"name": model}},
            }
        },
        "model": f"vcache/{model}",
        "small_model": f"vcache/{model}",  # its titles and summaries too
        "autoupdate": False,
        "share": "disabled",
    }
    path = root / "opencode.json"
    path.write_text(json.dumps(config))
    env = {
        "OPENCODE_CONFIG": str(path),
        "VCACHE_API_KEY": key,
        # off the internet but for the npm registry (its plugin package): no model list
        # from models.dev, no update check, no language servers fetched
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_SHARE": "1",
    }
    first = [str(binary), "run", TASK]
    again = [str(binary), "run", "--continue", FOLLOW_UP]
    return Runner(env, first, again)


@dataclass(frozen=True)
class Runner:
    env: dict[str, str]
    first: list[str]
    again: list[str]


_RUNNERS: dict[str, Callable[[Path, str, str, str, Path], Runner]] = {
    CODEX.name: _codex,
    CLAUDE_CODE.name: _claude,
    OPENCODE.name: _opencode,
}


def two_steps(
    agent: Agent,
    binary: Path,
    target: Target,
    base_url: str,
    key: str,
    root: Path,
    timeout_s: float = STEP_TIMEOUT_S,
    go_on: Callable[[], bool] = lambda: True,
) -> list[Step]:
    """The task, then (when it exited 0 and ``go_on()`` says so) the follow-up in the
    same conversation; the steps that ran.  ``root``: a new directory for the run."""
    root.mkdir(parents=True)
    home, tmp = root / "home", root / "tmp"
    home.mkdir()
    tmp.mkdir()
    env = _base_env() | {"HOME": str(home), "TMPDIR": str(tmp)}
    work = root / "work"
    _scratch_repo(work, env)
    runner = _RUNNERS[agent.name](binary, agent.model(target), base_url, key, root)
    env |= runner.env
    steps = [_run(runner.first, work, env, root / "step1", timeout_s)]
    if steps[0].returncode == 0 and go_on():
        steps.append(_run(runner.again, work, env, root / "step2", timeout_s))
    return steps
