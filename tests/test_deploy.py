"""The deployment files: Kubernetes manifests, the container image, the Slurm script.

None of them can run here (no cluster, no Docker daemon, no Slurm), so each is
checked as far as it can be without one: the manifests against the Kubernetes
OpenAPI schemas that kubernetes-validate carries (strict: an unknown field fails
too), every command line they hold against the real CLI parsers, the Dockerfile
statically, and the sbatch script for real, with fake srun and scontrol that
record what it starts.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import tyro
import yaml

from actors.actor import ActorConfig
from learner.config import LearnerConfig
from learner.main import parse_cli

ROOT = Path(__file__).resolve().parents[1]
KUBERNETES = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
SBATCH = ROOT / "deploy" / "slurm" / "seedrl.sbatch"
SETUP = ROOT / "scripts" / "setup.sh"
LAUNCH_ACTORS = ROOT / "scripts" / "launch_actors.sh"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# The oldest Kubernetes the manifests are meant for, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.28", kubernetes_validate.latest_version())
LEARNER_STATEFULSET = "seedrl-learner"
LEARNER_SERVICE = "seedrl-learner"
ACTOR_DEPLOYMENT = "seedrl-actors"


# -- command lines ------------------------------------------------------------------


def parse_learner_args(args: list[str], where: str) -> LearnerConfig:
    """LearnerConfig from flags, by the parser seedrl-learner's main() uses."""
    try:
        return parse_cli(args)
    except SystemExit as error:
        pytest.fail(f"{where}: seedrl-learner refuses {args}: exit {error.code}")


def parse_actor_args(args: list[str], where: str) -> ActorConfig:
    """ActorConfig from flags, as seedrl-actor's main() parses them."""
    try:
        return tyro.cli(ActorConfig, args=args, prog="seedrl-actor")
    except SystemExit as error:
        pytest.fail(f"{where}: seedrl-actor refuses {args}: exit {error.code}")


def case_flags(script: Path) -> set[str]:
    """The options a shell script's `case` arms accept, e.g. {"--learner", "-h", ...}."""
    arms = re.findall(
        r"^\s*((?:-{1,2}[a-z][a-z-]*\|)*-{1,2}[a-z][a-z-]*)\)", script.read_text(), re.M
    )
    return {flag for arm in arms for flag in arm.split("|")}


def option_values(args: list[str], accepted: set[str], where: str) -> dict[str, str]:
    """`--flag value` pairs of a shell script's command line, each flag one it accepts."""
    values = {}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        assert flag in accepted, f"{where}: {flag} is not an option of the script ({accepted})"
        values[flag] = value
    return values


# -- Kubernetes ---------------------------------------------------------------------


def load_yaml(path: Path) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def kustomization_files() -> list[Path]:
    return sorted(KUBERNETES.rglob("kustomization.yaml"))


def manifest_files() -> list[Path]:
    return sorted(set(KUBERNETES.rglob("*.yaml")) - set(kustomization_files()))


def manifests() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{path.relative_to(ROOT)}[{index}]", document)
        for path in manifest_files()
        for index, document in enumerate(load_yaml(path))
    ]


def base_object(kind: str, name: str) -> dict[str, Any]:
    for document in load_yaml(KUBERNETES / "base" / "learner.yaml") + load_yaml(
        KUBERNETES / "base" / "actors.yaml"
    ):
        if document["kind"] == kind and document["metadata"]["name"] == name:
            return document
    raise AssertionError(f"no {kind} {name} in deploy/kubernetes/base")


