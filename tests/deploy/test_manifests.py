"""Offline checks of the Kubernetes manifests in deploy/kubernetes/.

No cluster is needed (or used). Three kinds of checks:

* schema: every manifest document validates in strict mode (unknown fields are
  errors) against the Kubernetes API schemas that kubernetes-validate bundles,
  for each version in K8S_VERSIONS; where kubectl (or
  kustomize) is installed, the rendered `kubectl kustomize` output too;
* cross-manifest facts that break silently when one file changes and another
  does not: the shared runtime dir, the env var the clients read, the probes,
  the gid admission rule, the host namespaces, the grace period against the
  drain deadline, where the image is named, the metrics host (the pod IP) and
  ports against the port base;
* premises: the kernel behaviour the manifests rely on (SO_PEERCRED's pid
  across PID namespaces, its gid being the primary one), checked on plain
  processes where this machine allows it (root, unshare(1)), skipped otherwise.

Every failure message names the file and the field.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

try:
    import kubernetes_validate
    from kubernetes_validate import utils as kv_utils
except ImportError:  # the schema tests fail (not skip) without it; the other checks still run
    kubernetes_validate = kv_utils = None

ROOT = Path(__file__).resolve().parents[2]
KDIR = ROOT / "deploy" / "kubernetes"
DAEMONSET_FILE = KDIR / "daemonset.yaml"
CLIENT_FILE = KDIR / "client-example.yaml"
KUSTOMIZATION_FILE = KDIR / "kustomization.yaml"

# Kubernetes API versions validated against: 1.30, the oldest these manifests
# aim at, and 1.37, the newest kubernetes-validate 1.37.0 bundles (it has
# 1.25-1.37; a release that drops one fails the schema tests saying so).
K8S_VERSIONS = ("1.30", "1.37")

OPDCTL = "cache-dit-opdctl"
LAUNCHER = "cache-dit-opd-launcher"
DEFAULT_DRAIN_DEADLINE_MS = 5000  # server/options.h, Options::drain_deadline_ms
DEFAULT_GRACE_PERIOD_S = 30  # Kubernetes' default terminationGracePeriodSeconds
GRACE_MARGIN_MS = 5000  # after the drain: SIGTERM forwarding, GPU release, launcher exit


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def same_path(a, b) -> bool:
    """Two absolute paths naming the same file ("/run/x/" is "/run/x")."""
    return isinstance(a, str) and isinstance(b, str) and a.startswith("/") and os.path.normpath(a) == os.path.normpath(b)


# ---- loading -----------------------------------------------------------------


def load_documents(path: Path) -> list[dict]:
    assert path.is_file(), f"{rel(path)} is missing"
    with open(path) as f:
        try:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
        except yaml.YAMLError as e:
            pytest.fail(f"{rel(path)} is not valid YAML: {e}")
    for i, d in enumerate(docs):
        assert isinstance(d, dict), f"{rel(path)} document {i} is a {type(d).__name__}, not a mapping"
    return docs


def manifest_files() -> list[Path]:
    return sorted(p for p in KDIR.glob("*.yaml") if p.name != KUSTOMIZATION_FILE.name)


def all_documents() -> list[tuple[Path, int, dict]]:
    out = []
    for path in manifest_files():
        for i, d in enumerate(load_documents(path)):
            out.append((path, i, d))
    return out


def one(path: Path, kind: str) -> dict:
    docs = [d for d in load_documents(path) if d.get("kind") == kind]
    assert len(docs) == 1, f"{rel(path)}: expected exactly one {kind}, found {len(docs)}"
    return docs[0]


def dig(doc: dict, dotted: str, path: Path, required: bool = True):
    """doc["a"]["b"]... for "a.b...", failing with the file and the field when absent."""
    cur = doc
    for key in dotted.split("."):
        if not isinstance(cur, dict) or key not in cur:
            if required:
                pytest.fail(f"{rel(path)}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')} has no {dotted}")
            return None
        cur = cur[key]
    return cur


def daemonset() -> dict:
    return one(DAEMONSET_FILE, "DaemonSet")


def client_deployment() -> dict:
    return one(CLIENT_FILE, "Deployment")


def pod_spec(workload: dict, path: Path) -> dict:
    return dig(workload, "spec.template.spec", path)


def namespace_of(doc: dict) -> str:
    return (doc.get("metadata") or {}).get("namespace", "default")


def first_container(spec: dict, path: Path) -> dict:
    cs = spec.get("containers") or []
    assert len(cs) >= 1, f"{rel(path)}: spec.template.spec.containers is empty"
    return cs[0]


def daemon_container() -> dict:
    """The container that runs the launcher."""
    spec = pod_spec(daemonset(), DAEMONSET_FILE)
    for c in spec.get("containers") or []:
        if Path(str((c.get("command") or [""])[0])).name == LAUNCHER:
            return c
    pytest.fail(f"{rel(DAEMONSET_FILE)}: no container whose command[0] is .../{LAUNCHER}")


def client_container() -> dict:
    return first_container(pod_spec(client_deployment(), CLIENT_FILE), CLIENT_FILE)


def effective(spec: dict, c: dict, field: str):
    """A securityContext field as the container runs it: the container's own, else the pod's."""
    own = (c.get("securityContext") or {}).get(field)
    return own if own is not None else (spec.get("securityContext") or {}).get(field)


def configmaps() -> dict[tuple[str, str], dict]:
    out = {}
    for _, _, d in all_documents():
        if d.get("kind") == "ConfigMap":
            out[(namespace_of(d), d["metadata"]["name"])] = d.get("data") or {}
    return out


_VAR = re.compile(r"(\$+)\(([A-Za-z_][A-Za-z0-9_]*)\)")


def env_value(c: dict, name: str, namespace: str, path: Path):
    """The value env var `name` has in container `c`: literal, from a ConfigMap of the manifests, a
    placeholder for one known only at run time (fieldRef, ...), or None when `c` does not define it."""
    for e in c.get("env") or []:
        if e.get("name") != name:
            continue
        if "value" in e:
            return str(e["value"])
        ref = (e.get("valueFrom") or {}).get("configMapKeyRef")
        if ref is None:
            return f"<{name}:set-at-run-time>"  # fieldRef, secretKeyRef, ...: one word, as the value will be
        data = configmaps().get((namespace, ref.get("name")))
        assert data is not None, (
            f"{rel(path)}: container {c.get('name')!r} env {name} refers to ConfigMap "
            f"{namespace}/{ref.get('name')}, which no manifest in {rel(KDIR)} defines"
        )
        assert ref.get("key") in data, (
            f"{rel(path)}: container {c.get('name')!r} env {name} refers to key {ref.get('key')!r} of ConfigMap "
            f"{namespace}/{ref.get('name')}, which has only {sorted(data)}"
        )
        return str(data[ref["key"]])
    return None


def defined_env(c: dict) -> set[str]:
    return {e.get("name") for e in c.get("env") or []}


def expand(c: dict, word: str, namespace: str, path: Path) -> str:
    """Kubernetes' $(VAR) expansion of one argument ($$(VAR) is a literal $(VAR))."""

    def sub(m):
        dollars, var = m.group(1), m.group(2)
        if len(dollars) % 2 == 0:
            return "$" * (len(dollars) // 2) + f"({var})"
        v = env_value(c, var, namespace, path)
        assert v is not None, f"{rel(path)}: container {c.get('name')!r} uses $({var}) but defines no env {var}"
        return "$" * (len(dollars) // 2) + v

    return _VAR.sub(sub, word)


def daemon_argv() -> tuple[list[str], list[str]]:
    """(launcher flags, daemon flags) of the launcher container, $(VAR)s expanded."""
    c = daemon_container()
    ns = namespace_of(daemonset())
    words = [expand(c, str(w), ns, DAEMONSET_FILE) for w in list(c.get("command") or [])[1:] + list(c.get("args") or [])]
    assert "--" in words, (
        f"{rel(DAEMONSET_FILE)}: the launcher's args have no '--': the daemon flags "
        f"must follow it (cache-dit-opd-launcher [...] -- DAEMON FLAGS...)"
    )
    i = words.index("--")
    return words[:i], words[i + 1:]


def flag(words: list[str], name: str) -> str | None:
    """The value of --name in words (`--name V` or `--name=V`; the last one wins)."""
    value = None
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            value = words[i + 1]
        elif w.startswith(name + "="):
            value = w[len(name) + 1:]
    return value


def runtime_dir_mounts(path: Path, workload: dict) -> tuple[dict, list[tuple[str, str, dict]]]:
    """(the hostPath volume, [(container, mountPath, volumeMount)] of every container mounting it)."""
    spec = pod_spec(workload, path)
    vols = [v for v in spec.get("volumes") or [] if "hostPath" in v]
    assert len(vols) == 1, (
        f"{rel(path)}: spec.template.spec.volumes should hold exactly one hostPath volume (the runtime dir), "
        f"found {[v.get('name') for v in vols]}"
    )
    vol = vols[0]
    mounts = []
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        for m in c.get("volumeMounts") or []:
            if m.get("name") == vol["name"]:
                mounts.append((c.get("name"), m.get("mountPath"), m))
    assert mounts, f"{rel(path)}: no container mounts volume {vol['name']!r}"
    return vol, mounts


def runtime_dir() -> str:
    """The daemon's mountPath of the runtime dir (the path every other fact is checked against)."""
    _, mounts = runtime_dir_mounts(DAEMONSET_FILE, daemonset())
    c = daemon_container()
    for name, mount_path, _ in mounts:
        if name == c.get("name"):
            return mount_path
    pytest.fail(f"{rel(DAEMONSET_FILE)}: container {c.get('name')!r} does not mount the runtime-dir hostPath volume")


def kustomization() -> dict:
    docs = load_documents(KUSTOMIZATION_FILE)
    assert len(docs) == 1, f"{rel(KUSTOMIZATION_FILE)}: expected one document, found {len(docs)}"
    return docs[0]


def kustomize_images() -> dict[str, str]:
    """{image name kustomize matches: the reference it writes} for every images entry."""
    out = {}
    for i, img in enumerate(kustomization().get("images") or []):
        name = img.get("name")
        new_name = img.get("newName", name)
        if "digest" in img:
            out[name] = f"{new_name}@{img['digest']}"
        else:
            assert "newTag" in img, f"{rel(KUSTOMIZATION_FILE)}: images[{i}] ({name}) has neither newTag nor digest"
            out[name] = f"{new_name}:{img['newTag']}"
    return out


def image_name(ref: str) -> str:
    """"reg:5000/a/b:tag" -> "reg:5000/a/b"; "a@sha256:..." -> "a"."""
    ref = ref.split("@", 1)[0]
    last = ref.rsplit("/", 1)[-1]
    return ref[: len(ref) - len(last)] + last.split(":", 1)[0]


# ---- 1. schema ---------------------------------------------------------------


def _schema_cases():
    cases = []
    for path, i, d in all_documents():
        label = f"{path.name}#{i}:{d.get('kind')}/{(d.get('metadata') or {}).get('name')}"
        for v in K8S_VERSIONS:
            cases.append(pytest.param(path, i, d, v, id=f"{label}@{v}"))
    return cases


def _validate(doc: dict, version: str, where: str) -> None:
    if kubernetes_validate is None:
        pytest.fail("kubernetes-validate is not installed in this interpreter (deploy/install.sh installs it into .venv)")
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        field = ".".join(str(p) for p in e.path) or "(document)"
        pytest.fail(f"{where}: {doc.get('kind')}/{doc['metadata'].get('name')} fails the Kubernetes {version} "
                    f"schema (strict) at {field}: {e.message}")
    except kubernetes_validate.SchemaNotFoundError as e:
        pytest.fail(f"{where}: {e.message}")
    except kv_utils.VersionNotSupportedError as e:
        pytest.fail(f"kubernetes-validate {kubernetes_validate.__version__} has no schemas for Kubernetes "
                    f"{e.version}; set K8S_VERSIONS in {rel(Path(__file__))} to versions it bundles: "
                    f"{sorted(set(kv_utils.all_versions()))}")


@pytest.mark.parametrize("path,index,doc,version", _schema_cases())
def test_manifest_validates_strict(path, index, doc, version):
    _validate(doc, version, f"{rel(path)} document {index}")


def test_there_are_manifests():
    kinds = sorted(f"{p.name}:{d.get('kind')}" for p, _, d in all_documents())
    for want in ("daemonset.yaml:Namespace", "daemonset.yaml:ConfigMap", "daemonset.yaml:DaemonSet",
                 "client-example.yaml:Deployment"):
        assert want in kinds, f"{rel(KDIR)}: no {want.split(':')[1]} in {want.split(':')[0]} (have {kinds})"


# ---- 2. kustomization and the image -----------------------------------------

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "images", "labels", "namespace"}


def test_kustomization_shape():
    k = kustomization()
    where = rel(KUSTOMIZATION_FILE)
    assert k.get("apiVersion") == "kustomize.config.k8s.io/v1beta1", f"{where}: apiVersion is {k.get('apiVersion')!r}"
    assert k.get("kind") == "Kustomization", f"{where}: kind is {k.get('kind')!r}"
    unknown = set(k) - KUSTOMIZATION_KEYS
    assert not unknown, f"{where}: keys this test does not know (a typo?): {sorted(unknown)}"
    for r in k.get("resources") or []:
        assert (KDIR / r).is_file(), f"{where}: resources lists {r!r}, which is not a file in {rel(KDIR)}"
    for i, img in enumerate(k.get("images") or []):
        extra = set(img) - {"name", "newName", "newTag", "digest"}
        assert "name" in img and not extra, f"{where}: images[{i}] = {img!r} (keys: name, newName, newTag, digest)"
        assert not isinstance(img.get("newTag", ""), (int, float)), (
            f"{where}: images[{i}].newTag is a YAML number ({img['newTag']!r}); quote it or it may lose digits")


def test_every_manifest_is_deployed_or_is_the_example():
    listed = {str(r) for r in kustomization().get("resources") or []}
    for p in manifest_files():
        assert p.name in listed or p == CLIENT_FILE, (
            f"{rel(p)} is neither in {rel(KUSTOMIZATION_FILE)} resources nor the client example: "
            f"`kubectl apply -k` would leave it out")
    assert CLIENT_FILE.name not in listed, (
        f"{rel(KUSTOMIZATION_FILE)} lists {CLIENT_FILE.name}, whose image is a placeholder for the operator's application")


def test_image_is_named_only_in_kustomization():
    images = kustomize_images()
    assert "cache-dit-opd" in images, f"{rel(KUSTOMIZATION_FILE)}: no images entry named cache-dit-opd"
    spec = pod_spec(daemonset(), DAEMONSET_FILE)
    for field in ("initContainers", "containers"):
        for c in spec.get(field) or []:
            assert image_name(str(c.get("image"))) in images, (
                f"{rel(DAEMONSET_FILE)}: {field} {c.get('name')!r} image {c.get('image')!r} matches no images entry "
                f"of {rel(KUSTOMIZATION_FILE)} ({sorted(images)}), so kustomize does not set it")
    assert image_name(str(daemon_container().get("image"))) == "cache-dit-opd", (
        f"{rel(DAEMONSET_FILE)}: the launcher container's image is {daemon_container().get('image')!r}")
    for p in sorted(KDIR.iterdir()):
        if p == KUSTOMIZATION_FILE or not p.is_file():
            continue
        text = p.read_text()
        for name, ref in images.items():
            assert ref not in text, f"{rel(p)} names the image {ref!r}; name it only in {rel(KUSTOMIZATION_FILE)}"


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build", str(KDIR)]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize", str(KDIR)]
    return None


