"""bench.gpu_clocks: nvidia-smi's samples parsed, windowed and summarized; a
fake nvidia-smi stands in for the real one where there is none."""

import os
import stat
import sys
import time

import pytest

from bench import gpu_clocks

LINE = "{t}, {sm}, 2619, {w}, {u}"


def stamp(t: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t).strftime(gpu_clocks.TIMESTAMP)[:-3]


def test_parse_skips_fields_nvidia_smi_could_not_read():
    t0 = time.time()
    text = "\n".join([
        LINE.format(t=stamp(t0), sm=1980, w=300.5, u=60),
        LINE.format(t=stamp(t0 + 0.05), sm="[N/A]", w=300, u=60),
        "garbage",
        LINE.format(t=stamp(t0 + 0.1), sm=1200, w=150, u=20),
    ])
    samples = gpu_clocks.parse(text)
    assert [s["sm_mhz"] for s in samples] == [1980.0, 1200.0]
    assert samples[0]["power_w"] == 300.5 and samples[1]["util_pct"] == 20.0
    assert abs(samples[0]["t"] - t0) < 0.01 and abs(samples[1]["t"] - (t0 + 0.1)) < 0.01


def test_summary_takes_the_window_and_says_why_when_empty():
    log = gpu_clocks.ClockLog()
    log.samples = [{"t": float(t), "sm_mhz": sm, "mem_mhz": 2619.0, "power_w": 100.0 + t, "util_pct": 50.0}
                   for t, sm in ((1, 1980.0), (2, 1500.0), (3, 1200.0), (4, 1980.0))]
    whole = log.summary()
    assert whole["samples"] == 4 and whole["sm_mhz"] == {"min": 1200.0, "median": 1740.0, "max": 1980.0}
    part = log.summary(2, 3)
    assert part["samples"] == 2 and part["sm_mhz"]["median"] == 1350.0 and part["power_w"]["max"] == 103.0
    assert "no sample in the window (4 in all)" in log.summary(10, 11)["unavailable"]
    assert "SM 1350 MHz (1200-1500)" in gpu_clocks.describe(part)
    assert gpu_clocks.describe({"unavailable": "no nvidia-smi"}) == "GPU clocks unavailable (no nvidia-smi)"


def test_not_asked_for_and_no_nvidia_smi(monkeypatch):
    with gpu_clocks.sampled_clocks(False) as log:
        pass
    assert log.summary() == {"unavailable": "not asked for"}
    monkeypatch.setenv("PATH", "")
    with gpu_clocks.sampled_clocks(True) as log:
        pass
    assert log.summary() == {"unavailable": "no nvidia-smi"}


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for nvidia-smi")
def test_samples_from_a_stand_in_nvidia_smi(tmp_path, monkeypatch):
    """The stand-in prints a sample every 20 ms with the time it is taken,
    until it is stopped, and records the arguments it was given."""
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {tmp_path}/args\n'
        "while true; do\n"
        "  echo \"$(date +'%Y/%m/%d %H:%M:%S.%3N'), 1755, 2619, 250.0, 70\"\n"
        "  sleep 0.02\n"
        "done\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    with gpu_clocks.sampled_clocks(True) as log:
        time.sleep(0.3)
        since = time.time()
        # A window of 50 samples' time: on a loaded 2-core machine the
        # stand-in's loop (a date process each time) runs several times slower.
        time.sleep(1.0)
        until = time.time()
    summary = log.summary(since, until)
    assert summary["samples"] >= 3 and summary["sm_mhz"]["median"] == 1755.0
    assert len(log.samples) > summary["samples"]  # samples outside the window are left out
    args = (tmp_path / "args").read_text().split()
    assert args[:2] == [f"--query-gpu={gpu_clocks.QUERY}", "--format=csv,noheader,nounits"]
    assert args[2:] == ["-i", "3", "-lms", str(gpu_clocks.INTERVAL_MS)]
