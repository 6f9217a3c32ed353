"""The machine snapshot: what `sdplan doctor` reads once and everything else plans from.

Immutable, versioned, JSON-round-trippable. Unknown values are ``None`` (JSON null), never a fake 0.
Units are in the field names. This module imports nothing heavy: the planner and `recommend` use it.
"""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from sdplan.errors import ConfigError, UsageError

SCHEMA_VERSION = 1

# The GTX 16 cards (Turing TU116/TU117, no tensor cores) as AUTOMATIC1111 tells them apart to run them without
# autocast (modules/devices.py cuda_no_autocast: compute capability 7.5 and a name starting so): fp16 mixed
# precision gives NaN losses in training on them (kohya-ss/sd-scripts issue 293, bmaltais/kohya_ss issues 722 and
# 1951). The GPU catalog marks its GTX 16 entries so too (profiles/gpus.yaml fp16_trains: false).
GTX16_NAME_PREFIX = "NVIDIA GeForce GTX 16"
# the reports of it, as sdplan's messages cite them
GTX16_FP16_NAN_SOURCES = "kohya-ss/sd-scripts issue 293, bmaltais/kohya_ss issues 722 and 1951"


def fp16_gives_nan(name: str | None, compute_capability: str | None) -> bool:
    """Whether a GPU of this NVML name and compute capability is a GTX 16 card (:data:`GTX16_NAME_PREFIX`)."""
    return compute_capability == "7.5" and (name or "").startswith(GTX16_NAME_PREFIX)


@dataclass(frozen=True)
class Host:
    os: str | None = None
    kernel: str | None = None
    cpu_model: str | None = None
    cpu_cores: int | None = None
    ram_total_bytes: int | None = None
    ram_available_bytes: int | None = None
    disk_free_bytes: int | None = None
    shm_bytes: int | None = None
    # the cgroup memory limit that binds this process (a container's --memory, a Slurm job's memory): the
    # smallest on its cgroup's way up; None where none is set or it cannot be read (snapshots saved before it)
    ram_limit_bytes: int | None = None

    @property
    def ram_usable_bytes(self) -> int | None:
        """The RAM a run here may use: the host's MemTotal, or the cgroup limit where that is smaller (a process
        above it is killed by the OOM killer however much the host has). None where neither is known."""
        known = [n for n in (self.ram_total_bytes, self.ram_limit_bytes) if n is not None]
        return min(known) if known else None


@dataclass(frozen=True)
class GPU:
    index: int
    vendor: str  # "nvidia" | "amd"
    name: str | None = None
    uuid: str | None = None
    memory_total_bytes: int | None = None
    memory_free_bytes: int | None = None
    compute_capability: str | None = None  # "8.9" (NVIDIA)
    gfx_arch: str | None = None  # "gfx1030" (AMD)
    bf16: bool | None = None  # hardware truth, not torch.cuda.is_bf16_supported()
    fp16: bool | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    power_limit_watts: float | None = None
    driver_version: str | None = None
    # AMD: the HIP runtime's number for this GPU, which HIP_VISIBLE_DEVICES takes. HIP numbers GPUs by their KFD
    # topology node, amdsmi in its own discovery order; the two agree on most hosts, not all (amd-smi itself
    # computes HIP's id from the KFD node: ROCm/rocm-systems PR 4406). None: not read (NVIDIA; older amdsmi).
    hip_index: int | None = None
    # its KFD topology node id (amdsmi_get_gpu_kfd_info), what ROCm's per-GPU HSA_OVERRIDE_GFX_VERSION_<n> names
    kfd_node: int | None = None
    # NVIDIA MIG: whether the card is in MIG mode (None: not read, or a GPU without MIG), and how many MIG slices
    # (devices) it holds. CUDA sees only the slices, so in MIG mode memory_total_bytes/free are the largest
    # slice's, the most one process can use; None where no slice could be read (CUDA sees nothing there).
    mig: bool | None = None
    mig_slices: int | None = None


@dataclass(frozen=True)
class Link:
    a: int
    b: int
    type: str  # "nvlink" | "xgmi" | "pcie"
    p2p: bool | None = None


@dataclass(frozen=True)
class Software:
    python: str | None = None
    torch: str | None = None
    torch_build: str | None = None  # "cuda" | "rocm" | "cpu" | None
    cuda_runtime: str | None = None
    hip_runtime: str | None = None
    cuda_driver: str | None = None  # highest CUDA version the driver supports, e.g. "12.4"
    rocm: str | None = None
    packages: dict[str, str | None] = field(default_factory=dict)


