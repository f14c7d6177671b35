"""The three images' Dockerfiles parse and follow the house rules, checked without a Docker engine
(none runs on these machines): a small parser for the Dockerfile syntax we use (parser directives,
comments, line continuations, flags, exec-form JSON), then the rules:

- every FROM names a tag that is not `latest` (or a digest);
- the final stage runs as a numeric, non-root USER (the chart's runAsNonRoot can check it);
- the operator image installs only the base package: no torch, no llm-compressor, no `[quantjob]`
  extra (docs/architecture.md, house rule 6); the quantjob image does install them;
- what COPY takes from the build context exists and is not excluded by the Dockerfile's
  `<Dockerfile>.dockerignore`;
- the base is a build argument (`BASE_IMAGE`: the public image by default, the base made from Debian
  packages by scripts/images.sh), the final stage only copies the built environment in (no RUN, so
  no installer or compiler in it), and the pins each image installs agree with images/constraints.txt.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {
    "operator": ROOT / "operator" / "Dockerfile",
    "quantjob": ROOT / "quantjob" / "Dockerfile",
    "runtime": ROOT / "runtime" / "Dockerfile",
}
KNOWN = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
         "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}
EXEC_FORM = {"CMD", "ENTRYPOINT", "RUN", "SHELL"}
# quantjob/Dockerfile is written with the quantization Job (issue 5); until it lands its cases are
# expected failures that say so, and they turn into ordinary tests the moment the file exists.
_QUANTJOB_PENDING = pytest.mark.xfail(not DOCKERFILES["quantjob"].is_file(), strict=True,
                                      reason="quantjob/Dockerfile does not exist yet")
IMAGES = [pytest.param(name, marks=_QUANTJOB_PENDING) if name == "quantjob" else name for name in sorted(DOCKERFILES)]


class DockerfileError(ValueError):
    pass


@dataclass
class Instruction:
    keyword: str
    args: str
    """The arguments after the keyword and its flags, continuations joined."""
    line: int
    flags: dict[str, str] = field(default_factory=dict)
    exec_form: list[str] | None = None
    """The JSON array of an exec-form CMD/ENTRYPOINT/RUN/SHELL."""


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


def parse(text: str) -> tuple[list[Instruction], dict[str, str]]:
    """Instructions and parser directives of a Dockerfile (BuildKit's rules for what we use)."""
    lines = text.splitlines()
    directives: dict[str, str] = {}
    i = 0
    # Parser directives: `# key=value` lines at the very top, before any other line.
    while i < len(lines):
        m = re.fullmatch(r"#\s*([A-Za-z]+)\s*=\s*(\S+)\s*", lines[i])
        if not m:
            break
        directives[m.group(1).lower()] = m.group(2)
        i += 1
    escape = directives.get("escape", "\\")
    if escape not in ("\\", "`"):
        raise DockerfileError(f"invalid escape directive {escape!r}")

    out: list[Instruction] = []
    buf: list[str] | None = None
    start = 0
    for n in range(i, len(lines)):
        raw = lines[n]
        stripped = raw.strip()
        if buf is None:
            if not stripped or stripped.startswith("#"):
                continue
            buf, start = [], n + 1
        elif not stripped or stripped.startswith("#"):
            continue  # comments and empty lines inside a continued instruction are dropped
        body = raw.rstrip()
        if body.endswith(escape) and not body.endswith(escape * 2):
            buf.append(body[:-1])
            continue
        buf.append(body)
        out.append(_instruction(" ".join(part.strip() for part in buf), start))
        buf = None
    if buf is not None:
        raise DockerfileError(f"line {start}: the file ends inside a continued instruction")
    return out, directives


def _instruction(text: str, line: int) -> Instruction:
    m = re.match(r"([A-Za-z]+)(?:\s+(.*))?$", text, re.S)
    if not m:
        raise DockerfileError(f"line {line}: not an instruction: {text[:60]!r}")
    keyword, rest = m.group(1).upper(), (m.group(2) or "").strip()
    if keyword not in KNOWN:
        raise DockerfileError(f"line {line}: unknown instruction {keyword}")
    flags: dict[str, str] = {}
    if keyword in {"FROM", "COPY", "ADD", "RUN"}:
        while (fm := re.match(r"--([a-z-]+)(?:=(\S*))?\s+", rest)) is not None:
            flags[fm.group(1)] = fm.group(2) or ""
            rest = rest[fm.end():]
    exec_form = None
    if keyword in EXEC_FORM and rest.startswith("["):
        try:
            exec_form = json.loads(rest)
        except json.JSONDecodeError as e:
            if keyword in ("SHELL",):
                raise DockerfileError(f"line {line}: SHELL must be a JSON array: {e}") from None
            # Docker would run it as a shell command: almost always a typo in the JSON.
            raise DockerfileError(f"line {line}: {keyword} looks like exec form but is not valid JSON: {e}") from None
        if not (isinstance(exec_form, list) and exec_form and all(isinstance(a, str) for a in exec_form)):
            raise DockerfileError(f"line {line}: {keyword} exec form must be a non-empty array of strings")
    if not rest and keyword not in {"CMD"}:
        raise DockerfileError(f"line {line}: {keyword} has no arguments")
    return Instruction(keyword, rest, line, flags, exec_form)


def stages(instructions: list[Instruction]) -> list[Stage]:
    """Split into stages, substituting global ARG defaults (declared before the first FROM) in FROM."""
    args: dict[str, str] = {}
    out: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "ARG" and not out:
            name, _, default = ins.args.partition("=")
            args[name.strip()] = default.strip().strip('"')
            continue
        if ins.keyword == "FROM":
            ref = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: args.get(m.group(1), m.group(0)), ins.args)
            parts = ref.split()
            if len(parts) == 3 and parts[1].lower() == "as":
                out.append(Stage(parts[0], parts[2]))
            elif len(parts) == 1:
                out.append(Stage(parts[0], None))
            else:
                raise DockerfileError(f"line {ins.line}: FROM <image> [AS <name>], got {ins.args!r}")
            continue
        if not out:
            raise DockerfileError(f"line {ins.line}: {ins.keyword} before the first FROM")
        out[-1].instructions.append(ins)
    if not out:
        raise DockerfileError("no FROM")
    return out


