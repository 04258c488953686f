"""The GPU's clocks, power and load while a measurement runs (NVIDIA).

Decode through MLX on the H200 moves between runs of one process by up to
about 1.8x (bench/results/2026-11-30-nvidia-h200-7203892c90), and not always
with the host's share of a step: decode moved between 91 and 120 tok/s while
the split's build and launch stayed within 6%. Whether the GPU then ran at
other clocks is what this records: ``nvidia-smi`` samples the SM and memory
clocks, the power draw and the utilization every ``INTERVAL_MS`` in a process
of its own while the block runs.

    with sampled_clocks() as clocks:
        ...                          # the measurement
    clocks.summary(since, until)     # {"sm_mhz": {"min", "median", "max"}, ...} or {"unavailable": why}

``since`` and ``until`` (``time.time()`` seconds) pick the samples of one
window, e.g. an arm's decode after its prefill.

Opt-in (``--gpu-clocks``): the sampling process queries the driver while the
measurement runs.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import statistics
import subprocess
from typing import Dict, Iterator, List, Optional

INTERVAL_MS = 50
# The summary's "unavailable" where sampling was not asked for.
NOT_ASKED = "not asked for"
FIELDS = ("sm_mhz", "mem_mhz", "power_w", "util_pct")
QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu"
TIMESTAMP = "%Y/%m/%d %H:%M:%S.%f"  # nvidia-smi's, in local time


def gpu_index() -> str:
    """nvidia-smi's index of the GPU MLX uses (its device 0): the first of
    CUDA_VISIBLE_DEVICES where that names GPUs by index, else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible if visible.isdigit() else "0"


def parse(text: str) -> List[Dict[str, float]]:
    """One dict per sample line of ``nvidia-smi --format=csv,noheader,nounits``
    (its time as ``t``, in ``time.time()`` seconds); lines with a field
    nvidia-smi could not read ("[N/A]", "[Unknown]") are skipped."""
    samples = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(FIELDS) + 1:
            continue
        try:
            sample = {"t": datetime.datetime.strptime(cells[0], TIMESTAMP).timestamp()}
            sample.update({f: float(c) for f, c in zip(FIELDS, cells[1:])})
        except ValueError:
            continue
        samples.append(sample)
    return samples


class ClockLog:
    def __init__(self) -> None:
        self.samples: List[Dict[str, float]] = []
        self.why_not: Optional[str] = None

    def summary(self, since: Optional[float] = None, until: Optional[float] = None) -> Dict[str, object]:
        """Min, median and max of each field over the samples taken between
        ``since`` and ``until`` (either open)."""
        if self.why_not is not None:
            return {"unavailable": self.why_not}
        window = [s for s in self.samples
                  if (since is None or s["t"] >= since) and (until is None or s["t"] <= until)]
        if not window:
            return {"unavailable": f"no sample in the window ({len(self.samples)} in all)"}
        out: Dict[str, object] = {"samples": len(window)}
        for f in FIELDS:
            values = [s[f] for s in window]
            out[f] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
        return out


def describe(summary: Dict[str, object]) -> str:
    """One line: 'SM 1980 MHz (1755-1980), memory 3201 MHz, 312 W, 61% busy'."""
    if "unavailable" in summary:
        return f"GPU clocks unavailable ({summary['unavailable']})"
    sm, mem, power, util = (summary[f] for f in FIELDS)
    return (f"SM {sm['median']:.0f} MHz ({sm['min']:.0f}-{sm['max']:.0f}), memory {mem['median']:.0f} MHz, "
            f"{power['median']:.0f} W, {util['median']:.0f}% busy, {summary['samples']} samples")


@contextlib.contextmanager
def sampled_clocks(enabled: bool = True) -> Iterator[ClockLog]:
    """Sample while the block runs; a disabled or impossible log says why in
    its summary and costs nothing."""
    log = ClockLog()
    if not enabled:
        log.why_not = NOT_ASKED
        yield log
        return
    smi = shutil.which("nvidia-smi")
    if smi is None:
        log.why_not = "no nvidia-smi"
        yield log
        return
    command = [smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", gpu_index(),
               "-lms", str(INTERVAL_MS)]
    # Line-buffered where coreutils can ask for it, so that no sample waits in
    # a buffer the stop would lose; stopped as by Ctrl-C, which ends the loop.
    stdbuf = shutil.which("stdbuf")
    proc = subprocess.Popen([stdbuf, "-oL", *command] if stdbuf else command,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        log.samples = parse(out or "")