def test_kustomize_renders_valid_manifests_with_the_image():
    cmd = _kustomize_command()
    if cmd is None:
        pytest.skip("neither kustomize nor kubectl is installed: the rendered output is not checked")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`{' '.join(cmd)}` ran past 120 s")
    assert r.returncode == 0, f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}"
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    images = kustomize_images()
    kinds = []
    for d in docs:
        kinds.append(d.get("kind"))
        _validate(d, K8S_VERSIONS[-1], f"`{' '.join(cmd)}` output")
        if d.get("kind") == "DaemonSet":
            spec = d["spec"]["template"]["spec"]
            for c in (spec.get("initContainers") or []) + spec["containers"]:
                want = images.get(image_name(c["image"]))
                assert c["image"] == want, (
                    f"`{' '.join(cmd)}`: DaemonSet container {c['name']!r} has image {c['image']!r}, want {want!r} "
                    f"(from {rel(KUSTOMIZATION_FILE)})")
    assert sorted(kinds) == ["ConfigMap", "DaemonSet", "Namespace"], f"`{' '.join(cmd)}` rendered {kinds}"


# ---- 3. the runtime dir --------------------------------------------------------


def test_daemon_and_client_mount_the_same_host_path_at_the_same_path():
    d_vol, d_mounts = runtime_dir_mounts(DAEMONSET_FILE, daemonset())
    c_vol, c_mounts = runtime_dir_mounts(CLIENT_FILE, client_deployment())
    assert same_path(d_vol["hostPath"].get("path"), c_vol["hostPath"].get("path")), (
        f"hostPath.path differs: {rel(DAEMONSET_FILE)} volume {d_vol['name']!r} has {d_vol['hostPath'].get('path')!r}, "
        f"{rel(CLIENT_FILE)} volume {c_vol['name']!r} has {c_vol['hostPath'].get('path')!r}")
    want = runtime_dir()
    for path, mounts in ((DAEMONSET_FILE, d_mounts), (CLIENT_FILE, c_mounts)):
        for cname, mount_path, _ in mounts:
            assert same_path(mount_path, want), (
                f"{rel(path)}: container {cname!r} mounts the runtime dir at {mount_path!r}, the daemon at {want!r}: "
                f"a socket path the daemon writes must mean the same file in the client")
    assert same_path(d_vol["hostPath"].get("path"), want), (
        f"{rel(DAEMONSET_FILE)}: hostPath {d_vol['hostPath'].get('path')!r} is mounted at {want!r}; keep them equal "
        f"(the systemd unit and a client outside Kubernetes use the host path)")