def only_container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def container_port(container: dict[str, Any], port: int | str) -> int:
    """A port number, or the number of the container's port of that name."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def expand_env(args: list[str], container: dict[str, Any], values: dict[str, str]) -> list[str]:
    """The args as the kubelet expands $(VAR), each VAR one the container defines."""
    defined = {variable["name"] for variable in container.get("env", [])}

    def substitute(match: re.Match) -> str:
        name = match.group(1)
        assert name in defined, f"$({name}) is not an env variable of {container['name']}"
        return values[name]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", substitute, arg) for arg in args]


def secret_reference(container: dict[str, Any], variable: str) -> tuple[str, str]:
    (entry,) = [e for e in container["env"] if e["name"] == variable]
    reference = entry["valueFrom"]["secretKeyRef"]
    return reference["name"], reference["key"]


def validate_all_versions(document: dict[str, Any]) -> None:
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(document, version, strict=True)


MANIFESTS = manifests()


@pytest.mark.parametrize(("where", "document"), MANIFESTS, ids=[where for where, _ in MANIFESTS])
def test_manifest_matches_the_kubernetes_schema(where, document):
    try:
        validate_all_versions(document)
    except kubernetes_validate.ValidationError as error:
        pytest.fail(f"{where}: {error.message} at {'.'.join(map(str, error.absolute_path))}")


def test_every_kind_is_present():
    kinds = {document["kind"] for _, document in MANIFESTS}
    assert {"Service", "StatefulSet", "Deployment", "Secret"} <= kinds


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda d: d["spec"].update(replicas="three"), "'three' is not of type 'integer'"),
        (lambda d: d["spec"].update(replica=3), "'replica' was unexpected"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"), "'name'"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(image=["a"]), "type"),
        (lambda d: d["spec"].pop("selector"), "'selector' is a required property"),
    ],
    ids=[
        "replicas-not-a-number",
        "misspelt-field",
        "container-without-name",
        "image-list",
        "no-selector",
    ],
)
def test_the_schema_check_rejects_a_broken_manifest(change, reason):
    deployment = base_object("Deployment", ACTOR_DEPLOYMENT)
    validate_all_versions(deployment)
    broken = copy.deepcopy(deployment)
    change(broken)
    with pytest.raises(kubernetes_validate.ValidationError) as caught:
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)
    assert reason in caught.value.message


def test_kustomizations_name_files_that_exist_and_leave_the_secret_out():
    listed = set()
    for path in kustomization_files():
        kustomization = load_yaml(path)[0]
        assert kustomization["kind"] == "Kustomization"
        entries = kustomization.get("resources", []) + [
            patch["path"] for patch in kustomization.get("patches", [])
        ]
        assert entries, f"{path} lists nothing"
        for entry in entries:
            target = (path.parent / entry).resolve()
            assert target.exists(), f"{path.relative_to(ROOT)}: {entry} does not exist"
            listed.add(target)
    # Every manifest is used by some kustomization, except the Secret: applying the
    # directory must never replace the user's token with the placeholder.
    unused = {path.relative_to(KUBERNETES).as_posix() for path in manifest_files()} - {
        path.relative_to(KUBERNETES).as_posix() for path in listed if path.is_file()
    }
    assert unused == {"secret.yaml"}


def kustomize(directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [document for document in yaml.safe_load_all(result.stdout) if document]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", ["", "gpu"])
def test_kustomize_output_matches_the_schema(overlay):
    documents = kustomize(KUBERNETES / overlay)
    for document in documents:
        validate_all_versions(document)
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in documents}
    assert set(by_name) == {
        ("Service", LEARNER_SERVICE),
        ("StatefulSet", LEARNER_STATEFULSET),
        ("Deployment", ACTOR_DEPLOYMENT),
    }
    learner = only_container(by_name["StatefulSet", LEARNER_STATEFULSET])
    actor = only_container(by_name["Deployment", ACTOR_DEPLOYMENT])
    assert actor["image"] == "seedrl:cpu"
    if overlay == "gpu":
        assert learner["image"] == "seedrl:cuda"
        assert learner["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert {"name": "JAX_PLATFORMS", "value": "cuda"} in learner["env"]
        # The patch merged into the learner container, not beside it.
        assert (
            learner["args"]
            == only_container(base_object("StatefulSet", LEARNER_STATEFULSET))["args"]
        )
    else:
        assert learner["image"] == "seedrl:cpu"
        assert "nvidia.com/gpu" not in learner["resources"]["limits"]


def test_gpu_patch_targets_the_learner_container():
    (patch,) = load_yaml(KUBERNETES / "gpu" / "learner-gpu.yaml")
    base = base_object("StatefulSet", LEARNER_STATEFULSET)
    assert (patch["kind"], patch["metadata"]["name"]) == ("StatefulSet", LEARNER_STATEFULSET)
    assert only_container(patch)["name"] == only_container(base)["name"]
    assert only_container(patch)["image"] == "seedrl:cuda"


def learner_in_kubernetes() -> tuple[dict[str, Any], dict[str, Any], LearnerConfig]:
    statefulset = base_object("StatefulSet", LEARNER_STATEFULSET)
    container = only_container(statefulset)
    program, *args = container["args"]
    assert program == "seedrl-learner" and program in PYPROJECT["project"]["scripts"]
    return statefulset, container, parse_learner_args(args, "the learner's StatefulSet")


def test_learner_flags_ports_probes_and_scrape_annotations_agree():
    statefulset, container, config = learner_in_kubernetes()
    # Reachable from other pods: probes, Prometheus, actors.
    assert config.http_bind_address == "0.0.0.0"
    assert config.bind_address == "[::]"
    assert container_port(container, "grpc") == config.port
    assert container_port(container, "http") == config.http_port
    for probe, path in (
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        check = container[probe]["httpGet"]
        assert check["path"] == path, probe
        assert container_port(container, check["port"]) == config.http_port, probe
    pod = statefulset["spec"]["template"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(config.http_port)
    assert annotations["prometheus.io/path"] == "/metrics"
    # JAX compiles before the HTTP server starts: the startup probe waits minutes.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_learner_run_dir_is_on_the_claimed_volume():
    statefulset, container, config = learner_in_kubernetes()
    (mount,) = container["volumeMounts"]
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == mount["name"]
    assert Path(config.run_dir).is_relative_to(mount["mountPath"])
    # Whoever the image runs as may write there.
    assert statefulset["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == IMAGE_UID


def test_learner_service_selects_the_learner_and_exposes_its_ports():
    statefulset, container, config = learner_in_kubernetes()
    service = base_object("Service", LEARNER_SERVICE)
    assert statefulset["spec"]["serviceName"] == LEARNER_SERVICE
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {port["name"]: port for port in service["spec"]["ports"]}
    for name, wanted in (("grpc", config.port), ("http", config.http_port)):
        assert ports[name]["port"] == wanted
        assert container_port(container, ports[name]["targetPort"]) == wanted


def test_actor_flags_point_at_the_learner_service_with_its_env():
    _, _, learner = learner_in_kubernetes()
    deployment = base_object("Deployment", ACTOR_DEPLOYMENT)
    container = only_container(deployment)
    program, *args = container["args"]
    assert program == "seedrl-actor" and program in PYPROJECT["project"]["scripts"]
    pod_name = "seedrl-actors-7c9f8d6b5-x2x4q"
    actor = parse_actor_args(
        expand_env(args, container, {"POD_NAME": pod_name}), "the actors' Deployment"
    )
    assert actor.env == learner.env
    host, _, port = actor.learner.rpartition(":")
    assert host == LEARNER_SERVICE or host.startswith(f"{LEARNER_SERVICE}.")
    service_ports = {
        p["name"]: p["port"] for p in base_object("Service", LEARNER_SERVICE)["spec"]["ports"]
    }
    assert int(port) == service_ports["grpc"] == learner.port
    # The actor is named after its pod, from the downward API.
    assert actor.actor_id == pod_name
    (pod_name_variable,) = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert pod_name_variable["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert deployment["spec"]["replicas"] >= 1


def test_both_sides_read_the_token_from_the_secret():
    (secret,) = load_yaml(KUBERNETES / "secret.yaml")
    _, learner_container, _ = learner_in_kubernetes()
    actor_container = only_container(base_object("Deployment", ACTOR_DEPLOYMENT))
    wanted = (secret["metadata"]["name"], next(iter(secret["stringData"])))
    assert secret_reference(learner_container, "SEEDRL_AUTH_TOKEN") == wanted
    assert secret_reference(actor_container, "SEEDRL_AUTH_TOKEN") == wanted
    # The token never sits in the args, where `kubectl describe` would show it.
    for container in (learner_container, actor_container):
        assert not any(arg.startswith("--auth-token") for arg in container["args"])


def test_every_container_requests_cpu_and_memory():
    for kind, name in (("StatefulSet", LEARNER_STATEFULSET), ("Deployment", ACTOR_DEPLOYMENT)):
        workload = base_object(kind, name)
        resources = only_container(workload)["resources"]
        assert {"cpu", "memory"} <= resources["requests"].keys(), name
        assert "memory" in resources["limits"], name
        assert workload["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == IMAGE_UID


# -- the container image ------------------------------------------------------------

DOCKER_INSTRUCTIONS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK",
    "LABEL", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str
    stage: str  # the stage's name, or its index; "" before the first FROM


def parse_dockerfile(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile, continuation lines joined and comments dropped."""
    logical, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    instructions, stage, stages = [], "", 0
    for line in logical:
        keyword, _, arguments = line.partition(" ")
        assert keyword in DOCKER_INSTRUCTIONS, f"unknown instruction {keyword!r}"
        if keyword == "FROM":
            words = arguments.split()
            assert len(words) in (1, 3) and (len(words) == 1 or words[1].upper() == "AS"), line
            stage = words[2] if len(words) == 3 else str(stages)
            stages += 1
        instructions.append(Instruction(keyword, arguments.strip(), stage))
    return instructions


