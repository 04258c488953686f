"""Pieces shared by the A/B run and the op timings: lengths, the prompt, the
description of the machine and software, op paths, progress and file names."""

from __future__ import annotations

import ast
import datetime as _dt
import importlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent

ALL_LENGTHS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
# mlx-lm's default prompt chunk; both engines prefill through it.
PREFILL_STEP = 2048
DECODE_STEPS = 64


# ----------------------------------------------------------------- lengths


def parse_length(text: str) -> int:
    """'256' -> 256, '4K' / '4k' -> 4096 (K = 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", text)
    if not m:
        raise ValueError(f"not a length: {text!r} (use e.g. 256, 1K, 128K)")
    n = int(m.group(1)) * (1024 if m.group(2) else 1)
    if n < 2:
        raise ValueError(f"length must be at least 2, got {text!r}")
    return n


def parse_setting(text: str, where: str) -> Tuple[str, str, Any]:
    """'mod.NAME=VALUE' (VALUE a Python literal; ``mod`` importable and
    holding NAME) -> (module, name, value); ``where`` names the flag in
    the errors."""
    target, eq, value = text.partition("=")
    module, dot, name = target.strip().rpartition(".")
    if not eq or not dot:
        raise ValueError(f"{where}: {text!r} is not MODULE.NAME=VALUE")
    try:
        parsed = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError) as exc:
        raise ValueError(f"{where}: {value.strip()!r} is not a Python literal") from exc
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        raise ValueError(f"{where}: {module} has no {name}")
    return module, name, parsed


def apply_settings(settings: List[Tuple[str, str, Any]]) -> Dict[Tuple[str, str], Any]:
    """Set each (module, name, value); returns the values they replaced,
    for ``restore_settings``."""
    originals = {}
    for module, name, value in settings:
        mod = importlib.import_module(module)
        originals.setdefault((module, name), getattr(mod, name))
        setattr(mod, name, value)
    return originals


def restore_settings(originals: Dict[Tuple[str, str], Any]) -> None:
    for (module, name), value in originals.items():
        setattr(importlib.import_module(module), name, value)


def run_with_settings(parser: Any, texts: List[str], run: Any) -> Any:
    """``run(settings)`` with each ``--set`` MODULE.NAME=VALUE of ``texts``
    applied (a malformed one is ``parser``'s error), every constant put
    back afterwards."""
    try:
        settings = [parse_setting(text, "--set") for text in texts]
    except ValueError as exc:
        parser.error(str(exc))
    originals = apply_settings(settings)
    try:
        return run(settings)
    finally:
        restore_settings(originals)


def parse_lengths(text: str) -> List[int]:
    """'256,1K,4K' -> [256, 1024, 4096], sorted, duplicates dropped."""
    return sorted({parse_length(part) for part in text.split(",") if part.strip()})


def length_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


# ------------------------------------------------------------------ prompt


def prompt_ids(n: int, vocab_size: int) -> np.ndarray:
    """The benchmark's prompt: token i is ((i * 2654435761) mod 2**32) mod vocab.

    A multiplicative hash spreads the ids over the vocabulary (no repeats a
    cache or a router could exploit) and is the same on every machine."""
    i = np.arange(n, dtype=np.uint64)
    return ((i * np.uint64(2654435761)) % np.uint64(2**32) % np.uint64(vocab_size)).astype(np.int32)


# ----------------------------------------------------- machine and software


def _run(cmd: List[str]) -> Optional[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=15, cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu_name() -> str:
    if sys.platform == "darwin":
        name = _run(["sysctl", "-n", "machdep.cpu.brand_string"])
        if name:
            return name
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _accelerator() -> Dict[str, object]:
    """What MLX says about its default device, plus nvidia-smi where present."""
    import mlx.core as mx

    info: Dict[str, object] = {"default_device": str(mx.default_device())}
    try:
        info["mlx_device_info"] = {k: v for k, v in mx.device_info().items()}
    except Exception as exc:  # older MLX or no device info on this backend
        info["mlx_device_info"] = f"unavailable: {exc}"
    backend = "cpu"
    if mx.metal.is_available():
        backend = "metal"
    elif getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
        backend = "cuda"
    info["backend"] = backend
    smi = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    if smi:
        info["nvidia_smi"] = smi.splitlines()
    dev = info.get("mlx_device_info")
    name = dev.get("device_name") if isinstance(dev, dict) else None
    if smi:
        name = smi.splitlines()[0].split(",")[0].strip()
    info["name"] = name or backend
    return info


def machine_info() -> Dict[str, object]:
    return {
        "hostname": socket.gethostname(),
        "os": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "accelerator": _accelerator(),
    }


def git_revision() -> str:
    # A copy of the tree without .git (a remote GPU machine) names it by env.
    given = os.environ.get("MLX_LILY_GIT_REVISION")
    if given:
        return given
    rev = _run(["git", "rev-parse", "--short=10", "HEAD"])
    if not rev:
        return "unknown"
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return rev + ("-dirty" if dirty else "")


def _version(module: str, dist: str) -> str:
    try:
        return str(getattr(__import__(module, fromlist=["_"]), "__version__"))
    except Exception:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "unknown"


def software_info() -> Dict[str, str]:
    return {
        "python": platform.python_version(),
        "mlx": _version("mlx.core", "mlx"),
        "mlx_lm": _version("mlx_lm", "mlx-lm"),
        "mlx_lily": _version("mlx_lily", "mlx-lily"),
        "numpy": np.__version__,
        "git_revision": git_revision(),
        "MLX_LILY_KERNELS": os.environ.get("MLX_LILY_KERNELS", "(unset: kernels on)"),
        "MLX_LILY_KERNEL_BACKEND": os.environ.get("MLX_LILY_KERNEL_BACKEND", "(unset: auto)"),
        "kernel_backend": _kernel_backend(),
    }


def _kernel_backend() -> str:
    """Where lily's kernels run in this process, as the registry decides it."""
    from mlx_lily.toolchain import registry

    decide = getattr(registry, "kernel_backend", None)
    if decide is None:  # older registry: the GPU backend or nothing
        return registry.gpu_backend() or "none (reference)"
    backend, why = decide()
    return backend or f"none (reference: {why})"


def op_paths() -> Dict[str, Dict[str, str]]:
    """Each lily op's planned path on this machine (kernel or reference, and why)."""
    from mlx_lily.kernels import OPS

    out = {}
    for name, op in OPS.items():
        path, reason = op.planned_path()
        out[name] = {"path": path, "reason": reason, "description": op.description}
    return out


def last_op_paths() -> Dict[str, Dict[str, Optional[str]]]:
    """The path each op took on its most recent call (after a run)."""
    from mlx_lily.kernels import OPS

    return {n: {"path": op.last_path, "reason": op.last_reason} for n, op in OPS.items()}


# ------------------------------------------------------------------ output


def file_stem(kind: str, machine: Dict[str, object], revision: str) -> str:
    """e.g. ab-20250101-120000-myhost-h200-1a2b3c4d5e: date, machine, revision."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    host = str(machine.get("hostname", "host")).split(".")[0]
    accel = machine.get("accelerator", {})
    chip = accel.get("name", "") if isinstance(accel, dict) else ""
    parts = [kind, stamp, host, str(chip), revision]
    return "-".join(re.sub(r"[^A-Za-z0-9_.-]+", "_", p).strip("_") for p in parts if p)


def now_iso() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


# ---------------------------------------------------------------- progress


def write_report(out: Optional[str], name: str, text: str, echo: bool = True) -> None:
    """A diagnostic's table (or record): to stdout unless echo is False (a
    diagnostic that printed it row by row already), and to OUT/name where
    --out is given."""
    if echo:
        print(text)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(text)


def write_json(out: Optional[str], name: str, record: Dict[str, object]) -> None:
    """A diagnostic's JSON record, after the machine and the software, to
    OUT/name where --out is given."""
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(json.dumps({"machine": machine_info(), "software": software_info(), **record},
                                                 indent=1))


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def fmt_seconds(s: float) -> str:
    s = max(0.0, s)
    if s < 90:
        return f"{s:.0f}s"
    if s < 5400:
        return f"{s / 60:.1f}min"
    return f"{s / 3600:.1f}h"


class Progress:
    """Progress lines with an estimate of the time left.

    Each unit of work has a weight (roughly its cost: a fixed part for load and
    warmup plus the prompt length); time left = elapsed * remaining weight /
    finished weight. Crude, but it tracks long prompts better than a count."""

    def __init__(self, weights: List[float]):
        self.total = float(sum(weights)) or 1.0
        self.done = 0.0
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def remaining(self) -> Optional[float]:
        if self.done <= 0:
            return None
        return self.elapsed() * (self.total - self.done) / self.done

    def status(self) -> str:
        left = self.remaining()
        left_text = "estimating" if left is None else f"~{fmt_seconds(left)} left"
        return f"elapsed {fmt_seconds(self.elapsed())}, {left_text}"

    def finish(self, weight: float) -> None:
        self.done += weight