def test_daemon_creates_the_host_path_and_the_client_does_not():
    d_vol, _ = runtime_dir_mounts(DAEMONSET_FILE, daemonset())
    c_vol, _ = runtime_dir_mounts(CLIENT_FILE, client_deployment())
    assert d_vol["hostPath"].get("type") == "DirectoryOrCreate", (
        f"{rel(DAEMONSET_FILE)}: volume {d_vol['name']!r} hostPath.type is {d_vol['hostPath'].get('type')!r}, "
        f"want DirectoryOrCreate")
    assert c_vol["hostPath"].get("type") in ("Directory", "DirectoryOrCreate"), (
        f"{rel(CLIENT_FILE)}: volume {c_vol['name']!r} hostPath.type is {c_vol['hostPath'].get('type')!r}")


def test_daemon_runtime_dir_flag_is_the_mount_path():
    _, daemon_flags = daemon_argv()
    assert same_path(flag(daemon_flags, "--runtime-dir"), runtime_dir()), (
        f"{rel(DAEMONSET_FILE)}: daemon flag --runtime-dir is {flag(daemon_flags, '--runtime-dir')!r}, "
        f"the runtime dir is mounted at {runtime_dir()!r}")
    env = env_value(daemon_container(), "CACHE_DIT_OPD_RUNTIME_DIR", namespace_of(daemonset()), DAEMONSET_FILE)
    assert env is None or same_path(env, runtime_dir()), (
        f"{rel(DAEMONSET_FILE)}: daemon container env CACHE_DIT_OPD_RUNTIME_DIR is {env!r}, mount is {runtime_dir()!r}")