DOCKER = parse_dockerfile(DOCKERFILE.read_text())


def in_stage(stage: str, keyword: str) -> list[str]:
    return [i.arguments for i in DOCKER if i.stage == stage and i.keyword == keyword]


def build_args() -> dict[str, str]:
    """The ARGs declared before the first FROM (usable in FROM lines), with defaults."""
    return dict(arg.partition("=")[::2] for arg in in_stage("", "ARG"))


def final_stage() -> str:
    return [i for i in DOCKER if i.keyword == "FROM"][-1].stage


def image_variants() -> dict[str, str]:
    """VARIANT value -> the stage it builds from (FROM variant-${VARIANT})."""
    source = [i for i in DOCKER if i.keyword == "FROM"][-1].arguments.split()[0]
    prefix, marker, rest = source.partition("${VARIANT}")
    assert marker and not rest, f"the final stage does not pick a variant: FROM {source}"
    stages = {i.stage for i in DOCKER if i.keyword == "FROM"}
    return {stage.removeprefix(prefix): stage for stage in stages if stage.startswith(prefix)}


def setup_invocations(stage: str) -> list[list[str]]:
    """The flags of each scripts/setup.sh run by a RUN of the stage."""
    calls = []
    for command in in_stage(stage, "RUN"):
        words = shlex.split(command)
        for index, word in enumerate(words):
            if word.removeprefix("./") == "scripts/setup.sh":
                flags = []
                for flag in words[index + 1 :]:
                    if flag in ("&&", "||", ";", "|"):
                        break
                    flags.append(flag)
                calls.append(flags)
    return calls


