"""Hardware peaks for the roofline: datasheet specs for GPUs, a measured probe for the CPU.

A spec is a memory bandwidth (bytes/s), peak FLOP/s per compute dtype, and per dtype how far
the machine overlaps computing with moving bytes (1: fully, the standard roofline's max(); 0:
one after the other, their sum); optionally the device's memory capacity and its interconnect
(the per-GPU bus bandwidth an all-reduce reaches in one direction, and the latency per ring
step; harness/measuring/comm.py uses them). GPU specs are the public datasheet values in
`configs/hardware/<name>.yaml` (dense, no sparsity; overlap 1). `cpu` is measured on this
machine by `probe_cpu` (a large sum and copy for bandwidth, square matmuls for FLOP/s, a matmul
at the ridge point for the overlap, at the engine's thread count; a 2-process gloo all-reduce
over loopback for the link) and cached per machine so runs do not re-probe. `auto` picks the
spec from the engine's device. docs/roofline.md has the details.
"""

from __future__ import annotations

import json
import math
import platform
import re
import socket
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import psutil
import torch
import yaml
from omegaconf import MISSING

from configs import CONFIG_DIR
from harness.measuring.link_probe import LINK_BACKEND, LINK_SIZES, LINK_WORLD_SIZE, probe_link

SPEC_DIR = CONFIG_DIR / "hardware"
SPEC_KEYS = {
    "name",
    "source",
    "device_names",
    "memory_bandwidth",
    "peak_flops",
    "overlap",
    "memory_bytes",
    "link_bandwidth",
    "link_latency",
    "pcie_bandwidth",
    "network_bandwidth",
    "cost_per_hour",
}
PROBE_DTYPES = ("float32", "bfloat16", "float16")
PROBE_VERSION = 5  # bumped when the probe measures something new: older caches are re-probed


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    memory_bandwidth: float  # bytes/s
    peak_flops: dict[str, float]  # compute dtype ("float32", "bfloat16", ...) -> FLOP/s
    source: str = ""
    device_names: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)  # probe settings, machine, time
    # compute dtype -> 0..1: how much of the shorter of compute and memory time hides under the
    # longer (1, the standard roofline, for a dtype not listed)
    overlap: dict[str, float] = field(default_factory=dict)
    memory_bytes: int | None = None  # the device's memory capacity; None: not stated
    # the interconnect, for tensor parallelism's collectives (harness/measuring/comm.py): the
    # per-device bus bandwidth an all-reduce reaches, one direction (bytes/s; nccl-tests'
    # busbw), and the latency of one ring step (s). None: not stated (or not measured)
    link_bandwidth: float | None = None
    link_latency: float | None = None
    # links a KV cache moves over between instances or tiers (disaggregation, offloading), per
    # device, one direction (bytes/s): host <-> device, and the device's network interface
    pcie_bandwidth: float | None = None
    network_bandwidth: float | None = None
    cost_per_hour: float | None = None  # per device (hardware.cost_per_hour); None: not stated

    def flops_for(self, dtype: str) -> float | None:
        """Peak FLOP/s for a compute dtype (torch's name, "torch." prefix optional)."""
        return self.peak_flops.get(dtype.removeprefix("torch."))

    def overlap_for(self, dtype: str) -> float:
        return self.overlap.get(dtype.removeprefix("torch."), 1.0)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["device_names"] = list(self.device_names)
        return out


@dataclass
class HardwareCost:
    """The key every `hardware` config has, whichever spec it names."""

    # what one device of this hardware costs an hour to run or rent (any currency, e.g. USD):
    # the report's output tokens per dollar divide by it x the devices a run used (docs/
    # reports.md); null: not stated
    cost_per_hour: float | None = None


@dataclass
class CpuProbeConfig(HardwareCost):
    """hardware=cpu: this machine's peaks, measured on the spot (cpu_spec); the schema of
    configs/hardware/cpu.yaml (`hardware/cpu_schema`)."""

    name: str = "cpu"
    probe_bytes: int = 256 << 20  # bandwidth probe (one fp32 tensor), overlap probe weight
    matmul_size: int = 1024  # FLOP/s probe: square matmuls of this size
    reprobe: bool = False  # measure again instead of reading the cached result