def load(path: Path) -> list[Stage]:
    instructions, _ = parse(path.read_text())
    return stages(instructions)


def install_commands(stage: Stage) -> list[str]:
    """The pip/uv install and wheel commands of a stage's RUN instructions (one string each)."""
    found = []
    for ins in stage.instructions:
        if ins.keyword != "RUN":
            continue
        script = " ".join(ins.exec_form) if ins.exec_form else ins.args
        for part in re.split(r"&&|\|\||;|\n", script):
            if re.search(r"\b(pip3?|uv pip)\s+(install|wheel)\b", part):
                found.append(part.strip())
    return found


def _requirements_module():
    spec = importlib.util.spec_from_file_location("image_requirements", ROOT / "images" / "steps" / "requirements.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def requirement_groups(stages_: list[Stage]) -> list[str]:
    """The groups the Dockerfile's RUN steps ask images/steps/requirements.py for."""
    found = []
    for st in stages_:
        for ins in st.instructions:
            if ins.keyword == "RUN":
                found += re.findall(r"requirements\.py\s+([a-z]+)", ins.args)
    return found


def installed_requirements(image: str) -> list[str]:
    """The pinned requirements an image installs (pyproject.toml through requirements.py)."""
    import tomllib

    mod = _requirements_module()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [r for g in requirement_groups(load(DOCKERFILES[image])) for r in mod.requirements(g, pyproject)]


def _installs_heavy(commands: list[str]) -> list[str]:
    hits = []
    for cmd in commands:
        for token in shlex.split(cmd, posix=True):
            low = token.lower()
            name = re.split(r"[=<>~!;\s]", low, maxsplit=1)[0]
            if name in ("torch", "llmcompressor", "llm-compressor") or "[quantjob]" in low:
                hits.append(f"{token} in: {cmd}")
    return hits


# ------------------------------------------------------------------ the parser itself


def test_parser_handles_continuations_comments_flags_and_exec_form():
    text = (
        "# syntax=docker/dockerfile:1\n"
        "# escape=\\\n"
        "ARG PY=3.11.14-slim-bookworm\n"
        "FROM --platform=$BUILDPLATFORM python:${PY} AS build\n"
        "RUN pip install \\\n"
        "    # a comment inside a continuation is dropped\n"
        "    boto3==1.44.5 \\\n"
        " && echo done\n"
        "COPY --from=build --chown=65532:65532 /a /b\n"
        "ENTRYPOINT [\"python\", \"-m\", \"x\"]\n"
    )
    instructions, directives = parse(text)
    assert directives == {"syntax": "docker/dockerfile:1", "escape": "\\"}
    assert [i.keyword for i in instructions] == ["ARG", "FROM", "RUN", "COPY", "ENTRYPOINT"]
    assert instructions[2].args == "pip install boto3==1.44.5 && echo done"
    assert instructions[3].flags == {"from": "build", "chown": "65532:65532"}
    assert instructions[4].exec_form == ["python", "-m", "x"]
    (stage,) = stages(instructions)
    assert stage.base == "python:3.11.14-slim-bookworm" and stage.name == "build"
    assert install_commands(stage) == ["pip install boto3==1.44.5"]


@pytest.mark.parametrize("bad", [
    "FROM python:3.11\nENTRYPOINT [\"python\", \"-m\" \"x\"]\n",   # missing comma
    "FROM python:3.11\nRUN echo \\\n",                           # ends in a continuation
    "FROM python:3.11\nFORM x\n",                                 # unknown instruction
    "RUN echo hi\n",                                              # before FROM
])
def test_parser_rejects(bad: str):
    with pytest.raises(DockerfileError):
        stages(parse(bad)[0])


def test_heavy_install_detection():
    assert _installs_heavy(["pip install --no-cache-dir '.[quantjob]'"])
    assert _installs_heavy(["pip install torch==2.13.0"])
    assert not _installs_heavy(["pip wheel --wheel-dir /wheels ."])


# ------------------------------------------------------------------ the three Dockerfiles


@pytest.mark.parametrize("image", IMAGES)
def test_dockerfile_parses(image: str):
    path = DOCKERFILES[image]
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    assert load(path)


@pytest.mark.parametrize("image", IMAGES)
def test_base_images_are_pinned(image: str):
    all_stages = load(DOCKERFILES[image])
    names = set()
    for st in all_stages:
        if st.base in names or st.base == "scratch":
            pass  # an earlier stage
        elif "@sha256:" in st.base:
            pass  # pinned by digest
        else:
            last = st.base.rsplit("/", 1)[-1]
            assert ":" in last, f"{image}: FROM {st.base} has no tag"
            assert last.split(":", 1)[1] != "latest", f"{image}: FROM {st.base} uses latest"
        if st.name:
            names.add(st.name)


@pytest.mark.parametrize("image", IMAGES)
def test_final_stage_runs_as_numeric_non_root(image: str):
    final = load(DOCKERFILES[image])[-1]
    users = [i.args for i in final.instructions if i.keyword == "USER"]
    assert users, f"{image}: the final stage sets no USER (it would run as root)"
    m = re.fullmatch(r"(\d+)(?::(\d+))?", users[-1])
    assert m, f"{image}: USER {users[-1]} must be numeric (runAsNonRoot cannot check a name)"
    assert int(m.group(1)) != 0, f"{image}: USER is root"


def test_operator_image_has_no_torch():
    all_stages = load(DOCKERFILES["operator"])
    commands = [c for st in all_stages for c in install_commands(st)]
    assert commands, "the operator image installs nothing?"
    assert _installs_heavy(commands) == []
    reqs = installed_requirements("operator")
    assert any(r.startswith("kubernetes==") for r in reqs), reqs
    assert _installs_heavy([" ".join(reqs)]) == []
    final = all_stages[-1]
    entry = [i for i in final.instructions if i.keyword == "ENTRYPOINT"]
    assert entry and entry[-1].exec_form == ["python", "-m", "fewerbits_operator"]


@_QUANTJOB_PENDING
def test_quantjob_image_has_torch():
    commands = [c for st in load(DOCKERFILES["quantjob"]) for c in install_commands(st)]
    commands.append(" ".join(installed_requirements("quantjob")))
    assert _installs_heavy(commands), "the quantjob image must install the [quantjob] extra (torch, llm-compressor)"


def test_runtime_image_has_no_torch():
    commands = [c for st in load(DOCKERFILES["runtime"]) for c in install_commands(st)]
    assert _installs_heavy(commands) == []
    assert sorted(r.split("==")[0] for r in installed_requirements("runtime")) == ["boto3", "pydantic"]


def _dockerignore(path: Path) -> list[str] | None:
    ignore = path.with_name(path.name + ".dockerignore")
    if not ignore.is_file():
        ignore = ROOT / ".dockerignore"
    if not ignore.is_file():
        return None
    return [ln.strip() for ln in ignore.read_text().splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _excluded(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes; a pattern matching a folder
    matches everything under it."""
    excluded = False
    for pat in patterns:
        neg = pat.startswith("!")
        p = pat[1:] if neg else pat
        p = p.rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
        if any(fnmatch.fnmatchcase(pre, p) for pre in prefixes) or (p.startswith("**/") and any(
                fnmatch.fnmatchcase(part, p[3:]) for part in parts)):
            excluded = not neg
    return excluded


@pytest.mark.parametrize("image", IMAGES)
def test_copy_sources_are_in_the_build_context(image: str):
    """The build context is the repository root; a COPY source must exist and not be ignored."""
    path = DOCKERFILES[image]
    patterns = _dockerignore(path) or []
    for st in load(path):
        for ins in st.instructions:
            if ins.keyword not in ("COPY", "ADD") or "from" in ins.flags:
                continue
            srcs = json.loads(ins.args)[:-1] if ins.args.startswith("[") else ins.args.split()[:-1]
            for src in srcs:
                rel = src.strip("/").removeprefix("./")
                assert (ROOT / rel).exists(), f"{image}: COPY {src}: no such path in the repository"
                assert not _excluded(rel, patterns), f"{image}: COPY {src} is excluded by the .dockerignore"


# ------------------------------------------------------------------ images built by scripts/images.sh


@pytest.mark.parametrize("image", IMAGES)
def test_the_base_is_a_build_argument_with_the_public_image_as_default(image: str):
    instructions, _ = parse(DOCKERFILES[image].read_text())
    first_from = next(i for i, ins in enumerate(instructions) if ins.keyword == "FROM")
    global_args = {ins.args.split("=", 1)[0]: ins.args.partition("=")[2] for ins in instructions[:first_from]
                   if ins.keyword == "ARG"}
    assert global_args.get("BASE_IMAGE", "").startswith("python:3.11"), global_args
    named = {st.name for st in load(DOCKERFILES[image]) if st.name}
    for ins in instructions:
        if ins.keyword == "FROM":
            base = ins.args.split()[0]
            assert base == "${BASE_IMAGE}" or base in named, f"{image}: FROM {base} is neither the base argument nor a stage"


@pytest.mark.parametrize("image", IMAGES)
def test_the_final_stage_is_the_dependency_stage_plus_the_project(image: str):
    """The final stage adds the project to the dependency stage's layers (one copy of a 6 GiB
    environment, not two) and runs nothing; the dependency stage ran pip from the mounted wheelhouse
    (no pip in the venv) and removed its /build helpers. scripts/images.sh checks the built image:
    no pip, setuptools, compiler or apt in it."""
    all_stages = load(DOCKERFILES[image])
    by_name = {st.name: st for st in all_stages if st.name}
    final = all_stages[-1]
    assert final.base == "deps" and by_name["deps"].base == "python:3.11.14-slim-bookworm"
    assert not [i for i in final.instructions if i.keyword in ("RUN", "ADD")], f"{image}: the final stage runs commands"
    copies = [(i.flags.get("from"), i.args) for i in final.instructions if i.keyword == "COPY"]
    assert copies == [("app", "/opt/fewerbits-app /opt/fewerbits-app")], copies
    deps_runs = [i.args for i in by_name["deps"].instructions if i.keyword == "RUN"]
    assert len(deps_runs) == 1 and deps_runs[0].endswith("&& rm -rf /build"), deps_runs
    assert "venv" in deps_runs[0]
    env = " ".join(i.args for i in final.instructions if i.keyword == "ENV")
    assert "PATH=/opt/fewerbits/bin:" in env  # `python` is the venv's, whatever the base calls its own
    entry = [i for i in final.instructions if i.keyword == "ENTRYPOINT"]
    assert entry and entry[-1].exec_form == ["python", "-m", f"fewerbits_{image}"]


def test_the_venv_is_made_without_pip():
    helper = (ROOT / "images" / "steps" / "pip.sh").read_text()
    assert "python3.11 -m venv --without-pip" in helper


@pytest.mark.parametrize("image", IMAGES)
def test_installs_go_through_the_pinned_wheelhouse_helper(image: str):
    for st in load(DOCKERFILES[image]):
        for ins in st.instructions:
            if ins.keyword == "RUN" and re.search(r"\bpip\s+install\b", ins.args):
                assert ins.args.startswith(". /build/pip.sh"), f"{image}: line {ins.line} installs without images/steps/pip.sh"
                assert "-c /build/constraints.txt" in ins.args, f"{image}: line {ins.line} installs without the constraints"


def _constraints() -> dict[str, str]:
    out = {}
    for line in (ROOT / "images" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[name.strip().lower()] = version.strip()
    return out


@pytest.mark.parametrize("image", IMAGES)
def test_pyproject_pins_agree_with_the_wheelhouse_constraints(image: str):
    """A pin bumped in pyproject.toml and not in images/constraints.txt would fail the image build
    with a resolver conflict: fail here first, naming the package."""
    mod = _requirements_module()
    constraints = _constraints()
    for req in installed_requirements(image):
        name, _, version = req.partition("==")
        key = mod.name(name)
        assert key in constraints, f"{key} is not in images/constraints.txt"
        assert constraints[key] == version, f"{key}: pyproject.toml pins {version}, images/constraints.txt {constraints[key]}"


def test_requirements_script_rejects_an_unknown_image():
    import tomllib

    with pytest.raises(SystemExit, match="unknown image"):
        _requirements_module().requirements("vllm", tomllib.loads((ROOT / "pyproject.toml").read_text()))


def test_images_script_tags_what_the_chart_runs():
    """scripts/images.sh tags <registry>/fewerbits-<name>:<pyproject version>; the chart's values name
    the same repositories and its appVersion (the default tag) is the same version."""
    import tomllib

    import yaml

    script = (ROOT / "scripts" / "images.sh").read_text()
    assert "REGISTRY=${FEWERBITS_IMAGE_REGISTRY:-ghcr.io/fewerbits}" in script
    assert 'tag=$REGISTRY/fewerbits-$n:$VERSION' in script
    values = yaml.safe_load((ROOT / "charts" / "fewerbits" / "values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "charts" / "fewerbits" / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == version
    for key, name in (("image", "operator"), ("quantjobImage", "quantjob"), ("runtimeImage", "runtime")):
        assert values[key]["repository"] == f"ghcr.io/fewerbits/fewerbits-{name}"


def test_base_packages_pin_every_package_to_a_version():
    lines = [ln for ln in (ROOT / "images" / "base.packages").read_text().splitlines() if ln and not ln.startswith("#")]
    assert any(ln.startswith("python3.11=3.11.") for ln in lines), "the base has no Python 3.11"
    bad = [ln for ln in lines if not re.fullmatch(r"[a-z0-9][a-z0-9+.-]*=[A-Za-z0-9.+~:-]+", ln)]
    assert not bad, f"not name=version: {bad}"
    names = [ln.split("=")[0] for ln in lines]
    assert len(names) == len(set(names)), "a package is listed twice"