def test_dockerfile_variants_install_with_setup_sh():
    variants = image_variants()
    assert set(variants) == {"cpu", "cuda"}
    assert build_args()["VARIANT"] in variants
    expected = {"cpu": [], "cuda": ["--cuda"]}
    accepted = case_flags(SETUP)
    extras = PYPROJECT["project"]["optional-dependencies"]
    for variant, stage in variants.items():
        assert setup_invocations(stage) == [expected[variant]], variant
        for flag in expected[variant]:
            assert flag in accepted and flag.removeprefix("--") in extras
    # Installed only through scripts/setup.sh, from uv.lock: no hand-written pip lines.
    for instruction in DOCKER:
        if instruction.keyword == "RUN":
            assert not re.search(r"\bpip3? install\b|\buv (pip|sync|add)\b", instruction.arguments)


def test_cuda_extra_is_jax_cuda_plugin_of_the_pinned_jax_and_is_locked():
    jax_pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("jax=="))
    (cuda,) = PYPROJECT["project"]["optional-dependencies"]["cuda"]
    assert re.fullmatch(r"jax\[cuda1[23]\]==" + re.escape(jax_pin.removeprefix("jax==")), cuda)
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    (project,) = [p for p in lock["package"] if p["name"] == PYPROJECT["project"]["name"]]
    assert "cuda" in project["optional-dependencies"]
    assert {"jax-cuda12-plugin", "kubernetes-validate"} <= {p["name"] for p in lock["package"]}