@dataclass
class DatasheetSchema(HardwareCost):
    """The keys of a datasheet spec file (configs/hardware/<gpu>.yaml, `hardware/
    datasheet_schema`), so that `hardware.cost_per_hour=2.5` overrides with no `+`; the
    values are checked by spec_from_dict."""

    name: str = MISSING
    source: str = ""
    device_names: list[str] = field(default_factory=list)
    memory_bandwidth: float = MISSING  # bytes/s
    peak_flops: dict[str, float] = field(default_factory=dict)
    overlap: dict[str, float] = field(default_factory=dict)
    memory_bytes: int | None = None
    link_bandwidth: float | None = None
    link_latency: float | None = None
    pcie_bandwidth: float | None = None
    network_bandwidth: float | None = None


@dataclass
class AutoSchema(HardwareCost):
    """hardware=auto (configs/hardware/auto.yaml, `hardware/auto_schema`)."""

    name: str = "auto"


COST_KEYS = {f.name for f in fields(HardwareCost)}
CPU_KEYS = {f.name for f in fields(CpuProbeConfig)}
CPU_DEFAULTS: dict[str, Any] = {
    f.name: f.default
    for f in fields(CpuProbeConfig)
    if f.name != "name" and f.name not in COST_KEYS
}


def register_config_schema() -> None:
    """configs/hardware/cpu.yaml extends `hardware/cpu_schema`; the group's other files are
    datasheet specs (data, read by load_spec_file), not options."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group="hardware", name="cpu_schema", node=CpuProbeConfig)
    store.store(group="hardware", name="datasheet_schema", node=DatasheetSchema)
    store.store(group="hardware", name="auto_schema", node=AutoSchema)


register_config_schema()


def allowed_names() -> list[str]:
    return sorted(p.stem for p in SPEC_DIR.glob("*.yaml"))


def _check_name(name: Any) -> str:
    names = allowed_names()
    if name not in names:
        raise ValueError(f"hardware: {name!r} is invalid; allowed: {'|'.join(names)}")
    return str(name)


def spec_from_dict(values: dict[str, Any], where: str = "hardware") -> HardwareSpec:
    """Validate a datasheet spec (a configs/hardware file, or the composed `hardware` group)."""
    unknown = sorted(set(values) - SPEC_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(SPEC_KEYS)}")
    for key in ("name", "memory_bandwidth", "peak_flops"):
        if key not in values:
            raise ValueError(f"{where}.{key}: required")

    def number(key: str, value: Any, zero_ok: bool = False, unit: str = "") -> float:
        """A finite number > 0 (>= 0 with zero_ok); a bool is not one."""
        try:
            x = float("nan") if isinstance(value, bool) else float(value)
        except (TypeError, ValueError):
            x = float("nan")
        if not (math.isfinite(x) and (x >= 0 if zero_ok else x > 0)):
            bound = "a number >= 0" if zero_ok else "a number > 0"
            raise ValueError(f"{where}.{key}: {value!r} is invalid; allowed: {bound}{unit}")
        return x

    def optional(key: str, unit: str, zero_ok: bool = False) -> float | None:
        """An optional key: absent or null is None (not stated), else checked."""
        value = values.get(key)
        return None if value is None else number(key, value, zero_ok, unit)

    peaks = values["peak_flops"]
    if not isinstance(peaks, dict) or not peaks:
        raise ValueError(f"{where}.peak_flops: expected a mapping dtype -> FLOP/s, got {peaks!r}")
    overlap = values.get("overlap") or {}
    if not isinstance(overlap, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1
        for v in overlap.values()
    ):
        raise ValueError(
            f"{where}.overlap: {overlap!r} is invalid; allowed: a mapping dtype -> "
            "a number in [0, 1]"
        )
    return HardwareSpec(
        name=str(values["name"]),
        memory_bandwidth=number("memory_bandwidth", values["memory_bandwidth"]),
        peak_flops={str(k): number(f"peak_flops.{k}", v) for k, v in peaks.items()},
        source=str(values.get("source", "")),
        device_names=tuple(values.get("device_names") or ()),
        overlap={str(k): float(v) for k, v in overlap.items()},
        memory_bytes=_as_int(optional("memory_bytes", " (bytes)")),  # a capacity: whole bytes
        link_bandwidth=optional("link_bandwidth", " (bytes/s)"),
        link_latency=optional("link_latency", " (seconds per hop)", zero_ok=True),
        pcie_bandwidth=optional("pcie_bandwidth", " (bytes/s)"),
        network_bandwidth=optional("network_bandwidth", " (bytes/s)"),
        cost_per_hour=optional("cost_per_hour", " (per device-hour)"),
    )


def _as_int(value: float | None) -> int | None:
    return None if value is None else int(value)


def load_spec_file(name: str) -> dict[str, Any]:
    values = yaml.safe_load((SPEC_DIR / f"{_check_name(name)}.yaml").read_text()) or {}
    values.pop("defaults", None)  # Hydra's: the file's schema, no value of the spec
    return values


def datasheet_specs() -> list[HardwareSpec]:
    """Every spec with datasheet values (all files but `auto` and `cpu`)."""
    return [
        spec_from_dict(load_spec_file(n), f"configs/hardware/{n}.yaml")
        for n in allowed_names()
        if n not in ("auto", "cpu")
    ]


def match_gpu(device_name: str) -> HardwareSpec | None:
    """The spec whose device_names holds this CUDA device name (case-insensitive), if any."""
    wanted = device_name.strip().lower()
    for spec in datasheet_specs():
        if any(wanted == n.lower() for n in spec.device_names):
            return spec
    return None


# ---- the CPU probe ------------------------------------------------------------------------


def _best_seconds(fn: Any, repeats: int, budget_s: float) -> float:
    fn()  # warm: first-touch pages, kernel selection
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return best


def _bandwidths(probe_bytes: int, repeats: int) -> tuple[float, float]:
    """(read bytes/s of a sum, read + written bytes/s of a copy) over `probe_bytes` of fp32."""
    x = torch.ones(probe_bytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    read_s = _best_seconds(lambda: x.sum(), repeats, 1.0)
    copy_s = _best_seconds(lambda: y.copy_(x), repeats, 1.0)
    return nbytes / read_s, 2 * nbytes / copy_s


def _overlap(
    dtype: torch.dtype, peak_flops: float, bandwidth: float, weight_bytes: int, repeats: int
) -> float:
    """How much of the shorter of compute and memory time a linear layer at the ridge point
    hides under the longer: (compute + memory - measured) / min(compute, memory), in [0, 1].

    The layer is x [m, n] @ W [n, n]^T with W of `weight_bytes` (far larger than the caches)
    and m rows chosen so that its FLOPs per byte of W equal peak_flops / bandwidth: there its
    compute and memory times are equal, and max() and sum() differ the most. Timed through
    torch's plain GEMM, where oneDNN is available its prepacked one, and for float32 the
    engine's own GEMM (its C kernels, where they build): the fastest, the best this machine's
    kernels do (which one a run uses depends on its `prepack_weights` and `native_kernels`).
    0 when the machine is slower than even the sum (small-row matmuls short of both peaks).
    """
    from engines.builtin import native
    from engines.builtin.layers.linear import PrepackedDenseMethod

    size = torch.tensor([], dtype=dtype).element_size()
    n = int((weight_bytes // size) ** 0.5)
    rows = max(1, round(peak_flops / bandwidth * size / 2))
    weight = torch.ones(n, n, dtype=dtype)
    x = torch.ones(rows, n, dtype=dtype)
    measured = _best_seconds(lambda: torch.nn.functional.linear(x, weight), repeats, 2.0)
    if PrepackedDenseMethod.supported(torch.device("cpu"), dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        measured = min(
            measured,
            _best_seconds(
                lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                repeats,
                2.0,
            ),
        )
        del packed
    if dtype == torch.float32 and native.load() is not None:
        panels = native.pack_linear_weight(weight)
        measured = min(measured, _best_seconds(lambda: native.linear(x, panels, n), repeats, 2.0))
    compute, memory = 2 * rows * n * n / peak_flops, n * n * size / bandwidth
    return min(1.0, max(0.0, (compute + memory - measured) / min(compute, memory)))


def probe_cpu(
    probe_bytes: int = CPU_DEFAULTS["probe_bytes"],
    matmul_size: int = CPU_DEFAULTS["matmul_size"],
    repeats: int = 5,
) -> dict[str, Any]:
    """Measure memory bandwidth, matmul FLOP/s and their overlap at torch's thread count, and
    the link a gloo all-reduce between two processes reaches.

    Bandwidth: the best of a read-only sum over `probe_bytes` of fp32 (bytes read / s) and a
    copy of it (bytes read + written / s). FLOP/s: the best of `repeats` square matmuls of
    `matmul_size` per dtype (2 n^3 FLOPs each). Overlap per dtype: `_overlap` over a weight of
    `probe_bytes`. Best-of, because a peak is what the machine can do; noise only ever slows
    a sample down. The link: `link_probe.probe_link` (link_bandwidth and link_latency, or
    link_error with the reason it could not be measured; the rest stands either way).
    """
    if probe_bytes < 1 << 16 or matmul_size < 16:
        raise ValueError(
            f"hardware: probe_bytes={probe_bytes} / matmul_size={matmul_size} "
            "too small; allowed: probe_bytes >= 65536, matmul_size >= 16"
        )
    with torch.inference_mode():
        read_bw, copy_bw = _bandwidths(probe_bytes, repeats)
        flops: dict[str, float] = {}
        n = matmul_size
        for name in PROBE_DTYPES:
            dtype = getattr(torch, name)
            a = torch.randn(n, n).to(dtype)
            b = torch.randn(n, n).to(dtype)
            flops[name] = 2 * n**3 / _best_seconds(lambda a=a, b=b: a @ b, repeats, 1.0)
        bandwidth = max(read_bw, copy_bw)
        overlap = {
            name: _overlap(getattr(torch, name), flops[name], bandwidth, probe_bytes, repeats)
            for name in PROBE_DTYPES
        }
    return {
        "memory_bandwidth": bandwidth,
        "read_bandwidth": read_bw,
        "copy_bandwidth": copy_bw,
        "peak_flops": flops,
        "overlap": overlap,
        # after the rest, in processes of its own: the ranks start once this one is idle
        **probe_link(),
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def cache_path(threads: int, cache_dir: Path | None = None) -> Path:
    from models.cache import cache_dir as default_cache_dir

    key = f"{socket.gethostname()}-{cpu_model()}-{threads}t"
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", key)
    return (cache_dir or default_cache_dir() / "hardware") / f"{key}.json"


def cpu_spec(
    probe_bytes: int = CPU_DEFAULTS["probe_bytes"],
    matmul_size: int = CPU_DEFAULTS["matmul_size"],
    reprobe: bool = False,
    cache_dir: Path | None = None,
) -> HardwareSpec:
    """This CPU's measured spec at torch's current thread count, from the cache when a probe
    with the same settings was cached on this machine, else probed now (and cached)."""
    from harness.run_folder import write_json_atomic
    from models.cache import cache_dir as default_cache_dir
    from models.cache import check_trusted, make_folder

    threads = torch.get_num_threads()
    path = cache_path(threads, cache_dir)
    # the root the trust rule starts from: the cache's, or the folder a caller (a test) gave
    check_trusted(path, "hardware calibration cache", cache_dir or default_cache_dir())
    settings = {
        "probe_bytes": int(probe_bytes),
        "matmul_size": int(matmul_size),
        "threads": threads,
        "probe_version": PROBE_VERSION,  # 5: the link, so a cache without it is probed again
        "link": {"backend": LINK_BACKEND, "world_size": LINK_WORLD_SIZE, "sizes": list(LINK_SIZES)},
    }
    cached = None
    if path.is_file() and not reprobe:
        try:
            cached = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cached = None
        if cached is not None and cached.get("settings") != settings:
            cached = None
    if cached is None:
        start = time.perf_counter()
        measured = probe_cpu(int(probe_bytes), int(matmul_size))
        cached = {
            "settings": settings,
            "measured": measured,
            "cpu_model": cpu_model(),
            "host": socket.gethostname(),
            "probed_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "probe_s": time.perf_counter() - start,
        }
        make_folder(path.parent)
        write_json_atomic(path, cached)
        cached["from_cache"] = False
    else:
        cached["from_cache"] = True
    measured = cached["measured"]
    details = {k: v for k, v in cached.items() if k != "measured"}
    details.update(
        cache_file=str(path),
        read_bandwidth=measured["read_bandwidth"],
        copy_bandwidth=measured["copy_bandwidth"],
    )
    # the link's raw times, or why it could not be measured (its keys are then None)
    for key in ("link_probe", "link_error"):
        if key in measured:
            details[key] = measured[key]
    link_bandwidth, link_latency = measured.get("link_bandwidth"), measured.get("link_latency")
    return HardwareSpec(
        name="cpu",
        memory_bandwidth=float(measured["memory_bandwidth"]),
        peak_flops={k: float(v) for k, v in measured["peak_flops"].items()},
        overlap={k: float(v) for k, v in measured["overlap"].items()},
        source=f"measured on this machine ({threads} threads)",
        details=details,
        memory_bytes=int(psutil.virtual_memory().total),  # read, not measured: not cached
        link_bandwidth=None if link_bandwidth is None else float(link_bandwidth),
        link_latency=None if link_latency is None else float(link_latency),
    )


# ---- resolving the `hardware` config --------------------------------------------------------


def validate_config(config: dict[str, Any] | str | None) -> dict[str, Any]:
    """The `hardware` config group as a dict, checked: a known name, known keys."""
    if config is None:
        config = {"name": "auto"}
    if isinstance(config, str):
        config = {"name": config}
    config = dict(config)
    name = _check_name(config.get("name"))
    _check_cost(config.get("cost_per_hour"))
    if name == "auto":
        unknown = sorted(set(config) - {"name"} - COST_KEYS)
        if unknown:
            raise ValueError(
                f"hardware: unknown key(s) {unknown} for hardware=auto; "
                "pick a spec (e.g. hardware=cpu) to set its values"
            )
    elif name == "cpu":
        unknown = sorted(set(config) - CPU_KEYS)
        if unknown:
            raise ValueError(
                f"hardware: unknown key(s) {unknown}; allowed for cpu: {sorted(CPU_KEYS)}"
            )
        # checked here, not left to int()/bool(): bool("false") is True
        for key, low in (("probe_bytes", 1 << 16), ("matmul_size", 16)):
            value = config.get(key, CPU_DEFAULTS[key])
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"hardware.{key}: {value!r} is invalid; allowed: an integer >= {low}"
                )
        if not isinstance(config.get("reprobe", False), bool):
            raise ValueError(
                f"hardware.reprobe: {config['reprobe']!r} is invalid; allowed: true|false"
            )
    else:  # a datasheet spec: the file's values, overridden by the config's
        spec_from_dict({**load_spec_file(name), **config})
    return config


def resolve(
    config: dict[str, Any] | str | None, device: str | None, cache_dir: Path | None = None
) -> tuple[HardwareSpec | None, str | None]:
    """(spec, note) for a run on `device` (the engine's, e.g. "cpu" or "cuda:0"; None for a
    remote backend). The spec is None, with the note saying why, when no peak applies."""
    config = validate_config(config)
    name = config["name"]
    if name == "auto":
        if device is None:
            return None, "hardware=auto: the backend reports no local device (remote server)"
        if device.startswith("cuda"):
            device_name = torch.cuda.get_device_name(torch.device(device))
            spec = match_gpu(device_name)
            if spec is None:
                return None, (
                    f"hardware=auto: no spec in configs/hardware matches GPU "
                    f"{device_name!r}; add one or pick hardware=<name>"
                )
            return replace(spec, cost_per_hour=_cost(config)), None
        name = "cpu"
        config = {"name": "cpu", "cost_per_hour": config.get("cost_per_hour")}
    if name == "cpu":
        settings = {**CPU_DEFAULTS, **config}
        spec = cpu_spec(
            settings["probe_bytes"], settings["matmul_size"], bool(settings["reprobe"]), cache_dir
        )
        return replace(spec, cost_per_hour=_cost(config)), None
    return spec_from_dict({**load_spec_file(name), **config}), None


def _cost(config: dict[str, Any]) -> float | None:
    cost = config.get("cost_per_hour")
    return None if cost is None else float(cost)


def _check_cost(value: Any) -> None:
    ok = value is None or (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )
    if not ok:  # 0 too: a price of nothing gives tokens per dollar no report can draw
        raise ValueError(
            f"hardware.cost_per_hour: {value!r} is invalid; allowed: a number > 0 (per "
            "device-hour) or null (no price: no per-dollar view)"
        )


def describe_for_run(spec: HardwareSpec | None, note: str | None) -> dict[str, Any]:
    """What the run's summary records about the hardware behind its roofline columns."""
    if spec is None:
        return {"name": None, "note": note}
    return spec.to_dict()