ENV_KEYS = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",  # PCI_BUS_ID: CUDA numbers GPUs as NVML (and doctor) do; unset: fastest first
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",  # ROCm's runtime filter, before HIP's: set at all (even empty) it filters
    "HSA_OVERRIDE_GFX_VERSION",
    "PYTORCH_CUDA_ALLOC_CONF",
)
# ROCm's arch override for one GPU: libhsakmt's topology.c reads HSA_OVERRIDE_GFX_VERSION_<KFD node id> before
# HSA_OVERRIDE_GFX_VERSION (node 0 is the CPU on a one-socket host, so the first GPU is usually _1)
GFX_OVERRIDE_PER_NODE = re.compile(r"HSA_OVERRIDE_GFX_VERSION_\d+")


def env_of(environ: Any) -> dict[str, str | None]:
    """The environment a snapshot records: each of :data:`ENV_KEYS` (None where unset), and the per-GPU arch
    overrides that are set (:data:`GFX_OVERRIDE_PER_NODE`)."""
    out = {k: environ.get(k) for k in ENV_KEYS}
    out.update({k: v for k, v in sorted(environ.items()) if GFX_OVERRIDE_PER_NODE.fullmatch(k) and v})
    return out


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" | "warning" | "info"
    code: str
    message: str
    fix: str


def nvidia_uuid(uuid: str | None) -> bool:
    """Whether ``uuid`` is an NVIDIA GPU's UUID as NVML reports it (``GPU-8932f937-...``), the form
    ``CUDA_VISIBLE_DEVICES`` takes."""
    return bool(uuid) and str(uuid).startswith("GPU-")


@dataclass(frozen=True)
class Snapshot:
    host: Host
    gpus: tuple[GPU, ...] = ()
    links: tuple[Link, ...] = ()
    software: Software = field(default_factory=Software)
    env: dict[str, str | None] = field(default_factory=lambda: dict.fromkeys(ENV_KEYS))
    findings: tuple[Finding, ...] = ()
    schema_version: int = SCHEMA_VERSION

    # -- derived views -------------------------------------------------------------------------------
    @property
    def usable_gpus(self) -> tuple[GPU, ...]:
        """GPUs a trainer can use: known vendor and known memory."""
        return tuple(g for g in self.gpus if g.memory_total_bytes)

    def visible_devices(
        self, indexes: tuple[int, ...] | list[int], *, by_uuid: bool = True
    ) -> dict[str, str]:
        """The environment that shows a process only these GPUs (their ``index``, as `sdplan doctor` numbers
        them), in this order. NVIDIA: ``CUDA_VISIBLE_DEVICES`` by the UUIDs NVML reported (``GPU-...``, which
        CUDA and torch take in any device order), else by index with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (NVML's
        order; CUDA's own default puts the fastest first). AMD: ``HIP_VISIBLE_DEVICES`` by HIP's own numbers
        (``hip_index``, from the KFD topology), else counting AMD's GPUs in amdsmi's order.
        The GPUs must be one vendor's (one torch build drives them). ``by_uuid=False``: by index (shorter, for a
        person to type)."""
        chosen = [next(g for g in self.gpus if g.index == i) for i in indexes]
        vendors = {g.vendor for g in chosen}
        if len(vendors) != 1:
            raise ValueError(f"GPUs {list(indexes)} are not one vendor's")
        vendor = vendors.pop()
        if by_uuid and vendor == "nvidia" and all(nvidia_uuid(g.uuid) for g in chosen):
            ids = ",".join(str(g.uuid) for g in chosen)
            return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ids}
        local = [g.index for g in self.gpus if g.vendor == vendor]
        if vendor == "nvidia":
            ids = ",".join(str(local.index(g.index)) for g in chosen)
            return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ids}
        if all(g.hip_index is not None for g in chosen):  # HIP's own numbers (KFD node order)
            return {"HIP_VISIBLE_DEVICES": ",".join(str(g.hip_index) for g in chosen)}
        return {"HIP_VISIBLE_DEVICES": ",".join(str(local.index(g.index)) for g in chosen)}

    def to_dict(self) -> dict[str, Any]:
        """The exact object `sdplan doctor --json` prints."""
        return {
            "schema_version": self.schema_version,
            "host": asdict(self.host),
            "gpus": [asdict(g) for g in self.gpus],
            "links": [asdict(link) for link in self.links],
            "software": asdict(self.software),
            "env": env_of(self.env),
            "findings": [asdict(f) for f in self.findings],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "snapshot") -> Snapshot:
        """Validate and build; every problem found is reported at once as a ConfigError."""
        errors: list[str] = []
        if not isinstance(data, dict):
            raise ConfigError(
                source, ["top level: must be a JSON object (the output of `sdplan doctor --json`)"]
            )
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            errors.append(f"schema_version: expected {SCHEMA_VERSION}, got {version!r}")
        known = {"schema_version", "host", "gpus", "links", "software", "env", "findings"}
        errors += [f"{k}: unknown key" for k in data if k not in known]

        host = _build(Host, data.get("host", {}), "host", errors)
        gpus = tuple(
            g
            for i, item in enumerate(_as_list(data.get("gpus", []), "gpus", errors))
            if (g := _build(GPU, item, f"gpus[{i}]", errors)) is not None
        )
        links = tuple(
            lk
            for i, item in enumerate(_as_list(data.get("links", []), "links", errors))
            if (lk := _build(Link, item, f"links[{i}]", errors)) is not None
        )
        software = _build(Software, data.get("software", {}), "software", errors)
        findings = tuple(
            f
            for i, item in enumerate(_as_list(data.get("findings", []), "findings", errors))
            if (f := _build(Finding, item, f"findings[{i}]", errors)) is not None
        )
        env = data.get("env", {}) or {}
        if not isinstance(env, dict):
            errors.append("env: must be an object")
            env = {}
        for key, value in env.items():
            if not isinstance(
                value, (str, type(None))
            ):  # an environment variable's text, or null where unset
                errors.append(f"env.{key}: expected text or null, got {type(value).__name__}")
        for g in gpus:
            if g.vendor not in ("nvidia", "amd"):
                errors.append(f"gpus[{g.index}].vendor: must be 'nvidia' or 'amd', got {g.vendor!r}")
        if errors:
            raise ConfigError(source, errors)
        return cls(
            host=host,
            gpus=gpus,
            links=links,
            software=software,
            env=env_of(env),
            findings=findings,
        )

    @classmethod
    def load(cls, path: str | Path) -> Snapshot:
        p = Path(path)
        if p.is_dir():
            raise UsageError(
                f"machine snapshot {p} is a folder, not a file",
                fix="give the JSON file that `sdplan doctor --save FILE` wrote",
            )
        if not p.is_file():
            raise UsageError(
                f"machine snapshot {p} does not exist", fix="write one with `sdplan doctor --save FILE`"
            )
        again = "write it again with `sdplan doctor --save FILE` on that machine"
        try:
            data = json.loads(p.read_text(encoding="utf-8-sig"))  # an editor's byte-order mark is no error
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(str(p), [f"not valid JSON ({e})"], fix=again) from None
        try:
            return cls.from_dict(data, source=str(p))
        except ConfigError as e:
            raise ConfigError(e.source, e.errors, fix=again) from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")