def test_dockerfile_copies_files_that_exist_and_ignores_local_state():
    for instruction in DOCKER:
        if instruction.keyword in ("COPY", "ADD"):
            words = [w for w in instruction.arguments.split() if not w.startswith("--")]
            assert not instruction.arguments.startswith("--from"), "no COPY --from expected"
            for source in words[:-1]:
                assert (ROOT / source).exists() or list(ROOT.glob(source)), source
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", ".uv-bootstrap", "runs"} <= ignored
    # What the build needs is not ignored.
    needed = ["pyproject.toml", "uv.lock", "README.md", "scripts/setup.sh"]
    needed += PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    for path in needed:
        assert (ROOT / path).exists()
        for pattern in ignored:
            assert not Path(path).match(pattern.removeprefix("**/")), (path, pattern)


def image_app_dir() -> str:
    """Where the image holds the repository (the destination of COPY . DIR)."""
    (copy_line,) = [i.arguments for i in DOCKER if i.keyword == "COPY"]
    source, destination = copy_line.split()
    assert source == "."
    return destination.rstrip("/")


IMAGE_UID = int(in_stage(final_stage(), "USER")[-1].split(":")[0])


def test_image_runs_the_project_commands_from_its_venv():
    app = image_app_dir()
    environment = " ".join(in_stage(final_stage(), "ENV"))
    assert f"PATH={app}/.venv/bin:$PATH" in environment
    (command,) = in_stage(final_stage(), "CMD")
    assert json.loads(command)[0] in PYPROJECT["project"]["scripts"]
    (entrypoint,) = in_stage(final_stage(), "ENTRYPOINT")
    assert json.loads(entrypoint)[0].endswith("tini")
    assert IMAGE_UID != 0


def image_environment() -> dict[str, str]:
    """The final stage's ENV variables, as the image's processes see them."""
    pairs = [shlex.split(line) for line in in_stage(final_stage(), "ENV")]
    return dict(pair.partition("=")[::2] for line in pairs for pair in line)


def test_the_learners_compilation_cache_is_on_the_volume_of_its_run_directory(monkeypatch):
    """In the image, and so in the Kubernetes learner, the cache lies under /data with the
    run directories: a restarted learner on the same volume loads what it compiled."""
    from learner.backends import compile_cache

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", image_environment()["XDG_CACHE_HOME"])
    cache = Path(compile_cache.default_dir())
    (workdir,) = in_stage(final_stage(), "WORKDIR")
    assert cache.is_relative_to(workdir)  # the image's /data, where volumes go
    _, container, config = learner_in_kubernetes()
    (mount,) = container["volumeMounts"]
    assert cache.is_relative_to(mount["mountPath"])
    assert not cache.is_relative_to(config.run_dir)  # shared by runs, not one run's


def doc_commands(prefix: str) -> list[tuple[str, list[str]]]:
    """Commands in the docs' fenced code blocks that start with `prefix`, continuations joined."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", path.read_text(), re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if line.startswith(prefix):
                    found.append((path.name, shlex.split(line)))
    return found


def test_docs_docker_build_lines_use_this_dockerfile_and_its_variants():
    builds = doc_commands("docker build ")
    assert builds, "no `docker build` line in README.md or docs/"
    arguments, variants = build_args(), image_variants()
    built = set()
    for where, words in builds:
        assert words[words.index("-f") + 1] == DOCKERFILE.relative_to(ROOT).as_posix(), where
        assert words[-1] == ".", f"{where}: the build context is the repository's root"
        variant = arguments["VARIANT"]
        for index, word in enumerate(words):
            if word == "--build-arg":
                name, _, value = words[index + 1].partition("=")
                assert name in arguments, f"{where}: the Dockerfile has no ARG {name}"
                if name == "VARIANT":
                    variant = value
            assert word != "--target", f"{where}: the Dockerfile picks variants by VARIANT"
        assert variant in variants, f"{where}: no variant {variant}"
        built.add(variant)
        assert f"seedrl:{variant}" in words, f"{where}: the {variant} image is seedrl:{variant}"
    assert built == set(variants)


def test_docs_docker_run_lines_run_commands_the_image_has():
    runs = doc_commands("docker run ")
    assert runs, "no `docker run` line in README.md or docs/"
    for where, words in runs:
        (image_index,) = [i for i, w in enumerate(words) if re.fullmatch(r"seedrl:[a-z]+", w)]
        program, *args = words[image_index + 1 :] or [None]
        if program is None:  # the image's CMD
            continue
        if program == "seedrl-learner":
            parse_learner_args(args, where)
        elif program == "seedrl-actor":
            parse_actor_args(args, where)
        else:
            app = image_app_dir()
            assert program.startswith(f"{app}/scripts/"), f"{where}: {program} is not in the image"
            assert os.access(ROOT / program.removeprefix(f"{app}/"), os.X_OK), where


# -- Slurm --------------------------------------------------------------------------

FAKE_SRUN = r"""#!/usr/bin/env bash
# Records its command line and SEEDRL_AUTH_TOKEN, then plays the learner or actors.
log=$(mktemp "$FAKE_LOG/srun-XXXXXX")
child=""
trap 'echo TERM >"$log.signal"; [ -z "$child" ] || kill "$child"; exit 143' TERM
printf '%s' "${SEEDRL_AUTH_TOKEN:-}" >"$log.token"
printf '%s\0' "$@" >"$log.args"
case "$*" in
  *seedrl-learner*)
    hang=${FAKE_LEARNER_HANG:-0} status=${FAKE_LEARNER_STATUS:-0}
    # The learner ends only once every step has started (and set its trap).
    for _ in $(seq 200); do
      [ "$(find "$FAKE_LOG" -name '*.args' | wc -l)" -lt 3 ] || break
      sleep 0.05
    done ;;
  *) hang=${FAKE_ACTORS_HANG:-0} status=0 ;;