def _discovery_env_name() -> str:
    path = ROOT / "python" / "cache_dit_opd" / "_discovery.py"
    spec = importlib.util.spec_from_file_location("_opd_discovery_for_manifest_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # plain os/re; importing the package would import torch
    name = module.RUNTIME_DIR_ENV
    header = (ROOT / "client" / "discovery.h").read_text()
    assert name in header, f"client/discovery.h does not mention {name} ({rel(path)} RUNTIME_DIR_ENV): the clients disagree"
    return name


def test_client_runtime_dir_env_is_the_mount_path():
    name = _discovery_env_name()
    c = client_container()
    value = env_value(c, name, namespace_of(client_deployment()), CLIENT_FILE)
    assert value is not None, (
        f"{rel(CLIENT_FILE)}: container {c.get('name')!r} does not set {name}, the variable the clients read "
        f"(python/cache_dit_opd/_discovery.py RUNTIME_DIR_ENV)")
    assert same_path(value, runtime_dir()), (
        f"{rel(CLIENT_FILE)}: container {c.get('name')!r} env {name}={value!r}, but the runtime dir is mounted "
        f"at {runtime_dir()!r}")


def test_client_mounts_the_runtime_dir_read_only():
    _, mounts = runtime_dir_mounts(CLIENT_FILE, client_deployment())
    for cname, mount_path, m in mounts:
        assert m.get("readOnly") is True, (
            f"{rel(CLIENT_FILE)}: container {cname!r} mounts {mount_path} read-write; readOnly: true keeps a client "
            f"from replacing a daemon's socket with its own")


# ---- 4. probes -----------------------------------------------------------------


def _probe_argv(kind: str) -> list[str]:
    c = daemon_container()
    probe = c.get(kind)
    assert probe is not None, f"{rel(DAEMONSET_FILE)}: container {c.get('name')!r} has no {kind}"
    cmd = (probe.get("exec") or {}).get("command")
    assert cmd, f"{rel(DAEMONSET_FILE)}: container {c.get('name')!r} {kind} is not an exec probe"
    return [expand(c, str(w), namespace_of(daemonset()), DAEMONSET_FILE) for w in cmd]


def _check_opdctl(kind: str, want_words: list[str]) -> None:
    argv = _probe_argv(kind)
    where = f"{rel(DAEMONSET_FILE)}: {kind}.exec.command {argv}"
    assert Path(argv[0]).name == OPDCTL, f"{where} does not run {OPDCTL}"
    launcher = Path(str(daemon_container()["command"][0]))
    if argv[0].startswith("/"):
        assert Path(argv[0]).parent == launcher.parent, f"{where}: {OPDCTL} is not next to {launcher}"
    assert same_path(flag(argv[1:], "--runtime-dir"), runtime_dir()), f"{where}: --runtime-dir is not {runtime_dir()!r}"
    words, skip = [], False
    for w in argv[1:]:
        if skip:
            skip = False
        elif w == "--runtime-dir":
            skip = True
        elif not w.startswith("--runtime-dir="):
            words.append(w)
    assert words == want_words, f"{where}: the command after --runtime-dir is {words}, want {want_words}"


def test_readiness_probe_is_opdctl_status_all():
    _check_opdctl("readinessProbe", ["status", "--all"])


def test_liveness_probe_is_opdctl_status_all_live():
    _check_opdctl("livenessProbe", ["status", "--all", "--live"])


def test_startup_probe_if_any_is_the_liveness_check():
    if daemon_container().get("startupProbe") is None:
        pytest.skip("no startupProbe")
    _check_opdctl("startupProbe", ["status", "--all", "--live"])


# ---- 5. identity: uid, gid, namespaces ---------------------------------------


def allowed_gid() -> int:
    _, daemon_flags = daemon_argv()
    v = flag(daemon_flags, "--allowed-gid")
    assert v is not None, f"{rel(DAEMONSET_FILE)}: the daemon flags have no --allowed-gid (only uid 10001 would be admitted)"
    assert v.isdigit(), f"{rel(DAEMONSET_FILE)}: --allowed-gid is {v!r}; give a number (group names differ between images)"
    return int(v)


def test_allowed_gid_is_the_client_primary_gid():
    gid = allowed_gid()
    spec = pod_spec(client_deployment(), CLIENT_FILE)
    c = client_container()
    primary = effective(spec, c, "runAsGroup")
    supplementary = (spec.get("securityContext") or {}).get("supplementalGroups") or []
    fs_group = (spec.get("securityContext") or {}).get("fsGroup")
    hint = ""
    if primary != gid and (gid in supplementary or fs_group == gid):
        hint = (" It is only a supplementary group there (supplementalGroups/fsGroup), which SO_PEERCRED does not "
                "report: the daemon compares --allowed-gid with the peer's effective (primary) gid.")
    assert primary == gid, (
        f"{rel(CLIENT_FILE)}: container {c.get('name')!r} runs with runAsGroup {primary!r}, but "
        f"{rel(DAEMONSET_FILE)} admits --allowed-gid {gid}.{hint}")


def test_daemon_group_is_the_allowed_gid():
    gid = allowed_gid()
    spec = pod_spec(daemonset(), DAEMONSET_FILE)
    c = daemon_container()
    got = effective(spec, c, "runAsGroup")
    assert got == gid, (
        f"{rel(DAEMONSET_FILE)}: container {c.get('name')!r} runAsGroup is {got!r}, --allowed-gid is {gid}: the "
        f"sockets (mode 0660) take the daemon's gid, and the clients reach them through that group")


def _init_steps(ic: dict) -> list[list[str]]:
    """An init container's commands: its argv, or each `&&` step of `sh -c SCRIPT`."""
    argv = [str(w) for w in (ic.get("command") or []) + (ic.get("args") or [])]
    if len(argv) == 3 and Path(argv[0]).name == "sh" and argv[1] == "-c":
        return [shlex.split(step) for step in argv[2].split("&&")]
    return [argv]


def test_runtime_dir_is_owned_by_the_daemon_and_the_clients_group():
    spec = pod_spec(daemonset(), DAEMONSET_FILE)
    uid = effective(spec, daemon_container(), "runAsUser")
    gid = allowed_gid()
    mount = runtime_dir()
    chown = chmod = None
    for ic in spec.get("initContainers") or []:
        for step in _init_steps(ic):
            if len(step) == 3 and same_path(step[2], mount):
                where = f"{rel(DAEMONSET_FILE)}: initContainers {ic.get('name')!r} runs {step}"
                if Path(step[0]).name == "chown":
                    chown = (step[1], where)
                elif Path(step[0]).name == "chmod":
                    chmod = (step[1], where)
    assert chown is not None, (
        f"{rel(DAEMONSET_FILE)}: no initContainer runs `chown UID:GID {mount}`; kubelet creates the hostPath "
        f"root:root 0755 and the daemon (uid {uid}) could not create its sockets")
    assert chown[0] == f"{uid}:{gid}", f"{chown[1]}: want owner {uid}:{gid} (the daemon's uid, --allowed-gid)"
    assert chmod is not None, f"{rel(DAEMONSET_FILE)}: no initContainer runs `chmod MODE {mount}`"
    assert chmod[0] in ("0750", "750"), (
        f"{chmod[1]}: want 0750 (the owner creates sockets, the clients' group only reaches them)")


def test_daemon_runs_as_non_root():
    spec = pod_spec(daemonset(), DAEMONSET_FILE)
    c = daemon_container()
    sc = c.get("securityContext") or {}
    where = f"{rel(DAEMONSET_FILE)}: container {c.get('name')!r}"
    uid = effective(spec, c, "runAsUser")
    assert isinstance(uid, int) and uid != 0, f"{where}: runAsUser is {uid!r}; run as a fixed non-root uid"
    assert effective(spec, c, "runAsNonRoot") is True, f"{where}: runAsNonRoot is not true"
    assert sc.get("privileged") is not True, f"{where}: securityContext.privileged is true"
    assert sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation is not false"
    caps = sc.get("capabilities") or {}
    assert "ALL" in (caps.get("drop") or []), f"{where}: capabilities.drop lacks ALL"
    assert not caps.get("add"), f"{where}: capabilities.add is {caps.get('add')}"
    assert not spec.get("hostNetwork"), (
        f"{rel(DAEMONSET_FILE)}: hostNetwork is true; the daemons need no host network (their sockets are in the "
        f"hostPath dir), and their metrics, which listen on the pod IP, would then listen on the node's IP")


def test_init_container_is_root_with_chown_and_fowner_only():
    spec = pod_spec(daemonset(), DAEMONSET_FILE)
    for ic in spec.get("initContainers") or []:
        sc = ic.get("securityContext") or {}
        where = f"{rel(DAEMONSET_FILE)}: initContainers {ic.get('name')!r}"
        assert sc.get("privileged") is not True, f"{where}: privileged"
        assert sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation is not false"
        caps = sc.get("capabilities") or {}
        assert "ALL" in (caps.get("drop") or []), f"{where}: capabilities.drop lacks ALL"
        assert set(caps.get("add") or []) <= {"CHOWN", "FOWNER"}, f"{where}: capabilities.add is {caps.get('add')}"


def test_client_uid_is_not_the_daemon_uid():
    d_uid = effective(pod_spec(daemonset(), DAEMONSET_FILE), daemon_container(), "runAsUser")
    spec = pod_spec(client_deployment(), CLIENT_FILE)
    c = client_container()
    uid = effective(spec, c, "runAsUser")
    where = f"{rel(CLIENT_FILE)}: container {c.get('name')!r}"
    assert isinstance(uid, int) and uid != 0, f"{where}: runAsUser is {uid!r}; run the example as a non-root uid"
    assert uid != d_uid, (
        f"{where}: runAsUser {uid} is the daemon's uid ({rel(DAEMONSET_FILE)}); with hostPID a client of that uid "
        f"could signal the daemon. Admit clients by --allowed-gid instead")


@pytest.mark.parametrize("path,field", [
    (DAEMONSET_FILE, "hostPID"), (DAEMONSET_FILE, "hostIPC"), (CLIENT_FILE, "hostPID"), (CLIENT_FILE, "hostIPC"),
], ids=["daemonset-hostPID", "daemonset-hostIPC", "client-hostPID", "client-hostIPC"])
def test_host_namespaces(path, field):
    workload = daemonset() if path == DAEMONSET_FILE else client_deployment()
    got = pod_spec(workload, path).get(field)
    why = {
        "hostPID": "the daemon compares SO_PEERCRED's pid with the client's own getpid(), which agree only when both "
                   "run in one PID namespace, the host's",
        "hostIPC": "legacy CUDA IPC across pods is assumed to need the host IPC namespace",
    }[field]
    assert got is True, f"{rel(path)}: spec.template.spec.{field} is {got!r}, want true: {why}"



def test_namespace_admits_host_namespaces_and_holds_everything():
    ns = one(DAEMONSET_FILE, "Namespace")
    name = ns["metadata"]["name"]
    level = (ns["metadata"].get("labels") or {}).get("pod-security.kubernetes.io/enforce")
    assert level == "privileged", (
        f"{rel(DAEMONSET_FILE)}: Namespace {name} label pod-security.kubernetes.io/enforce is {level!r}; "
        f"baseline and restricted refuse hostPID, hostIPC and hostPath")
    for path, i, d in all_documents():
        if d.get("kind") == "Namespace":
            continue
        got = (d.get("metadata") or {}).get("namespace")
        assert got == name, f"{rel(path)} document {i} ({d.get('kind')}): metadata.namespace is {got!r}, want {name!r}"


# ---- 6. lifecycle, GPUs, variables ---------------------------------------------


def test_grace_period_exceeds_drain_deadline():
    _, daemon_flags = daemon_argv()
    raw = flag(daemon_flags, "--drain-deadline-ms")
    drain_ms = int(raw) if raw is not None else DEFAULT_DRAIN_DEADLINE_MS
    grace = pod_spec(daemonset(), DAEMONSET_FILE).get("terminationGracePeriodSeconds", DEFAULT_GRACE_PERIOD_S)
    assert grace * 1000 >= drain_ms + GRACE_MARGIN_MS, (
        f"{rel(DAEMONSET_FILE)}: terminationGracePeriodSeconds {grace} s is not at least {GRACE_MARGIN_MS // 1000} s "
        f"above the drain deadline ({drain_ms} ms, --drain-deadline-ms from ConfigMap cache-dit-opd-flags): "
        f"kubelet would SIGKILL daemons still draining")


def test_every_variable_reference_resolves():
    for path, workload in ((DAEMONSET_FILE, daemonset()), (CLIENT_FILE, client_deployment())):
        ns = namespace_of(workload)
        spec = pod_spec(workload, path)
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            words = list(c.get("command") or []) + list(c.get("args") or [])
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                words += ((c.get(kind) or {}).get("exec") or {}).get("command") or []
            for w in words:
                for m in _VAR.finditer(str(w)):
                    if len(m.group(1)) % 2 == 1:
                        assert m.group(2) in defined_env(c), (
                            f"{rel(path)}: container {c.get('name')!r} uses $({m.group(2)}) in {w!r} but defines no "
                            f"env {m.group(2)}; Kubernetes would pass the text $({m.group(2)}) unchanged")
            for e in c.get("env") or []:
                env_value(c, e["name"], ns, path)  # configMapKeyRef -> an existing ConfigMap key


def test_daemon_flags_come_one_per_argument():
    launcher_flags, daemon_flags = daemon_argv()
    for w in launcher_flags + daemon_flags:
        assert " " not in w, (
            f"{rel(DAEMONSET_FILE)}: launcher argument {w!r} holds a space; Kubernetes does not split $(VAR) "
            f"expansions into words, so each flag and each value needs its own args entry")
    for name in ("--runtime-dir", "--allowed-gid", "--drain-deadline-ms"):
        assert flag(daemon_flags, name) is not None, f"{rel(DAEMONSET_FILE)}: daemon flags lack {name}"
    assert flag(launcher_flags, "--daemon"), f"{rel(DAEMONSET_FILE)}: launcher flags lack --daemon"


def _raw_launcher_words() -> list[str]:
    """The launcher container's arguments before `--`, $(VAR)s not expanded."""
    c = daemon_container()
    words = [str(w) for w in list(c.get("command") or [])[1:] + list(c.get("args") or [])]
    return words[:words.index("--")] if "--" in words else words


def metrics_port_base() -> int:
    launcher_flags, _ = daemon_argv()
    raw = flag(launcher_flags, "--metrics-port-base")
    assert raw is not None and raw.isdigit() and int(raw) > 0, (
        f"{rel(DAEMONSET_FILE)}: launcher flag --metrics-port-base is {raw!r} (from ConfigMap cache-dit-opd-flags); "
        f"want a port: with 0 (or none given) no daemon gets a metrics address on the pod IP")
    return int(raw)


def test_metrics_listen_on_the_pod_ip():
    c = daemon_container()
    where = f"{rel(DAEMONSET_FILE)}: container {c.get('name')!r}"
    got = flag(_raw_launcher_words(), "--metrics-host")
    assert got == "$(POD_IP)", (
        f"{where}: launcher flag --metrics-host is {got!r}, want $(POD_IP): without it the daemons listen on "
        f"127.0.0.1, the pod's own loopback, which Prometheus cannot reach")
    env = [e for e in c.get("env") or [] if e.get("name") == "POD_IP"]
    assert len(env) == 1, f"{where}: want one env POD_IP, found {len(env)}"
    field = ((env[0].get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
    assert field == "status.podIP" and "value" not in env[0], (
        f"{where}: env POD_IP is {env[0]!r}, want valueFrom.fieldRef.fieldPath status.podIP (the downward API)")
    metrics_port_base()  # and there is an address to give the host to


def test_metrics_ports_and_annotations_match_the_port_base():
    base = metrics_port_base()
    c = daemon_container()
    where = f"{rel(DAEMONSET_FILE)}: container {c.get('name')!r}"
    ports = [p for p in c.get("ports") or [] if str(p.get("name", "")).startswith("metrics")]
    assert ports, f"{where} declares no metrics-<i> containerPort"
    for i, p in enumerate(ports):
        assert p.get("name") == f"metrics-{i}" and p.get("containerPort") == base + i, (
            f"{where}: ports entry {p!r}: want name metrics-{i}, containerPort {base + i} "
            f"(daemon {i} listens on --metrics-port-base {base} + {i})")
        assert p.get("protocol", "TCP") == "TCP", f"{where}: port {p.get('name')} protocol is {p.get('protocol')!r}"
        assert "hostPort" not in p, f"{where}: port {p.get('name')} has a hostPort: it would open the node's IP"
    annotations = (dig(daemonset(), "spec.template.metadata", DAEMONSET_FILE) or {}).get("annotations") or {}
    for key, want in (("prometheus.io/scrape", "true"), ("prometheus.io/port", str(base))):
        assert annotations.get(key) == want, (
            f"{rel(DAEMONSET_FILE)}: spec.template.metadata.annotations[{key!r}] is {annotations.get(key)!r}, "
            f"want {want!r}")
    assert annotations.get("prometheus.io/path", "/metrics") == "/metrics", (
        f"{rel(DAEMONSET_FILE)}: prometheus.io/path is {annotations.get('prometheus.io/path')!r}; the daemons "
        f"answer only /metrics")


def _gpu_resources(c: dict) -> dict:
    res = c.get("resources") or {}
    return {f"{part}.{k}": v for part in ("requests", "limits") for k, v in (res.get(part) or {}).items()
            if k.startswith("nvidia.com/")}


def test_daemon_takes_no_gpu_from_the_device_plugin_but_sees_all():
    spec = pod_spec(daemonset(), DAEMONSET_FILE)
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        assert not _gpu_resources(c), (
            f"{rel(DAEMONSET_FILE)}: container {c.get('name')!r} requests {_gpu_resources(c)}: the device plugin would "
            f"take those GPUs away from the client pods")
    c = daemon_container()
    got = env_value(c, "NVIDIA_VISIBLE_DEVICES", namespace_of(daemonset()), DAEMONSET_FILE)
    assert got == "all", f"{rel(DAEMONSET_FILE)}: container {c.get('name')!r} env NVIDIA_VISIBLE_DEVICES is {got!r}, want 'all'"
    res = c.get("resources") or {}
    for k in ("cpu", "memory"):
        assert k in (res.get("requests") or {}), f"{rel(DAEMONSET_FILE)}: container {c.get('name')!r} resources.requests lacks {k}"


def test_client_requests_one_gpu():
    c = client_container()
    got = (c.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu")
    assert got == 1, f"{rel(CLIENT_FILE)}: container {c.get('name')!r} resources.limits['nvidia.com/gpu'] is {got!r}, want 1"


@pytest.mark.parametrize("path", [DAEMONSET_FILE, CLIENT_FILE], ids=["daemonset", "client"])
def test_gpu_nodes_only(path):
    workload = daemonset() if path == DAEMONSET_FILE else client_deployment()
    spec = pod_spec(workload, path)
    assert (spec.get("nodeSelector") or {}).get("nvidia.com/gpu.present") == "true", (
        f"{rel(path)}: spec.template.spec.nodeSelector['nvidia.com/gpu.present'] is not \"true\"")
    keys = [t.get("key") for t in spec.get("tolerations") or []]
    assert "nvidia.com/gpu" in keys, f"{rel(path)}: spec.template.spec.tolerations has no key nvidia.com/gpu ({keys})"


def test_daemonset_never_runs_two_pods_on_a_node():
    ru = (dig(daemonset(), "spec.updateStrategy", DAEMONSET_FILE, required=False) or {}).get("rollingUpdate") or {}
    assert ru.get("maxSurge", 0) in (0, "0", "0%"), (
        f"{rel(DAEMONSET_FILE)}: spec.updateStrategy.rollingUpdate.maxSurge is {ru.get('maxSurge')!r}; a second pod "
        f"on a node would find the first one's live sockets in the shared runtime dir")


# ---- 7. premises: what the kernel reports through SO_PEERCRED --------------------

_CLIENT = (
    "import os, socket, sys\n"
    "c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
    "c.connect(bytes.fromhex(sys.argv[1]))\n"
    "c.send(str(os.getpid()).encode())\n"
    "c.recv(1)\n"
)


def _listen() -> tuple[socket.socket, bytes]:
    addr = b"\0cache-dit-opd-manifest-test-" + uuid.uuid4().hex.encode()  # abstract: no file permissions involved
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(addr)
    s.listen(1)
    s.settimeout(20)
    return s, addr


def _accept(s: socket.socket) -> tuple[tuple[int, int, int], str]:
    c, _ = s.accept()
    with c:
        c.settimeout(20)
        cred = struct.unpack("3i", c.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        said = c.recv(64).decode()
        c.send(b"k")
    return cred, said


def _peer_in(prefix: list[str]) -> tuple[tuple[int, int, int], str]:
    s, addr = _listen()
    with s:
        p = subprocess.Popen(prefix + [sys.executable, "-c", _CLIENT, addr.hex()], stderr=subprocess.PIPE, text=True)
        try:
            try:
                return _accept(s)
            except socket.timeout:
                p.kill()
                _, err = p.communicate(timeout=10)
                pytest.skip(f"`{' '.join(prefix)}` did not run a client here: {err.strip()[-300:]}")
        finally:
            if p.poll() is None:
                p.wait(timeout=20)


def _unshare_pid() -> list[str]:
    exe = shutil.which("unshare")
    if exe is None:
        pytest.skip("unshare(1) is not installed")
    for prefix in ([exe, "--pid", "--fork"], [exe, "--user", "--map-root-user", "--pid", "--fork"]):
        if subprocess.run(prefix + ["true"], capture_output=True, timeout=20).returncode == 0:
            return prefix
    pytest.skip("this machine does not let unshare(1) make a PID namespace (needs root or user namespaces)")


def test_premise_peercred_pid_matches_getpid_only_in_one_pid_namespace():
    """Why client-example.yaml sets hostPID: the number a client sends as OpenSession's client_pid
    (its own getpid()) is the one the daemon's SO_PEERCRED reads only when both share a PID
    namespace; otherwise the daemon must map it (NSpid) or refuse the session."""
    (pid, _, _), said = _peer_in([])
    assert pid == int(said), f"same PID namespace: SO_PEERCRED pid {pid} != the client's getpid() {said}"
    (pid, _, _), said = _peer_in(_unshare_pid())
    assert pid > 0 and pid != int(said), (
        f"client in its own PID namespace: SO_PEERCRED pid {pid}, client's getpid() {said}; expected a host pid that "
        f"differs from the client's own view (the daemon would then refuse its session)")


def test_premise_peercred_pid_is_zero_for_a_peer_outside_the_readers_pid_namespace():
    """Why the daemon's pod needs hostPID: a daemon in a PID namespace of its own reads pid 0 for clients."""
    prefix = _unshare_pid()
    server = (
        "import socket, struct, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "s.bind(bytes.fromhex(sys.argv[1])); s.listen(1); print('listening', flush=True)\n"
        "c, _ = s.accept()\n"
        "print(struct.unpack('3i', c.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0], flush=True)\n"
    )
    addr = b"\0cache-dit-opd-manifest-test-" + uuid.uuid4().hex.encode()
    p = subprocess.Popen(prefix + [sys.executable, "-c", server, addr.hex()], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "listening", "the namespaced reader did not start"
        c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with c:
            c.connect(addr)
            out, _ = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=20)
    assert out.strip() == "0", f"a reader in a child PID namespace saw pid {out.strip()!r} for a host process, expected 0"


def test_premise_peercred_gid_is_the_primary_gid_not_a_supplementary_one():
    """Why the client pod's runAsGroup, not supplementalGroups, must be --allowed-gid."""
    if os.geteuid() != 0:
        pytest.skip("needs root to start a process with another uid, gid and groups")
    s, addr = _listen()
    with s:
        pid = os.fork()
        if pid == 0:  # child: become uid 20001, primary gid 3000, supplementary 10001, then connect
            code = 1
            try:
                os.setgroups([10001])
                os.setgid(3000)
                os.setuid(20001)
                c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                c.connect(addr)
                c.send(str(os.getpid()).encode())
                c.recv(1)
                code = 0
            finally:
                os._exit(code)
        try:
            (_, uid, gid), _ = _accept(s)
        finally:
            os.waitpid(pid, 0)
    assert (uid, gid) == (20001, 3000), (
        f"SO_PEERCRED reported uid {uid} gid {gid} for a process of uid 20001, gid 3000, groups [10001]: "
        f"expected the primary gid 3000 (the daemon compares --allowed-gid with this gid only)")
