"""Readers of the deployment artefacts, shared by the deploy and observability tests.

Small parsers for what has no library here: the Dockerfile (instructions, stages, the
exec-form CMD/HEALTHCHECK) and ``.dockerignore`` (Docker's rules: patterns matched against
a path and its parents, the last matching pattern wins, ``!`` re-includes).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvsvc.ports import is_unix_address
from tests import tooling

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
COMPOSE = DEPLOY / "compose.yaml"
KUBERNETES = DEPLOY / "kubernetes"
PROMETHEUS = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "kvsvc-dashboard.json"
CLUSTER_DASHBOARD = GRAFANA / "kvsvc-cluster-index.json"

# The worker agent's /metrics port in every artefact (the agent has no default of its own;
# the server's ports are kvsvc.server.config's defaults).
AGENT_METRICS_PORT = 9401


def load_yaml_documents(path: Path) -> list[Any]:
    """Every YAML document in ``path`` (PyYAML's safe loader; empty documents dropped)."""
    yaml = pytest.importorskip("yaml", reason="pyyaml (dev extra) parses the YAML artefacts")
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def load_yaml(path: Path) -> Any:
    """The single YAML document in ``path``."""
    docs = load_yaml_documents(path)
    assert len(docs) == 1, f"{path}: expected one YAML document, found {len(docs)}"
    return docs[0]


def require_tool(name: str) -> str:
    """The path of Prometheus executable ``name`` (promtool, prometheus).

    Missing, it skips saying how to get it, or fails in CI (:mod:`tests.tooling`).
    """
    return tooling.require_tool(
        name, "Debian package 'prometheus': apt-get install prometheus (.ci/run installs it)"
    )


# ---------------------------------------------------------------- Dockerfile


@dataclass(slots=True)
class Instruction:
    """One Dockerfile instruction: keyword (upper case), its argument text, its line."""

    keyword: str
    args: str
    line: int

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form CMD/ENTRYPOINT/HEALTHCHECK CMD."""
        text = self.args
        if self.keyword == "HEALTHCHECK":
            text = text[text.index("CMD") + 3 :]
        value = json.loads(text)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), (
            f"Dockerfile line {self.line}: {self.keyword} is not in exec form"
        )
        return value

    def options(self) -> dict[str, str]:
        """``--name=value`` options before the instruction's main argument."""
        return dict(re.findall(r"--([a-z-]+)=(\S+)", self.args.split("CMD", 1)[0]))


@dataclass(slots=True)
class Stage:
    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def find(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction:
        found = self.find(keyword)
        assert found, f"stage {self.name!r} has no {keyword}"
        return found[-1]


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        text = " ".join(p for p in pending if p)
        pending = []
        keyword, _, args = text.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
    assert not pending, f"{path}: the last instruction ends with a line continuation"
    return out


def dockerfile_stages(path: Path = DOCKERFILE) -> dict[str, Stage]:
    """Stages by name (``FROM image AS name``), in file order."""
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for instruction in dockerfile_instructions(path):
        if instruction.keyword == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", instruction.args, re.IGNORECASE)
            assert match, f"Dockerfile line {instruction.line}: every stage needs a name"
            current = Stage(match.group(2), match.group(1))
            stages[current.name] = current
        elif current is not None:
            current.instructions.append(instruction)
    return stages


def dockerfile_global_args(path: Path = DOCKERFILE) -> dict[str, str]:
    """``ARG NAME=default`` declared before the first FROM."""
    args: dict[str, str] = {}
    for instruction in dockerfile_instructions(path):
        if instruction.keyword == "FROM":
            break
        if instruction.keyword == "ARG":
            name, _, default = instruction.args.partition("=")
            args[name] = default
    return args


def stage_chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """``name`` and the stages it is built FROM, nearest first."""
    chain = [stages[name]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


def effective(stages: dict[str, Stage], name: str, keyword: str) -> Instruction:
    """The instruction (CMD, USER, HEALTHCHECK, ...) in force in stage ``name``."""
    for stage in stage_chain(stages, name):
        found = stage.find(keyword)
        if found:
            return found[-1]
    raise AssertionError(f"no {keyword} in force in stage {name!r}")


def exposed_ports(stages: dict[str, Stage], name: str) -> set[int]:
    ports: set[int] = set()
    for stage in stage_chain(stages, name):
        for instruction in stage.find("EXPOSE"):
            ports |= {int(p.split("/")[0]) for p in instruction.args.split()}
    return ports


# ---------------------------------------------------------------- .dockerignore


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's pattern syntax (Go filepath.Match plus ``**``) as a regex on a path."""
    out = ""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
                out += "(?:.*/)?"
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.index("]", i)
            out += "[" + pattern[i + 1 : end].replace("!", "^", 1) + "]"
            i = end
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out)


def dockerignore_rules(path: Path = DOCKERIGNORE) -> list[tuple[bool, re.Pattern[str]]]:
    """``(exclude, regex)`` per pattern, in order."""
    rules = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line[1:] if negated else line
        pattern = pattern.strip().lstrip("/").rstrip("/")
        rules.append((not negated, pattern_regex(pattern)))
    return rules


def in_build_context(relative: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether Docker sends ``relative`` (a repo path) with the build context."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for exclude, regex in rules:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = exclude
    return not excluded


def tracked_files(under: str) -> Iterator[str]:
    """Repo files under ``under`` (a file or a directory), relative, caches skipped."""
    root = REPO / under
    if root.is_file():
        yield under
        return
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            yield path.relative_to(REPO).as_posix()


# ---------------------------------------------------------------- Kubernetes


def kubernetes_documents() -> list[tuple[Path, dict[str, Any]]]:
    """Every manifest of deploy/kubernetes/ the kustomization lists, with its file."""
    kustomization = load_yaml(KUBERNETES / "kustomization.yaml")
    docs = []
    for name in kustomization["resources"]:
        path = KUBERNETES / name
        docs.extend((path, doc) for doc in load_yaml_documents(path))
    return docs


def find_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in kubernetes_documents() if doc.get("kind") == kind]


def rewrite_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with the value after ``flag`` replaced (the flag must be there once)."""
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def rewrite_listen(argv: list[str], socket_path: str, frames_path: str = "") -> list[str]:
    """``argv`` with each ``--listen`` moved here: TCP ones to a free loopback port, a
    ``unix:PATH`` one to ``socket_path``; a ``--frames-listen unix:PATH`` to
    ``frames_path``."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--listen":
            out[i + 1] = f"unix:{socket_path}" if is_unix_address(out[i + 1]) else "127.0.0.1:0"
        elif arg == "--frames-listen":
            assert frames_path, "the manifest has a framed socket: give frames_path"
            out[i + 1] = f"unix:{frames_path}" if is_unix_address(out[i + 1]) else "127.0.0.1:0"
    return out


def flag_value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def flag_values(argv: list[str], flag: str) -> list[str]:
    """Every value of a flag that may be given more than once (``--listen``)."""
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])