esac
if [ "$hang" = 1 ]; then
  sleep 60 >/dev/null 2>&1 &
  child=$!
  wait "$child"
fi
exit "$status"
"""

FAKE_SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] || exit 1
printf 'node-a\\nnode-b\\nnode-c\\n'
"""


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir, log_dir = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    environment = {
        key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "SEEDRL_"))
    }
    environment.update(
        PATH=f"{bin_dir}:{environment['PATH']}",
        FAKE_LOG=str(log_dir),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node-[a-c]",
        SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_CPUS_PER_TASK="4",
        SEEDRL_RUN_DIR=str(tmp_path / "run"),
        SEEDRL_ACTOR_GRACE_S="30",
    )
    return environment


def srun_calls(environment: dict[str, str]) -> list[dict[str, Any]]:
    calls = []
    for args_file in sorted(Path(environment["FAKE_LOG"]).glob("*.args")):
        stem = args_file.with_suffix("")
        signal_file = stem.with_suffix(".signal")
        calls.append(
            {
                "args": args_file.read_text().split("\0")[:-1],
                "token": stem.with_suffix(".token").read_text(),
                "signalled": signal_file.exists(),
            }
        )
    return calls


def split_srun(args: list[str]) -> tuple[dict[str, str], str, list[str]]:
    """srun's --option=value options, the program, and the program's arguments."""
    options = {}
    for index, arg in enumerate(args):
        if not arg.startswith("--"):
            return options, arg, args[index + 1 :]
        name, _, value = arg.partition("=")
        options[name] = value
    raise AssertionError(f"srun without a program: {args}")


def run_sbatch(environment, *args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SBATCH), *args], env=environment, capture_output=True, text=True, timeout=timeout
    )


def test_sbatch_script_parses_and_its_directives_come_first():
    assert subprocess.run(["bash", "-n", str(SBATCH)], timeout=30).returncode == 0
    lines = SBATCH.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines[1:], 1) if line and line[0] != "#")
    directives = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    # sbatch reads no #SBATCH line after the first command.
    assert directives and max(directives) < first_command
    options = {lines[i].split()[1].split("=")[0] for i in directives}
    assert {"--partition", "--nodes", "--time", "--cpus-per-task", "--signal"} <= options