_TYPES: dict[str, tuple[type, ...]] = {
    "int | None": (int, type(None)),
    "str | None": (str, type(None)),
    "bool | None": (bool, type(None)),
    "float | None": (int, float, type(None)),
    "int": (int,),
    "str": (str,),
}


def _as_list(value: Any, where: str, errors: list[str]) -> list:
    if not isinstance(value, list):
        errors.append(f"{where}: must be a list")
        return []
    return value


def _build(kind: type, data: Any, where: str, errors: list[str]):
    if not isinstance(data, dict):
        errors.append(f"{where}: must be an object")
        return kind() if kind in (Host, Software) else None
    names = {f.name: f for f in fields(kind)}
    ok = True
    for key in data:
        if key not in names:
            errors.append(f"{where}.{key}: unknown key")
            ok = False
    kwargs = {}
    for name, f in names.items():
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                errors.append(f"{where}.{name}: missing")
                ok = False
            continue
        value = data[name]
        allowed = _TYPES.get(str(f.type))
        if str(f.type) == "dict[str, str | None]" and not (
            isinstance(value, dict) and all(isinstance(v, (str, type(None))) for v in value.values())
        ):  # software.packages: name -> version, null where not installed
            errors.append(f"{where}.{name}: expected an object of name: version (or null)")
            ok = False
        elif allowed and (
            not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)
        ):
            errors.append(f"{where}.{name}: expected {f.type}, got {type(value).__name__}")
            ok = False
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and not value >= 0:
            errors.append(f"{where}.{name}: must be >= 0, got {value}")  # bytes, cores, watts, an index
            ok = False
        kwargs[name] = value
    if not ok:
        return kind() if kind in (Host, Software) else None
    return kind(**kwargs)