def test_sbatch_starts_the_learner_on_the_first_node_and_actors_on_the_others(fake_slurm):
    result = run_sbatch(fake_slurm, "classic:CartPole-v1", "--", "--total-env-steps", "1000")
    assert result.returncode == 0, result.stderr
    calls = srun_calls(fake_slurm)
    assert len(calls) == 3
    tokens = {call["token"] for call in calls}
    assert len(tokens) == 1 and re.fullmatch(r"[0-9a-f]{32}", tokens.pop())
    learners = [c for c in calls if split_srun(c["args"])[1].endswith("/seedrl-learner")]
    (learner_call,) = learners
    options, program, args = split_srun(learner_call["args"])
    assert options["--nodelist"] == "node-a" and options["--nodes"] == "1"
    assert program == str(ROOT / ".venv" / "bin" / "seedrl-learner")
    learner = parse_learner_args(args, "seedrl.sbatch")
    assert learner.env == "classic:CartPole-v1"
    assert learner.run_dir == fake_slurm["SEEDRL_RUN_DIR"]
    assert learner.total_env_steps == 1000
    accepted = case_flags(LAUNCH_ACTORS)
    nodes = set()
    for call in calls:
        if call is learner_call:
            continue
        options, program, args = split_srun(call["args"])
        assert program == str(LAUNCH_ACTORS)
        values = option_values(args, accepted, "seedrl.sbatch")
        assert values["--actor-prefix"] == options["--nodelist"]
        nodes.add(options["--nodelist"])
        assert values["--learner"] == f"node-a:{learner.port}"
        assert values["--env"] == learner.env
        assert values["--num-actors"] == fake_slurm["SLURM_CPUS_PER_TASK"]
        # What launch_actors.sh hands each seedrl-actor.
        actor = parse_actor_args(
            [
                *("--learner", values["--learner"], "--env", values["--env"]),
                *("--num-envs", values["--num-envs"], "--actor-id", "node-b-0"),
            ],
            "seedrl.sbatch",
        )
        assert actor.env == learner.env
    assert nodes == {"node-b", "node-c"}
    assert (Path(fake_slurm["SEEDRL_RUN_DIR"]) / "actors").is_dir()


def test_sbatch_keeps_a_given_token(fake_slurm):
    fake_slurm["SEEDRL_AUTH_TOKEN"] = "given-token"
    result = run_sbatch(fake_slurm)
    assert result.returncode == 0, result.stderr
    assert {call["token"] for call in srun_calls(fake_slurm)} == {"given-token"}


def test_sbatch_stops_the_actors_when_the_learner_fails(fake_slurm):
    fake_slurm.update(FAKE_LEARNER_STATUS="3", FAKE_ACTORS_HANG="1")
    started = time.monotonic()
    result = run_sbatch(fake_slurm)
    assert result.returncode == 3, result.stderr
    # At once, not after the grace period given to actors of a finished run.
    assert time.monotonic() - started < 20
    actors = [c for c in srun_calls(fake_slurm) if split_srun(c["args"])[1] == str(LAUNCH_ACTORS)]
    assert len(actors) == 2 and all(call["signalled"] for call in actors)


def test_sbatch_passes_sigterm_on_to_the_learner_and_actors(fake_slurm):
    fake_slurm.update(FAKE_LEARNER_HANG="1", FAKE_ACTORS_HANG="1")
    process = subprocess.Popen(
        [str(SBATCH)], env=fake_slurm, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while len(list(Path(fake_slurm["FAKE_LOG"]).glob("*.args"))) < 3:
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.05)
    time.sleep(0.2)  # the script reaches its wait
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 143, stderr  # the fake learner's status after SIGTERM
    calls = srun_calls(fake_slurm)
    assert len(calls) == 3 and all(call["signalled"] for call in calls), stderr


@pytest.mark.parametrize(
    ("args", "environment", "message"),
    [
        (["Pong"], {}, "is not FAMILY:NAME"),
        (["a:b", "c:d"], {}, "too many arguments"),
        (["--fast"], {}, "unknown option '--fast'"),
        ([], {"SLURM_JOB_ID": ""}, "run it with sbatch"),
        ([], {"SLURM_SUBMIT_DIR": "/"}, "submit from the repository's root"),
        ([], {"SEEDRL_ENVS_PER_ACTOR": "0"}, "not a positive integer"),
    ],
)
def test_sbatch_refuses_bad_arguments_with_usage(fake_slurm, args, environment, message):
    fake_slurm.update(environment)
    result = run_sbatch(fake_slurm, *args)
    assert result.returncode == 2
    assert message in result.stderr and "Usage:" in result.stderr
    assert srun_calls(fake_slurm) == []
